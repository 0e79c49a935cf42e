"""verl's one-step-off trainer (``verl.experimental.one_step_off_policy``) on CPU, a real pair of runs under
``python -m skipinject``: run 1 generates and caches with ``skip.rollout``, run 2 makes 0 generator calls;
``skip.reward`` is enabled in both and acts (recorded in run 1, served in run 2) -- or, where its target is not
reached, says so in one line (never silent).

On demand (the CI end-to-end stream has no room for two more verl runs):
``SKIPINJECT_ON_DEMAND=one-step-off .venv/bin/python -m pytest -q tests/e2e/test_one_step_off_e2e.py``.

The one-step-off trainer generates step k+1's batch while it trains step k, and labels it with the step it
is generated in (``meta_info["global_steps"] = self.global_steps`` when the generation starts): its first two
generations both carry step 1. The ``rollout`` role's step is that label, so step 1's cache holds two calls
(steps 1 and 2's batches), replayed as calls 1 and 2 of step 1.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from examples.verl_cpu import harness
from tests.e2e.conftest import skip_lines

ON_DEMAND = "SKIPINJECT_ON_DEMAND"
PAIR_ID = "one-step-off"

pytestmark = pytest.mark.skipif(
    PAIR_ID not in os.environ.get(ON_DEMAND, "").replace(" ", "").split(","),
    reason=f"on demand: {ON_DEMAND}={PAIR_ID} runs verl's one-step-off pair (two real verl runs)",
)

LAUNCHER = (sys.executable, "-m", "skipinject", "-m", "verl.experimental.one_step_off_policy.main_ppo")
STEPS = 2


def one_step_off_run(assets: Any, tmp: Path, dump: Path, name: str) -> tuple[Any, list[dict], dict]:
    """One 2-step run with ``rollout`` and ``reward`` on at steps 1-2; its output, generations and summary."""
    roles = [f"skip.{role}.{key}" for role in ("rollout", "reward") for key in ("enable=True", "steps=[1,2]")]
    roles += [f"skip.{role}.dump_dir={dump}" for role in ("rollout", "reward")]
    overrides = harness.one_step_off_overrides(assets, total_steps=STEPS, extra=roles)
    gen_log, summary = tmp / f"{name}.gen.jsonl", tmp / f"{name}.summary.json"
    env = {"RAY_DEDUP_LOGS": "0", "SKIPINJECT_SUMMARY": str(summary)}
    proc = harness.run_main_ppo(assets, overrides, gen_log=gen_log, launcher=LAUNCHER, timeout=900, env_extra=env)
    (tmp / f"{name}.stdout.txt").write_text(proc.stdout)
    (tmp / f"{name}.stderr.txt").write_text(proc.stderr)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc, harness.generate_calls(gen_log), json.loads(summary.read_text())


def test_one_step_off_rollout_cache_then_hit_and_reward_acts(assets: Any, tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    first, generated, summary_1 = one_step_off_run(assets, tmp_path, dump, "run1")
    second, regenerated, summary_2 = one_step_off_run(assets, tmp_path, dump, "run2")

    # rollout: run 1 generates both steps' batches (labelled step 1: see the module's docstring) and saves them
    assert sum(int(r.get("n_sequences", 1)) for r in generated) == STEPS * harness.TRAIN_BATCH * harness.ROLLOUT_N
    lines = skip_lines(first, "rollout")
    assert any("rollout step 1: miss" in line for line in lines), lines
    assert (harness.cache_dir(dump) / "1" / "meta.json").is_file()
    # run 2 serves them: no generator call at all
    assert regenerated == [], f"run 2 generated {len(regenerated)} sequences"
    assert any("rollout step 1: hit" in line for line in skip_lines(second, "rollout"))
    assert summary_2["roles"]["rollout"]["served_steps"] >= 1 and summary_2["roles"]["rollout"]["generated_steps"] == 0

    # never silent: the reward role either acted or said in one line why not (the line's trainer is named)
    said = [line for line in first.stdout.splitlines() + first.stderr.splitlines() if "was never called" in line]
    acted = skip_lines(first, "reward")
    assert acted or any("skip.reward: step 1 ended" in line and "OneStepOffRayTrainer" in line for line in said)
    assert ("reward" in summary_1["never_called"]) == (not acted)
    # ... and, where the trainer's module binds the function under a name not patched, before the run too
    started = "skip.reward may not act in this run: OneStepOffRayTrainer calls verl.trainer.ppo.reward.extract_reward"
    assert acted or started in first.stdout + first.stderr, first.stderr[-3000:]

    # reward acts: recorded at steps 1-2 in run 1, served in run 2 (its target is followed where the
    # one-step-off trainer's module binds verl.trainer.ppo.reward.extract_reward)
    assert sum(f"reward step {s}: miss" in line for line in acted for s in (1, 2)) == 2, acted + said
    hits = [line for line in skip_lines(second, "reward") if "hit, served step" in line]
    assert len(hits) == 2, skip_lines(second, "reward")
    assert summary_2["never_called"] == {}
