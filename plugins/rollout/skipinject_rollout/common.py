"""What the rollout roles share: input fingerprints, hit metrics, upstream's pickle format."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skipinject import (
    Call,
    CodecError,
    DataProtoCodec,
    TensorDictCodec,
    UpstreamFormat,
    attended_tokens,
    installed_verl_matches,
    row_digest,
    row_text,
    select,
)

from skipinject_rollout import weight_sync

if TYPE_CHECKING:
    from skipinject import HitInfo, MatchInfo

__all__ = [
    "GENERATION_SETTINGS",
    "GENSTEP_BATCH",
    "GEN_BATCH",
    "RolloutCodec",
    "installed_verl_matches",
    "mark_hit",
    "mark_match",
    "mark_miss",
    "prompt_digests",
    "prompt_fingerprint",
    "prompt_key",
    "rescore_matched_sample",
    "rescore_sample",
    "separate_trainer",
    "workers_of",
]


def separate_trainer(config: Any) -> bool:
    """verl's one-step-off and fully async trainers: their own ``main``s, with a top-level ``rollout`` section
    for the rollout's resources, run V0-based trainers whatever ``trainer.use_v1`` says."""
    return select(config, "rollout.nnodes") is not None


#: Non-tensor keys the V0 trainer keeps on its own batch and compares in ``batch.union(output)``.
#: ``uid`` is random per run, so a cached one never matches; the others are replaced by this
#: call's values once a mismatch has been reported (``on_mismatch``).
SHARED_KEYS = ("uid", "data_source", "reward_model", "extra_info")
PROMPT_KEYS = ("raw_prompt", "raw_prompt_ids", "multi_modal_data")


def prompt_fingerprint(call: Call) -> Sequence[str] | None:
    """One short digest per input row, from the prompt (chat messages, else token ids)."""
    batch = call.batch
    non_tensor = getattr(batch, "non_tensor_batch", None) or {}
    columns = [non_tensor[key] for key in PROMPT_KEYS if key in non_tensor]
    if not columns:
        tokens = attended_tokens(getattr(batch, "batch", None))
        return None if tokens is None else [row_digest(row) for row in tokens]
    return [row_digest("\x1f".join(row_text(column[index]) for column in columns)) for index in range(len(columns[0]))]


#: Non-tensor inputs that decide a generation (``action=match`` keys rows by them and the tokens).
GENERATION_INPUTS = (
    "raw_prompt",
    "raw_prompt_ids",
    "multi_modal_data",
    "multi_modal_inputs",
    "tools_kwargs",
    "interaction_kwargs",
    "agent_name",
    "__do_sample__",  # verl 0.9's REMAX: the greedy baseline rows of the same call do not sample
)
#: The run settings deciding a generation: rows recorded under other values are never served.
GENERATION_SETTINGS = (
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.mode",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.top_k",
    "actor_rollout_ref.rollout.do_sample",
    "actor_rollout_ref.rollout.response_length",
    "actor_rollout_ref.rollout.prompt_length",
    "actor_rollout_ref.rollout.multi_turn",
    # the agent loop's settings but its num_workers (how a batch is split among workers, not what each
    # row generates: a call of some rows is padded to them)
    "actor_rollout_ref.rollout.agent.default_agent_loop",
    "actor_rollout_ref.rollout.agent.agent_loop_config_path",
    "actor_rollout_ref.rollout.agent.custom_async_server",
    "data.max_prompt_length",
    "data.max_response_length",
)


def prompt_key(call: Call) -> Sequence[str] | None:
    """Per input row, a digest of everything of the prompt deciding its generation: its tokens (padding
    left out) and its non-tensor inputs (chat, multi-modal data, tool and interaction arguments), and
    whether it samples (``meta_info["do_sample"]``, REMAX's greedy baseline does not)."""
    batch = call.batch
    non_tensor = getattr(batch, "non_tensor_batch", None) or {}
    meta = getattr(batch, "meta_info", None) or {}
    columns = [(key, non_tensor[key]) for key in GENERATION_INPUTS if key in non_tensor]
    return prompt_digests(attended_tokens(getattr(batch, "batch", None)), columns, meta.get("do_sample", True))


def prompt_digests(
    tokens: Sequence[Any] | None, columns: Sequence[tuple[str, Any]], do_sample: Any
) -> list[str] | None:
    """:func:`prompt_key`'s digests from a batch's parts, whatever holds them (a V0 ``DataProto``, a V1
    ``TensorDict``): per row its attended tokens, its :data:`GENERATION_INPUTS` columns, whether it samples."""
    if tokens is None and not columns:
        return None
    rows = len(tokens) if tokens is not None else len(columns[0][1])
    sampling = row_text({"do_sample": do_sample})
    return [
        row_digest(
            sampling,
            b"\x00" if tokens is None else tokens[index],
            *(f"\x1f{key}={row_text(column[index])}" for key, column in columns),
        )
        for index in range(rows)
    ]


#: The codec name of the V1 ``rollout_tq`` role's recordings (TransferQueue trajectories).
V1_CODEC = "TensorDict"


class RolloutCodec(DataProtoCodec):
    """The V0 rollouts' ``DataProto`` codec. A V1 ``rollout_tq`` recording (found by ``action=match``, whose
    row keys are the same for both trainers) is served as the V0 agent loop pads its rows, to this call's
    widths (:mod:`skipinject_rollout.trainer_formats`), or refused naming the field that cannot be carried."""

    def decode(self, payload: Any, call: Any = None) -> Any:
        if payload.objects.get("codec") == V1_CODEC:
            from skipinject_rollout import trainer_formats

            if call is None:
                raise CodecError("a V1 TransferQueue recording is served to a V0 call only, padded to its widths")
            scores = getattr(call.instance, "reward_loop_worker_handles", None) is not None
            return trainer_formats.v0_rows_from_trajectories(
                TensorDictCodec().decode(payload), call.run_config, scores_in_loop=scores
            )
        return super().decode(payload, call)


def workers_of(call: Call) -> int:
    """How many parts the target splits a batch into: the agent loop manager's workers, else the
    rollout worker group's size (a subset of a call's rows is padded to a multiple of it)."""
    instance = call.instance
    workers = getattr(instance, "agent_loop_workers", None)
    if workers is not None:
        return max(1, len(workers))
    group = getattr(instance, "actor_rollout_wg", None)
    size = getattr(group, "world_size", None)
    return size if isinstance(size, int) and size > 0 else 1


def mark_match(result: Any, call: Call, info: MatchInfo) -> Any:
    """A merged batch's served rows are scored by this run's reward where their recording's was another
    (:mod:`skipinject_rollout.rescore`); it reports what was served, generated and re-scored
    (``timing_s/skipinject/match_*``, ``…/rescored_rows``, ``…/rescore_s``)."""
    from skipinject_rollout import rescore  # the first hit's: not imported at start

    sources = [(info.source_meta.get(name, {}), rows) for name, rows in info.served.items()]
    if not info.generated_rows and sources:
        weight_sync.served(info.step, sources[0][0])
    done = rescore.apply(result, call, "rollout", info.step, info.settings, sources) if sources else None
    meta = getattr(result, "meta_info", None)
    if isinstance(meta, dict):
        timing = meta.get("timing") if info.generated_rows else None
        timing = dict(timing) if isinstance(timing, dict) else {}  # all served: not the old run's timing
        timing.update(
            {
                "skipinject/hit": 1.0 if not info.generated_rows else 0.0,
                "skipinject/load_s": info.seconds,
                "skipinject/match_served_rows": float(info.served_rows),
                "skipinject/match_generated_rows": float(info.generated_rows),
                "skipinject/match_source_steps": float(len(info.sources)),
                "skipinject/rescored_rows": float(done.rows if done else 0),
                "skipinject/rescore_s": done.seconds if done else 0.0,
            }
        )
        meta["timing"] = timing
    return result


def mark_hit(result: Any, call: Call, info: HitInfo) -> Any:
    """A served batch is scored by this run's reward where the recording's was another
    (:mod:`skipinject_rollout.rescore`) and reports the hit, not the old run's generation timing."""
    from skipinject_rollout import rescore  # the first hit's: not imported at start

    _align_shared_keys(result, call)
    weight_sync.served(info.requested_step, info.meta)
    done = rescore.apply(result, call, "rollout", info.requested_step, info.settings, [(info.meta, None)])
    meta = getattr(result, "meta_info", None)
    if isinstance(meta, dict):
        meta["timing"] = {
            "skipinject/hit": 1.0,
            "skipinject/load_s": info.load_seconds,
            "skipinject/served_step": float(info.served_step),
            "skipinject/prompt_mismatch_rows": float(info.mismatched_rows),
            "skipinject/rescored_rows": float(done.rows),
            "skipinject/rescore_s": done.seconds,
        }
    return result


def rescore_sample(result: Any, call: Call, info: HitInfo) -> Any:
    """A served fully async sample, scored by this run's reward where the recording's was another. Nothing
    else is added: the fully async trainer asserts that its samples' ``meta_info`` agree."""
    from skipinject_rollout import rescore  # the first hit's: not imported at start

    rescore.apply(result, call, "async_rollout", info.requested_step, info.settings, [(info.meta, None)])
    return result


def rescore_matched_sample(result: Any, call: Call, info: MatchInfo) -> Any:
    """A fully async sample merged by ``action=match``: the rows served from a recording of another reward
    are scored by this run's; nothing else is added (see :func:`rescore_sample`)."""
    from skipinject_rollout import rescore  # the first hit's: not imported at start

    sources = [(info.source_meta.get(name, {}), rows) for name, rows in info.served.items()]
    if sources:
        rescore.apply(result, call, "async_rollout", info.step, info.settings, sources)
    return result


def mark_miss(result: Any, call: Call) -> Any:
    """A generated batch reports the miss in its timing (a NeoProto's ``meta_info`` is a live mapping)."""
    meta = getattr(result, "meta_info", None)
    if isinstance(meta, MutableMapping):
        timing = meta.get("timing")
        if isinstance(timing, dict):
            timing["skipinject/hit"] = 0.0
    return result


def _align_shared_keys(result: Any, call: Call) -> None:
    """Make the cached batch's shared keys this call's, so the trainer's ``union`` accepts it. The call's
    columns are read by key: on verl's NeoProto data plane they are a proxy reading its storage."""
    cached = getattr(result, "non_tensor_batch", None)
    current = getattr(call.batch, "non_tensor_batch", None)
    if not isinstance(cached, dict) or current is None or not hasattr(current, "keys"):
        return
    import numpy as np  # a hit's: not imported where the plugin is only loaded (the runner)

    present = set(current.keys())
    for key in SHARED_KEYS:
        if key in cached and key in present and len(cached[key]) == len(current[key]):
            cached[key] = np.array(current[key], copy=True)


def _load_pickled_dataproto(path: Path) -> Any:
    from verl.protocol import DataProto

    return DataProto.load_from_disk(str(path))


#: verl's own cache of a rollout step: a pickled DataProto, loaded only when the user trusts it.
GEN_BATCH = UpstreamFormat("gen_batch.dp", _load_pickled_dataproto, label="verl-v0", required=("meta.json",))
#: verl < 0.9's RolloutSkip: ``genstep_{step:06d}/gen_batch.dp`` beside the step directories.
GENSTEP_BATCH = UpstreamFormat(
    "gen_batch.dp",
    _load_pickled_dataproto,
    directory="genstep_{step:06d}",
    label="verl-0.8",
    inputs_file="new_batch.dp",
    step_key="global_steps",
)
