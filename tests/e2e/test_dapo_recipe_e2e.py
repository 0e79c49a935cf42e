"""DAPO's dynamic sampling in a recipe-style trainer on real verl 0.9.1 (V0): several generation
calls per step, recorded call by call in run 1 and replayed call by call in run 2.

The recipe (``tests/fixtures/recipes/dapo_recipe.py``) overrides ``RayPPOTrainer.fit`` as verl <= 0.8's
DAPO recipe does: it draws generation batches until ``train_batch_size`` prompt groups survive its
group filter, all at one ``global_steps`` and without ``meta_info["global_steps"]`` (the step comes
from the trainer clock, which follows the recipe's own ``fit``). The reward makes the groups of
odd-length prompts uniform, so filtering and extra generation calls really happen.

The cache is in an object store (``skip.rollout.dump_dir=s3://...`` on a real S3-compatible server,
moto): run 1 uploads every call of steps 1-2 from verl's TaskRunner actor, run 2 is served from the
store. One pair proves both, so the suite runs no separate object-store run. Both runs score with the
same reward: run 2 trains on the recorded scores bit for bit (``skip.rollout.rescore=auto``; the V0
pair's run 2 replays with another reward, ``test_rollout_e2e.py``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIXTURES
from tests.e2e.conftest import harness, skip_lines

pytestmark = pytest.mark.e2e

RECIPE_DIR = FIXTURES / "recipes"
LAUNCHER = (sys.executable, "-m", "skipinject", "-m", "dapo_recipe")
#: Groups of prompts whose length is odd get one reward for every sample: DAPO filters them out.
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if int(ground_truth) % 2:
        return 0.5
    return min(len(solution_str) / 40.0, 1.0)
"""


class RecipeLog:
    """What the recipe logged: the prompts (dataset rows) of each generation call and of each trained step."""

    def __init__(self, path: Path) -> None:
        self.drawn: dict[int, list[list[int]]] = {}
        self.trained: dict[int, list[int]] = {}
        #: Per trained step, the hash of the responses, masks and scores it trained on.
        self.digests: dict[int, str] = {}
        #: Per trained step, the hash of its responses and masks alone, and each row's score.
        self.responses: dict[int, str] = {}
        self.scores: dict[int, list[float]] = {}
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "call" in record:
                self.drawn.setdefault(record["step"], []).append(record["prompts"])
            else:
                self.trained[record["step"]] = record["trained"]
                self.digests[record["step"]] = record.get("digest", "")
                self.responses[record["step"]] = record.get("responses", "")
                self.scores[record["step"]] = record.get("scores", [])

    def calls(self, step: int) -> int:
        return len(self.drawn.get(step, []))


def _run(assets: Any, tmp: Path, name: str, dump: str, store_env: dict[str, str]) -> tuple[Any, int, RecipeLog]:
    reward = tmp / "dapo_reward.py"
    reward.write_text(REWARD)
    log = tmp / f"{name}.recipe.jsonl"
    overrides = harness.main_ppo_overrides(
        assets,
        use_v1=False,
        total_steps=3,
        dump_dir=dump,
        extra=[
            "skip.rollout.enable=True",
            "skip.rollout.steps=[1,2]",
            f"reward.custom_reward_function.path={reward}",
        ],
    )
    path = os.pathsep.join([harness.harness_env(assets, None)["PYTHONPATH"], str(RECIPE_DIR)])
    gen_log = tmp / f"{name}.gen.jsonl"
    proc = harness.run_main_ppo(
        assets,
        overrides,
        gen_log=gen_log,
        launcher=LAUNCHER,
        timeout=900,
        env_extra={"PYTHONPATH": path, "DAPO_RECIPE_LOG": str(log), "RAY_DEDUP_LOGS": "0", **store_env},
    )
    (tmp / f"{name}.out").write_text(proc.stdout + "\n--- stderr\n" + proc.stderr)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc, harness.count_generate_calls(gen_log), RecipeLog(log)


def test_dapo_recipe_steps_are_replayed_call_by_call_from_an_object_store(assets: Any, tmp_path: Path) -> None:
    import fsspec

    from tests.integration.s3_server import create_bucket, s3_environment, s3_server

    with s3_server(str(tmp_path / "moto.log")) as endpoint:
        create_bucket(endpoint, "verl-cache")
        url = "s3://verl-cache/dump"
        store_env = s3_environment(endpoint)
        first, generated1, log1 = _run(assets, tmp_path, "run1", url, store_env)
        fs = fsspec.filesystem("s3", key="skipinject-test", secret="skipinject-test", endpoint_url=endpoint)
        layout = harness.cache_dir(Path(url.removeprefix("s3://")))
        found = fs.find(url.removeprefix("s3://"))
        metas = {step: json.loads(fs.cat_file(f"{layout}/{step}/meta.json")) for step in (1, 2)}
        second, generated2, log2 = _run(assets, tmp_path, "run2", url, store_env)

    per_call = harness.TRAIN_BATCH * harness.ROLLOUT_N
    assert sorted(log1.trained) == [1, 2, 3]
    assert all(len(rows) == harness.TRAIN_BATCH for rows in log1.trained.values()), log1.trained
    assert log1.calls(1) + log1.calls(2) > 2, f"no extra batch drawn at steps 1-2 ({log1.drawn}): proves nothing"
    assert generated1 == per_call * sum(map(log1.calls, (1, 2, 3))), "run 1 generates every call for real"
    lines1 = skip_lines(first, "rollout")
    assert not any(": hit" in line for line in lines1), f"run 1 served a call from its own cache: {lines1}"
    assert any("rollout step 1: miss" in line for line in lines1), lines1
    assert any("step 1: saved" in line and url in line for line in lines1), "uploaded to the store: " + str(lines1)
    assert sorted(path for path in found if path.endswith("/meta.json")) == [
        f"{layout}/1/meta.json",
        f"{layout}/2/meta.json",
    ], found
    for step in (1, 2):
        assert metas[step]["step"] == step
        assert metas[step]["calls"] == log1.calls(step), f"step {step} records every generation call of run 1"

    for step in (1, 2):
        assert log2.drawn[step] == log1.drawn[step], f"step {step}: run 2 draws the batches run 1 drew"
        assert log2.trained[step] == log1.trained[step], f"step {step}: run 2 trains on run 1's prompts"
        assert log2.digests[step] == log1.digests[step], f"step {step}: run 2 trains on run 1's responses and scores"
    assert log2.drawn[3][0] == log1.drawn[3][0], "after the replayed steps the dataloader is where run 1's was"
    assert generated2 == per_call * log2.calls(3), "0 generator calls at steps 1-2: only step 3 generates"
    lines = skip_lines(second, "rollout")
    hits = [line for line in lines if ": hit" in line]
    assert len(hits) == log1.calls(1) + log1.calls(2), hits
    # The same reward as the recording's: every served call's scores are served as recorded, bit for bit
    # (the digests above), with the line saying why; nothing is re-scored (skip.rollout.rescore=auto).
    served = [line for line in lines if "rewards served as recorded (recorded by this run's reward)" in line]
    assert len(served) == len(hits) and not any("re-scored" in line for line in lines), lines
    assert all(url.removeprefix("s3://") in line for line in hits), f"every call is served from the store: {hits}"
    busiest = max((1, 2), key=log1.calls)
    calls = log1.calls(busiest)
    assert any(f"rollout step {busiest}: hit (call {calls} of {calls})" in line for line in hits), hits
