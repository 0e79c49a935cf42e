"""Role ``rollout``: the whole generation of a V0 ``RayPPOTrainer`` step.

verl generates through one of two driver-side callables, and the role has a target on each:

* ``AgentLoopManager.generate_sequences`` (verl >= 0.7, and 0.5/0.6 with
  ``actor_rollout_ref.rollout.mode=async``);
* the worker group's ``actor_rollout_wg.generate_sequences`` (verl 0.4-0.6 with their default
  ``rollout.mode=sync``). verl binds it on each worker-group instance in ``init_workers``, so no
  class-level patch sees it: the target wraps that attribute of the trainer each time
  ``RayPPOTrainer.init_workers`` returns (an attribute target). The trainer calls it with the whole
  batch (the same object the worker group then splits between ranks), in ``fit`` and ``_validate``.

A trainer calls exactly one of them (``async_rollout_mode`` chooses, and the agent loop never calls
the worker group's method), so exactly one of skipinject's targets acts on a generation. The step
is ``meta_info["global_steps"]``, else the trainer's clock (verl 0.4 sets no step in the batch).
Validation batches (``meta_info["validate"]``) always run the original.

The trainer's weight sync into the rollout engine (``CheckpointEngineManager``, verl >= 0.8) waits while
the coming step is served and is carried out before the next generation that runs
(:mod:`skipinject_rollout.weight_sync`, ``skip.rollout.defer_weight_sync``).

REMAX (verl 0.4-0.6) generates a greedy baseline in every step, a second call of the same step
(``meta_info["do_sample"] = False``): like any second call of a step it is recorded as the step's
call 2 and replayed as such (see docs/how-it-works.md, "Several calls in one step"), never served call 1.

On verl < 0.9 the built-in rollout skip is the older ``RolloutSkip`` (0.6-0.8; it wraps the same
worker-group attribute, or the agent loop manager in 0.8); while this role is enabled it is turned
off (see :mod:`skipinject_rollout.legacy`), so exactly one mechanism acts.

``action=match`` keys each row by its prompt (:func:`~skipinject_rollout.common.prompt_key`) and the
run's generation settings; a batch of only the uncached rows is padded to a multiple of the agent
loop workers (or the worker group's size), as verl pads batches, and the padding's output dropped.
"""

from __future__ import annotations

from typing import Any

from skipinject import Role, StepSource, Target, hookimpl, select

from skipinject_rollout.common import (
    GEN_BATCH,
    GENERATION_SETTINGS,
    GENSTEP_BATCH,
    RolloutCodec,
    installed_verl_matches,
    mark_hit,
    mark_match,
    mark_miss,
    prompt_fingerprint,
    prompt_key,
    separate_trainer,
    workers_of,
)
from skipinject_rollout.legacy import BUILTIN_WRAP, BuiltinSkipOff
from skipinject_rollout.weight_sync import (
    BEFORE_TRAINING,
    before_generation,
    hybrid_engine,
    manager_targets,
    recorded_meta,
)

TARGET = "verl.experimental.agent_loop.agent_loop:AgentLoopManager.generate_sequences"
#: verl 0.4-0.6's sync rollout: the worker group's per-instance method, wrapped after init_workers.
WORKER_GROUP = Target(
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer.init_workers",
    attribute="actor_rollout_wg.generate_sequences",
    verl="<0.7",
)
V0_FIT = "verl.trainer.ppo.ray_trainer:RayPPOTrainer.fit"
V1_FIT = "verl.trainer.ppo.v1.trainer_base:PPOTrainer.fit"  # the V1 trainer exists from verl 0.9 on
CLOCKS = (V0_FIT, V1_FIT) if installed_verl_matches(">=0.9") else (V0_FIT,)


def cannot_fire(config: Any) -> str | None:
    """Trainers that call neither target: V1 (verl >= 0.9's default), the fully async trainer (its Rollouter
    generates per sample), verl 0.4's async server manager."""
    if select(config, "async_training") is not None:
        return (
            "the fully async trainer generates in its Rollouter, one sample per call of "
            "FullyAsyncAgentLoopManager.generate_sequences_single; use skip.async_rollout there"
        )
    if select(config, "trainer.use_v1") is True and not separate_trainer(config):
        return (
            "trainer.use_v1=True runs the V1 TransferQueue trainer, which does not call "
            "AgentLoopManager.generate_sequences; use skip.rollout_tq there, or set trainer.use_v1=False"
        )
    if select(config, "actor_rollout_ref.rollout.mode") == "async" and not installed_verl_matches(">=0.5"):
        return (
            "actor_rollout_ref.rollout.mode=async on verl 0.4 generates through AsyncLLMServerManager, which "
            "skipinject does not handle; use the default actor_rollout_ref.rollout.mode=sync"
        )
    return None


def v0_defers(config: Any) -> str | None:
    """Whether this V0 run may defer its weight syncs (see :mod:`skipinject_rollout.weight_sync`)."""
    return cannot_fire(config) or hybrid_engine(config)


def record_meta(call: Any) -> dict[str, Any]:
    """What scored the step (re-scoring) and what the weight sync before its generation took."""
    from skipinject_rollout.reward_identity import record_run  # a recording's: not imported at start

    return {**(record_run(call) or {}), **recorded_meta()}


ROLLOUT = Role(
    name="rollout",
    targets=[
        # A generation that runs carries a deferred weight sync out first (validation and misses alike).
        Target(TARGET, verl=">=0.5", before=before_generation),
        WORKER_GROUP,
        # verl 0.6-0.8's built-in (RolloutSkip): not wrapped while this role is on (every step: it is
        # called once, before step 1). verl 0.4/0.5 have none.
        Target(BUILTIN_WRAP, phase=BuiltinSkipOff(cannot_fire), verl=">=0.6,<0.9", every_step=True),
        # The trainer's weight sync into the rollout engine, deferred while the coming step is served.
        *manager_targets(v0_defers),
    ],
    step=StepSource.meta("global_steps").or_else(StepSource.clock("global_steps"), BEFORE_TRAINING),
    codec=RolloutCodec(divisor=workers_of),
    clocks=CLOCKS,
    builtin="rollout",
    check=cannot_fire,
    fingerprint=prompt_fingerprint,
    on_hit=mark_hit,
    on_miss=mark_miss,
    record_meta=record_meta,
    row_key=prompt_key,
    match_settings=GENERATION_SETTINGS,
    match_reads=("rollout_tq",),  # the V1 trainer's trajectories, padded as this trainer pads its rows
    on_match=mark_match,
    cache_subdir="",
    upstream=(GEN_BATCH, GENSTEP_BATCH),
    description=(
        "generation of a whole training step (V0 RayPPOTrainer, trainer.use_v1=False): the agent loop "
        "manager, or on verl < 0.7 with rollout.mode=sync the worker group's generate_sequences"
    ),
)


@hookimpl
def skipinject_roles() -> list[Role]:
    return [ROLLOUT]
