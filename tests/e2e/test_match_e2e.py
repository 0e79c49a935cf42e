"""``action=match`` on real verl 0.9.1 (agent loop, CPU): the V0 trainer and the fully async one.

Each ``match`` run is served from a copy of a recording the session makes once
(:mod:`tests.e2e.conftest`): run 1 of the V0 pair (``cache``, steps 1-2) and the fully async run 1
(``match`` with nothing cached: it records as ``cache`` does). The ``match`` run draws its prompts
with another data seed (and, in the V0 pair, another batch size: 2 prompts a step, not 4, so its
layout directory is another one): at each step it serves the prompts run 1 saw (from run 1's layout)
and generates exactly the others (the CPU rollout logs every sequence it generates, with a digest of
its prompt), trains on responses that belong to its own prompts, and saves its steps in its own layout.
The V0 run's advantage role (``cache`` at step 1) misses there, and its line names run 1's layout and
the batch size that differs.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import (
    ASYNC_PROMPTS,
    OTHER_REWARD_FILE,
    AsyncRecording,
    V0Runs,
    async_overrides,
    copy_dump,
    harness,
    launch,
    other_reward,
    other_score,
    rollout_records,
    skip_lines,
)
from tests.e2e.test_rollout_e2e import trained_scores

pytestmark = pytest.mark.e2e

#: The V0 ``match`` run's agent-loop workers (run 1: 1), to which a call of some rows is padded.
AGENT_WORKERS = 4
#: Steps of the V0 ``match`` run (the recording holds steps 1-2: step 3 is no cached step).
STEPS = 3
#: The V0 match run's batch: 2 prompts a step (run 1: harness.TRAIN_BATCH = 4), PPO mini-batches to match.
SMALL_BATCH = 2
SMALLER_BATCH = (
    f"data.train_batch_size={SMALL_BATCH}",
    f"actor_rollout_ref.actor.ppo_mini_batch_size={SMALL_BATCH}",
    f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={SMALL_BATCH * harness.ROLLOUT_N}",
    f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={SMALL_BATCH * harness.ROLLOUT_N}",
)


def prompt_text(record: dict) -> str:
    """The user's message of a dumped sample (verl decodes the chat-templated prompt)."""
    match = re.search(r"user\s*\n(.*?)\n", record["input"], re.S)
    return (match.group(1) if match else record["input"]).strip()


#: A call of which some rows were served and the others generated: step, served, rows, generated, asked.
_MATCH_LINE = re.compile(
    r"step (\d+): match: (\d+) of (\d+) rows served from .*; (\d+) generated in one call of (\d+) rows"
)
#: The rollout's fields a served row carries as recorded (its reward's score is re-scored by this run).
_RECORDED_FIELDS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids")


def _served_rows(recorded: Path, own: Path) -> dict[int, int]:
    """Step -> rows of ``own``'s steps whose key a step of ``recorded`` holds, each checked to be
    bit-identical to the recorded row (the rollout's fields and its log-probs)."""
    import torch

    from skipinject.cache_tool.plugins import InstalledRoles
    from skipinject.cache_tool.show import load_step

    roles = InstalledRoles()
    run_1 = {}
    for step_dir in sorted(p for p in recorded.iterdir() if p.name.isdigit()):
        meta, step = load_step(step_dir, roles)
        run_1.update({key: (step.value, row) for row, key in enumerate(meta["row_keys"][0])})
    served: dict[int, int] = {}
    for step_dir in sorted(p for p in own.iterdir() if p.name.isdigit()):
        meta, step = load_step(step_dir, roles)
        for row, key in enumerate(meta["row_keys"][0]):
            if key not in run_1:
                continue
            old, old_row = run_1[key]
            for name in (*_RECORDED_FIELDS, "rollout_log_probs"):
                same = torch.equal(step.value.batch[name][row], old.batch[name][old_row])
                assert same, f"step {step_dir.name} row {row}: {name} is not run 1's"
            served[int(step_dir.name)] = served.get(int(step_dir.name), 0) + 1
    return served


def test_match_serves_seen_prompts_generates_the_others_and_trains_on_its_own(
    assets: Any, v0_runs: V0Runs, tmp_path: Path
):
    recorded = harness.cache_dir(v0_runs.dump)
    rows = [json.loads((recorded / str(s) / "meta.json").read_text())["rows"] for s in (1, 2)]
    assert rows == [harness.TRAIN_BATCH * harness.ROLLOUT_N] * 2
    generated_1 = harness.generate_calls(v0_runs.tmp / "run1.gen.jsonl")
    assert len(generated_1) == sum(rows), "nothing cached: every sequence generated"

    dump = copy_dump(v0_runs.dump, tmp_path / "dump")
    layout = harness.cache_dir(dump)
    overrides = harness.main_ppo_overrides(
        assets,
        use_v1=False,
        total_steps=STEPS,
        dump_dir=dump,
        extra=[
            "skip.rollout.enable=True",
            f"skip.rollout.steps=[1-{STEPS}]",
            "skip.rollout.action=match",
            f"trainer.rollout_data_dir={tmp_path / 'run2'}",
            # Seed 9 draws, 2 a step: step 1 two prompts run 1 did not see, step 2 one it saw and one
            # it did not (a mixed call), step 3 two it saw (verl's RandomSampler with this seed, no run).
            "data.seed=9",
            *SMALLER_BATCH,
            # Another reward than run 1's: the served rows are scored by it (skip.rollout.rescore=auto).
            *other_reward(tmp_path),
            # Run 1 had one agent-loop worker: the number is no part of a row's key. With 4, the mixed
            # call's 2 uncached rows are padded to 4 (the first rows repeated), the padding's output dropped.
            f"actor_rollout_ref.rollout.agent.num_workers={AGENT_WORKERS}",
            # The advantage role, ``cache`` at step 1: run 1 cached it under its batch size's layout, so
            # the miss says where and which setting differs (this run's step 1 is computed and saved).
            "skip.advantage.enable=True",
            "skip.advantage.steps=[1]",
            f"skip.advantage.dump_dir={dump}",
        ],
    )
    second, generated_2 = launch(assets, tmp_path, "run2", overrides)
    one, two = rollout_records(v0_runs.tmp / "run1"), rollout_records(tmp_path / "run2")
    assert sorted(one) == [1, 2] and sorted(two) == [1, 2, 3]
    seen = {prompt_text(r) for step in one.values() for r in step}
    outputs_1 = collections.defaultdict(list)
    for step in one.values():
        for r in step:
            outputs_1[prompt_text(r)].append(r["output"])
    drawn = {step: {prompt_text(r) for r in records} for step, records in two.items()}
    assert [(len(p & seen), len(p)) for _, p in sorted(drawn.items())] == [(0, 2), (1, 2), (2, 2)], drawn

    # The mixed call: step 2's rows of the seen prompt served, the other prompt's cut out and generated.
    lines = skip_lines(second, "rollout")
    calls = {int(m[1]): m.groups()[1:] for line in lines if (m := _MATCH_LINE.search(line))}
    rows = SMALL_BATCH * harness.ROLLOUT_N
    assert calls == {2: (str(rows // 2), str(rows), str(rows // 2), str(AGENT_WORKERS))}, lines
    padding = AGENT_WORKERS - rows // 2
    assert any("step 1: match: no row of this call cached" in line for line in lines), lines
    assert any("step 3: match:" in line and "(target not called)" in line for line in lines), lines

    # The generator got exactly the new prompts' rows, each at its step (a record's global_steps are
    # those of the weights it generated with: the step before), and no prompt run 1 generated.
    digests = harness.prompt_digests(assets, sorted(seen | set().union(*drawn.values())))
    got = collections.Counter((int(call["global_steps"]) + 1, digests.get(call["prompt"])) for call in generated_2)
    wanted = {(step, text): harness.ROLLOUT_N for step, texts in drawn.items() for text in texts - seen}
    [new_at_2] = drawn[2] - seen
    wanted[(2, new_at_2)] += padding  # the padding rows repeat the cut call's first rows: the new prompt's
    assert got == wanted, (got, wanted)
    assert not {call["prompt"] for call in generated_2} & {call["prompt"] for call in generated_1}
    # Every step chosen (match): each sync waits; steps 1 and 2 have rows to generate, so the pending sync is
    # carried out right before their call (weights of the step before, as above); step 3 is served whole.
    syncs = harness.weight_syncs(tmp_path / "run2.gen.jsonl")
    assert [s["global_steps"] for s in syncs] == [0, 1], syncs
    carried = [line for line in skip_lines(second, "rollout") if "pending weight sync carried out" in line]
    assert len(carried) == 2, carried
    for step, line in zip((1, 2), carried, strict=True):
        said = f"rollout step {step}: pending weight sync carried out before step {step}'s generation (weights of"
        assert f"{said} step {step - 1}," in line, carried

    # Trained on its own prompts: each dumped row's prompt (decoded from the rollout's output) has the
    # ground truth of its dataset row (the call's own), and a served prompt got run 1's responses for it.
    for step, records in two.items():
        for r in records:
            assert int(r["gts"]) == len(prompt_text(r)), f"step {step}: a row is not its prompt's: {r}"
        for text in drawn[step] & seen:
            outputs = sorted(r["output"] for r in records if prompt_text(r) == text)
            assert outputs == sorted(outputs_1[text]), f"step {step}: {text!r} not served run 1's responses"
    # The served rows are bit-identical to run 1's (all but the reward's score, re-scored), by row key.
    served = _served_rows(layout, harness.cache_dir(dump, gbs=SMALL_BATCH))
    assert served == {2: rows // 2, 3: rows}, served
    for step, records in two.items():  # served and generated rows alike: scored by this run's reward
        assert [r["score"] for r in records] == [other_score(r["output"]) for r in records], f"step {step}"
    assert any("rows re-scored by this run's reward-loop workers" in line for line in lines), lines
    matched = [line for line in lines if ": match: " in line and "rows served from" in line]
    assert len(matched) >= 1, lines
    assert any("rows served from step" in line for line in matched)
    metrics = second.stdout.replace(" ", "")
    assert "timing_s/skipinject/match_served_rows:" in metrics
    assert all(len(records) == SMALL_BATCH * harness.ROLLOUT_N for records in two.values()), "run 2's batch size"
    assert all("GBS4_N" in line for line in matched if "rows served from step" in line), "from run 1's layout"
    assert any("target not called" in line for line in matched), "a step whose prompts were all seen: no call"
    # The advantage role's miss names run 1's layout and the batch size, both values (issue 34, part 3).
    own = harness.cache_dir(dump, gbs=SMALL_BATCH)
    [missed] = [line for line in skip_lines(second, "advantage") if "advantage step 1: miss" in line]
    assert (
        f"(no cache at {own}/advantage/1; cached under another layout, {layout}/advantage/1: the batch size "
        f"(data.gen_batch_size, else data.train_batch_size) is {harness.TRAIN_BATCH} there, {SMALL_BATCH} here)"
    ) in missed, missed
    # Run 1's layout is left as it was; run 2's steps are saved whole in its own layout.
    assert sorted(p.name for p in layout.iterdir() if p.name.isdigit()) == ["1", "2"]
    assert not (layout / "rows").exists(), "nothing of run 2 written into run 1's layout"
    assert sorted(p.name for p in own.iterdir() if p.name.isdigit()) == ["1", "2", "3"]
    for step in (1, 2, 3):
        meta = json.loads((own / str(step) / "meta.json").read_text())
        assert meta["rows"] == SMALL_BATCH * harness.ROLLOUT_N and len(meta["row_keys"][0]) == meta["rows"]


def test_fully_async_match_serves_a_sample_by_its_prompt_not_its_id(
    assets: Any, async_recording: AsyncRecording, tmp_path: Path
):
    """The fully async Rollouter (one prompt per call, ``n`` sequences). Run 1 (the session's
    recording: ``match`` with nothing cached) generates feed indices 1-4 and saves them as ``cache``
    does; run 2 draws other prompts in another order (``data.seed=29``): a sample whose prompt run 1
    generated, at whatever feed index, is served; only the others are generated. Run 2 scores with
    another reward function: the served samples' rows are re-scored by it, so every trained row is."""
    generated_1 = async_recording.generated
    lines = skip_lines(async_recording.first, "async_rollout")
    assert sum("match: no row of this call cached" in line for line in lines) == ASYNC_PROMPTS, lines
    recorded = harness.cache_dir(async_recording.dump, gbs=1)
    steps = sorted(int(p.name) for p in recorded.iterdir() if p.name.isdigit())
    assert steps == list(range(1, ASYNC_PROMPTS + 1)), "saved like cache"
    rows = [json.loads((recorded / str(s) / "meta.json").read_text())["rows"] for s in steps]
    assert rows == [harness.ROLLOUT_N] * ASYNC_PROMPTS
    assert len(generated_1) == sum(rows), "nothing cached: every sequence generated"
    digests_1 = {call["prompt"] for call in generated_1}
    assert len(digests_1) == ASYNC_PROMPTS, "run 1 generated 4 prompts"

    dump = copy_dump(async_recording.dump, tmp_path / "dump")
    overrides = async_overrides(
        assets, dump, "skip.async_rollout.action=match", "data.seed=29", *other_reward(tmp_path)
    )
    second, generated_2 = launch(assets, tmp_path, "async2", overrides, fully_async=True)
    per_prompt = collections.Counter(call["prompt"] for call in generated_2)
    assert not set(per_prompt) & digests_1, "a prompt run 1 generated was generated again"
    assert set(per_prompt.values()) <= {harness.ROLLOUT_N}
    lines = skip_lines(second, "async_rollout")
    served = [line for line in lines if "rows served from" in line]
    assert len(served) == ASYNC_PROMPTS - len(per_prompt) and served, (served, per_prompt)
    assert all("target not called" in line for line in served), "a sample's n rows are served together"
    rescored = [line for line in lines if f"{harness.ROLLOUT_N} rows re-scored by this run's reward-loop" in line]
    assert len(rescored) == len(served), lines
    assert all("recorded by another" in line and OTHER_REWARD_FILE in line for line in rescored), rescored
    # Every trained row is scored by this run's reward (in [-2, -1)), none by the recorded one ([0, 1]).
    scores = trained_scores(second)
    assert scores and all(-2.0 <= value < -1.0 for value in scores), scores
