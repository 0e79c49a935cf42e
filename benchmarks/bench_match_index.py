"""``action=match``: finding a 4096-row call's rows among many cached steps must not read every step.

Builds a project of ``--steps`` committed steps holding ``ROWS`` row keys in all (only their
``meta.json``: the index reads nothing else), then times, for each size:

* **build**: the first lookup of a run with no index file (every ``meta.json`` read once, the
  index written beside the steps);
* **lookup, new run**: a fresh index object (a new run) finding 4096 keys, half of them cached:
  the index file loaded and checked, the project listed, a binary search; ``meta.json`` reads counted;
* **lookup, same run**: the next call's lookup in the same process;
* **one new step**: a step committed since the index was written: only its ``meta.json`` is read.

    python benchmarks/bench_match_index.py [--steps 10000] [--rows 10000 100000 1000000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import results
from skipinject.engine.row_index import RowIndex
from skipinject.store import StepStore
from skipinject.store.format import ROWS_DIR
from skipinject.store.writer import StepWriter

CALL_ROWS = 4096


def build(project: Path, steps: int, rows: int, rng: random.Random) -> tuple[StepStore, list[str]]:
    """``steps`` committed steps with ``rows`` keys in all (meta.json only), and every key."""
    store = StepStore(project, "bench", {})
    project.mkdir(parents=True)
    per_step = max(1, rows // steps)
    keys: list[str] = []
    for step in range(1, steps + 1):
        step_keys = [f"{rng.getrandbits(64):016x}" for _ in range(per_step)]
        keys += step_keys
        write_meta(store, step, step_keys)
    return store, keys


def write_meta(store: StepStore, step: int, keys: list[str]) -> None:
    writer = StepWriter(store, step)
    writer.parts[""] = {"dir": "", "rows": len(keys), "files": {}}
    text = writer.meta_record({"calls": 1, "inputs": None, "row_keys": [keys], "rows_per_input": [1]})
    directory = store.step_dir(step)
    directory.mkdir()
    (directory / "meta.json").write_bytes(text)


class CountingStore(StepStore):
    reads = 0

    def read_meta(self, step: int, *, siblings: bool = False) -> dict[str, Any]:
        CountingStore.reads += 1
        return super().read_meta(step, siblings=siblings)


def index_of(project: Path) -> RowIndex:
    return RowIndex(CountingStore(project, "bench", {}), CountingStore(project / ROWS_DIR, "bench", {}))


def measure(steps: int, rows: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp) / "project"
        started = time.perf_counter()
        store, keys = build(project, steps, rows, rng)
        made = time.perf_counter() - started
        wanted = rng.sample(keys, CALL_ROWS // 2) + [f"{rng.getrandbits(64):016x}" for _ in range(CALL_ROWS // 2)]

        CountingStore.reads = 0
        started = time.perf_counter()
        found = index_of(project).lookup(wanted)
        build_ms = (time.perf_counter() - started) * 1000
        build_reads = CountingStore.reads
        assert sum(bool(f) for f in found) == CALL_ROWS // 2

        CountingStore.reads = 0
        index = index_of(project)
        started = time.perf_counter()
        found = index.lookup(wanted)
        lookup_ms = (time.perf_counter() - started) * 1000
        lookup_reads = CountingStore.reads
        assert sum(bool(f) for f in found) == CALL_ROWS // 2

        started = time.perf_counter()
        index.lookup(wanted)
        again_ms = (time.perf_counter() - started) * 1000

        write_meta(store, steps + 1, [f"{rng.getrandbits(64):016x}" for _ in range(max(1, rows // steps))])
        CountingStore.reads = 0
        started = time.perf_counter()
        index.lookup(wanted)
        new_step_ms = (time.perf_counter() - started) * 1000
        new_step_reads = CountingStore.reads
        size = (project / "row-index.npz").stat().st_size
    return {
        "steps": steps,
        "rows": len(keys),
        "make_s": round(made, 1),
        "build_ms": round(build_ms, 1),
        "build_meta_reads": build_reads,
        "lookup_ms": round(lookup_ms, 1),
        "lookup_meta_reads": lookup_reads,
        "same_run_ms": round(again_ms, 1),
        "new_step_ms": round(new_step_ms, 1),
        "new_step_meta_reads": new_step_reads,
        "index_mb": round(size / 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--json", action="store_true")
    results.add_argument(parser)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    figures = [measure(args.steps, rows) for rows in args.rows]
    load = os.getloadavg()[0]
    print(f"{CALL_ROWS} keys looked up (half cached) among {args.steps} cached steps; load avg {load:.1f}")
    print(
        "| cached rows | build (no index) ms | meta reads | lookup, new run ms | meta reads | same run ms "
        "| one new step ms | meta reads | index MB |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for f in figures:
        print(
            f"| {f['rows']:,} | {f['build_ms']} | {f['build_meta_reads']} | {f['lookup_ms']} "
            f"| {f['lookup_meta_reads']} | {f['same_run_ms']} | {f['new_step_ms']} | {f['new_step_meta_reads']} "
            f"| {f['index_mb']} |"
        )
    if args.json:
        print(json.dumps({"call_rows": CALL_ROWS, "load": load, "sizes": figures}))
    if args.record:
        results.record("match_index", {"call_rows": CALL_ROWS, "steps": args.steps, "sizes": figures}, load_start)


if __name__ == "__main__":
    main()
