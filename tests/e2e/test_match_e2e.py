"""``skip.rollout.action=match`` on real verl 0.9.1 (V0 trainer, agent loop, CPU): one pair of short runs.

Run 1 (``match`` with an empty cache: it behaves like ``cache``) generates and saves steps 1-3.
Run 2 draws its batches with another data seed and another batch size (2 prompts a step, not 4: its
layout directory is another one): at each step it serves the prompts run 1 saw (from run 1's
layout) and generates exactly the others (the CPU rollout logs every sequence it generates, with a
digest of its prompt), trains on responses that belong to its own prompts, and saves its steps in
its own layout.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import SKIPINJECT_MAIN_PPO, harness, rollout_records, skip_lines

pytestmark = pytest.mark.e2e

STEPS = 3
#: Run 2's batch: 2 prompts a step (run 1: harness.TRAIN_BATCH = 4), PPO mini-batches to match.
SMALL_BATCH = 2
SMALLER_BATCH = (
    f"data.train_batch_size={SMALL_BATCH}",
    f"actor_rollout_ref.actor.ppo_mini_batch_size={SMALL_BATCH}",
    f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={SMALL_BATCH * harness.ROLLOUT_N}",
    f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={SMALL_BATCH * harness.ROLLOUT_N}",
)


def _run(assets: Any, tmp: Path, dump: Path, name: str, *extra: str) -> tuple[Any, list[dict]]:
    gen_log = tmp / f"{name}.gen.jsonl"
    overrides = harness.main_ppo_overrides(
        assets,
        use_v1=False,
        total_steps=STEPS,
        dump_dir=dump,
        extra=[
            "skip.rollout.enable=True",
            "skip.rollout.steps=[1-3]",
            "skip.rollout.action=match",
            f"trainer.rollout_data_dir={tmp / name}",
            *extra,
        ],
    )
    proc = harness.run_main_ppo(
        assets, overrides, gen_log=gen_log, launcher=SKIPINJECT_MAIN_PPO, timeout=900, env_extra={"RAY_DEDUP_LOGS": "0"}
    )
    (tmp / f"{name}.stdout.txt").write_text(proc.stdout)
    (tmp / f"{name}.stderr.txt").write_text(proc.stderr)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc, harness.generate_calls(gen_log)


def _prompt_text(record: dict) -> str:
    """The user's message of a dumped sample (verl decodes the chat-templated prompt)."""
    match = re.search(r"user\s*\n(.*?)\n", record["input"], re.S)
    return (match.group(1) if match else record["input"]).strip()


def test_match_serves_seen_prompts_generates_the_others_and_trains_on_its_own(assets: Any, tmp_path: Path):
    dump = tmp_path / "dump"
    first, generated_1 = _run(assets, tmp_path, dump, "run1")
    layout = harness.cache_dir(dump)
    lines = skip_lines(first, "rollout")
    assert sum("match: no row of this call cached" in line for line in lines) == STEPS, lines
    assert sorted(p.name for p in layout.iterdir() if p.name.isdigit()) == ["1", "2", "3"], "saved like cache"
    rows = [json.loads((layout / str(s) / "meta.json").read_text())["rows"] for s in (1, 2, 3)]
    assert rows == [harness.TRAIN_BATCH * harness.ROLLOUT_N] * STEPS
    assert len(generated_1) == sum(rows), "nothing cached: every sequence generated"

    second, generated_2 = _run(assets, tmp_path, dump, "run2", "data.seed=7", *SMALLER_BATCH)
    one, two = rollout_records(tmp_path / "run1"), rollout_records(tmp_path / "run2")
    assert sorted(one) == sorted(two) == [1, 2, 3]
    seen = {_prompt_text(r) for step in one.values() for r in step}
    outputs_1 = collections.defaultdict(list)
    for step in one.values():
        for r in step:
            outputs_1[_prompt_text(r)].append(r["output"])
    new_prompts = {_prompt_text(r) for step in two.values() for r in step} - seen
    served_prompts = {_prompt_text(r) for step in two.values() for r in step} & seen
    assert served_prompts and new_prompts, "the seed draws some prompts run 1 saw and some it did not"

    # Generated exactly the others: n sequences per new prompt, none of a prompt run 1 generated.
    digests_1 = {call["prompt"] for call in generated_1}
    per_prompt = collections.Counter(call["prompt"] for call in generated_2)
    assert not set(per_prompt) & digests_1, "a prompt run 1 generated was generated again"
    assert len(per_prompt) == len(new_prompts) and set(per_prompt.values()) == {harness.ROLLOUT_N}, per_prompt

    # Trained on its own prompts: each dumped row's ground truth (this run's dataset row) is its
    # prompt's, and every served prompt got run 1's responses for it.
    for step, records in two.items():
        for r in records:
            assert int(r["gts"]) == len(_prompt_text(r)), f"step {step}: a row is not its prompt's: {r}"
            text = _prompt_text(r)
            if text in seen:
                assert r["output"] in outputs_1[text], f"step {step}: served another prompt's response"
    lines = skip_lines(second, "rollout")
    matched = [line for line in lines if ": match: " in line and "rows served from" in line]
    assert len(matched) >= 1, lines
    assert any("rows served from step" in line for line in matched)
    metrics = second.stdout.replace(" ", "")
    assert "timing_s/skipinject/match_served_rows:" in metrics
    assert all(len(records) == SMALL_BATCH * harness.ROLLOUT_N for records in two.values()), "run 2's batch size"
    assert all("GBS4_N" in line for line in matched if "rows served from step" in line), "from run 1's layout"
    assert any("target not called" in line for line in matched), "a step whose prompts were all seen: no call"
    # Run 1's layout is left as it was; run 2's steps are saved whole in its own layout.
    assert sorted(p.name for p in layout.iterdir() if p.name.isdigit()) == ["1", "2", "3"]
    assert not (layout / "rows").exists(), "nothing of run 2 written into run 1's layout"
    own = harness.cache_dir(dump, gbs=SMALL_BATCH)
    assert sorted(p.name for p in own.iterdir() if p.name.isdigit()) == ["1", "2", "3"]
    for step in (1, 2, 3):
        meta = json.loads((own / str(step) / "meta.json").read_text())
        assert meta["rows"] == SMALL_BATCH * harness.ROLLOUT_N and len(meta["row_keys"][0]) == meta["rows"]


def test_fully_async_match_serves_a_sample_by_its_prompt_not_its_id(assets: Any, tmp_path: Path):
    """The fully async Rollouter (one prompt per call, ``n`` sequences): run 1 caches feed indices
    1-4; run 2 draws other prompts in another order (``data.seed=29``): a sample whose prompt run 1
    generated, at whatever feed index, is served; only the others are generated."""
    from tests.e2e.conftest import SKIPINJECT_FULLY_ASYNC

    dump = tmp_path / "dump"
    runs = []
    for name, extra in (
        ("async1", ["skip.async_rollout.action=cache"]),
        ("async2", ["skip.async_rollout.action=match", "data.seed=29"]),
    ):
        overrides = harness.fully_async_overrides(
            assets,
            total_rollout_steps=4,
            dump_dir=dump,
            extra=["skip.async_rollout.enable=True", "skip.async_rollout.steps=[1-4]", *extra],
        )
        gen_log = tmp_path / f"{name}.gen.jsonl"
        proc = harness.run_fully_async(
            assets,
            overrides,
            gen_log=gen_log,
            launcher=SKIPINJECT_FULLY_ASYNC,
            timeout=900,
            env_extra={"RAY_DEDUP_LOGS": "0"},
        )
        assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        runs.append((proc, harness.generate_calls(gen_log)))
    (_, generated_1), (second, generated_2) = runs
    digests_1 = {call["prompt"] for call in generated_1}
    assert len(digests_1) == 4, "run 1 generated 4 prompts"
    per_prompt = collections.Counter(call["prompt"] for call in generated_2)
    assert not set(per_prompt) & digests_1, "a prompt run 1 generated was generated again"
    assert set(per_prompt.values()) <= {harness.ROLLOUT_N}
    served = [line for line in skip_lines(second, "async_rollout") if "rows served from" in line]
    assert len(served) == 4 - len(per_prompt) and served, (served, per_prompt)
    assert all("target not called" in line for line in served), "a sample's n rows are served together"
