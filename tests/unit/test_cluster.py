"""skipinject.cluster: node-local cache detection, the warn-once rule, node identity; the ray.init amendment."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from skipinject import bootstrap, cluster, dump_root, node
from skipinject.config import Config, RoleConfig
from skipinject.store import mounts


def mountinfo(*mounts: tuple[str, str]) -> str:
    lines = ["22 27 0:21 / /proc rw,relatime - proc proc rw", "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw"]
    for i, (point, kind) in enumerate(mounts):
        escaped = point.replace("\\", "\\134").replace(" ", "\\040")
        lines.append(f"{100 + i} 27 0:{50 + i} / {escaped} rw,relatime shared:1 - {kind} server:/export rw")
    return "\n".join(lines) + "\n"


@pytest.fixture(autouse=True)
def _fresh_warning():
    cluster._reset_warning()
    yield
    cluster._reset_warning()


def test_parse_mountinfo_reads_mount_point_and_type_with_escapes():
    text = mountinfo(("/mnt/my share", "nfs4"), ("/data", "lustre"))
    assert ("/mnt/my share", "nfs4") in mounts.parse_mountinfo(text)
    assert ("/data", "lustre") in mounts.parse_mountinfo(text)
    assert ("/", "ext4") in mounts.parse_mountinfo(text)
    assert mounts.parse_mountinfo("garbage\n\n1 2 3\n") == []


def test_fs_type_is_the_longest_enclosing_mount_even_for_paths_not_created_yet(tmp_path: Path):
    shared = tmp_path / "shared dir"
    shared.mkdir()
    text = mountinfo((str(tmp_path.resolve()), "tmpfs"), (str(shared.resolve()), "nfs4"))
    assert mounts.fs_type(tmp_path / "x", text) == "tmpfs"
    assert mounts.fs_type(shared / "not" / "yet" / "there", text) == "nfs4"
    assert mounts.fs_type("/", text) == "ext4"


@pytest.mark.parametrize(
    ("kind", "local"),
    [
        ("ext4", True),
        ("xfs", True),
        ("tmpfs", True),
        ("overlay", True),
        ("fuse.lxcfs", True),
        ("nfs", False),
        ("nfs4", False),
        ("cifs", False),
        ("lustre", False),
        ("gpfs", False),
        ("beegfs", False),
        ("ceph", False),
        ("cephfs", False),
        ("glusterfs", False),
        ("fuse.sshfs", False),
        ("fuse.juicefs", False),
        ("fuse.gcsfuse", False),
    ],
)
def test_is_node_local_by_file_system_type(tmp_path: Path, kind: str, local: bool):
    text = mountinfo((str(tmp_path.resolve()), kind))
    assert cluster.is_node_local(tmp_path / "rollout_dump", text) is local


def test_urls_are_not_node_local_and_unknown_is_not_claimed_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for url in ("s3://bucket/dump", "hdfs://nn:8020/dump", "gs://b/d"):
        assert dump_root.is_url(url) and not cluster.is_node_local(url, mountinfo())
    # file:// is a path on this node: it is judged by the file system it is on
    assert cluster.is_node_local("file:///srv/x", mountinfo())
    assert not cluster.is_node_local("file:///srv/x", mountinfo(("/srv", "nfs4")))
    assert not dump_root.is_url("/tmp/a://b") and not dump_root.is_url("relative/dir")
    monkeypatch.setattr(mounts, "MOUNTINFO", str(tmp_path / "no-such-mountinfo"))
    assert mounts.fs_type(tmp_path) is None
    assert cluster.is_node_local(tmp_path) is False


def test_this_machines_tmp_is_node_local():
    assert mounts.fs_type("/") is not None
    assert cluster.is_node_local("/tmp/skipinject-test-dump")


def test_warns_once_per_process_with_the_fix(caplog: pytest.LogCaptureFixture, tmp_path: Path):
    roles = {"rollout": RoleConfig(enable=True, dump_dir=str(tmp_path)), "reward": str(tmp_path / "r")}
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        logging.getLogger("skipinject").propagate = True
        try:
            assert not cluster.warn_if_cache_not_shared(roles, nodes=1)
            assert cluster.warn_if_cache_not_shared(roles, nodes=2)
            assert not cluster.warn_if_cache_not_shared(roles, nodes=3)
        finally:
            logging.getLogger("skipinject").propagate = False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0]
    assert "2 nodes" in message and str(tmp_path) in message
    assert "set skip.rollout.dump_dir to a shared file system path" in message
    assert "set skip.reward.dump_dir to a shared file system path" in message


def test_no_warning_when_the_cache_is_shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(mounts, "MOUNTINFO", str(tmp_path / "mi"))
    (tmp_path / "mi").write_text(mountinfo((str(tmp_path.resolve()), "nfs4")))
    assert not cluster.warn_if_cache_not_shared({"rollout": str(tmp_path / "d"), "x": "s3://b/d"}, nodes=4)


def test_node_identity_without_ray_is_the_host_name():
    identity = node.node_identity()
    assert identity["hostname"] == socket.gethostname()
    assert "ray_node_id" not in identity and cluster.ray_alive_nodes() == 0


# ---------------------------------------------------------------- the ray.init amendment (no cluster)


def _interceptor() -> bootstrap._RayInitInterceptor:
    config = Config(roles={"toy": RoleConfig(enable=True, steps=(1,))})
    return bootstrap._RayInitInterceptor(config)


def test_amend_adds_config_and_hook_and_keeps_the_users_env_vars():
    amended = _interceptor().amend({"env_vars": {"A": "1"}, "pip": ["x"]})
    assert amended["env_vars"]["A"] == "1" and bootstrap.ENV_CONFIG in amended["env_vars"]
    assert amended["worker_process_setup_hook"] == bootstrap.RAY_SETUP_HOOK
    assert amended["pip"] == ["x"]
    assert _interceptor().amend(None)["worker_process_setup_hook"] == bootstrap.RAY_SETUP_HOOK


@pytest.mark.integration  # builds Ray's RuntimeEnv / JobConfig
def test_amend_keeps_a_runtime_env_object_and_does_not_modify_it():
    from ray.runtime_env import RuntimeEnv

    original = RuntimeEnv(env_vars={"A": "1"})
    amended = _interceptor().amend(original)
    assert isinstance(amended, RuntimeEnv)
    assert amended["env_vars"]["A"] == "1" and bootstrap.ENV_CONFIG in amended["env_vars"]
    assert bootstrap.ENV_CONFIG not in original["env_vars"] and "worker_process_setup_hook" not in original


def test_amend_chains_a_users_module_hook():
    amended = _interceptor().amend({"worker_process_setup_hook": "mypkg.setup.hook"})
    assert amended["worker_process_setup_hook"] == bootstrap.RAY_SETUP_HOOK
    assert amended["env_vars"][bootstrap.ENV_CHAINED_HOOK] == "mypkg.setup.hook"


def test_amend_chains_a_users_callable_hook(monkeypatch: pytest.MonkeyPatch):
    calls = []
    monkeypatch.setattr(bootstrap, "ray_worker_setup", lambda: calls.append("skipinject"))
    amended = _interceptor().amend({"worker_process_setup_hook": lambda: calls.append("user") or "ret"})
    hook = amended["worker_process_setup_hook"]
    assert callable(hook) and hook.__name__
    assert hook() == "ret" and calls == ["skipinject", "user"]


def test_worker_setup_runs_the_chained_module_hook(monkeypatch: pytest.MonkeyPatch):
    calls = []
    monkeypatch.setattr(bootstrap, "start_from_env", lambda: None)
    monkeypatch.setitem(__import__("sys").modules, "fake_hook_mod", type("M", (), {"hook": lambda: calls.append(1)}))
    monkeypatch.setenv(bootstrap.ENV_CHAINED_HOOK, "fake_hook_mod.hook")
    bootstrap.ray_worker_setup()
    assert calls == [1]


def test_a_child_says_once_that_it_cannot_read_its_configuration(monkeypatch: pytest.MonkeyPatch):
    """ray's import (hand on only), then verl's (start): a tampered SKIPINJECT_CONFIG was said twice."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    monkeypatch.setattr(bootstrap.logger, "handlers", [handler])
    monkeypatch.setattr(bootstrap, "_refused", None)
    monkeypatch.setenv(bootstrap.ENV_CONFIG, '{"version": 1}')
    assert bootstrap.start_from_env(hand_on_only=True) is None and bootstrap.start_from_env() is None
    assert len(lines) == 1 and "serialised config has version 1" in lines[0], lines


@pytest.mark.integration  # builds Ray's RuntimeEnv / JobConfig
def test_job_config_runtime_env_is_amended_not_replaced():
    from ray.job_config import JobConfig

    interceptor = _interceptor()
    user = JobConfig(runtime_env={"env_vars": {"A": "1"}})

    class FakeCall:
        kwargs = {"job_config": user}

    seen = {}
    interceptor.check_cluster = lambda: None  # type: ignore[method-assign]
    interceptor.sync(FakeCall, lambda: seen.update(FakeCall.kwargs))
    assert "runtime_env" not in seen
    env = seen["job_config"].runtime_env
    assert env["env_vars"]["A"] == "1" and bootstrap.ENV_CONFIG in env["env_vars"]
    assert bootstrap.ENV_CONFIG not in user.runtime_env["env_vars"], "the user's JobConfig is left as it was"


def test_a_job_submit_hook_is_left_alone(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"runtime_env": {"worker_process_setup_hook": "x.y"}}')
    amended = _interceptor().amend({})
    assert "worker_process_setup_hook" not in amended and bootstrap.ENV_CONFIG in amended["env_vars"]
