"""``dump_dir`` is parsed once into a DumpRoot that the config, the engine's stores and the cluster
check share; validating a config imports no part of the store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from skipinject import cluster
from skipinject.config import RoleConfig, role_config
from skipinject.dump_root import DumpRoot
from skipinject.errors import ConfigError


def test_local_roots_are_resolved_paths_and_urls_stay_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert DumpRoot.parse("~/cache").path == (tmp_path / "cache").resolve()
    assert DumpRoot.parse(f"file://{tmp_path}/x").path == (tmp_path / "x").resolve()
    remote = DumpRoot.parse("s3://bucket/dir/")
    assert remote.url == "s3://bucket/dir" and remote.path is None and remote.scheme == "s3"
    assert str(remote) == "s3://bucket/dir" and remote.text == "s3://bucket/dir/"


def test_a_role_parses_its_dump_dir_once(tmp_path: Path) -> None:
    settings = RoleConfig(dump_dir=str(tmp_path))
    assert settings.root is settings.root and settings.root.path == tmp_path.resolve()
    assert cluster.node_local_dump_dirs({"rollout": settings}) in ({}, {"rollout": str(tmp_path)})
    assert cluster.node_local_dump_dirs({"rollout": RoleConfig(dump_dir="memory://b/x")}) == {}


def test_a_url_is_checked_when_the_config_is_read() -> None:
    with pytest.raises(ConfigError, match=r"^skip\.rollout\.dump_dir=nosuch://b: fsspec knows no protocol 'nosuch'$"):
        role_config("rollout", {"dump_dir": "nosuch://b"})
    assert role_config("rollout", {"dump_dir": "memory://b/x"}).root.url


@pytest.mark.parametrize("kind", ["unknown user", "symlink loop"])
def test_a_dump_dir_that_resolves_nowhere_is_one_line_naming_the_key(tmp_path: Path, kind: str) -> None:
    """``~nosuchuser/x`` or a path through a symlink loop: pathlib raises RuntimeError, not a traceback."""
    if kind == "unknown user":
        given = "~si_no_such_user_x/cache"
    else:
        (tmp_path / "a").symlink_to(tmp_path / "b")
        (tmp_path / "b").symlink_to(tmp_path / "a")
        given = f"{tmp_path}/a/cache"
    with pytest.raises(ConfigError) as info:
        role_config("rollout", {"dump_dir": given})
    message = str(info.value)
    assert message.startswith(f"skip.rollout.dump_dir={given}: not a usable directory path") and "\n" not in message


def test_reading_the_config_imports_no_store() -> None:
    code = (
        "import sys; from skipinject.config import role_config;"
        "role_config('rollout', {'dump_dir': 'memory://b/x'}).root;"
        "print(sorted(m for m in sys.modules if m.startswith('skipinject.store')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_engine_opens_its_stores_under_the_root(tmp_path: Path) -> None:
    from skipinject import Call, Role, StepSource, Target
    from skipinject.engine.runtime import RoleRuntime
    from skipinject.store.local import LocalFiles
    from skipinject.store.remote import FsspecFiles, RemotePath

    role = Role(name="toy", targets=[Target("json:dumps")], step=StepSource.argument("step"))
    call = Call("json:dumps", repr, None, (), {})
    local = RoleRuntime(role, RoleConfig(enable=True, dump_dir=str(tmp_path)), "test").store_for(call)
    assert isinstance(local.backend, LocalFiles) and local.dump_dir == tmp_path.resolve()
    assert local.project_dir == tmp_path.resolve() / "skipinject_default" / "toy"
    remote = RoleRuntime(role, RoleConfig(enable=True, dump_dir="memory://bucket/d"), "test").store_for(call)
    assert isinstance(remote.backend, FsspecFiles) and remote.dump_dir is None
    assert isinstance(remote.project_dir, RemotePath)
    assert str(remote.project_dir).endswith("bucket/d/skipinject_default/toy")
