"""Real ``python -m skipinject -m verl.trainer.main_ppo`` runs of verl's V1 TransferQueue trainer on CPU.

Run 1 generates steps 1 and 2 and caches them; run 2 (same command) injects them from the cache
into TransferQueue, never calls the generator, and trains to the end (rc 0): in ``sync`` mode with
group filtering (DAPO) on, where the replay buffer refills evicted groups, and in ``separate_async``
with ``parameter_sync_step=2`` (two mini-batches per step, one commit).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import SKIPINJECT_MAIN_PPO, harness, rollout_records, skip_lines
from tests.integration.test_cache_tool import check_real_dump

pytestmark = pytest.mark.e2e

ROLE = "rollout_tq"


def _run(assets: Any, tmp: Path, name: str, overrides: list[str]) -> tuple[Any, int]:
    """One run through ``python -m skipinject``; returns it and its generator calls (log: ``{name}.gen.jsonl``)."""
    gen_log = tmp / f"{name}.gen.jsonl"
    proc = harness.run_main_ppo(
        assets,
        overrides,
        gen_log=gen_log,
        launcher=SKIPINJECT_MAIN_PPO,
        timeout=1200,
        env_extra={"RAY_DEDUP_LOGS": "0"},
    )
    (tmp / f"{name}.stdout.txt").write_text(proc.stdout)
    (tmp / f"{name}.stderr.txt").write_text(proc.stderr)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc, harness.count_generate_calls(gen_log)


def _generations(directory: Path) -> dict[int, Counter]:
    """verl's per-step generation dumps as multisets of (prompt, response, score): row order may differ."""
    return {
        step: Counter((r["input"], r["output"], round(float(r["score"]), 5)) for r in records)
        for step, records in rollout_records(directory).items()
    }


@pytest.mark.parametrize(
    ("trainer_mode", "sync_step", "gbs"),
    [pytest.param("separate_async", 2, 1, id="separate_k2")],
)
def test_v1_rollout_tq_cache_then_hit(assets: Any, tmp_path: Path, trainer_mode: str, sync_step: int, gbs: int):
    dump = tmp_path / "dump"

    def overrides(run: str) -> list[str]:
        return harness.main_ppo_overrides(
            assets,
            use_v1=True,
            trainer_mode=trainer_mode,
            parameter_sync_step=sync_step,
            total_steps=2,
            dump_dir=dump,
            extra=[
                f"skip.{ROLE}.enable=True",
                f"skip.{ROLE}.steps=[1,2]",
                f"trainer.rollout_data_dir={tmp_path / run}",
            ],
        )

    # Run 1: both steps generated, each cached as one commit of `parameter_sync_step` parts.
    first, calls_1 = _run(assets, tmp_path, "run1", overrides("run1"))
    assert calls_1 >= 2 * harness.TRAIN_BATCH * harness.ROLLOUT_N
    layout = harness.cache_dir(dump, gbs=gbs)
    assert sorted(p.name for p in layout.iterdir()) == ["1", "2"]
    for step in ("1", "2"):
        meta = json.loads((layout / step / "meta.json").read_text())
        assert [part["dir"] for part in meta["parts"]] == [str(i) for i in range(sync_step)]
        assert meta["rows"] == harness.TRAIN_BATCH * harness.ROLLOUT_N
    assert not list(layout.rglob("tq_batch.pt")), "only skipinject's safe format is written"
    lines = skip_lines(first, ROLE)
    assert (
        sum(
            f"{ROLE} step {s}: saved {harness.TRAIN_BATCH * harness.ROLLOUT_N} rows in {sync_step} part(s)" in line
            for line in lines
            for s in (1, 2)
        )
        == 2
    ), lines

    # Run 2: both steps injected from the cache; the generator is never called; training finishes.
    second, calls_2 = _run(assets, tmp_path, "run2", overrides("run2"))
    assert calls_2 == 0, f"run 2 called the generator {calls_2} times"
    lines = skip_lines(second, ROLE)
    assert sum("hit, served step" in line and "rollout not submitted" in line for line in lines) == 2, lines
    assert not any(": saved" in line for line in lines), "a served step is not saved again"
    if trainer_mode != "sync":
        assert "async warm-up prefetch switched off" in second.stdout + second.stderr
    one, two = _generations(tmp_path / "run1"), _generations(tmp_path / "run2")
    assert sorted(one) == sorted(two) == [1, 2]
    for step in (1, 2):
        assert two[step] == one[step], f"step {step}: run 2 trained on other trajectories than run 1 generated"
    check_real_dump(dump, {ROLE}, tmp_path, one_process=True)  # `skipinject cache ...` on the k-part steps


#: Group filtering's reward: rows 5 and 6 of the data (step 2's submit, unshuffled) score 0 in every
#: session, so the filter evicts their groups and the replay buffer refills; every other trajectory
#: scores at random, so no other group is uniform (and nothing else depends on what was generated).
DAPO_REWARD = """import random


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if int((extra_info or {}).get("index", -1)) in (5, 6):
        return 0.0
    return random.random()
"""


def _calls_by_weights(gen_log: Path) -> Counter:
    """Generator calls per weight version: the sync trainer rolls step s out with step s-1's weights."""
    return Counter(int(call["global_steps"]) for call in harness.generate_calls(gen_log))


def test_v1_group_filtering_served_steps_refill_nothing_and_keep_the_dataloader(assets: Any, tmp_path: Path):
    """DAPO (``algorithm.filter_groups``) on the sync V1 trainer, steps 1-3 with 1 and 2 chosen.

    Run 1's step 2 draws its 4 prompts, loses 2 groups to the filter and refills: its record says how
    many prompts it drew. Run 2 serves steps 1 and 2 with no generator call (no refill either), draws
    what run 1 drew, so step 3 (generated in both runs) trains on the same prompts as in run 1.
    """
    dump = tmp_path / "dump"
    reward = tmp_path / "dapo_reward.py"
    reward.write_text(DAPO_REWARD)

    def overrides(run: str) -> list[str]:
        return harness.main_ppo_overrides(
            assets,
            use_v1=True,
            total_steps=3,
            dump_dir=dump,
            extra=[
                "algorithm.filter_groups.enable=True",
                "algorithm.filter_groups.metric=reward",
                "data.shuffle=False",
                f"reward.custom_reward_function.path={reward}",
                f"skip.{ROLE}.enable=True",
                f"skip.{ROLE}.steps=[1,2]",
                f"trainer.rollout_data_dir={tmp_path / run}",
            ],
        )

    per_prompt = harness.ROLLOUT_N
    first, _ = _run(assets, tmp_path, "run1", overrides("run1"))
    layout = harness.cache_dir(dump, gbs=1)  # group filtering fetches one prompt at a time
    assert sorted(p.name for p in layout.iterdir()) == ["1", "2"]
    meta = {step: json.loads((layout / str(step) / "meta.json").read_text()) for step in (1, 2)}
    assert (meta[1]["prompts_drawn"], meta[1]["refills"]) == (harness.TRAIN_BATCH, [])
    drawn = meta[2]["prompts_drawn"]
    assert meta[2]["prompts_submitted"] == harness.TRAIN_BATCH and drawn == harness.TRAIN_BATCH + sum(
        meta[2]["refills"]
    )
    assert drawn > harness.TRAIN_BATCH and meta[2]["carried_over"] == 0, meta[2]
    assert meta[2]["rows"] == harness.TRAIN_BATCH * per_prompt, "the filtered groups are not in the record"
    calls_1 = _calls_by_weights(tmp_path / "run1.gen.jsonl")
    assert calls_1[1] == drawn * per_prompt, f"run 1's step 2 generated every prompt it drew: {calls_1}"
    assert any(f"{ROLE} step 2: refill of" in line for line in skip_lines(first, ROLE))

    second, calls_2 = _run(assets, tmp_path, "run2", overrides("run2"))
    assert calls_2 == harness.TRAIN_BATCH * per_prompt, f"run 2 called the generator {calls_2} times"
    by_weights = _calls_by_weights(tmp_path / "run2.gen.jsonl")
    assert by_weights == Counter({2: harness.TRAIN_BATCH * per_prompt}), f"only step 3 is generated: {by_weights}"
    lines = skip_lines(second, ROLE)
    assert sum("hit, served step" in line and "rollout not submitted" in line for line in lines) == 2, lines
    assert any(
        f"{ROLE} step 2: hit" in line and f"drew {drawn} prompts as the recorded step did" in line for line in lines
    ), lines
    assert not any("refill of" in line or "asks for" in line for line in lines), lines
    assert not any(": saved" in line for line in lines), "a served step is not saved again"

    one, two = _generations(tmp_path / "run1"), _generations(tmp_path / "run2")
    assert sorted(one) == sorted(two) == [1, 2, 3]
    for step in (1, 2):
        assert two[step] == one[step], f"step {step}: run 2 trained on other trajectories than run 1 generated"
    prompts = {
        run: {step: Counter(r["input"] for r in records) for step, records in rollout_records(tmp_path / run).items()}
        for run in ("run1", "run2")
    }
    assert prompts["run2"][3] == prompts["run1"][3], "step 3 trained on other prompts: the dataloader drifted"
    check_real_dump(dump, {ROLE}, tmp_path, one_process=True)
