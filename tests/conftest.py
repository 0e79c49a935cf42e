"""Shared fixtures: fresh copies of the toy target module, clean injector state."""

from __future__ import annotations

import importlib
import itertools
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
_counter = itertools.count()


@pytest.fixture
def fresh_module_name(tmp_path: Path) -> Iterator[str]:
    """The name of a not-yet-imported copy of ``fixtures/toy_targets.py``."""
    name = f"toy_targets_{next(_counter)}"
    shutil.copy(FIXTURES / "toy_targets.py", tmp_path / f"{name}.py")
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    try:
        yield name
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


@pytest.fixture
def injector() -> Iterator[object]:
    from skipinject.injector import Injector

    inj = Injector()
    yield inj
    inj.uninstrument_all()


@pytest.fixture(autouse=True)
def _inline_saves(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Misses save in the calling thread, so tests can look at the cache right after a call.

    The background writer itself is tested where a test is marked ``background_saves`` (and in
    every end-to-end run, which goes through real subprocesses).
    """
    if request.node.get_closest_marker("background_saves"):
        return
    from skipinject.engine.background import WRITER

    monkeypatch.setattr(WRITER, "submit", lambda key, job: job())


@pytest.fixture(autouse=True)
def _stop_bootstrap() -> Iterator[None]:
    yield
    from skipinject import bootstrap

    bootstrap.stop()


@pytest.fixture(scope="session")
def toy_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site directory where pip really installed the test plugin distribution (with its entry point)."""
    import subprocess

    site = tmp_path_factory.mktemp("toy_site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(FIXTURES / "toy_plugin_dist"),
        ],
        check=True,
        capture_output=True,
    )
    return site


@pytest.fixture
def toy_path(toy_site: Path) -> Iterator[Path]:
    """``toy_site`` and ``fixtures`` importable in this process."""
    added = [str(toy_site), str(FIXTURES)]
    for entry in added:
        sys.path.insert(0, entry)
    importlib.invalidate_caches()
    try:
        yield toy_site
    finally:
        for entry in added:
            sys.path.remove(entry)
        for name in [n for n in sys.modules if n.startswith(("toy_targets", "skipinject_toy_plugin"))]:
            sys.modules.pop(name)


def toy_env(toy_site: Path, **extra: str) -> dict[str, str]:
    """Environment for a subprocess that sees the toy plugin and toy targets."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP"))}
    env["PYTHONPATH"] = os.pathsep.join([str(toy_site), str(FIXTURES)])
    env.update(extra)
    return env
