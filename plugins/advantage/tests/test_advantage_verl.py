"""The advantage role (``plugins/advantage``) on verl 0.9.1's real ``compute_advantage``, called as
``RayPPOTrainer.fit`` calls it, with real GRPO ``DataProto`` batches (:mod:`skipinject.testing`)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from skipinject.testing import RoleRun, call, grpo_batch, v0_trainer

ADVANTAGE_TARGET = "verl.trainer.ppo.ray_trainer:compute_advantage"


def call_like_fit(batch: Any) -> Any:
    """``compute_advantage`` exactly as ``RayPPOTrainer.fit`` calls it (looked up in ray_trainer)."""
    from verl.trainer.config import AlgoConfig

    return call(
        ADVANTAGE_TARGET,
        batch,
        adv_estimator="grpo",
        gamma=1.0,
        lam=1.0,
        num_repeat=2,
        norm_adv_by_std_in_grpo=True,
        config=AlgoConfig(adv_estimator="grpo"),
    )


def test_advantage_miss_then_hit_on_real_compute_advantage(
    user_plugins: None, tmp_path: Path, counted_compute_advantage: list[int]
) -> None:
    from verl.trainer.ppo import core_algos

    # Run 1: computes and saves steps 1 and 2.
    with RoleRun("advantage", tmp_path) as run:
        from skipinject.injector import INJECTOR

        assert INJECTOR.is_patched(ADVANTAGE_TARGET)
        first: dict[int, Any] = {}
        for step in (1, 2):
            trainer = v0_trainer(step)
            batch = grpo_batch(seed=step)
            out = call_like_fit(batch)
            assert out is batch
            first[step] = out.batch["advantages"].clone()
        assert len(counted_compute_advantage) == 2
        v0_trainer(3)  # a fit that returns: the end of a run, which commits the step still open (step 2)
        run.assert_miss(1)
        run.assert_miss(2)
        assert len(run.lines_with("saved 8 rows")) == 2
    step_dir = tmp_path / "e_p" / "GBS4_N2_in5_out6" / "advantage" / "1"
    assert (step_dir / "meta.json").is_file()

    # Sanity: what was computed is verl's GRPO advantage.
    check = grpo_batch(seed=1)
    expected, _ = core_algos.compute_grpo_outcome_advantage(
        check.batch["token_level_rewards"], check.batch["response_mask"], check.non_tensor_batch["uid"]
    )
    torch.testing.assert_close(first[1], expected)

    # Run 2: a new engine, same dump_dir, new uids as in a new run; the original is not called.
    with RoleRun("advantage", tmp_path) as run:
        for step in (1, 2):
            trainer = v0_trainer(step)
            batch = grpo_batch(seed=step)
            batch.non_tensor_batch["uid"] = np.repeat(np.array([str(uuid.uuid4()) for _ in range(4)], dtype=object), 2)
            keep = {k: batch.batch[k].clone() for k in ("responses", "token_level_rewards")}
            out = call_like_fit(batch)
            assert out is batch, "a hit returns the trainer's own batch, like compute_advantage"
            torch.testing.assert_close(out.batch["advantages"], first[step], rtol=0, atol=0)
            torch.testing.assert_close(out.batch["returns"], first[step], rtol=0, atol=0)
            for key, value in keep.items():
                assert torch.equal(out.batch[key], value)
            assert trainer.global_steps == step
        assert len(counted_compute_advantage) == 2, "run 2 served both steps without calling compute_advantage"
        assert [line.split(":")[0] for line in run.hits()] == ["advantage step 1", "advantage step 2"]
        run.assert_hit(1)
        run.assert_hit(2)
        assert not run.lines_with("other inputs")

        # Training modifying the served tensors in place never changes the cache.
        out.batch["advantages"].mul_(0)
        trainer = v0_trainer(2)
        again = call_like_fit(grpo_batch(seed=2))
        torch.testing.assert_close(again.batch["advantages"], first[2], rtol=0, atol=0)

        # A step outside skip.advantage.steps always runs the original and saves nothing.
        _trainer = v0_trainer(3)
        call_like_fit(grpo_batch(seed=3))
        assert len(counted_compute_advantage) == 3
    assert not (step_dir.parent / "3").exists()


def test_advantage_hit_for_other_batch_is_reported(
    user_plugins: None, tmp_path: Path, counted_compute_advantage: list[int]
) -> None:
    with RoleRun("advantage", tmp_path, "[1]"):
        _trainer = v0_trainer(1)
        call_like_fit(grpo_batch(seed=1))

    with RoleRun("advantage", tmp_path, "[1]") as run:
        _trainer = v0_trainer(1)
        other = grpo_batch(seed=1)
        other.batch["token_level_rewards"][:3] += 1.0  # three rows were scored differently this time
        call_like_fit(other)
    (warning,) = run.lines_with("other inputs")
    assert "in 3 of 8 rows" in warning and "on_mismatch=warn" in warning
    assert len(counted_compute_advantage) == 1


def test_advantage_mismatch_regenerate_policy(
    user_plugins: None, tmp_path: Path, counted_compute_advantage: list[int]
) -> None:
    from verl.trainer.ppo import core_algos

    settings = ("advantage", tmp_path, "[1]", "skip.advantage.on_mismatch=regenerate")
    with RoleRun(*settings):
        _trainer = v0_trainer(1)
        call_like_fit(grpo_batch(seed=1))

    with RoleRun(*settings):
        _trainer = v0_trainer(1)
        other = grpo_batch(seed=7)
        out = call_like_fit(other)
    assert len(counted_compute_advantage) == 2
    expected, _ = core_algos.compute_grpo_outcome_advantage(
        other.batch["token_level_rewards"], other.batch["response_mask"], other.non_tensor_batch["uid"]
    )
    torch.testing.assert_close(out.batch["advantages"], expected)


def test_advantage_cache_of_other_shape_is_not_served(
    user_plugins: None, tmp_path: Path, counted_compute_advantage: list[int]
) -> None:
    with RoleRun("advantage", tmp_path, "[1]"):
        _trainer = v0_trainer(1)
        call_like_fit(grpo_batch(seed=1))

    with RoleRun("advantage", tmp_path, "[1]") as run:
        _trainer = v0_trainer(1)
        bigger = grpo_batch(seed=1, prompts=6)
        out = call_like_fit(bigger)
    assert len(counted_compute_advantage) == 2
    assert out.batch["advantages"].shape == (12, 6)
    assert run.lines_with("running the target instead")
    assert not run.hits(1)


def test_validation_batches_always_run_compute_advantage(
    user_plugins: None, tmp_path: Path, counted_compute_advantage: list[int]
) -> None:
    with RoleRun("advantage", tmp_path, "[1]"):
        _trainer = v0_trainer(1)
        call_like_fit(grpo_batch(seed=1))
        batch = grpo_batch(seed=1)
        batch.meta_info["validate"] = True
        call_like_fit(batch)
    assert len(counted_compute_advantage) == 2


def test_pf_ppo_calls_are_never_cached(
    user_plugins: None, tmp_path: Path, counted_compute_advantage: list[int]
) -> None:
    from verl.trainer.config import AlgoConfig

    with RoleRun("advantage", tmp_path, "[1]"):
        _trainer = v0_trainer(1)
        for _ in range(2):
            call(ADVANTAGE_TARGET, grpo_batch(seed=1), "grpo", config=AlgoConfig(use_pf_ppo=True))
    assert len(counted_compute_advantage) == 2
    assert not (tmp_path / "e_p").exists()


def test_use_v1_keeps_the_role_off_main_ppo_only() -> None:
    """The fully async and one-step-off trainers compute advantages with RayPPOTrainer's
    ``compute_advantage`` whatever their inherited ``trainer.use_v1`` says."""
    from omegaconf import OmegaConf
    from skipinject_advantage.role import cannot_fire

    assert "trainer.use_v1=True" in (cannot_fire(OmegaConf.create({"trainer": {"use_v1": True}})) or "")
    separated = OmegaConf.create({"trainer": {"use_v1": True}, "rollout": {"nnodes": 1, "n_gpus_per_node": 1}})
    assert cannot_fire(separated) is None
