"""Shared fixtures of the end-to-end runs: the CPU harness and its tiny local assets."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

HARNESS_DIR = ROOT / "examples" / "verl_cpu"
if str(HARNESS_DIR) not in sys.path:
    sys.path.insert(0, str(HARNESS_DIR))

import harness  # noqa: E402

SKIPINJECT_MAIN_PPO = (sys.executable, "-m", "skipinject", "-m", "verl.trainer.main_ppo")
SKIPINJECT_FULLY_ASYNC = (
    sys.executable,
    "-m",
    "skipinject",
    "-m",
    "verl.experimental.fully_async_policy.fully_async_main",
)


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return harness.build_assets(tmp_path_factory.mktemp("verl_cpu_assets"))


def skip_lines(proc: Any, role: str) -> list[str]:
    """skipinject's decision lines for ``role`` from a run's output (Ray forwards worker logs)."""
    return [
        line.split("skipinject ", 1)[1]
        for line in (proc.stdout + proc.stderr).splitlines()
        if "skipinject " in line and f" {role} step " in line
    ]


def rollout_records(directory: Path) -> dict[int, list[dict]]:
    """verl's own per-step generation dumps (``trainer.rollout_data_dir``): step -> records."""
    return {
        int(path.stem): [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for path in sorted(directory.glob("*.jsonl"))
    }
