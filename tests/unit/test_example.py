"""The toy example (no verl) shows miss→dump, then hit, as its README section says."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_toy_example_misses_then_hits():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "toy" / "run_example.py")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    runs = proc.stdout.split("--- run 2")
    first = [line for line in runs[0].splitlines() if line.startswith("step ")]
    second = [line for line in runs[1].splitlines() if line.startswith("step ")]
    strip = [line.rsplit(" (", 1)[0] for line in first]
    assert [line.rsplit(" (", 1)[0] for line in second[:2]] == strip[:2], "steps 1-2 replayed from the cache"
    assert proc.stderr.count("toy_rollout step 1: miss") == 1
    assert proc.stderr.count("toy_rollout step 1: hit, served step 1") == 1
    assert "toy_rollout step 3" not in proc.stderr
