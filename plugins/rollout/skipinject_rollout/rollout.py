"""Role ``rollout``: verl's ``AgentLoopManager.generate_sequences`` (the V0 ``RayPPOTrainer``).

One call is one step: the trainer passes the step's whole generation batch, with
``meta_info["global_steps"]`` set by the trainer (also read from the trainer's clock).
"""

from __future__ import annotations

from typing import Any

from skipinject import Role, StepSource, Target, hookimpl, select

from skipinject_rollout.common import GEN_BATCH, mark_hit, mark_miss, prompt_fingerprint

TARGET = "verl.experimental.agent_loop.agent_loop:AgentLoopManager.generate_sequences"
CLOCKS = (
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer.fit",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer.fit",
)


def cannot_fire(config: Any) -> str | None:
    """verl >= 0.9 runs the V1 trainer by default, whose rollout manager never calls this target."""
    if select(config, "trainer.use_v1") is True:
        return (
            "trainer.use_v1=True runs the V1 TransferQueue trainer, which does not call "
            "AgentLoopManager.generate_sequences; use skip.rollout_tq there, or set trainer.use_v1=False"
        )
    return None


ROLLOUT = Role(
    name="rollout",
    targets=[Target(TARGET)],
    step=StepSource.meta("global_steps").or_else(StepSource.clock("global_steps")),
    clocks=CLOCKS,
    builtin="rollout",
    check=cannot_fire,
    fingerprint=prompt_fingerprint,
    on_hit=mark_hit,
    on_miss=mark_miss,
    cache_subdir="",
    upstream=GEN_BATCH,
    description="generation of a whole training step (V0 RayPPOTrainer, trainer.use_v1=False)",
)


@hookimpl
def skipinject_roles() -> list[Role]:
    return [ROLLOUT]
