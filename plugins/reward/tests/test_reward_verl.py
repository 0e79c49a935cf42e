"""The reward role (``plugins/reward``) on verl 0.9.1's real ``extract_reward``, called as
``RayPPOTrainer.fit`` calls it, with real GRPO ``DataProto`` batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from skipinject import bootstrap
from tests.integration.user_plugins import (
    _config,
    _lines,
    _reward_batch,
    enter_fit,
    start,
)


def test_reward_miss_then_hit_on_real_extract_reward(
    user_plugins: None, tmp_path: Path, counted_extract_reward: list[int], skip_log: list[str]
) -> None:
    from verl.trainer.ppo import ray_trainer

    config, plugins = _config("reward", tmp_path, "[1]")
    start(config, plugins)
    _trainer = enter_fit(1)
    reward_1, extra_1 = ray_trainer.extract_reward(_reward_batch(1))
    assert isinstance(extra_1["acc"], np.ndarray)
    bootstrap.stop()  # the run ends: its open step is committed
    assert len(counted_extract_reward) == 1 and _lines(skip_log, "reward step 1: saved 8 rows")

    # Run 2: same responses, but the reward function (say an LLM judge) would score them otherwise now.
    start(config, plugins)
    _trainer = enter_fit(1)
    batch = _reward_batch(1, scores=torch.zeros(8))
    reward_2, extra_2 = ray_trainer.extract_reward(batch)
    assert len(counted_extract_reward) == 1
    torch.testing.assert_close(reward_2, reward_1, rtol=0, atol=0)
    assert set(extra_2) == {"acc"} and np.array_equal(extra_2["acc"], extra_1["acc"])
    assert extra_2["acc"].dtype == extra_1["acc"].dtype
    assert _lines(skip_log, "reward step 1: hit, served step 1")
    assert not _lines(skip_log, "other inputs")

    # The trainer uses the pair exactly as it would the original's.
    batch.batch["token_level_scores"] = reward_2
    batch.non_tensor_batch.update({k: np.array(v) for k, v in extra_2.items()})


def test_reward_served_for_other_responses_is_reported(
    user_plugins: None, tmp_path: Path, counted_extract_reward: list[int], skip_log: list[str]
) -> None:
    from verl.trainer.ppo import ray_trainer

    config, plugins = _config("reward", tmp_path, "[1]")
    start(config, plugins)
    _trainer = enter_fit(1)
    ray_trainer.extract_reward(_reward_batch(1))
    bootstrap.stop()

    start(config, plugins)
    _trainer = enter_fit(1)
    other = _reward_batch(1)
    other.batch["input_ids"][0, 5] += 1  # the first response token of one row came out differently
    ray_trainer.extract_reward(other)
    (warning,) = _lines(skip_log, "other inputs")
    assert "in 1 of 8 rows" in warning
