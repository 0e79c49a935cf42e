"""The toy example (no verl) shows miss→dump, then hit, as examples/toy/README.md says, and keeps its cache."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests import readme_sync
from tests.conftest import ROOT


def test_toy_example_misses_then_hits_and_keeps_its_cache(tmp_path: Path) -> None:
    dump = tmp_path / "cache"
    script = ROOT / "examples" / "toy" / "run_example.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--dump-dir", str(dump)], capture_output=True, text=True, timeout=300
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
    kept = dump / "skipinject_default" / "toy_rollout"
    assert sorted(p.name for p in kept.iterdir()) == ["1", "2"], "the cache is kept for `skipinject cache ls`"
    assert f"try: python -m skipinject cache ls {dump}" in proc.stdout

    listing = readme_sync.cache_listing(dump)  # `skipinject cache ls` of it, as the README shows it
    assert "toy_rollout  1-2       6" in listing and "complete" in listing
    shown = readme_sync.blocks((ROOT / "README.md").read_text())["cache-ls"]
    assert readme_sync.comparable(shown) == readme_sync.comparable(listing), (
        "README's cache-ls block drifted: run python tests/readme_sync.py"
    )
