"""Real ``python -m skipinject -m ...`` runs of verl 0.9.1 on CPU: the V0 trainer (rollout, and the
user-added advantage and reward roles in the same runs) and the fully async trainer.

The user-added roles come from ``plugins/advantage`` and ``plugins/reward``, installed as
distributions of their own; nothing in skipinject or verl knows them. The V0 pair
(:func:`tests.e2e.conftest.v0_runs`, shared with ``test_install.py``) runs in the environment the
release wheels were installed into; the later runs here use this set-up's editable install. Every call runs in verl's
Ray actors, where the hooks arrive through the runner's bootstrap. The rollout role's cache in an
object store is proven by the DAPO recipe's pair (``test_dapo_recipe_e2e.py``), not by a run of its own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import (
    ASYNC_PROMPTS,
    OTHER_REWARD_FILE,
    USER_ROLES,
    AsyncRecording,
    V0Runs,
    async_overrides,
    async_reward,
    copy_dump,
    harness,
    launch,
    other_reward,
    other_score,
    rollout_records,
    skip_lines,
)
from tests.integration.test_cache_tool import check_real_dump

pytestmark = pytest.mark.e2e

#: Statistics that do not depend on response order: scores summed over tokens; GRPO gives every token
#: of a row the same advantage, so token-masked max/min are the rows' max/min.
_METRIC = re.compile(r"(critic/(?:score/(?:mean|max|min)|(?:advantages|returns)/(?:max|min))):(-?[0-9.e+-]+)")


def trained_metrics(proc: Any) -> list[dict[str, float]]:
    """Per training step, the score and advantage statistics verl logged to the console."""
    steps = []
    for line in proc.stdout.splitlines():
        found = dict(_METRIC.findall(line))
        if found:
            steps.append({key: float(value) for key, value in found.items()})
    return steps


def test_v0_rollout_cache_then_hit(v0_runs: V0Runs):
    layout = harness.cache_dir(v0_runs.dump)
    assert v0_runs.calls[0] > 0
    assert sorted(p.name for p in layout.iterdir() if p.name.isdigit()) == ["1", "2"]
    assert all((layout / s / "meta.json").is_file() for s in ("1", "2"))
    assert not list(layout.rglob("gen_batch.dp")), "only skipinject's safe format is written"
    lines = skip_lines(v0_runs.first, "rollout")
    assert any("rollout step 1: miss" in line for line in lines) and any("step 2: saved" in line for line in lines)

    # Run 2: both steps served from the cache, the generator is never called for training, training
    # finishes (its step 3, ``repeat``: test_v0_repeat_serves_nearest_step_...).
    assert v0_runs.calls[1] == 0
    lines = skip_lines(v0_runs.second, "rollout")
    assert sum("hit, served step" in line for line in lines if "rollout step 3:" not in line) == 2, lines
    assert not any("other inputs" in line for line in lines if "rollout step 3:" not in line), lines
    step_two = [line for line in lines if "rollout step 2: hit" in line]
    assert len(step_two) == 1 and "read ahead, waited" in step_two[0], lines  # read while step 1 trained
    one, two = rollout_records(v0_runs.tmp / "run1"), rollout_records(v0_runs.tmp / "run2")
    assert sorted(one) == [1, 2] and sorted(two) == [1, 2, 3]
    for step in (1, 2):
        assert [r["output"] for r in two[step]] == [r["output"] for r in one[step]], f"step {step} responses differ"
    assert "timing_s/skipinject/hit:1.0" in v0_runs.second.stdout.replace(" ", ""), "hits are visible in the metrics"
    assert "timing_s/skipinject/hit:0.0" in v0_runs.first.stdout.replace(" ", "")


def test_v0_replay_with_another_reward_trains_on_its_scores(v0_runs: V0Runs):
    """Run 2 scores with another reward function (``skip.rollout.rescore=auto``): each served step's
    responses are re-scored by it through the trainer's reward-loop workers, with no generator call.
    Step 3 (no reward role there) trains on them: each row's score is the new function of its served
    response. At steps 1-2 the reward role serves run 1's reward, which wins by design (its order)."""
    layout = harness.cache_dir(v0_runs.dump)
    recorded = json.loads((layout / "1" / "meta.json").read_text())["reward"]["files"]
    assert recorded["reward.custom_reward_function.path"]["sha256"], "meta.json records what scored the step"
    assert v0_runs.calls[1] == 0, "no generator call for training"
    lines = skip_lines(v0_runs.second, "rollout")
    rescored = [line for line in lines if "rows re-scored by this run's reward-loop workers" in line]
    assert [sum(f"rollout step {s}:" in line for line in rescored) for s in (1, 2, 3)] == [1, 1, 1], lines
    assert all("recorded by another" in line and OTHER_REWARD_FILE in line for line in rescored), rescored
    assert not any("rewards served as recorded" in line for line in lines), lines
    one, two = rollout_records(v0_runs.tmp / "run1"), rollout_records(v0_runs.tmp / "run2")
    assert [r["output"] for r in two[3]] == [r["output"] for r in one[2]], "step 3 serves step 2's responses"
    scores = [(r["score"], other_score(r["output"])) for r in two[3]]
    assert all(score == expected for score, expected in scores), f"step 3 trained on other scores: {scores}"
    for step in (1, 2):  # the reward role's served reward: run 1's scores, not the re-scored rollout's
        assert [r["score"] for r in two[step]] == [r["score"] for r in one[step]], f"step {step}"
        assert all(r["score"] >= 0 for r in two[step]), f"step {step}: the reward role's reward wins"
    assert "timing_s/skipinject/rescored_rows:8.0" in v0_runs.second.stdout.replace(" ", ""), "in the metrics"


def test_v0_user_roles_cache_then_hit(v0_runs: V0Runs):
    layout = harness.cache_dir(v0_runs.dump)
    for role in USER_ROLES:
        assert sorted(p.name for p in (layout / role).iterdir()) == ["1", "2"], role
        lines = skip_lines(v0_runs.first, role)
        assert sum(f"{role} step {s}: miss" in line for line in lines for s in (1, 2)) == 2, lines
        lines = skip_lines(v0_runs.second, role)
        hits = [line for line in lines if "hit, served step" in line]
        assert len(hits) == 2 and not any(": miss" in line or "other inputs" in line for line in lines), lines
    # Run 2 trained on the served values: verl's logged statistics of them are run 1's, step by step.
    one, two = trained_metrics(v0_runs.first), trained_metrics(v0_runs.second)
    assert len(one) == 2 and len(two) == 3  # run 2's step 3: the rollout role's repeat
    assert one == two[:2]


def test_cache_tool_on_the_v0_runs_caches(assets: Any, v0_runs: V0Runs, tmp_path: Path):
    """``skipinject cache ls/verify/show/diff/prune`` on what the V0 runs (rollout + user roles) wrote, all
    in one new interpreter (``python -m skipinject cache`` as a process: tests/integration/test_cache_tool.py)."""
    check_real_dump(v0_runs.dump, {"rollout", *USER_ROLES}, tmp_path, tokenizer=assets.model_dir, one_process=True)


def test_v0_repeat_serves_nearest_step_reports_other_prompts_and_never_skips_validation(v0_runs: V0Runs):
    """Run 2 of the V0 pair chooses steps 1-3 with ``action=repeat`` and validates before training."""
    lines = skip_lines(v0_runs.second, "rollout")
    assert any("rollout step 3: hit, served step 2 (repeat: largest cached step below 3)" in line for line in lines)
    assert sum("other inputs" in line for line in lines) >= 1, "serving step 2's responses at step 3 must be reported"
    assert v0_runs.validation == harness.N_ROWS, "every training step hit, so these generations are validation's"
    assert v0_runs.calls[1] == 0, "validation is never skipped, training's generations all are"
    assert not (harness.cache_dir(v0_runs.dump) / "3").exists(), "a repeat hit does not write a new step"


def test_fully_async_rollout_cache_then_hit(assets: Any, async_recording: AsyncRecording, tmp_path: Path):
    """Run 1 is the session's fully async recording (4 prompts fed one at a time, two trainer steps);
    run 2, the same command with ``action=cache``, is served all of it from a copy of its dump dir --
    with another reward function and ``rescore=never``: the recorded scores are served, said once.
    The ``reward`` role acts beside it on the fully async trainer: run 1 saves steps 1 and 2, run 2
    is served them."""
    assert async_recording.generated, "run 1 generated"
    reward_1 = skip_lines(async_recording.first, "reward")
    assert sorted(re.findall(r"reward step (\d+): saved", "\n".join(reward_1))) == ["1", "2"], reward_1
    layout = harness.cache_dir(async_recording.dump, gbs=1)
    assert sorted(int(p.name) for p in layout.iterdir() if p.name.isdigit()) == list(range(1, ASYNC_PROMPTS + 1))
    meta = json.loads((layout / "1" / "meta.json").read_text())
    assert meta["reward"]["files"]["reward.custom_reward_function.path"]["sha256"], "what scored it is recorded"
    dump = copy_dump(async_recording.dump, tmp_path / "dump")
    overrides = async_overrides(
        assets,
        dump,
        "skip.async_rollout.action=cache",
        "skip.async_rollout.rescore=never",
        *other_reward(tmp_path),
        *async_reward(dump),
    )
    second, generated_2 = launch(assets, tmp_path, "async2", overrides, fully_async=True)
    assert generated_2 == [], f"feed indices 1-{ASYNC_PROMPTS} are served from the cache"
    reward_2 = skip_lines(second, "reward")
    assert sorted(re.findall(r"reward step (\d+): hit", "\n".join(reward_2))) == ["1", "2"], reward_2
    lines = skip_lines(second, "async_rollout")
    assert sum("hit, served step" in line for line in lines) == ASYNC_PROMPTS
    warned = [line for line in lines if "not computed by this run's reward" in line]
    assert len(warned) == 1 and "rescore=never" in warned[0] and OTHER_REWARD_FILE in warned[0], lines
    assert not any("re-scored" in line for line in lines), lines
    # The Rollouter calls the role's target in its own process: the trainer's step ends find it called there.
    for run in (async_recording.first, second):
        assert "was never called" not in run.stdout + run.stderr
    # The recorded scores (the harness's reward, in [0, 1]) are trained on, none of this run's (< -1).
    scores = trained_scores(second)
    assert scores and all(0.0 <= value <= 1.0 for value in scores), scores
    check_real_dump(dump, {"async_rollout", "reward"}, tmp_path, one_process=True)


def trained_scores(proc: Any) -> list[float]:
    """Every score statistic (mean, max, min) verl logged to the console for the trained steps."""
    return [value for step in trained_metrics(proc) for key, value in step.items() if key.startswith("critic/score/")]


def test_v0_weight_syncs_wait_for_a_generation(v0_runs: V0Runs):
    """Run 1 generates steps 1-2: a sync before each; the one after its last step waits for nothing.
    Run 2 serves steps 1-3 and validates first: the first sync waits until validation needs the engine,
    is carried out once before it, and no served step makes another (before each served step and after
    the last, ``weight sync deferred``)."""
    syncs_1 = harness.weight_syncs(v0_runs.tmp / "run1.gen.jsonl")
    assert [s["global_steps"] for s in syncs_1] == [0, 1], syncs_1
    generated_1 = harness.generate_calls(v0_runs.tmp / "run1.gen.jsonl")
    assert {int(call["global_steps"]) for call in generated_1} == {0, 1}

    syncs_2 = harness.weight_syncs(v0_runs.tmp / "run2.gen.jsonl")
    generated_2 = harness.generate_calls(v0_runs.tmp / "run2.gen.jsonl")
    assert [s["global_steps"] for s in syncs_2] == [0], syncs_2
    assert generated_2 and min(call["time"] for call in generated_2) > syncs_2[0]["time"], "validation after it"
    assert {(int(call["global_steps"]), call["weight_digest"]) for call in generated_2} == {
        (0, syncs_2[0]["weight_digest"])
    }
    assert syncs_2[0]["weight_digest"] == syncs_1[0]["weight_digest"], "the initial weights, as run 1 synced them"
    lines = skip_lines(v0_runs.second, "rollout")
    carried = [line for line in lines if "pending weight sync carried out" in line]
    assert len(carried) == 1 and "before validation's generation (weights of step 0" in carried[0], lines
    deferred = [m[1] for line in lines if (m := re.search(r"(\w+ step \d+): weight sync deferred", line))]
    assert deferred == [f"rollout step {s}" for s in (1, 2, 3, 4)], lines
    said = [
        line for line in (v0_runs.second.stdout + v0_runs.second.stderr).splitlines() if "summary: rollout:" in line
    ]
    assert said and "3 weight syncs skipped" in said[-1], said
