"""Rows of a verl ``DataProto``: taken, padded and merged for ``action=match`` (:class:`~skipinject.roles.RowCodec`).

Rows of one key have one width (the padded lengths are part of the key): pieces that still differ in
their columns, dtypes or widths are refused (:class:`CodecError`: the call runs whole), never padded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from skipinject.errors import CodecError


def attended_tokens(tensors: Any) -> list[Any] | None:
    """Each row's ``input_ids`` where ``attention_mask`` is set (padding left out), or ``None`` when
    the batch's tensors (a TensorDict) have no ``input_ids``."""
    keys = () if tensors is None else tensors.keys()  # TensorDict refuses ``in`` on itself
    if "input_ids" not in keys:
        return None
    ids = tensors["input_ids"]
    mask = tensors["attention_mask"] if "attention_mask" in keys else None
    return [ids[index] if mask is None else ids[index][mask[index].bool()] for index in range(ids.shape[0])]


def take(data: Any, rows: Sequence[int]) -> Any:
    """A new DataProto holding ``rows`` of ``data`` in that order (copies; ``meta_info`` copied)."""
    import numpy as np
    import torch
    from verl.protocol import DataProto

    index = np.asarray(list(rows), dtype=np.int64)
    batch = None if data.batch is None else data.batch[torch.from_numpy(index)]
    non_tensor = {key: value[index] for key, value in data.non_tensor_batch.items()}
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(data.meta_info))


def with_rows(call: Any, rows: Sequence[int], divisor: Callable[[Any], int] | None) -> tuple[Any, int]:
    """The call's batch with only ``rows``, padded like verl pads a batch to its workers
    (``pad_dataproto_to_divisor``: the first rows repeated): ``(batch, padding rows)``."""
    subset = take(call.batch, rows)
    size = 1
    if divisor is not None:
        size = int(divisor(call))
    if size > 1 and len(subset) % size:
        from verl.protocol import pad_dataproto_to_divisor

        subset, padding = pad_dataproto_to_divisor(subset, size)
        return subset, int(padding)
    return subset, 0


def merge(pieces: Sequence[Any], order: Sequence[int], call: Any) -> Any:
    """The pieces' rows concatenated and taken in ``order``, as one result of ``call``.

    The call's own per-row inputs (``uid`` and the other non-tensor columns it passes in) replace
    the recorded ones, repeated when the target returns several rows per input; ``meta_info`` is
    the first piece's, with this call's values for the keys the call's batch carries (its step).
    """
    import numpy as np
    import torch
    from verl.protocol import DataProto

    if not pieces:
        raise CodecError("nothing to merge")
    _check_alike(pieces)
    index = np.asarray(list(order), dtype=np.int64)
    if pieces[0].batch is None:
        batch = None
    else:
        joined = torch.cat([piece.batch for piece in pieces], dim=0) if len(pieces) > 1 else pieces[0].batch
        batch = joined[torch.from_numpy(index)]
    non_tensor = {
        key: np.concatenate([piece.non_tensor_batch[key] for piece in pieces])[index]
        for key in pieces[0].non_tensor_batch
    }
    source = call.batch
    inputs: Mapping[str, Any] = getattr(source, "non_tensor_batch", None) or {}
    if inputs and len(index) % len(source) == 0:
        per_input = len(index) // len(source)
        for key, column in inputs.items():
            if key in non_tensor and isinstance(column, np.ndarray):
                non_tensor[key] = np.repeat(column, per_input, axis=0) if per_input > 1 else column.copy()
    meta = dict(pieces[0].meta_info)
    own = getattr(source, "meta_info", None) or {}
    for key in meta.keys() & own.keys():
        meta[key] = own[key]
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)


def _check_alike(pieces: Sequence[Any]) -> None:
    """Every piece has the same columns, dtypes and widths as the first."""
    first = pieces[0]
    for piece in pieces[1:]:
        if (first.batch is None) != (piece.batch is None):
            raise CodecError("pieces differ: one has tensors, another none")
        if first.batch is not None:
            if set(first.batch.keys()) != set(piece.batch.keys()):
                raise CodecError(
                    f"pieces differ in their tensors: {sorted(first.batch.keys())} vs {sorted(piece.batch.keys())}"
                )
            for key in first.batch.keys():
                a, b = first.batch[key], piece.batch[key]
                if a.dtype != b.dtype or tuple(a.shape[1:]) != tuple(b.shape[1:]):
                    shapes = f"{a.dtype} {tuple(a.shape[1:])} vs {b.dtype} {tuple(b.shape[1:])}"
                    raise CodecError(f"pieces differ in tensor {key!r}: {shapes}")
        if set(first.non_tensor_batch) != set(piece.non_tensor_batch):
            raise CodecError("pieces differ in their non-tensor columns")
        for key, column in first.non_tensor_batch.items():
            other = piece.non_tensor_batch[key]
            if column.dtype != other.dtype or column.shape[1:] != other.shape[1:]:
                raise CodecError(f"pieces differ in non-tensor column {key!r}")
