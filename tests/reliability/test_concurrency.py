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
    parts = [1 if w < 2 else 2 for w in range(WRITERS)]
    run = h.writers_and_readers(ctx, str(project), step, parts, READERS, ROUNDS, NUMEL)
    totals = run.totals
    observed = sum(len(values) for values in run.seen)
    store = StepStore(project, "toy", h.CONTEXT)
    final = {h.payload_consistent(p) for p in store.load(store.verified(step))}
    final_ok = len(final) == 1 and final <= run.last_values
    lost = totals["torn"] + totals["error"] + totals["miss_after_hit"] + run.foreign + int(not final_ok)
    lost += sum(1 for c in run.exit_codes if c != 0)
    ledger(
        "concurrency",
        f"{WRITERS} processes saving one step {ROUNDS}x each (1- and 2-part) while {READERS} read it in a loop",
        WRITERS * ROUNDS + sum(totals.values()),
        f"{WRITERS * ROUNDS} commits; reads: {totals['hit']} complete ({observed} different writes seen), "
        f"{totals['miss']} misses before the first commit, {totals['torn']} torn, {totals['miss_after_hit']} lost "
        f"after a hit; final step = one writer's last write: {final_ok}",
        lost,
    )
    assert lost == 0, (totals, run.errors, final, run.exit_codes)
    assert totals["hit"] > 0
