"""What the rollout roles share: input fingerprints, hit metrics, upstream's pickle format."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from skipinject import Call, HitInfo, UpstreamFormat, attended_tokens, installed_verl_matches, row_digest, row_text

__all__ = ["GENSTEP_BATCH", "GEN_BATCH", "installed_verl_matches", "mark_hit", "mark_miss", "prompt_fingerprint"]


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


def mark_hit(result: Any, call: Call, info: HitInfo) -> Any:
    """A served batch reports the hit, not the old run's generation timing."""
    meta = getattr(result, "meta_info", None)
    if isinstance(meta, dict):
        meta["timing"] = {
            "skipinject/hit": 1.0,
            "skipinject/load_s": info.load_seconds,
            "skipinject/served_step": float(info.served_step),
            "skipinject/prompt_mismatch_rows": float(info.mismatched_rows),
        }
    _align_shared_keys(result, call)
    return result


def mark_miss(result: Any, call: Call) -> Any:
    meta = getattr(result, "meta_info", None)
    if isinstance(meta, dict):
        timing = meta.get("timing")
        if isinstance(timing, dict):
            timing["skipinject/hit"] = 0.0
    return result


def _align_shared_keys(result: Any, call: Call) -> None:
    """Make the cached batch's shared keys this call's, so the trainer's ``union`` accepts it."""
    cached = getattr(result, "non_tensor_batch", None)
    current = getattr(call.batch, "non_tensor_batch", None)
    if not isinstance(cached, dict) or not isinstance(current, dict):
        return
    for key in SHARED_KEYS:
        if key in cached and key in current and len(cached[key]) == len(current[key]):
            cached[key] = current[key].copy()


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
