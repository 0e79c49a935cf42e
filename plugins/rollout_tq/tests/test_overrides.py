"""Subclasses of verl 0.9.1's V1 trainer and replay buffer overriding a ``rollout_tq`` target: followed
when the contract is the same, refused in one line when not (a streaming feeder submitting elsewhere, a
sampler taking other parameters) -- never silently bypassed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

from skipinject.injector import SkipinjectWrapper
from skipinject.testing import RoleRun
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync


class ExtendingTrainer(PPOTrainerSeparateAsync):
    """Same contract: runs the base's submit (which is patched) around its own bookkeeping."""

    def _add_batch_to_generate(self) -> Any:
        return super()._add_batch_to_generate()


class StreamingTrainer(PPOTrainerSeparateAsync):
    """PR #6868's shape: a feeder thread submits prompts; the per-step submit does nothing."""

    def _add_batch_to_generate(self) -> None:
        return None


class CustomSampler(ReplayBuffer):
    """A ``trainer.v1.sampler.custom_sampler``: another strategy, the same call."""

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> Any:
        return ("custom", global_steps)


class SessionSampler(ReplayBuffer):
    def sample(self, global_steps: int, partition_id: str, batch_size: int, sessions: int = 1) -> Any:
        return ("sessions", global_steps)


def test_overrides_of_submit_and_sample_are_followed_or_refused_in_one_line(tmp_path: Path) -> None:
    with RoleRun("rollout_tq", tmp_path, "[1]") as run:

        class LaterStreaming(StreamingTrainer):  # defined while the role runs: seen by the subclass hook
            pass

        assert isinstance(vars(ReplayBufferAsync)["sample"], SkipinjectWrapper), "the async buffer is followed"
        assert isinstance(vars(CustomSampler)["sample"], SkipinjectWrapper)
        assert isinstance(vars(ExtendingTrainer)["_add_batch_to_generate"], SkipinjectWrapper)
        assert run.lines_with("refused") == [], "nothing is said before a refused class is used"

        StreamingTrainer._add_batch_to_generate(object.__new__(LaterStreaming))
        StreamingTrainer._add_batch_to_generate(object.__new__(StreamingTrainer))
        assert SessionSampler.sample(object.__new__(SessionSampler), 1, "train", 4) == ("sessions", 1)
        refused = run.lines_with("refused")
        assert refused == [
            f"rollout_tq/rollout_tq: {__name__}:StreamingTrainer._add_batch_to_generate overrides the target "
            "verl.trainer.ppo.v1.trainer_base:PPOTrainer._add_batch_to_generate and is refused: its "
            "_add_batch_to_generate does not call PPOTrainer's, so the step's prompts are submitted where a "
            "cached step cannot take their place; this role does not act on StreamingTrainer",
            f"rollout_tq/rollout_tq: {__name__}:SessionSampler.sample overrides the target "
            "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.sample and is refused: its sample takes (self, "
            "global_steps, partition_id, batch_size, sessions), where ReplayBuffer.sample takes (self, "
            "global_steps, partition_id, batch_size); this role does not act on SessionSampler",
        ]
    for cls, name in (
        (ReplayBufferAsync, "sample"),
        (CustomSampler, "sample"),
        (SessionSampler, "sample"),
        (ExtendingTrainer, "_add_batch_to_generate"),
        (StreamingTrainer, "_add_batch_to_generate"),
    ):
        assert not isinstance(vars(cls)[name], SkipinjectWrapper), f"{cls.__name__}.{name} is restored"
