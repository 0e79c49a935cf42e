"""Helpers the test modules import (``from tests.conftest import ROOT``). The tiers and the shared
fixtures live in the repository's root ``conftest.py``."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def toy_env(toy_site: Path, **extra: str) -> dict[str, str]:
    """Environment for a subprocess that sees the toy plugin and toy targets."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP"))}
    env["PYTHONPATH"] = os.pathsep.join([str(toy_site), str(FIXTURES)])
    env.update(extra)
    return env
