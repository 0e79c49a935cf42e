"""The toy example (no verl) shows miss→dump, then hit, as examples/toy/README.md says, and keeps its cache."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from tests import readme_sync
from tests.conftest import ROOT


def test_toy_example_misses_then_hits_and_keeps_its_cache(tmp_path: Path) -> None:
    dump = tmp_path / "cache"
    script = ROOT / "examples" / "toy" / "run_example.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--dump-dir", str(dump)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
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
    # the first hit's logged time is the step's (finding, reading and decoding it, and what that imported the
    # first time, which it names); a step without tensors imports neither torch nor tensordict
    hit = re.search(r"toy_rollout step 1: hit, [^\n]* in ([0-9.]+) s[^\n]*", proc.stderr)
    assert hit is not None, proc.stderr
    # not `in 0.000 s`: the hit's time holds its own work (no ratio to the step's time: that is a timing)
    assert float(hit[1]) > 0 and "in 0.000 s" not in hit[0], (hit[0], second[0])
    assert "torch" not in hit[0] and "tensordict" not in hit[0], hit[0]
    kept = dump / "skipinject_default" / "toy_rollout"
    assert sorted(p.name for p in kept.iterdir()) == ["1", "2"], "the cache is kept for `skipinject cache ls`"
    hint = proc.stdout.rstrip().rsplit("try: ", 1)[1]
    listed = as_typed(hint, tmp_path)
    assert listed.returncode == 0 and "toy_rollout  1-2" in listed.stdout, (hint, listed.stderr)

    listing = readme_sync.cache_listing(dump)  # `skipinject cache ls` of it, as the README shows it
    assert "toy_rollout  1-2       6" in listing and "complete" in listing
    shown = readme_sync.blocks((ROOT / "README.md").read_text())["cache-ls"]
    assert readme_sync.comparable(shown) == readme_sync.comparable(listing), (
        "README's cache-ls block drifted: run python tests/readme_sync.py"
    )


def as_typed(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``command`` typed in a shell at ``cwd`` whose ``PATH`` is the system's, without this environment's ``bin``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP", "VIRTUAL_ENV"))}
    env["PATH"] = "/usr/bin:/bin"
    return subprocess.run(["/bin/sh", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_demos_closing_hint_works_as_printed(tmp_path: Path) -> None:
    """The demo ends with a ``cache ls`` of its cache: typed as printed, from where the demo ran, it lists it,
    although the console script is in the environment's ``bin`` and not on ``PATH``."""
    spec = importlib.util.spec_from_file_location("demo", ROOT / "examples" / "verl_cpu" / "demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    try:
        spec.loader.exec_module(demo)
    finally:
        sys.path[:] = path
    cache = tmp_path / ".demo" / "cache"
    cache.mkdir(parents=True)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        hint = demo.cache_ls_hint(cache)
    finally:
        os.chdir(cwd)
    assert hint.endswith(" cache ls .demo/cache"), hint
    listed = as_typed(hint, tmp_path)
    assert listed.returncode == 0 and "nothing cached in" in listed.stdout, (hint, listed.stdout, listed.stderr)
