"""Real ``python -m skipinject -m verl.trainer.main_ppo`` runs of verl's V1 TransferQueue trainer on CPU.

One pair of runs (the module's :func:`v1_pair`, shared by its tests: each run costs minutes) proves
every V1 mechanism at once: the ``separate_async`` trainer with ``parameter_sync_step=2`` (two
mini-batches per step, one commit) and group filtering (DAPO) on, where the replay buffer refills
evicted groups; steps 1-3 with 1 and 2 chosen. Run 1 generates steps 1 and 2 and caches them; run 2
(the same command with another reward function, launched without the runner: a launcher calls
``skipinject.enable(...)`` and verl's ``run_ppo`` from Python) injects them from the cache into
TransferQueue, never calls the generator for them, trains on its own reward's scores of them, draws
what run 1 drew, and trains step 3 (generated in both runs) on the same prompts (rc 0).
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIXTURES
from tests.e2e.conftest import (
    OTHER_REWARD_FILE,
    SKIPINJECT_MAIN_PPO,
    copy_dump,
    harness,
    other_reward,
    other_score,
    rollout_records,
    skip_lines,
)
from tests.e2e.test_match_e2e import prompt_text
from tests.integration.test_cache_tool import check_real_dump

pytestmark = pytest.mark.e2e

ROLE = "rollout_tq"
#: Mini-batches per step, each a part of the step's one commit.
SYNC_STEP = 2


#: Run 2's launcher: ``skipinject.enable(...)`` and verl's ``run_ppo`` called from Python (no runner).
RUN_PPO_FROM_PYTHON = (sys.executable, str(FIXTURES / "run_ppo_launcher.py"))


def _run(
    assets: Any, tmp: Path, name: str, overrides: list[str], launcher: tuple[str, ...] = SKIPINJECT_MAIN_PPO
) -> tuple[Any, int]:
    """One run (by default through ``python -m skipinject``); returns it and its generator calls (log:
    ``{name}.gen.jsonl``)."""
    gen_log = tmp / f"{name}.gen.jsonl"
    proc = harness.run_main_ppo(
        assets,
        overrides,
        gen_log=gen_log,
        launcher=launcher,
        timeout=1200,
        env_extra={"RAY_DEDUP_LOGS": "0", "SKIPINJECT_SUMMARY": str(tmp / f"{name}.summary.json")},
    )
    (tmp / f"{name}.stdout.txt").write_text(proc.stdout)
    (tmp / f"{name}.stderr.txt").write_text(proc.stderr)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc, harness.count_generate_calls(gen_log)


def _generations(directory: Path) -> dict[int, Counter]:
    """verl's per-step generation dumps as multisets of (prompt, response): row order may differ."""
    return {
        step: Counter((r["input"], r["output"]) for r in records)
        for step, records in rollout_records(directory).items()
    }


#: Group filtering's reward: rows 5 and 6 of the data (step 2's submit, unshuffled) score 0 in every
#: session, so the filter evicts their groups and the replay buffer refills; every other trajectory
#: scores at random, so no other group is uniform (and nothing else depends on what was generated).
DAPO_REWARD = """import random


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if int((extra_info or {}).get("index", -1)) in (5, 6):
        return 0.0
    return random.random()
"""


@dataclass
class V1Pair:
    tmp: Path
    dump: Path
    first: Any
    second: Any
    calls: tuple[int, int]


@pytest.fixture(scope="module")
def v1_pair(assets: Any, tmp_path_factory: pytest.TempPathFactory) -> V1Pair:
    """Two runs into one dump_dir: ``separate_async``, ``parameter_sync_step=2``, group filtering on
    (``algorithm.filter_groups``, the data unshuffled), steps 1-3 with 1 and 2 chosen; run 2 scores
    with another reward function."""
    tmp = tmp_path_factory.mktemp("v1")
    dump = tmp / "dump"
    first, calls_1 = _run(assets, tmp, "run1", _pair_overrides(assets, tmp, dump, "run1"))
    # Another reward (its scores: no two answers alike, so group filtering drops no served group).
    run_2 = _pair_overrides(assets, tmp, dump, "run2", *other_reward(tmp))
    second, calls_2 = _run(assets, tmp, "run2", run_2, RUN_PPO_FROM_PYTHON)
    return V1Pair(tmp, dump, first, second, (calls_1, calls_2))


def _pair_overrides(assets: Any, tmp: Path, dump: Path, run: str, *extra: str) -> list[str]:
    """A run of the pair: ``separate_async``, ``parameter_sync_step=2``, group filtering (DAPO_REWARD)."""
    reward = tmp / "dapo_reward.py"
    reward.write_text(DAPO_REWARD)
    return harness.main_ppo_overrides(
        assets,
        use_v1=True,
        trainer_mode="separate_async",
        parameter_sync_step=SYNC_STEP,
        total_steps=3,
        dump_dir=dump,
        extra=[
            "algorithm.filter_groups.enable=True",
            "algorithm.filter_groups.metric=reward",
            "data.shuffle=False",
            f"reward.custom_reward_function.path={reward}",
            f"skip.{ROLE}.enable=True",
            f"skip.{ROLE}.steps=[1,2]",
            f"trainer.rollout_data_dir={tmp / run}",
            *extra,
        ],
    )


def _calls_by_weights(gen_log: Path) -> Counter:
    """Generator calls per weight version (the trainer step whose weights the rollout had)."""
    return Counter(int(call["global_steps"]) for call in harness.generate_calls(gen_log))


def test_v1_rollout_tq_k_part_steps_cache_then_hit(v1_pair: V1Pair):
    """``separate_async`` with ``parameter_sync_step=2``: each chosen step is cached as one commit of
    two parts, and run 2 injects both steps from the cache with no generator call for them."""
    per_step = harness.TRAIN_BATCH * harness.ROLLOUT_N
    # Run 1: both chosen steps generated, each cached as one commit of `parameter_sync_step` parts.
    assert v1_pair.calls[0] >= 2 * per_step
    layout = harness.cache_dir(v1_pair.dump, gbs=1)  # the async modes fetch one prompt at a time
    assert sorted(p.name for p in layout.iterdir()) == ["1", "2"]
    for step in ("1", "2"):
        meta = json.loads((layout / step / "meta.json").read_text())
        assert [part["dir"] for part in meta["parts"]] == [str(i) for i in range(SYNC_STEP)]
        assert meta["rows"] == per_step
        assert meta["reward"]["files"]["reward.custom_reward_function.path"]["sha256"], "what scored it"
    assert not list(layout.rglob("tq_batch.pt")), "only skipinject's safe format is written"
    lines = skip_lines(v1_pair.first, ROLE)
    assert sum(f"{ROLE} step {s}: saved {per_step} trajectories" in line for line in lines for s in (1, 2)) == 2, lines

    # The driver's start line names the layout the V1 trainer resolves (it fetches one prompt at a time).
    start = f"skipinject INFO: {ROLE}: cache steps 1-2 in {layout}: "
    assert start + "0 cached, 2 to generate" in v1_pair.first.stderr.splitlines(), v1_pair.first.stderr[-3000:]

    # The driver's summary: what every process counted (the trainer is a Ray actor), also as JSON.
    summary = f"skipinject INFO: summary: {ROLE}: "
    said = [line for line in v1_pair.first.stderr.splitlines() if line.startswith(summary)]
    assert said and said[0].startswith(summary + "0 steps served, 2 generated, 0 failed;"), said
    recorded = [json.loads((layout / str(s) / "meta.json").read_text())["generation_s"] for s in (1, 2)]
    assert all(seconds > 0 for seconds in recorded), "a saved step records its generation time"

    # Run 2 (skipinject.enable and run_ppo from Python, no runner): both steps injected from the cache;
    # the generator runs for step 3 only; training finishes.
    assert start + "2 cached, 0 to generate" in v1_pair.second.stderr.splitlines(), v1_pair.second.stderr[-3000:]
    said = [line for line in v1_pair.second.stderr.splitlines() if line.startswith(summary)]
    assert said and said[0].startswith(summary + "2 steps served, 0 generated, 0 failed;"), said
    assert said[0].endswith(f"{sum(recorded):.1f} s of generation saved"), (said, recorded)
    counts = json.loads((v1_pair.tmp / "run2.summary.json").read_text())["roles"][ROLE]
    assert counts["served_steps"] == 2 and counts["generation_s_saved"] == pytest.approx(sum(recorded))
    assert "skipinject/served_steps_total:2" in v1_pair.second.stdout.replace(" ", ""), "the trainer's metrics"
    assert v1_pair.calls[1] == per_step, f"run 2 called the generator {v1_pair.calls[1]} times: step 3's only"
    lines = skip_lines(v1_pair.second, ROLE)
    assert sum("hit, served step" in line and "rollout not submitted" in line for line in lines) == 2, lines
    assert not any(": saved" in line for line in lines), "a served step is not saved again"
    assert "async warm-up prefetch switched off" in v1_pair.second.stdout + v1_pair.second.stderr
    one, two = _generations(v1_pair.tmp / "run1"), _generations(v1_pair.tmp / "run2")
    assert sorted(one) == sorted(two) == [1, 2, 3]
    for step in (1, 2):
        assert two[step] == one[step], f"step {step}: run 2 trained on other trajectories than run 1 generated"
    check_real_dump(v1_pair.dump, {ROLE}, v1_pair.tmp, one_process=True)  # `skipinject cache ...` on the k-part steps


def test_v1_replay_with_another_reward_trains_on_its_scores(v1_pair: V1Pair):
    """Run 2 scores with another reward function (``skip.rollout_tq.rescore=auto``): the served
    trajectories are re-scored by the trainer's reward-loop workers before they are put into
    TransferQueue, with no generator call; each trained row's score is the new function of its response."""
    layout = harness.cache_dir(v1_pair.dump, gbs=1)
    meta = json.loads((layout / "1" / "meta.json").read_text())
    assert meta["reward"]["files"]["reward.custom_reward_function.path"]["sha256"], "what scored it is recorded"
    lines = skip_lines(v1_pair.second, ROLE)
    rescored = [line for line in lines if "rows re-scored by this run's reward-loop workers" in line]
    assert [sum(f"{ROLE} step {s}:" in line for line in rescored) for s in (1, 2)] == [1, 1], lines
    assert all("recorded by another" in line and OTHER_REWARD_FILE in line for line in rescored), rescored
    assert not any("rewards served as recorded" in line for line in lines), lines
    for step, records in rollout_records(v1_pair.tmp / "run2").items():
        scores = [(r["score"], other_score(r["output"])) for r in records]
        assert all(score == expected for score, expected in scores), f"step {step}: not this run's reward: {scores}"


def test_v1_group_filtering_served_steps_refill_nothing_and_keep_the_dataloader(v1_pair: V1Pair):
    """DAPO (``algorithm.filter_groups``) on the V1 trainer, steps 1-3 with 1 and 2 chosen.

    Run 1's step 2 draws its 4 prompts, loses 2 groups to the filter and refills: its record says how
    many prompts it drew. Run 2 serves steps 1 and 2 with no generator call (no refill either), draws
    what run 1 drew, so step 3 (generated in both runs) trains on the same prompts as in run 1.
    """
    tmp = v1_pair.tmp
    per_prompt = harness.ROLLOUT_N
    layout = harness.cache_dir(v1_pair.dump, gbs=1)  # group filtering fetches one prompt at a time
    assert sorted(p.name for p in layout.iterdir()) == ["1", "2"]
    meta = {step: json.loads((layout / str(step) / "meta.json").read_text()) for step in (1, 2)}
    assert (meta[1]["prompts_drawn"], meta[1]["refills"]) == (harness.TRAIN_BATCH, [])
    drawn = meta[2]["prompts_drawn"]
    assert meta[2]["prompts_submitted"] == harness.TRAIN_BATCH and drawn == harness.TRAIN_BATCH + sum(
        meta[2]["refills"]
    )
    assert drawn > harness.TRAIN_BATCH and meta[2]["carried_over"] == 0, meta[2]
    assert meta[2]["rows"] == harness.TRAIN_BATCH * per_prompt, "the filtered groups are not in the record"
    calls_1 = _calls_by_weights(tmp / "run1.gen.jsonl")
    assert calls_1[1] == drawn * per_prompt, f"run 1's step 2 generated every prompt it drew: {calls_1}"
    assert any(f"{ROLE} step 2: refill of" in line for line in skip_lines(v1_pair.first, ROLE))

    assert v1_pair.calls[1] == harness.TRAIN_BATCH * per_prompt, f"run 2 called the generator {v1_pair.calls[1]} times"
    by_weights = _calls_by_weights(tmp / "run2.gen.jsonl")
    assert by_weights == Counter({2: harness.TRAIN_BATCH * per_prompt}), f"only step 3 is generated: {by_weights}"
    lines = skip_lines(v1_pair.second, ROLE)
    assert sum("hit, served step" in line and "rollout not submitted" in line for line in lines) == 2, lines
    assert any(
        f"{ROLE} step 2: hit" in line and f"drew {drawn} prompts as the recorded step did" in line for line in lines
    ), lines
    assert not any("refill of" in line or "asks for" in line for line in lines), lines
    assert not any(": saved" in line for line in lines), "a served step is not saved again"

    one, two = _generations(tmp / "run1"), _generations(tmp / "run2")
    assert sorted(one) == sorted(two) == [1, 2, 3]
    for step in (1, 2):
        assert two[step] == one[step], f"step {step}: run 2 trained on other trajectories than run 1 generated"
    prompts = {
        run: {step: Counter(r["input"] for r in records) for step, records in rollout_records(tmp / run).items()}
        for run in ("run1", "run2")
    }
    assert prompts["run2"][3] == prompts["run1"][3], "step 3 trained on other prompts: the dataloader drifted"


#: A submit or refill of which some prompts were served and the others submitted: served, drawn, submitted.
_MATCH_LINE = re.compile(r"step \d+: match \((?:submit|refill)\): (\d+) of (\d+) prompts served .*; (\d+) submitted")


def test_v1_match_serves_seen_prompts_and_generates_only_the_others(v1_pair: V1Pair, assets: Any, tmp_path: Path):
    """``skip.rollout_tq.action=match`` on the pair's trainer (``separate_async``, two mini-batches a
    step, group filtering), served from run 1's recording, with the data shuffled by another seed
    (``data.seed=60`` draws rows 13, 17, 2, 19, then 3, 14, 28, 1, then 25, 7, 21, 22: each submit mixes
    rows run 1 trained at its steps 1 and 2 with rows it never saw). Every prompt run 1 trained is served,
    never generated; the generator gets only the others (``n`` sequences each); each trained row is its
    own prompt's (by its ground truth); a served prompt trains on run 1's responses for it. Step 3, never
    cached before, is recorded whole: its served trajectories are run 1's, tensor for tensor."""
    dump = copy_dump(v1_pair.dump, tmp_path / "dump")
    overrides = _pair_overrides(
        assets, tmp_path, dump, "run3", f"skip.{ROLE}.action=match", f"skip.{ROLE}.steps=[1-3]", "data.shuffle=True"
    )
    third, _ = _run(assets, tmp_path, "run3", [*overrides, "data.seed=60"])
    lines = skip_lines(third, ROLE)
    mixed = [m.groups() for line in lines if (m := _MATCH_LINE.search(line))]
    assert any(0 < int(served) < int(drawn) for served, drawn, _ in mixed), lines
    assert (
        sum(
            "action=match is not exact with trainer.v1.trainer_mode=separate_async" in line
            for line in (third.stdout + third.stderr).splitlines()
        )
        == 1
    )

    recorded_1 = rollout_records(v1_pair.tmp / "run1")
    seen = {prompt_text(r) for step in (1, 2) for r in recorded_1[step]}
    outputs_1 = Counter((prompt_text(r), r["output"]) for step in (1, 2) for r in recorded_1[step])
    trained = rollout_records(tmp_path / "run3")
    assert sorted(trained) == [1, 2, 3]
    drawn = {prompt_text(r) for records in trained.values() for r in records}
    digests = harness.prompt_digests(assets, harness._prompts(harness.N_ROWS, seed=2))  # the training data
    generated = Counter(digests.get(call["prompt"]) for call in harness.generate_calls(tmp_path / "run3.gen.jsonl"))
    assert generated and not set(generated) & seen, f"a prompt run 1 trained was generated again: {generated}"
    assert None not in generated and set(generated.values()) <= {harness.ROLLOUT_N}, generated
    assert drawn - seen <= set(generated), "a prompt run 1 never trained was not generated"
    assert drawn & seen, "no prompt was served"
    for step, records in trained.items():
        for r in records:
            assert int(r["gts"]) == len(prompt_text(r)), f"step {step}: a row is not its prompt's: {r}"
            if prompt_text(r) in seen:
                assert outputs_1[(prompt_text(r), r["output"])], f"step {step}: not run 1's response: {r}"
    # Bit for bit: step 3's record (the whole step: run 1 never cached it) holds the served trajectories
    # as TransferQueue got them; each is run 1's, every tensor field (tokens, masks, log-probs, scores).
    import torch

    layout = harness.cache_dir(dump, gbs=1)
    run_1 = {key: row for step in (1, 2) for key, row in _rows_by_key(layout / str(step)).items()}
    served = 0
    for key, row in _rows_by_key(layout / "3").items():
        if key in run_1:
            tensors = [name for name in row.keys() if isinstance(row[name], torch.Tensor)]
            assert {"prompts", "responses", "input_ids", "rollout_log_probs", "rm_scores"} <= set(tensors), tensors
            for name in tensors:
                assert torch.equal(row[name], run_1[key][name]), f"step 3: {name} of a served row is not run 1's"
            served += 1
    assert served >= harness.ROLLOUT_N, "step 3 served no prompt run 1 trained"


def _rows_by_key(step_dir: Path) -> dict[str, Any]:
    """A cached step's trajectories (TensorDict rows), by their row keys (parts in order)."""
    from skipinject.cache_tool.plugins import InstalledRoles
    from skipinject.cache_tool.show import load_step

    meta, step = load_step(step_dir, InstalledRoles())
    keys = [key for part in meta["row_keys"] for key in part]
    data = step.value["tensordict"]
    assert len(keys) == data.batch_size[0], step_dir
    return {key: data[row] for row, key in enumerate(keys)}
