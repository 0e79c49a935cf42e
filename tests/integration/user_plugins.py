"""Helpers of the user-added roles' tests (``plugins/reward``, ``plugins/advantage``): installing
both distributions, real verl GRPO batches, the clock of a real ``RayPPOTrainer`` entering ``fit``."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from skipinject import bootstrap
from skipinject.config import Config, apply_overrides, split_overrides
from skipinject.plugin_manager import load_plugins

ROOT = Path(__file__).resolve().parents[2]
ADVANTAGE_TARGET = "verl.trainer.ppo.ray_trainer:compute_advantage"


def _run_config() -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "trainer": {"experiment_name": "e", "project_name": "p", "use_v1": False},
            "data": {"train_batch_size": 4, "max_prompt_length": 5, "max_response_length": 6},
            "actor_rollout_ref": {"rollout": {"n": 2}},
            "algorithm": {"adv_estimator": "grpo", "use_pf_ppo": False},
        }
    )


class _StopFit(Exception):
    pass


class _Executor:
    @property
    def _shutdown(self) -> bool:
        raise _StopFit


def enter_fit(global_steps: int) -> Any:
    """A real ``RayPPOTrainer`` entering the patched ``fit`` (stopped at its first line): the clock."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.config = _run_config()
    trainer._dump_executor = _Executor()
    with pytest.raises(_StopFit):
        trainer.fit()
    trainer.global_steps = global_steps
    return trainer


def grpo_batch(seed: int = 0, prompts: int = 4, n: int = 2, prompt_len: int = 5, response_len: int = 6) -> Any:
    """A V0 training batch as it reaches ``compute_advantage``: tokens, masks, outcome rewards, fresh uids."""
    from verl import DataProto

    gen = torch.Generator().manual_seed(seed)
    rows = prompts * n
    lengths = torch.randint(1, response_len + 1, (rows,), generator=gen)
    response_mask = (torch.arange(response_len)[None, :] < lengths[:, None]).long()
    prompt_ids = torch.randint(3, 400, (prompts, prompt_len), generator=gen).repeat_interleave(n, dim=0)
    responses = torch.randint(3, 400, (rows, response_len), generator=gen) * response_mask
    scores = torch.rand(rows, generator=gen)
    token_level_rewards = torch.zeros(rows, response_len)
    token_level_rewards[torch.arange(rows), lengths - 1] = scores
    uids = np.repeat(np.array([str(uuid.uuid4()) for _ in range(prompts)], dtype=object), n)
    return DataProto.from_dict(
        tensors={
            "prompts": prompt_ids,
            "responses": responses,
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": torch.cat([torch.ones(rows, prompt_len, dtype=torch.long), response_mask], dim=1),
            "response_mask": response_mask,
            "token_level_scores": token_level_rewards.clone(),
            "token_level_rewards": token_level_rewards,
        },
        non_tensors={"uid": uids, "data_source": np.array(["toy"] * rows, dtype=object)},
        meta_info={"global_token_num": [prompt_len] * rows},
    )


def _config(role: str, dump_dir: Path, steps: str = "[1,2]", *more: str) -> tuple[Config, Any]:
    """What ``python -m skipinject ... skip.<role>.enable=True ...`` resolves, for one plugin."""
    plugins = load_plugins(role)
    argv = [f"skip.{role}.enable=True", f"skip.{role}.steps={steps}", f"skip.{role}.dump_dir={dump_dir}", *more]
    overrides, rest = split_overrides(argv)
    assert rest == []
    config = apply_overrides(Config(), overrides, plugins.roles)
    return Config(plugins=role, roles=config.roles), plugins


def call_like_fit(batch: Any) -> Any:
    """``compute_advantage`` exactly as ``RayPPOTrainer.fit`` calls it (looked up in ray_trainer)."""
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import ray_trainer

    return ray_trainer.compute_advantage(
        batch,
        adv_estimator="grpo",
        gamma=1.0,
        lam=1.0,
        num_repeat=2,
        norm_adv_by_std_in_grpo=True,
        config=AlgoConfig(adv_estimator="grpo"),
    )


def start(config: Config, plugins: Any) -> Any:
    bootstrap.stop()
    engine = bootstrap.start(config, plugins)
    assert engine is not None and set(engine.runtimes) == set(config.enabled_roles)
    return engine


def _lines(log: list[str], needle: str) -> list[str]:
    return [line for line in log if needle in line]


def _reward_batch(seed: int, scores: torch.Tensor | None = None) -> Any:
    """A V0 batch after the rollout: the reward loop's ``rm_scores`` and extra infos are in it."""
    batch = grpo_batch(seed=seed)
    rows, response_len = batch.batch["responses"].shape
    lengths = batch.batch["response_mask"].sum(-1)
    if scores is None:
        scores = torch.rand(rows, generator=torch.Generator().manual_seed(100 + seed))
    rm_scores = torch.zeros(rows, response_len)
    rm_scores[torch.arange(rows), lengths - 1] = scores
    batch.batch["rm_scores"] = rm_scores
    batch.non_tensor_batch["acc"] = np.array((scores > 0.5).tolist())
    batch.non_tensor_batch["reward_model"] = np.array(
        [{"style": "rule", "ground_truth": str(i % 4)} for i in range(rows)], dtype=object
    )
    batch.meta_info["reward_extra_keys"] = ["acc"]
    return batch
