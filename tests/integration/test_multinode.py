"""Roles fire in Ray actors on another node (issue 12, SPEC §7): real two-node clusters on one machine.

Each cluster has a head and a worker node with their own raylets (``ray start`` processes with
their own ports and temp directories, on 127.0.0.1); the trainer actor needs the custom
resource ``worker_node``, which only the worker node has. The worker node is always started
from a clean environment (no ``SKIPINJECT_*``, no bootstrap directory on ``PYTHONPATH``), so
skipinject can reach its processes only through the job's ``runtime_env``:

* a job that starts its own cluster (``ray.init()`` starts the head; the test adds the worker node);
* a job that connects to a cluster started before skipinject ran, by ``ray.init(address=...)``
  (with a ``RuntimeEnv`` object and a callable setup hook of the user's) and by ``RAY_ADDRESS``
  (with a module setup hook of the user's).

Every case runs the driver twice under ``python -m skipinject``: run 1 misses and saves in the
actor on the worker node, run 2 hits there. Clusters are torn down by process group and by
their own temp directory, never with a global ``ray stop``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIXTURES, ROOT, toy_env

pytestmark = [pytest.mark.ray, pytest.mark.multinode]

RAY = str(Path(sys.executable).with_name("ray"))
PROGRAM = str(FIXTURES / "multinode_program.py")
START_TIMEOUT = 240.0
RUN_TIMEOUT = 600.0
WARNING_FIX = "set skip.toy.dump_dir to a shared file system path"


#: Ports handed out in this process: the OS may give a just-closed port again, and two Ray
#: components (or nodes) told to use one port fail to start.
_GIVEN_PORTS: set[int] = set()


def free_port() -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


def wait_until(condition: Callable[[], Any], timeout: float, what: str, alive: Callable[[], str | None]) -> Any:
    """Poll ``condition`` until it is true; fail early when ``alive`` reports a dead process."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        problem = alive()
        if problem:
            raise AssertionError(f"while waiting for {what}: {problem}")
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _kill_group(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGTERM to the leader (``ray start --block`` then stops its node's processes in order; a
    SIGTERM to the whole group would kill the GCS under its drain request), then SIGKILL the group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def _kill_by_temp_dir(temp_dir: str) -> None:
    """Kill what is left of a cluster of ours (processes naming its own temp directory), then remove it."""
    import shutil

    import psutil

    mine = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(temp_dir in part for part in proc.info["cmdline"] or ()):
                mine.append(proc)
    for proc in mine:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(mine, timeout=30)
    shutil.rmtree(temp_dir, ignore_errors=True)


class Node:
    """One ``ray start --block`` node in its own process group, temp dir and ports."""

    def __init__(self, name: str, env: dict[str, str], logs: Path) -> None:
        self.name = name
        self.env = env
        self.temp_dir = tempfile.mkdtemp(prefix=f"skmn{name[0]}", dir="/tmp")  # short: socket paths
        self.log = logs / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, *args: str) -> None:
        command = [
            RAY,
            "start",
            "--block",
            "--disable-usage-stats",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=1",
            "--object-store-memory=100000000",
            f"--temp-dir={self.temp_dir}",
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            "--min-worker-port=0",
            "--max-worker-port=0",
            *args,
        ]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                command, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd="/"
            )
        wait_until(
            lambda: "Ray runtime started" in self.log.read_text(errors="replace"),
            START_TIMEOUT,
            f"the {self.name} node to start",
            self.problem,
        )

    def problem(self) -> str | None:
        if self.proc is not None and self.proc.poll() is not None:
            log = self.log.read_text(errors="replace")[-3000:]
            return f"{self.name} node exited with {self.proc.returncode}:\n{log}"
        return None

    def stop(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc)
        _kill_by_temp_dir(self.temp_dir)


def worker_node_args(address: str) -> list[str]:
    return [f"--address={address}", '--resources={"worker_node": 1}']


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    path = tmp_path / "logs"
    path.mkdir()
    return path


@pytest.fixture
def ray_auth() -> dict[str, str]:
    """A token of this test's own: Ray's default token file (~/.ray/auth_token) is shared by every
    Ray cluster of the user on this machine, and another one may replace it mid-test."""
    import secrets

    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def ray_env(toy_site: Path, auth: dict[str, str], **extra: str) -> dict[str, str]:
    env = toy_env(toy_site, **auth, **extra)
    for key in ("RAY_ADDRESS", "RAY_JOB_CONFIG_JSON_ENV_VAR", "RAY_AUTH_TOKEN_PATH"):
        env.pop(key, None)
    return env


@pytest.fixture
def cluster_env(toy_site: Path, ray_auth: dict[str, str]) -> dict[str, str]:
    """What the nodes get: the toy plugin and targets installed, nothing of skipinject's run."""
    return ray_env(toy_site, ray_auth)


@contextlib.contextmanager
def nodes(env: dict[str, str], logs: Path) -> Iterator[list[Node]]:
    started: list[Node] = []
    try:
        yield started
    finally:
        for node in reversed(started):
            node.stop()


class Driver:
    """``python -m skipinject ... multinode_program.py`` in its own process group."""

    def __init__(self, env: dict[str, str], logs: Path, name: str, args: list[str]) -> None:
        self.out, self.err = logs / f"{name}.out", logs / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "skipinject", *args],
                env=env,
                stdout=out,
                stderr=err,
                cwd=ROOT,
                start_new_session=True,
            )

    def problem(self) -> str | None:
        if self.proc.poll() is not None:
            return f"driver exited with {self.proc.returncode}:\n{self.stderr()[-4000:]}"
        return None

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def finish(self) -> dict[str, Any]:
        try:
            self.proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"driver still running after {RUN_TIMEOUT:.0f} s:\n{self.stderr()[-4000:]}") from None
        assert self.proc.returncode == 0, self.stderr()[-4000:]
        for line in self.out.read_text().splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
        raise AssertionError(f"no RESULT line:\n{self.out.read_text()}\n{self.stderr()[-4000:]}")

    def kill(self) -> None:
        _kill_group(self.proc, grace=30)


def skip_args(program_args: list[str], cache: Path | str) -> list[str]:
    return [
        "--plugins",
        "toy",
        PROGRAM,
        *program_args,
        "skip.toy.enable=True",
        "skip.toy.steps=[2]",
        f"skip.toy.dump_dir={cache}",
    ]


def check_miss_then_hit(one: dict[str, Any], two: dict[str, Any], cache: Path) -> None:
    for result in (one, two):
        assert result["node_id"] != result["driver_node_id"], "the actor must run on the other node"
        assert result["wrapper"] == "SkipinjectWrapper", "the target must be patched in the actor on the other node"
        assert result["has_config"]
        assert result["grandchild_active"] == "true", result["grandchild_err"]
    assert one["calls"].count("generate") == 2, "run 1: step 2 is a miss, generated and saved on the other node"
    assert two["calls"].count("generate") == 1, "run 2: step 2 must be served from the cache on the other node"
    assert two["outputs"] == one["outputs"]
    meta = json.loads((cache / "skipinject_default" / "toy" / "2" / "meta.json").read_text())
    assert meta["node"]["ray_node_id"] == one["node_id"], "meta.json records the node that wrote the step"
    assert meta["node"]["ray_node_ip"] and meta["node"]["hostname"] == socket.gethostname()


def test_job_that_starts_its_own_cluster_reaches_an_actor_on_an_added_node(
    toy_site: Path, cluster_env: dict[str, str], ray_auth: dict[str, str], logs: Path, tmp_path: Path
):
    cache = tmp_path / "cache"
    driver_env = ray_env(toy_site, ray_auth, RAY_DEDUP_LOGS="0")
    results = []
    for run in (1, 2):
        head_dir = tempfile.mkdtemp(prefix="skmnh", dir="/tmp")
        info = tmp_path / f"address-{run}"
        driver = Driver(driver_env, logs, f"own-{run}", skip_args(["own", "2", str(info), head_dir], cache))
        with nodes(cluster_env, logs) as started:
            try:
                address = wait_until(
                    lambda: info.is_file() and info.read_text().strip(),  # noqa: B023
                    START_TIMEOUT,
                    "the driver's new cluster",
                    driver.problem,
                )
                worker = Node(f"worker-own-{run}", cluster_env, logs)
                started.append(worker)
                worker.start(*worker_node_args(address))
                results.append(driver.finish())
            finally:
                driver.kill()
                _kill_by_temp_dir(head_dir)
    check_miss_then_hit(results[0], results[1], cache)


@pytest.mark.parametrize("connect", ["address", "env"])
def test_job_that_connects_to_a_running_cluster_reaches_an_actor_on_the_other_node(
    toy_site: Path, cluster_env: dict[str, str], ray_auth: dict[str, str], logs: Path, tmp_path: Path, connect: str
):
    cache = tmp_path / "cache"
    info = tmp_path / "address"
    with nodes(cluster_env, logs) as started:
        head = Node("head", cluster_env, logs)
        started.append(head)
        port = free_port()
        head.start("--head", f"--port={port}", "--include-dashboard=false", f"--ray-client-server-port={free_port()}")
        address = f"127.0.0.1:{port}"
        info.write_text(address)
        worker = Node("worker", cluster_env, logs)
        started.append(worker)
        worker.start(*worker_node_args(address))

        driver_env = ray_env(toy_site, ray_auth, RAY_DEDUP_LOGS="0")
        if connect == "env":
            driver_env["RAY_ADDRESS"] = address
        results, stderrs = [], []
        for run in (1, 2):
            driver = Driver(driver_env, logs, f"{connect}-{run}", skip_args([connect, "2", str(info)], cache))
            try:
                results.append(driver.finish())
                stderrs.append(driver.stderr())
            finally:
                driver.kill()
    check_miss_then_hit(results[0], results[1], cache)
    for result in results:
        assert result["user_var"] == "kept", "the user's runtime_env env_vars must be kept"
        assert result["user_hook"] == ("callable" if connect == "address" else "module"), (
            "the user's own worker_process_setup_hook must run too (chained)"
        )
    for stderr in stderrs:
        # Two nodes, a cache under /tmp (node-local): one warning with the fix, in the driver only.
        assert stderr.count(WARNING_FIX) == 1, stderr[-4000:]


def test_a_cache_in_an_object_store_serves_a_run_that_lands_on_another_node(
    toy_site: Path, ray_auth: dict[str, str], logs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """``dump_dir=s3://...`` (a real S3-compatible server): run 1's actor saves step 2 on worker node
    A; A is gone and run 2's actor lands on a new worker node B, which is served run 1's step."""
    from tests.integration.s3_server import create_bucket, s3_environment, s3_server, use_server

    pytest.importorskip("s3fs")
    info = tmp_path / "address"
    with s3_server(str(logs / "moto.log")) as endpoint:
        create_bucket(endpoint, "shared-cache")
        cache = "s3://shared-cache/dump"
        env = ray_env(toy_site, ray_auth, **s3_environment(endpoint))  # every node can reach the store
        with nodes(env, logs) as started:
            head = Node("head", env, logs)
            started.append(head)
            port = free_port()
            head.start(
                "--head", f"--port={port}", "--include-dashboard=false", f"--ray-client-server-port={free_port()}"
            )
            address = f"127.0.0.1:{port}"
            info.write_text(address)
            results, stderrs = [], []
            for run in (1, 2):
                worker = Node(f"worker-{run}", env, logs)
                started.append(worker)
                worker.start(*worker_node_args(address))
                driver_env = {**env, "RAY_DEDUP_LOGS": "0"}
                driver = Driver(driver_env, logs, f"s3-{run}", skip_args(["address", "2", str(info)], cache))
                try:
                    results.append(driver.finish())
                    stderrs.append(driver.stderr())
                finally:
                    driver.kill()
                worker.stop()
        one, two = results
        assert one["node_id"] != two["node_id"], "run 2's actor runs on another node than run 1's"
        assert one["calls"].count("generate") == 2 and two["calls"].count("generate") == 1
        assert two["outputs"] == one["outputs"]
        for stderr in stderrs:
            assert WARNING_FIX not in stderr, "an object store is shared by every node: no warning"
        import fsspec

        use_server(endpoint, monkeypatch)
        fs, _ = fsspec.core.url_to_fs(cache)
        meta = json.loads(fs.cat_file("shared-cache/dump/skipinject_default/toy/2/meta.json"))
        assert meta["node"]["ray_node_id"] == one["node_id"], "meta.json records the node that wrote the step"
