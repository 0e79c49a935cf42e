"""Role ``rollout_tq``: the rollout of verl's V1 TransferQueue trainer (``trainer.use_v1=True``).

Targets (verl 0.9.1):

* ``PPOTrainer._add_batch_to_generate`` (submit): the dataloader always advances; a cached step
  is put into TransferQueue under the new uids instead of submitting the prompts for generation.
* ``PPOTrainer._add_prompts_to_generate`` (refill; the replay buffer's ``refill_fn``): at a chosen
  step, the prompts group filtering (DAPO) and failed-group refills draw are counted for the step's
  record; a served step drew them already in its submit (``prompts_drawn`` of the record).
* ``ReplayBuffer.sample`` (sample), and every subclass's override of it with the same parameters
  (``ReplayBufferAsync``, a ``trainer.v1.sampler.custom_sampler``): after the real sample, the train
  batch of a generated step is read back and copied in the call, then written in the background;
  ``parameter_sync_step = k`` gives k parts, one commit.
* ``PPOTrainer._add_async_warmup_batches`` (verl >= 0.9.1): switched off while the role is enabled (every
  step). verl 0.9.0 has no such method: its async modes' ``on_train_begin`` (``PPOTrainerColocateAsync``,
  ``PPOTrainerSeparateAsync``) submits the warm-up batches itself, through the submit target, at step 1
  (upstream skips them when its own ``skip.rollout_tq.enable`` is set); those two are switched off instead,
  so step 1 is submitted once, by the step itself.

A subclass whose ``_add_batch_to_generate`` calls the base's is followed; one that replaces it (a
streaming feeder that submits prompts elsewhere) is refused with one line when it is first called,
as is a ``sample`` override taking other parameters: a cached step could not be put in its place.

The step is the trainer's ``global_steps`` (clock: ``PPOTrainer.fit``). The cache lives where
upstream puts it, ``{dump_dir}/{experiment}_{project}/GBS.._N.._in.._out../{step}/``; upstream's
pickled ``{step}/{i}/tq_batch.pt`` is read only with ``skip.rollout_tq.trust_upstream=true``.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from typing import Any

from skipinject import (
    Role,
    StepSource,
    Target,
    UpstreamFormat,
    hookimpl,
    installed_verl_matches,
    select,
    verl_version,
)
from skipinject_rollout.common import GENERATION_SETTINGS, separate_trainer
from skipinject_rollout.reward_identity import record_reward
from skipinject_rollout.weight_sync import BEFORE_TRAINING, before_generation, manager_targets, recorded_meta

from skipinject_rollout_tq.phases import (
    LastServed,
    RefillPhase,
    SamplePhase,
    SubmitPhase,
    WarmupOff,
    match_caveat,
)
from skipinject_rollout_tq.transfer import UPSTREAM_FILE, TrajectoryCodec, batch_digests, load_upstream_file

TRAINER = "verl.trainer.ppo.v1.trainer_base:PPOTrainer"
SUBMIT = f"{TRAINER}._add_batch_to_generate"
REFILL = f"{TRAINER}._add_prompts_to_generate"
WARMUP = f"{TRAINER}._add_async_warmup_batches"
#: verl 0.9.0's async modes submit their warm-up batches in ``on_train_begin`` (nothing else happens there).
WARMUP_090 = (
    "verl.trainer.ppo.v1.trainer_colocate_async:PPOTrainerColocateAsync.on_train_begin",
    "verl.trainer.ppo.v1.trainer_separate_async:PPOTrainerSeparateAsync.on_train_begin",
)
FIT = f"{TRAINER}.fit"
#: The trainer's set-up, before ``fit``: it makes the first weight sync (``on_init_end``), a clock too.
INIT = f"{TRAINER}.init"
#: What generates in the V1 trainer (submit, refill, validation, re-issued prompts): a deferred sync first.
GENERATE = "verl.trainer.ppo.v1.agent_loop_tq:AgentLoopManagerTQ.generate_sequences"
#: The V1 trainer modes whose engine sleeps while the trainer trains: weight syncs may wait.
DEFERRING_MODES = ("sync", "colocate_async")
SAMPLE = "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.sample"

#: The V1 TransferQueue trainer exists in verl >= 0.9 only.
V1_VERL = ">=0.9"
#: ``_add_async_warmup_batches`` exists from verl 0.9.1 on; 0.9.0 warms up in ``on_train_begin``.
WARMUP_VERL = ">=0.9.1"
WARMUP_090_VERL = ">=0.9,<0.9.1"

#: Upstream's file of part 0 of a step; the loader reads every part of that step.
#: verl 0.9 writes ``num_trajectories`` in a ``meta.json`` beside each part's file.
TQ_BATCH = UpstreamFormat(f"0/{UPSTREAM_FILE}", load_upstream_file, label="verl-v1", rows_key="num_trajectories")


#: verl's TransferQueue glue, which the V1 trainer runs on. A verl >= 0.9 without it has no V1 trainer: verl's
#: ``neo`` line removes TransferQueue for the NeoProto data plane of the V0 trainer, and its ``main_ppo``
#: refuses ``trainer.use_v1=true``.
V1_GLUE = "verl.utils.transferqueue_utils"


def no_v1_trainer() -> str | None:
    """Why the installed verl has no V1 TransferQueue trainer for this role to act in, else ``None`` (older
    verls have none either: there the start line says that no target is for that verl)."""
    if not installed_verl_matches(V1_VERL):
        return None
    try:  # verl's package is found, not imported: its submodule is looked for as a file
        spec = importlib.util.find_spec("verl")
    except (ImportError, ValueError):
        return None  # no verl to ask: the start line says what it can without it
    if spec is None or not spec.submodule_search_locations:
        return None
    glue = V1_GLUE.split(".")[1:]
    if any(
        os.path.exists(os.path.join(root, *glue) + ".py") or os.path.isdir(os.path.join(root, *glue))
        for root in spec.submodule_search_locations
    ):
        return None
    return (
        f"this verl ({verl_version()}) has no V1 TransferQueue trainer (no {V1_GLUE}: its main_ppo runs the V0 "
        "RayPPOTrainer only); use skip.rollout, which records and serves that trainer's rollout"
    )


def submit_override(cls: type) -> str | None:
    """An override of the submit that runs the base's keeps its contract (followed); one that does not
    submits the step's prompts its own way, where a cached step cannot take their place (refused)."""
    if calls_base(cls, "_add_batch_to_generate"):
        return None
    return (
        "its _add_batch_to_generate does not call PPOTrainer's, so the step's prompts are submitted where a "
        "cached step cannot take their place"
    )


def sample_override(cls: type) -> str | None:
    """An override of ``sample`` with the base's parameters returns the sampled batch as the base does."""
    theirs, ours = _parameters(vars(cls)["sample"]), ["self", "global_steps", "partition_id", "batch_size"]
    if theirs == ours:
        return None
    return f"its sample takes ({', '.join(theirs)}), where ReplayBuffer.sample takes ({', '.join(ours)})"


def calls_base(cls: type, name: str) -> bool:
    """Whether ``cls``'s own ``name`` calls ``super().<name>`` (read from its code, not run)."""
    code = getattr(vars(cls).get(name), "__code__", None)
    return code is not None and "super" in code.co_names and name in code.co_names


def _parameters(function: Any) -> list[str]:
    try:
        return list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return []


def cannot_fire(config: Any) -> str | None:
    """A verl without the V1 trainer, the V0 trainer chosen, or verl's one-step-off and fully async trainers:
    no TransferQueue submit/sample."""
    missing = no_v1_trainer()
    if missing is not None:
        return missing
    if separate_trainer(config):
        return (
            "verl's one-step-off and fully async trainers have no TransferQueue submit/sample, whatever "
            "trainer.use_v1 says; use skip.rollout (one-step-off) or skip.async_rollout (fully async)"
        )
    if select(config, "trainer.use_v1") is False:
        return (
            "trainer.use_v1=False runs the V0 RayPPOTrainer, which has no TransferQueue submit/sample; "
            "use skip.rollout there"
        )
    return None


def v1_defers(config: Any) -> str | None:
    """Whether this V1 run may defer its weight syncs (see :mod:`skipinject_rollout.weight_sync`)."""
    mode = select(config, "trainer.v1.trainer_mode", "sync")
    if mode not in DEFERRING_MODES:
        return f"trainer.v1.trainer_mode={mode}: the rollout engine generates while the trainer trains"
    return cannot_fire(config)


class PassThrough:
    """A target only watched (its ``Target.before`` acts): the original always runs."""

    def run(self, role: Any, call: Any, step: int, proceed: Any) -> Any:
        return proceed()

    async def run_async(self, role: Any, call: Any, step: int, proceed: Any) -> Any:
        return await proceed()


def record_meta(call: Any) -> dict[str, Any]:
    """What scored the step (re-scoring) and what the weight sync before its generation took."""
    return {**(record_reward(call) or {}), **recorded_meta()}


def make_role() -> Role:
    """The ``rollout_tq`` role; its submit and sample phases share the last served step per cache directory."""
    last_served: LastServed = {}
    return Role(
        name="rollout_tq",
        targets=[
            Target(SUBMIT, phase=SubmitPhase(last_served), verl=V1_VERL, overrides=submit_override),
            Target(REFILL, phase=RefillPhase(), verl=V1_VERL),
            Target(SAMPLE, phase=SamplePhase(last_served), every_step=True, verl=V1_VERL, overrides=sample_override),
            Target(WARMUP, phase=WarmupOff(), every_step=True, verl=WARMUP_VERL),
            *(Target(path, phase=WarmupOff(), every_step=True, verl=WARMUP_090_VERL) for path in WARMUP_090),
            Target(GENERATE, phase=PassThrough(), every_step=True, verl=V1_VERL, before=before_generation),
            # The trainer's weight sync into the rollout engine, deferred while the coming step is served.
            *manager_targets(v1_defers, verl=V1_VERL),
        ],
        step=StepSource.clock("global_steps").or_else(StepSource.argument("global_steps"), BEFORE_TRAINING),
        codec=TrajectoryCodec(),
        # action=match: each trajectory keyed as ``rollout`` keys a row (its prompt, its session as the
        # copy, the generation settings); the submit and refill phases key and cut the prompts.
        row_key=lambda call: batch_digests(call.batch) if call.batch is not None else None,
        match_settings=GENERATION_SETTINGS,
        match_reads=("rollout",),  # the V0 trainer's rows, unpadded as this trainer writes its trajectories
        # What scored the trajectories, in each saved step's meta.json (a served step is re-scored when
        # this run's reward differs: skipinject_rollout.rescore).
        record_meta=record_meta,
        # The V1 trainer's fit does not exist before verl 0.9: no clock there (nothing to time).
        clocks=[FIT, INIT] if installed_verl_matches(V1_VERL) else [],
        builtin="rollout_tq",
        check=cannot_fire,
        # action=match in the async modes or with parameter_sync_step > 1: one line at start says why not exact.
        caveat=match_caveat,
        cache_subdir="",
        upstream=TQ_BATCH,
        description="V1 TransferQueue trainer: submit (inject cached trajectories), refill (count DAPO's draws) "
        "and sample (save them)",
    )


ROLLOUT_TQ = make_role()


@hookimpl
def skipinject_roles() -> list[Role]:
    return [ROLLOUT_TQ]
