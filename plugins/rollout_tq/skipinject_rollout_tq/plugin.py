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
* ``PPOTrainer._add_async_warmup_batches``: switched off while the role is enabled (every step).

A subclass whose ``_add_batch_to_generate`` calls the base's is followed; one that replaces it (a
streaming feeder that submits prompts elsewhere) is refused with one line when it is first called,
as is a ``sample`` override taking other parameters: a cached step could not be put in its place.

The step is the trainer's ``global_steps`` (clock: ``PPOTrainer.fit``). The cache lives where
upstream puts it, ``{dump_dir}/{experiment}_{project}/GBS.._N.._in.._out../{step}/``; upstream's
pickled ``{step}/{i}/tq_batch.pt`` is read only with ``skip.rollout_tq.trust_upstream=true``.
"""

from __future__ import annotations

import inspect
from typing import Any

from skipinject import (
    Role,
    StepSource,
    Target,
    UpstreamFormat,
    hookimpl,
    installed_verl_matches,
    select,
)
from skipinject_rollout.common import GENERATION_SETTINGS
from skipinject_rollout.reward_identity import record_reward

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
FIT = f"{TRAINER}.fit"
SAMPLE = "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.sample"

#: The V1 TransferQueue trainer exists in verl >= 0.9 only.
V1_VERL = ">=0.9"

#: Upstream's file of part 0 of a step; the loader reads every part of that step.
#: verl 0.9 writes ``num_trajectories`` in a ``meta.json`` beside each part's file.
TQ_BATCH = UpstreamFormat(f"0/{UPSTREAM_FILE}", load_upstream_file, label="verl-v1", rows_key="num_trajectories")


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
    """The V0 trainer has no TransferQueue submit/sample."""
    if select(config, "trainer.use_v1") is False:
        return (
            "trainer.use_v1=False runs the V0 RayPPOTrainer, which has no TransferQueue submit/sample; "
            "use skip.rollout there"
        )
    return None


def make_role() -> Role:
    """The ``rollout_tq`` role; its submit and sample phases share the last served step per cache directory."""
    last_served: LastServed = {}
    return Role(
        name="rollout_tq",
        targets=[
            Target(SUBMIT, phase=SubmitPhase(last_served), verl=V1_VERL, overrides=submit_override),
            Target(REFILL, phase=RefillPhase(), verl=V1_VERL),
            Target(SAMPLE, phase=SamplePhase(last_served), every_step=True, verl=V1_VERL, overrides=sample_override),
            Target(WARMUP, phase=WarmupOff(), every_step=True, verl=V1_VERL),
        ],
        step=StepSource.clock("global_steps").or_else(StepSource.argument("global_steps")),
        codec=TrajectoryCodec(),
        # action=match: each trajectory keyed as ``rollout`` keys a row (its prompt, its session as the
        # copy, the generation settings); the submit and refill phases key and cut the prompts.
        row_key=lambda call: batch_digests(call.batch) if call.batch is not None else None,
        match_settings=GENERATION_SETTINGS,
        match_reads=("rollout",),  # the V0 trainer's rows, unpadded as this trainer writes its trajectories
        # What scored the trajectories, in each saved step's meta.json (a served step is re-scored when
        # this run's reward differs: skipinject_rollout.rescore).
        record_meta=record_reward,
        # The V1 trainer's fit does not exist before verl 0.9: no clock there (nothing to time).
        clocks=[FIT] if installed_verl_matches(V1_VERL) else [],
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
