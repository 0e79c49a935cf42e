"""Test tiers, chosen by directory, and the fixtures every tier shares.

Tiers (markers applied here, by path, to every collected test):

- ``unit``: ``tests/unit/``, ``tests/reliability/`` (its toy role saves
  :func:`skipinject.testing.toy_batch`, a batch shaped like a ``DataProto`` without verl) and
  ``plugins/*/tests/unit/``. No verl, Ray, TransferQueue or pip, at import nor in the test (torch
  and tensordict are fine); the tier runs in under two minutes (``make test-unit``). A unit test
  that imports verl, ray or transfer_queue fails (when it is the first to import it: run the tier
  alone, as ``make test-unit`` does, to be sure).
- ``integration``: ``tests/integration/``, ``plugins/*/tests/`` (outside ``unit/``), and the tests
  marked so (a reliability test of a verl role's codec, of several processes for tens of seconds):
  real verl, Ray, TransferQueue, pip-installed plugin distributions (``make test-integration``).
- ``e2e``: ``tests/e2e/``: the real trainers (``make test-e2e``).

Anything else, notably a ``tests/test_*.py`` left at the top level (e.g. by a merge), defaults to
``integration``: the safe tier, as nothing there promises to stay verl-free. ``ray`` still marks a
test that starts a local Ray cluster, in any tier. An explicit tier marker on a test wins.
"""

from __future__ import annotations

import importlib
import importlib.abc
import itertools
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
FIXTURES = ROOT / "tests" / "fixtures"
TIERS = ("unit", "integration", "e2e")
HEAVY = ("verl", "ray", "transfer_queue")
_counter = itertools.count()

# Fixtures for the user-added roles' tests, which live in tests/integration and beside each plugin.
pytest_plugins = ["tests.integration.user_plugin_fixtures"]


def tier_of(path: Path) -> str:
    """The tier of a test file, from its directory alone (see the module docstring)."""
    try:
        parts = path.resolve().relative_to(ROOT).parts
    except ValueError:
        return "integration"
    if parts[:1] == ("tests",):
        sub = parts[1] if len(parts) > 2 else ""
        return {"unit": "unit", "reliability": "unit", "e2e": "e2e"}.get(sub, "integration")
    if parts[:1] == ("plugins",) and len(parts) > 3 and parts[2] == "tests":
        return "unit" if parts[3] == "unit" and len(parts) > 4 else "integration"
    return "integration"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(getattr(pytest.mark, tier_of(item.path)))


class _NoHeavyImports(importlib.abc.MetaPathFinder):
    """Makes a unit test that imports verl, Ray or TransferQueue fail, naming the import."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.partition(".")[0] in HEAVY:
            raise ImportError(f"{name}: the unit tier imports no verl, ray or transfer_queue (see conftest.py)")
        return None


@pytest.fixture(autouse=True)
def _unit_tier_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    guard = _NoHeavyImports()
    sys.meta_path.insert(0, guard)
    try:
        yield
    finally:
        sys.meta_path.remove(guard)


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
    from skipinject.testing import RoleRun

    RoleRun.stop_all()  # a run a test started without ``with``: its log handler goes too
    bootstrap.stop()


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


@pytest.fixture(scope="session")
def toy_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site directory where pip really installed the test plugin distribution (integration tier)."""
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


@pytest.fixture(scope="session")
def toy_site_unpacked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test plugin distribution as an installer leaves it (package + dist-info with its entry
    point), laid out without pip: what ``importlib.metadata`` finds is the same (unit tier)."""
    site = tmp_path_factory.mktemp("toy_site_unpacked")
    dist = FIXTURES / "toy_plugin_dist"
    shutil.copytree(dist / "skipinject_toy_plugin", site / "skipinject_toy_plugin")
    info = site / "skipinject_toy_plugin-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: skipinject-toy-plugin\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text("[skipinject.plugins]\ntoy = skipinject_toy_plugin:plugin\n")
    return site


@pytest.fixture
def toy_path(toy_site_unpacked: Path) -> Iterator[Path]:
    """The toy plugin distribution and ``fixtures`` importable in this process."""
    added = [str(toy_site_unpacked), str(FIXTURES)]
    for entry in added:
        sys.path.insert(0, entry)
    importlib.invalidate_caches()
    try:
        yield toy_site_unpacked
    finally:
        for entry in added:
            sys.path.remove(entry)
        for name in [n for n in sys.modules if n.startswith(("toy_targets", "skipinject_toy_plugin"))]:
            sys.modules.pop(name)


@pytest.fixture
def toy(toy_path: Path) -> object:
    """``fixtures/toy_targets.py`` (its ``Trainer``, ``score``...), imported with the toy plugin on the path."""
    import toy_targets

    return toy_targets
