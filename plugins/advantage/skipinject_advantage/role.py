"""Role ``advantage``: verl's ``compute_advantage``, patched where the V0 trainer looks it up.

``RayPPOTrainer.fit`` calls the module-level ``compute_advantage`` of
``verl.trainer.ppo.ray_trainer`` once per training step. The call carries no step of its own, so
the step is the trainer's ``global_steps``, read from the trainer captured entering ``fit``.

A hit returns the batch the trainer passed in, with the cached ``advantages`` and ``returns``
put into it: exactly what the original returns. Each row's inputs (tokens, rewards, mask,
values, group, estimator settings) are digested when saving, so a cache that belongs to another
batch is reported (``skip.advantage.on_mismatch``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from skipinject import (
    Call,
    HitInfo,
    Role,
    StepSource,
    Target,
    attended_tokens,
    default_bypass,
    hookimpl,
    row_digest,
    select,
)

from skipinject_advantage.codec import AdvantageCodec, batch_of, response_mask_of

TARGET = "verl.trainer.ppo.ray_trainer:compute_advantage"
CLOCK = "verl.trainer.ppo.ray_trainer:RayPPOTrainer.fit"
#: Per-row tensors that determine a row's advantage (``values`` only with a critic).
INPUT_FIELDS = ("token_level_rewards", "values")


def resamples(call: Call) -> bool:
    """PF-PPO returns a resampled batch, not the one given: caching two fields cannot reproduce it."""
    return bool(select(call.argument("config"), "use_pf_ppo", False))


def bypass(call: Call) -> bool:
    return default_bypass(call) or resamples(call)


def cannot_fire(config: Any) -> str | None:
    # The fully async and one-step-off trainers (a top-level ``rollout`` section: their own rollout
    # resources) run on RayPPOTrainer whatever trainer.use_v1 says.
    if select(config, "trainer.use_v1") is True and select(config, "rollout") is None:
        return (
            "trainer.use_v1=True runs the V1 trainer, which computes advantages through "
            "verl.trainer.ppo.v1.utils; set trainer.use_v1=False for the V0 RayPPOTrainer"
        )
    if select(config, "algorithm.use_pf_ppo", False):
        return "algorithm.use_pf_ppo=True resamples the batch in compute_advantage; those calls always run"
    return None


def input_fingerprint(call: Call) -> list[str] | None:
    """One digest per row of what its advantage is computed from.

    uids are random per run, so a row's group enters as the position of its group's first row.
    """
    data = batch_of(call)
    tensors = getattr(data, "batch", None)
    keys = () if tensors is None else tensors.keys()
    if "token_level_rewards" not in keys:
        return None
    assert tensors is not None
    settings = json.dumps(
        [str(call.argument(name)) for name in ("adv_estimator", "gamma", "lam", "norm_adv_by_std_in_grpo")]
    ).encode()
    columns = [tensors[name] for name in INPUT_FIELDS if name in keys]
    columns.append(response_mask_of(data))
    tokens = attended_tokens(tensors)
    uids = (getattr(data, "non_tensor_batch", None) or {}).get("uid")
    first_row: dict[Any, int] = {}
    rows = []
    for index in range(len(data)):
        group = () if uids is None else (str(first_row.setdefault(uids[index], index)),)
        row = () if tokens is None else (tokens[index],)
        rows.append(row_digest(settings, *group, *row, *(column[index] for column in columns)))
    return rows


def merge_into_batch(fields: Mapping[str, Any], call: Call, info: HitInfo) -> Any:
    """Put the cached fields into this call's batch and return it, as compute_advantage does."""
    data = batch_of(call)
    keys = data.batch.keys()
    if "response_mask" not in keys:
        data.batch["response_mask"] = response_mask_of(data)
    for name, tensor in fields.items():
        data.batch[name] = tensor
    return data


ADVANTAGE = Role(
    name="advantage",
    targets=[Target(TARGET)],
    step=StepSource.clock("global_steps"),
    codec=AdvantageCodec(),
    clocks=[CLOCK],
    check=cannot_fire,
    bypass=bypass,
    fingerprint=input_fingerprint,
    on_hit=merge_into_batch,
    description="advantages/returns of a training step (V0 RayPPOTrainer, trainer.use_v1=False)",
)


@hookimpl
def skipinject_roles() -> list[Role]:
    return [ADVANTAGE]
