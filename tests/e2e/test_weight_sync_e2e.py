"""The trainer's weight sync into the rollout engine on real verl 0.9.1 (CPU), V1 TransferQueue trainer in
``sync`` mode: a pair of 3-step runs. Run 1 generates every step (steps 1-2 chosen, so cached); run 2
serves steps 1-2 from run 1's cache and generates step 3.

The CPU rollout's weight sync is real: the trainer's state dict is sent to the generation server, which
loads it and logs it (``weight_sync``: verl's weight version ``global_steps`` and a digest of the values);
each generation logs the weights it saw. The V0 trainer's syncs are checked on the session's shared runs
(``test_rollout_e2e.py``: every step served, validation first; ``test_match_e2e.py``: pending syncs
carried out before the generations of ``match``).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import copy_dump, harness, launch, skip_lines

pytestmark = pytest.mark.e2e

ROLE = "rollout_tq"


def v1_sync(assets: Any, tmp: Path, dump: Path, run: str) -> list[str]:
    return harness.main_ppo_overrides(
        assets,
        use_v1=True,
        trainer_mode="sync",
        total_steps=3,
        dump_dir=dump,
        extra=[f"skip.{ROLE}.enable=True", f"skip.{ROLE}.steps=[1,2]", f"trainer.rollout_data_dir={tmp / run}"],
    )


def grad_norms(proc: Any) -> list[str]:
    """verl's logged ``actor/grad_norm`` of each training step, as printed."""
    return re.findall(r"actor/grad_norm:(-?[0-9.e+-]+?)(?:\s|$)", proc.stdout)


def weights_by_step(generated: list[dict]) -> dict[int, set[tuple[int, str]]]:
    """Training step -> the (weight version, weights digest) its generations saw (weights of the step before)."""
    seen: dict[int, set[tuple[int, str]]] = {}
    for call in generated:
        seen.setdefault(int(call["global_steps"]) + 1, set()).add((int(call["global_steps"]), call["weight_digest"]))
    return seen


def test_v1_sync_served_steps_make_no_weight_sync_and_the_generated_step_sees_the_same_weights(
    assets: Any, tmp_path: Path
):
    dump = tmp_path / "dump"
    first, generated_1 = launch(assets, tmp_path, "run1", v1_sync(assets, tmp_path, dump, "run1"))
    syncs_1 = harness.weight_syncs(tmp_path / "run1.gen.jsonl")
    # Run 1 generates every step: a sync before each (weights of steps 0, 1, 2); the one after step 3 waits
    # for a generation that never comes (no training step follows).
    assert [s["global_steps"] for s in syncs_1] == [0, 1, 2], syncs_1
    one = weights_by_step(generated_1)
    assert sorted(one) == [1, 2, 3] and all(len(seen) == 1 for seen in one.values()), one
    deferred = [line for line in skip_lines(first, ROLE) if "weight sync deferred" in line]
    assert len(deferred) == 1 and "step 4: weight sync deferred (no training step follows step 3" in deferred[0]

    copy_dump(dump, tmp_path / "dump2")
    second, generated_2 = launch(assets, tmp_path, "run2", v1_sync(assets, tmp_path, tmp_path / "dump2", "run2"))
    syncs_2 = harness.weight_syncs(tmp_path / "run2.gen.jsonl")
    # Steps 1-2 served: no sync for them and no generation; one sync, with step 2's weights, before step 3's
    # generation, which sees exactly the weights run 1's step 3 saw (same weight version, same values).
    assert [s["global_steps"] for s in syncs_2] == [2], syncs_2
    two = weights_by_step(generated_2)
    assert sorted(two) == [3], two
    # Step 3's generation saw the weights of the one sync, carried out before it: the trainer's after step 2.
    assert two[3] == {(2, syncs_2[0]["weight_digest"])}, (two[3], syncs_2)
    assert min(call["time"] for call in generated_2) > syncs_2[0]["time"]
    # The weights are run 1's whenever the served steps trained bit for bit as run 1's did (the V1 trainer may
    # sum a served batch's rows in another order than the generated one: then both differ in the last bits).
    if grad_norms(first)[:2] == grad_norms(second)[:2]:
        assert two[3] == one[3], (two[3], one[3])
    assert Counter(call["prompt"] for call in generated_2) == Counter(
        call["prompt"] for call in generated_1 if int(call["global_steps"]) == 2
    ), "step 3 generated the prompts run 1 generated at step 3"
    lines = skip_lines(second, ROLE)
    deferred = [m[1] for line in lines if (m := re.search(r"(\w+ step \d+): weight sync deferred", line))]
    assert deferred == [f"{ROLE} step 1", f"{ROLE} step 2", f"{ROLE} step 4"], lines
    summary = [line for line in (second.stdout + second.stderr).splitlines() if f"summary: {ROLE}:" in line]
    assert summary and "3 weight syncs skipped" in summary[-1], summary
