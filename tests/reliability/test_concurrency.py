"""Concurrency: processes writing and reading one step at once never see a torn or partial step.

Four writers (two saving one part, two saving parts ``0`` and ``1``) save the same step over and
over with values of their own; four readers verify and load it in a loop. Every read must be a miss
(before the first commit) or a complete payload whose every byte comes from one write; once a
reader has seen the step it must never lose it; at the end the step is exactly one writer's last
write. The processes come from a ``forkserver`` (fresh interpreters with torch preloaded, nothing
inherited from the test process; ``spawn`` semantics at a fraction of the start-up cost).
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest

from skipinject.store import StepStore
from tests.reliability import helpers as h

# Processes writing and reading one step for tens of seconds: too slow for the unit tier.
pytestmark = pytest.mark.integration

WRITERS = 4
READERS = 4
ROUNDS = 30
NUMEL = 40_000  # 160 KB + 40 KB of tensors per part: small, so that reads and commits interleave often


def test_writers_and_readers_of_one_step(tmp_path: Path, ledger: Any) -> None:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "skipinject.store", "tests.reliability.helpers"])
    project = h.project_dir(h.runtime(tmp_path / "dump"))
    step = 5
    out = ctx.Queue()
    stop = ctx.Event()
    readers = [ctx.Process(target=h.reader_proc, args=(str(project), step, r, stop, out)) for r in range(READERS)]
    writers = [
        ctx.Process(target=h.writer_proc, args=(str(project), step, w, ROUNDS, NUMEL, 1 if w < 2 else 2, out))
        for w in range(WRITERS)
    ]
    for proc in readers + writers:
        proc.start()
    results = [out.get(timeout=300) for _ in writers]
    stop.set()
    results += [out.get(timeout=300) for _ in readers]
    for proc in readers + writers:
        proc.join(60)

    written = {w: values for kind, w, values in (r[:3] for r in results if r[0] == "writer")}
    last_values = {values[-1] for values in written.values()}
    all_values = {v for values in written.values() for v in values}
    totals = {"hit": 0, "miss": 0, "miss_after_hit": 0, "torn": 0, "error": 0}
    errors: list[str] = []
    foreign = 0
    observed = 0
    for _, _, counts, seen, errs in (r for r in results if r[0] == "reader"):
        for key in totals:
            totals[key] += counts[key]
        foreign += len(set(seen) - all_values)
        observed += len(seen)
        errors += errs

    store = StepStore(project, "toy", h.CONTEXT)
    final = {h.payload_consistent(p) for p in store.load(store.verified(step))}
    final_ok = len(final) == 1 and final <= last_values
    exit_codes = [p.exitcode for p in readers + writers]
    lost = totals["torn"] + totals["error"] + totals["miss_after_hit"] + foreign + int(not final_ok)
    lost += sum(1 for c in exit_codes if c != 0)
    ledger(
        "concurrency",
        f"{WRITERS} processes saving one step {ROUNDS}x each (1- and 2-part) while {READERS} read it in a loop",
        WRITERS * ROUNDS + sum(totals.values()),
        f"{WRITERS * ROUNDS} commits; reads: {totals['hit']} complete ({observed} different writes seen), "
        f"{totals['miss']} misses before the first commit, {totals['torn']} torn, {totals['miss_after_hit']} lost "
        f"after a hit; final step = one writer's last write: {final_ok}",
        lost,
    )
    assert lost == 0, (totals, errors, final, exit_codes)
    assert totals["hit"] > 0
