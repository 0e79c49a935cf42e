"""Role ``async_rollout``: the fully async Rollouter's per-sample generation.

``FullyAsyncAgentLoopManager.generate_sequences_single`` is called once per prompt, many at a
time. Each call finds its own step in its sample id, ``[uid_]sample_<epoch>_<feed_index>``:
the feed index (the Rollouter's running count of prompts fed, from 1) is the step. Nothing about
the step is shared between concurrent calls. The fully async policy's Rollouter module exists in
verl >= 0.8 only (the target declares that range).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from skipinject import Call, Role, StepSource, Target, hookimpl, select

from skipinject_rollout.common import (
    GEN_BATCH,
    GENERATION_SETTINGS,
    RolloutCodec,
    prompt_fingerprint,
    prompt_key,
    rescore_matched_sample,
    rescore_sample,
)
from skipinject_rollout.reward_identity import record_run

TARGET = (
    "verl.experimental.fully_async_policy.fully_async_rollouter:FullyAsyncAgentLoopManager.generate_sequences_single"
)
_SAMPLE_ID = re.compile(r"(?:uid_)?sample_([0-9]{1,18})_([0-9]{1,18})")


def cannot_fire(config: Any) -> str | None:
    """Only the fully async trainer (its config has an ``async_training`` section) has a Rollouter."""
    if select(config, "async_training") is None:
        return (
            "only verl's fully async trainer (-m verl.experimental.fully_async_policy.fully_async_main) calls "
            "FullyAsyncAgentLoopManager.generate_sequences_single; use skip.rollout (V0, one-step-off) or "
            "skip.rollout_tq (V1) here"
        )
    return None


def parse_sample_id(sample_id: str) -> int | None:
    """The feed index in ``[uid_]sample_<epoch>_<feed_index>``, or ``None`` for other ids."""
    match = _SAMPLE_ID.fullmatch(sample_id) if isinstance(sample_id, str) else None
    return int(match.group(2)) if match else None


def feed_index(call: Call) -> int | None:
    non_tensor = getattr(call.batch, "non_tensor_batch", None) or {}
    uids = non_tensor.get("uid")
    if uids is None or len(uids) == 0:
        return None
    return parse_sample_id(str(uids[0]))


def is_async_batch(batch: Any) -> bool:
    """Whether verl's ``gen_batch.dp`` holds fully async samples (its uids are sample ids)."""
    uids = getattr(batch, "non_tensor_batch", {}).get("uid")
    return uids is not None and len(uids) > 0 and parse_sample_id(str(uids[0])) is not None


ASYNC_ROLLOUT = Role(
    name="async_rollout",
    targets=[Target(TARGET, verl=">=0.8")],
    step=StepSource.per_call(feed_index),
    builtin="async_rollout",
    check=cannot_fire,
    codec=RolloutCodec(),
    fingerprint=prompt_fingerprint,
    # action=match: a sample is served by its prompt (not its id), from whichever step recorded it,
    # and its served rows are scored by this run's reward where their recording's was another.
    row_key=prompt_key,
    match_settings=GENERATION_SETTINGS,
    on_match=rescore_matched_sample,
    # No hit/miss marks in meta_info: the fully async trainer concatenates samples and asserts that
    # their meta_info agree, so a served sample must carry exactly what a generated one carries.
    on_hit=rescore_sample,
    record_meta=record_run,
    cache_subdir="",
    upstream=dataclasses.replace(GEN_BATCH, claims=is_async_batch),
    description="per-sample generation of the fully async Rollouter (step = feed index of the sample id)",
)


@hookimpl
def skipinject_roles() -> list[Role]:
    return [ASYNC_ROLLOUT]
