"""Fixtures of the user-added roles' tests (``plugins/reward``, ``plugins/advantage``), registered for
every test by the root ``conftest.py``: pip-installing both distributions (integration tier) and
counting verl's real calls under skipinject's wrapper."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import site
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skipinject import bootstrap

ROOT = Path(__file__).resolve().parents[2]
USER_PLUGINS = {
    "skipinject-reward": ("reward", "skipinject_reward", ROOT / "plugins" / "reward"),
    "skipinject-advantage": ("advantage", "skipinject_advantage", ROOT / "plugins" / "advantage"),
}


def _usable(dist: str, module: str) -> bool:
    import importlib_metadata

    try:
        importlib_metadata.distribution(dist)
    except importlib_metadata.PackageNotFoundError:
        return False
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="session")
def user_plugins() -> None:
    """pip-install the two plugin distributions (editable) unless they already are."""
    missing = [name for name, (_, module, _) in USER_PLUGINS.items() if not _usable(name, module)]
    if not missing:
        return
    args = [arg for name in missing for arg in ("-e", str(USER_PLUGINS[name][2]))]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *args],
        check=True,
        capture_output=True,
    )
    # Editable installs work through a .pth file, which Python reads at start-up only.
    for directory in site.getsitepackages():
        site.addsitedir(directory)
    importlib.invalidate_caches()
    still = [name for name, (_, module, _) in USER_PLUGINS.items() if not _usable(name, module)]
    assert not still, f"{still} not importable after pip install"


@pytest.fixture
def skip_log() -> Iterator[list[str]]:
    """Messages of the ``skipinject`` logger (it may not propagate to the root logger)."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger("skipinject")
    handler, level = Collect(logging.DEBUG), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


@pytest.fixture
def counted_compute_advantage(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Count real ``compute_advantage`` runs: a counting layer *under* skipinject's wrapper."""
    from verl.trainer.ppo import ray_trainer

    calls: list[int] = []
    original = ray_trainer.compute_advantage

    @functools.wraps(original)
    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(ray_trainer, "compute_advantage", counting)
    yield calls
    bootstrap.stop()  # unpatch before monkeypatch puts the original back


@pytest.fixture
def counted_extract_reward(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    from verl.trainer.ppo import reward

    calls: list[int] = []
    original = reward.extract_reward

    @functools.wraps(original)
    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(reward, "extract_reward", counting)
    yield calls
    bootstrap.stop()  # unpatch before monkeypatch puts the original back
