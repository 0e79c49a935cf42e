"""Role ``rollout``: verl's ``AgentLoopManager.generate_sequences`` (the V0 ``RayPPOTrainer``).

One call is one step: the trainer passes the step's whole generation batch, with
``meta_info["global_steps"]`` set by the trainer (also read from the trainer's clock).

On verl < 0.9 the built-in rollout skip is the older ``RolloutSkip``; while this role is enabled
it is turned off (see :mod:`skipinject_rollout.legacy`), so exactly one mechanism acts. verl 0.6's
default ``actor_rollout_ref.rollout.mode=sync`` generates through the worker group
(``actor_rollout_wg.generate_sequences``), not ``AgentLoopManager``: the role warns there.
"""

from __future__ import annotations

from typing import Any

from skipinject import Role, StepSource, Target, hookimpl, select

from skipinject_rollout.common import (
    GEN_BATCH,
    GENSTEP_BATCH,
    installed_verl_matches,
    mark_hit,
    mark_miss,
    prompt_fingerprint,
)
from skipinject_rollout.legacy import BUILTIN_WRAP, BuiltinSkipOff

TARGET = "verl.experimental.agent_loop.agent_loop:AgentLoopManager.generate_sequences"
V0_FIT = "verl.trainer.ppo.ray_trainer:RayPPOTrainer.fit"
V1_FIT = "verl.trainer.ppo.v1.trainer_base:PPOTrainer.fit"  # the V1 trainer exists from verl 0.9 on
CLOCKS = (V0_FIT, V1_FIT) if installed_verl_matches(">=0.9") else (V0_FIT,)


def cannot_fire(config: Any) -> str | None:
    """Trainers that never call this target: V1 (verl >= 0.9's default) and verl 0.6's sync rollout."""
    if select(config, "trainer.use_v1") is True:
        return (
            "trainer.use_v1=True runs the V1 TransferQueue trainer, which does not call "
            "AgentLoopManager.generate_sequences; use skip.rollout_tq there, or set trainer.use_v1=False"
        )
    if select(config, "actor_rollout_ref.rollout.mode") == "sync":
        return (
            "actor_rollout_ref.rollout.mode=sync generates through the worker group "
            "(actor_rollout_wg.generate_sequences), not AgentLoopManager.generate_sequences; "
            "set actor_rollout_ref.rollout.mode=async"
        )
    return None


ROLLOUT = Role(
    name="rollout",
    targets=[
        Target(TARGET),
        # verl < 0.9's built-in (RolloutSkip): not wrapped while this role is on (every step: it is
        # called once, before step 1).
        Target(BUILTIN_WRAP, phase=BuiltinSkipOff(cannot_fire), verl="<0.9", every_step=True),
    ],
    step=StepSource.meta("global_steps").or_else(StepSource.clock("global_steps")),
    clocks=CLOCKS,
    builtin="rollout",
    check=cannot_fire,
    fingerprint=prompt_fingerprint,
    on_hit=mark_hit,
    on_miss=mark_miss,
    cache_subdir="",
    upstream=(GEN_BATCH, GENSTEP_BATCH),
    description="generation of a whole training step (V0 RayPPOTrainer, trainer.use_v1=False)",
)


@hookimpl
def skipinject_roles() -> list[Role]:
    return [ROLLOUT]
