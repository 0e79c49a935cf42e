"""The store benchmark runs (small batch): its code paths, equality checks and report stay working."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args: str) -> tuple[str, dict]:
    """Run ``benchmarks/<script>`` with ``args``; its stdout and the JSON figures of its last line."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, json.loads(out.stdout.strip().splitlines()[-1])


def test_bench_store_quick(tmp_path: Path) -> None:
    stdout, figures = run_benchmark("bench_store.py", "--quick", "--json", "--dir", str(tmp_path))
    assert "| warm load, usable" in stdout and "upstream/skipinject" in stdout
    for table in ("dataproto", "v1"):
        assert figures[table]["rows"] == 64
        assert figures[table]["ours_load_ms"] > 0 and figures[table]["upstream_load_ms"] > 0
        assert figures[table]["ours_miss_call_ms"] > 0, "what a miss costs the training call, both paths"
    assert list(tmp_path.iterdir()) == [], "the benchmark cleans up its files"


def test_bench_scaling_quick(tmp_path: Path) -> None:
    args = ["--dp-rows", "16", "32", "--v1-rows", "16", "32", "--dp-lengths", "8", "16"]
    args += ["--v1-lengths", "8", "16", "--repeat", "1", "--json", "--dir", str(tmp_path)]
    stdout, figures = run_benchmark("bench_scaling.py", *args)
    assert "| rows | tensor MB |" in stdout and "load avg" in stdout
    for table in ("dataproto", "v1"):
        assert [f["rows"] for f in figures[table]] == [16, 32]
        assert all(f["ours_load_ms"] > 0 and f["ours_decode_ms"] > 0 for f in figures[table])
    assert list(tmp_path.iterdir()) == [], "the benchmark cleans up its files"


def test_bench_remote_quick(tmp_path: Path) -> None:
    stdout, figures = run_benchmark("bench_remote.py", "--quick", "--json", "--dir", str(tmp_path))
    assert "| hit, verified and usable |" in stdout and "moto server on localhost" in stdout
    assert figures["rows"] == 64 and figures["remote_load_ms"] > 0 and figures["remote_save_ms"] > 0
    assert list(tmp_path.iterdir()) == [], "the benchmark cleans up its files"


def test_bench_compression_quick(tmp_path: Path) -> None:
    stdout, figures = run_benchmark("bench_compression.py", "--quick", "--s3", "--json", "--dir", str(tmp_path))
    assert "| skipinject `zstd`, S3 |" in stdout and "load average" in stdout and "Floor of a verified" in stdout
    assert figures["rows"] == 64 and figures["local_zstd_mb"] < figures["local_none_mb"]
    assert figures["s3_zstd_hit_ms"] > 0 and figures["upstream_hit_ms"] > 0 and figures["floor_ms"] > 0
    assert figures["fresh_floor_ms"] > 0 and "Floor of any hit that builds the tensors anew" in stdout
    assert "| skipinject `zstd`, local disk, hit steady state (previous batch held, pool" in stdout
    assert figures["local_zstd_steady_hit_ms"] > 0 and figures["local_zstd_pool_mb"] > 0
    assert figures["warm_floor_ms"] >= 0 and "memory already faulted in" in stdout
    for where, key in (("local disk", "local_zstd"), ("S3", "s3_zstd")):
        assert f"| skipinject `zstd`, {where}, hit read ahead (while the previous step trained" in stdout
        assert figures[f"{key}_ahead_hit_ms"] > 0 and figures[f"{key}_ahead_wait_ms"] >= 0
    assert list(tmp_path.iterdir()) == [], "the benchmark cleans up its files"


def test_bench_match_index_quick() -> None:
    stdout, figures = run_benchmark("bench_match_index.py", "--steps", "50", "--rows", "5000", "--json")
    assert "| cached rows |" in stdout
    (size,) = figures["sizes"]
    assert size["rows"] == 5000 and size["build_meta_reads"] == 50
    assert size["lookup_meta_reads"] == 0, "a new run's lookup reads no step's meta.json"
    assert size["new_step_meta_reads"] == 1, "a step committed since the index: only its meta.json is read"


def test_bench_rescore_quick() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_rescore.py"),
            "--prompts",
            "4",
            "--response",
            "8",
            "--repeat",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "re-scored hit" in out.stdout and "goal (served + reward)" in out.stdout
