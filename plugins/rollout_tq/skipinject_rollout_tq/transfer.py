"""Moving a step's trajectories between TransferQueue and the cache.

A cached step is what ``ReplayBuffer.sample`` handed the trainer, read back from TransferQueue:
``{"tensordict": <all fields of the trajectories>, "keys": [...], "tags": [...], "global_steps": s}``
(upstream's ``tq_batch.pt`` payload has the same shape). Serving it puts those trajectories back
into TransferQueue under the uids the dataloader just produced, so the replay buffer samples them
as if the rollout had generated them in this run.

Keys are ``{uid}_{session}_{index}`` (verl's ``ReplayBuffer`` docstring); the prompt-level key is
the bare ``{uid}``. Nothing here imports verl, torch or transfer_queue at module level.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skipinject import CodecError, CorruptCacheError, DataProtoCodec, TensorDictCodec, attended_tokens
from skipinject_rollout import trainer_formats
from skipinject_rollout.common import GENERATION_INPUTS, prompt_digests

logger = logging.getLogger("skipinject")

#: Tag keys set to the current step on injected trajectories: the replay buffer's staleness
#: control and the trainer's staleness metrics read them, and a served batch is this step's.
STEP_TAGS = ("global_steps", "min_global_steps", "max_global_steps")
#: Per-row copies of what the key and tags say (GRPO groups by the ``uid`` field): rewritten to match
#: the new key, so a cycled group is not merged with its other copy.
ROW_FIELDS = ("uid", "session_id", "global_steps")
TRAIN = "train"


@dataclass
class CachedBatch:
    """The trajectories of one cached step, all parts merged."""

    data: Any  # tensordict.TensorDict, one row per key
    keys: list[str]
    tags: list[dict[str, Any]]

    @classmethod
    def from_payloads(cls, payloads: Sequence[Mapping[str, Any]], merge: Any) -> CachedBatch:
        """Merge decoded parts (``merge``: the codec's, concatenating TensorDicts and lists)."""
        if not payloads:
            raise CorruptCacheError("the cache holds no parts")
        for index, payload in enumerate(payloads):
            if not isinstance(payload, Mapping) or not {"tensordict", "keys", "tags"} <= set(payload):
                raise CorruptCacheError(f"part {index} is not a TransferQueue batch (needs tensordict, keys, tags)")
        merged = merge(list(payloads))
        keys = [str(key) for key in merged["keys"]]
        tags = [dict(tag) for tag in merged["tags"]]
        data = merged["tensordict"]
        rows = int(data.batch_size[0]) if len(data.batch_size) else -1
        if not (len(keys) == len(tags) == rows):
            raise CorruptCacheError(f"cache holds {len(keys)} keys, {len(tags)} tags and {rows} rows; they must agree")
        return cls(data, keys, tags)


@dataclass(frozen=True)
class Remap:
    """Where each injected trajectory comes from and what it is called now."""

    keys: list[str]
    tags: list[dict[str, Any]]
    rows: list[int]
    uids: list[str]  # the new prompt uid of each injected row
    sessions: list[int]  # the new session of each injected row
    groups: int  # cached prompt groups available


def group_rows(keys: Sequence[str]) -> list[list[int]]:
    """Row indices per prompt group (uid = the key up to its first ``_``), in first-seen order.

    ``ReplayBuffer.sample`` does not order keys by uid, so grouping must not rely on order.
    """
    groups: dict[str, list[int]] = {}
    for row, key in enumerate(keys):
        groups.setdefault(key.split("_")[0], []).append(row)
    return list(groups.values())


def remap(keys: Sequence[str], tags: Sequence[Mapping[str, Any]], new_uids: Sequence[str], n: int, step: int) -> Remap:
    """Assign cached trajectories to ``new_uids``: uid ``i`` takes cached group ``i % groups``,
    its session ``j`` the group's trajectory ``j % len(group)``; keys become ``{uid}_{j}_0``.

    Cycling fills in when fewer groups were cached than prompts now, or a group lost sessions
    (failed agent loops). Tags keep everything but ``is_prompt``, with the step tags set to ``step``.
    """
    if n < 1:
        raise ValueError(f"actor_rollout_ref.rollout.n must be >= 1 to inject cached trajectories, not {n}")
    groups = group_rows(keys)
    if not groups:
        raise CorruptCacheError("the cached step holds no trajectories")
    return _renamed(tags, new_uids, n, step, lambda index, session: groups[index % len(groups)], len(groups))


def _renamed(
    tags: Sequence[Mapping[str, Any]],
    new_uids: Sequence[str],
    n: int,
    step: int,
    group_of: Callable[[int, int], Sequence[int]],
    groups: int,
) -> Remap:
    """Session ``j`` of ``new_uids[i]`` takes row ``group[j % len(group)]`` of ``group_of(i, j)``, keyed
    ``{uid}_{j}_0``, its tags kept but ``is_prompt``, the step tags set to ``step``."""
    new_keys: list[str] = []
    new_tags: list[dict[str, Any]] = []
    rows: list[int] = []
    row_uids: list[str] = []
    sessions: list[int] = []
    for index, uid in enumerate(new_uids):
        for session in range(n):
            group = group_of(index, session)
            row = group[session % len(group)]
            tag = {key: value for key, value in tags[row].items() if key != "is_prompt"}
            tag.update(dict.fromkeys(STEP_TAGS, step))
            new_keys.append(f"{uid}_{session}_0")
            new_tags.append(tag)
            rows.append(row)
            row_uids.append(str(uid))
            sessions.append(session)
    return Remap(new_keys, new_tags, rows, row_uids, sessions, groups)


def select_rows(data: Any, plan: Remap, step: int) -> Any:
    """The planned rows of ``data`` as a new TensorDict (jagged fields too), renamed per :data:`ROW_FIELDS`.

    Rows may repeat (cycled groups). Jagged NestedTensors cannot be indexed on dim 0, so verl's own
    row selection (unbind, pick, rebuild) is used.
    """
    from tensordict import NonTensorData, NonTensorStack
    from verl.utils.tensordict_utils import index_select_tensor_dict

    selected = index_select_tensor_dict(data, list(plan.rows))
    values: dict[str, list[Any]] = {
        "uid": plan.uids,
        "session_id": plan.sessions,
        "global_steps": [step] * len(plan.rows),
    }
    for name in ROW_FIELDS:
        if isinstance(selected.get(name, None), (NonTensorStack, NonTensorData)):
            selected[name] = NonTensorStack.from_list([NonTensorData(value) for value in values[name]])
    return selected


@dataclass(frozen=True)
class Injection:
    """A cached step made ready for this step's uids: the remap and the rows to put."""

    plan: Remap
    fields: Any  # tensordict.TensorDict, one row per ``plan.keys``
    uids: list[str]
    step: int


def prepare(batch: CachedBatch, new_uids: Sequence[str], n: int, step: int) -> Injection:
    """Everything that can fail on a bad cache, before anything is put into TransferQueue."""
    plan = remap(batch.keys, batch.tags, new_uids, n, step)
    return Injection(plan, select_rows(batch.data, plan, step), [str(uid) for uid in new_uids], step)


def inject(injection: Injection, partition: str = TRAIN) -> Remap:
    """Put the trajectories into TransferQueue under the new uids and mark those prompts finished.

    Trajectories go in first, then the prompt-level keys (tagged ``finished``), so the replay buffer
    never sees a finished prompt without its trajectories.
    """
    import transfer_queue as tq

    plan = injection.plan
    tq.kv_batch_put(keys=plan.keys, fields=injection.fields, tags=plan.tags, partition_id=partition)
    prompt_tags = [{"is_prompt": True, "status": "finished", "global_steps": injection.step} for _ in injection.uids]
    tq.kv_batch_put(keys=injection.uids, partition_id=partition, tags=prompt_tags)
    return plan


def prompt_groups(partition: str = TRAIN) -> int:
    """Prompt groups in ``partition`` now (pending, running, or terminal but not sampled yet)."""
    import transfer_queue as tq

    listing = tq.kv_list(partition) or {}
    return sum(1 for tag in listing.get(partition, {}).values() if tag.get("is_prompt", False))


def snapshot(batch_meta: Any, step: int) -> dict[str, Any]:
    """A sampled batch (``KVBatchMeta``) read back from TransferQueue, in the cached-step shape."""
    import transfer_queue as tq

    keys = [str(key) for key in batch_meta.keys]
    data = tq.kv_batch_get(keys=keys, partition_id=batch_meta.partition_id)
    return {
        "tensordict": data,
        "keys": keys,
        "tags": [dict(tag) for tag in batch_meta.tags],
        "global_steps": step,
    }


# ---------------------------------------------------------------- action=match: rows of a cached step


def batch_digests(batch: Any) -> list[str] | None:
    """Per prompt of a submitted batch (a V1 ``TensorDict``), the digest ``rollout`` keys its rows by
    (:func:`skipinject_rollout.common.prompt_key`): attended tokens, generation inputs, sampling."""
    present = set(batch.keys())
    tensors = {key: batch[key] for key in ("input_ids", "attention_mask") if key in present}
    columns = [(key, list(batch[key])) for key in GENERATION_INPUTS if key in present]
    return prompt_digests(attended_tokens(tensors) if tensors else None, columns, True)


#: The codec name of the V0 ``rollout`` role's recordings (:class:`skipinject.DataProtoCodec`).
V0_CODEC = "DataProto"


class TrajectoryCodec(TensorDictCodec):
    """The TensorDict codec whose cached step parts are rows, one per trajectory (``action=match``).

    A part is ``{"tensordict", "keys", "tags", ...}``: :meth:`select_rows` takes rows of all three.
    The phases key, cut and submit the prompts themselves, so calls are never cut or merged here. A V0
    ``rollout`` recording (found by its equal row keys) is read as the V1 agent loop writes trajectories
    (:mod:`skipinject_rollout.trainer_formats`), or refused naming the field that cannot be carried."""

    def decode(self, payload: Any, call: Any = None) -> Any:
        if payload.objects.get("codec") == V0_CODEC:  # a V0 rollout's rows, found by their (equal) keys
            if call is None:
                raise CodecError("a V0 DataProto recording is served to a V1 submit only, with its prompts' fields")
            return trainer_formats.trajectories_from_v0(
                DataProtoCodec().decode(payload), trainer_formats.needs_log_probs(call.run_config)
            )
        return super().decode(payload, call)

    def input_rows(self, call: Any) -> int:
        raise CodecError("rollout_tq's submit keys its prompts itself")

    def result_rows(self, result: Any) -> int:
        return len(result["keys"])

    def with_rows(self, call: Any, rows: Sequence[int]) -> tuple[tuple[Any, ...], dict[str, Any], int]:
        raise CodecError("rollout_tq's submit cuts its prompts itself")

    def select_rows(self, result: Any, rows: Sequence[int]) -> Any:
        from verl.utils.tensordict_utils import index_select_tensor_dict

        if result.get(trainer_formats.FROM_V0):
            return trainer_formats.select_v0_rows(result, rows)
        picked = list(rows)
        return {
            **result,
            "tensordict": index_select_tensor_dict(result["tensordict"], picked),
            "keys": [result["keys"][row] for row in picked],
            "tags": [result["tags"][row] for row in picked],
        }

    def merge_rows(self, pieces: Sequence[Any], order: Sequence[int], call: Any) -> Any:
        raise CodecError("rollout_tq's submit merges served trajectories into TransferQueue itself")


def matched_injection(
    pieces: Sequence[Mapping[str, Any]],
    rows: Sequence[tuple[int, int]],
    uids: Sequence[str],
    n: int,
    step: int,
) -> Injection:
    """Served trajectories ready for this step: prompt ``i`` (``uids[i]``) session ``j`` is row ``rows[i*n+j]``
    (``(piece, row in piece)``) of ``pieces`` (:meth:`TrajectoryCodec.select_rows` results, after
    :func:`with_prompts`)."""
    from verl.utils.tensordict_utils import concat_tensordict

    starts, at = [], 0
    for piece in pieces:
        starts.append(at)
        at += len(piece["keys"])
    data = pieces[0]["tensordict"] if len(pieces) == 1 else concat_tensordict([p["tensordict"] for p in pieces])
    tags = [tag for piece in pieces for tag in piece["tags"]]

    def served_row(index: int, session: int) -> list[int]:
        piece, position = rows[index * n + session]
        return [starts[piece] + position] * n  # session j takes entry j: this row

    plan = _renamed(tags, uids, n, step, served_row, len(uids))
    return Injection(plan, select_rows(data, plan, step), [str(uid) for uid in uids], step)


def with_prompts(
    pieces: Sequence[Mapping[str, Any]],
    rows: Sequence[tuple[int, int]],
    n: int,
    prompts: Callable[[int], dict[str, Any]],
) -> tuple[list[Mapping[str, Any]], list[tuple[int, int]]]:
    """The pieces read from V0 recordings cut to their served rows, each with its prompt's fields (``prompts(i)``:
    prompt ``i``'s) and session, as the V1 agent loop writes them
    (:func:`skipinject_rollout.trainer_formats.with_prompt_fields`); ``rows`` renumbered to match."""
    out, rows = list(pieces), list(rows)
    for number, piece in enumerate(pieces):
        if not piece.get(trainer_formats.FROM_V0):
            continue
        used = [index for index, (p, _) in enumerate(rows) if p == number]
        picked = trainer_formats.select_v0_rows(piece, [rows[index][1] for index in used])
        out[number] = trainer_formats.with_prompt_fields(
            picked, [prompts(index // n) for index in used], [index % n for index in used]
        )
        for position, index in enumerate(used):
            rows[index] = (number, position)
    return out, rows


# ---------------------------------------------------------------- upstream's tq_batch.pt

UPSTREAM_FILE = "tq_batch.pt"


def upstream_parts(step_dir: Path) -> list[Path]:
    """Upstream's ``{step}/{0,1,...}/tq_batch.pt`` files of one step, consecutive from part 0."""
    parts = []
    index = 0
    while (step_dir / str(index) / UPSTREAM_FILE).is_file():
        parts.append(step_dir / str(index) / UPSTREAM_FILE)
        index += 1
    return parts


def load_upstream(step_dir: Path) -> list[dict[str, Any]]:
    """Read upstream's pickled parts. Runs code from the files: only for caches the user trusts."""
    import torch

    payloads = []
    for path in upstream_parts(step_dir):
        payload = torch.load(path, weights_only=False, map_location="cpu")  # trusted by the user (trust_upstream)
        if not isinstance(payload, Mapping):
            raise CorruptCacheError(f"{path}: not a TransferQueue batch payload ({type(payload).__name__})")
        payloads.append(dict(payload))
    return payloads


def load_upstream_file(path: Path) -> list[dict[str, Any]]:
    """:class:`skipinject.UpstreamFormat` loader: ``path`` is part 0; every part of its step is read."""
    return load_upstream(Path(path).parent.parent)
