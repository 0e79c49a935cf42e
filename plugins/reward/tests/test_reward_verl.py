"""The reward role (``plugins/reward``) on verl 0.9.1's real ``extract_reward``, called as
``RayPPOTrainer.fit`` calls it, with real GRPO ``DataProto`` batches (:mod:`skipinject.testing`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from skipinject.testing import RoleRun, call, grpo_batch, v0_trainer

EXTRACT_REWARD = "verl.trainer.ppo.reward:extract_reward"


def test_reward_miss_then_hit_on_real_extract_reward(
    user_plugins: None, tmp_path: Path, counted_extract_reward: list[int]
) -> None:
    with RoleRun("reward", tmp_path, "[1]") as run:
        _trainer = v0_trainer(1)
        reward_1, extra_1 = call(EXTRACT_REWARD, grpo_batch(1, scores=True))
        assert isinstance(extra_1["acc"], np.ndarray)
    # the run ended: its open step is committed
    run.assert_miss(1)
    assert len(counted_extract_reward) == 1 and run.lines_with("reward step 1: saved 8 rows")

    # Run 2: same responses, but the reward function (say an LLM judge) would score them otherwise now.
    with RoleRun("reward", tmp_path, "[1]") as run:
        _trainer = v0_trainer(1)
        batch = grpo_batch(1, scores=torch.zeros(8))
        reward_2, extra_2 = call(EXTRACT_REWARD, batch)
    assert len(counted_extract_reward) == 1
    torch.testing.assert_close(reward_2, reward_1, rtol=0, atol=0)
    assert set(extra_2) == {"acc"} and np.array_equal(extra_2["acc"], extra_1["acc"])
    assert extra_2["acc"].dtype == extra_1["acc"].dtype
    run.assert_hit(1)
    assert not run.lines_with("other inputs")

    # The trainer uses the pair exactly as it would the original's.
    batch.batch["token_level_scores"] = reward_2
    batch.non_tensor_batch.update({k: np.array(v) for k, v in extra_2.items()})


def test_reward_served_for_other_responses_is_reported(
    user_plugins: None, tmp_path: Path, counted_extract_reward: list[int]
) -> None:
    with RoleRun("reward", tmp_path, "[1]"):
        _trainer = v0_trainer(1)
        call(EXTRACT_REWARD, grpo_batch(1, scores=True))

    with RoleRun("reward", tmp_path, "[1]") as run:
        _trainer = v0_trainer(1)
        other = grpo_batch(1, scores=True)
        other.batch["input_ids"][0, 5] += 1  # the first response token of one row came out differently
        call(EXTRACT_REWARD, other)
    (warning,) = run.lines_with("other inputs")
    assert "in 1 of 8 rows" in warning
    run.assert_hit(1)


def test_use_v1_keeps_the_role_off_main_ppo_only() -> None:
    """The fully async and one-step-off configs inherit ``trainer.use_v1: true`` but run RayPPOTrainer's
    reward (their top-level ``rollout`` section: the rollout's own resources): no warning there."""
    from omegaconf import OmegaConf
    from skipinject_reward.role import cannot_fire

    assert "trainer.use_v1=True" in (cannot_fire(OmegaConf.create({"trainer": {"use_v1": True}})) or "")
    separated = OmegaConf.create({"trainer": {"use_v1": True}, "rollout": {"nnodes": 1, "n_gpus_per_node": 1}})
    assert cannot_fire(separated) is None
