"""Per-row columns stored as unique values plus an index when rows repeat (GRPO repeats each prompt n times)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from skipinject.codecs.tagged_json import _SCALARS, DEDUP_MAX_UNIQUE_FRACTION, TAG, _Encoder, from_jsonable, to_jsonable
from skipinject.codecs.tensors import TensorSink
from skipinject.errors import CodecError

if TYPE_CHECKING:
    import torch


# ---------------------------------------------------------------- per-row columns


def encode_column(items: Sequence[Any], field: str, sink: TensorSink | None = None) -> dict[str, Any]:
    """Encode one value per row, as uniques + index when rows repeat (identity, or value for scalars)."""
    seen: dict[Any, int] = {}
    index: list[int] = []
    uniques: list[Any] = []
    first_rows: list[int] = []
    for row, item in enumerate(items):
        key = (type(item), item) if type(item) in _SCALARS else id(item)
        position = seen.get(key)
        if position is None:
            position = seen[key] = len(uniques)
            uniques.append(item)
            first_rows.append(row)
        index.append(position)
    encoder = _Encoder(sink)
    if uniques and len(uniques) <= DEDUP_MAX_UNIQUE_FRACTION * len(items):
        values = _encode_rows(encoder, uniques, first_rows, field)
        column: dict[str, Any] = {TAG: "column", "n": len(items), "u": values, "i": index}
    else:
        values = _encode_rows(encoder, items, range(len(items)), field)
        column = {TAG: "column", "n": len(items), "u": values}
    column["plain"] = not encoder.tagged
    return column


class _NotPlain(Exception):
    pass


_JSON_LEAVES = frozenset({str, int, float, bool, type(None)})


def _plain_copy(value: Any) -> Any:
    """What ``_Encoder.enc`` gives for a plain JSON value (a copy; no tag), without building the
    error path of every element; raises :class:`_NotPlain` for anything else."""
    kind = type(value)
    if kind in _JSON_LEAVES:
        return value
    if kind is list:
        return [_plain_copy(item) for item in value]
    if kind is dict:
        if TAG in value or not all(type(key) is str for key in value):
            raise _NotPlain
        return {key: _plain_copy(item) for key, item in value.items()}
    raise _NotPlain


def _encode_rows(encoder: _Encoder, values: Sequence[Any], rows: Sequence[int], field: str) -> list[Any]:
    out: list[Any] = []
    append = out.append
    for value, row in zip(values, rows, strict=True):
        try:
            append(_plain_copy(value))
        except (_NotPlain, RecursionError):
            append(encoder.enc(value, f"{field}[{row}]"))
    return out


def decode_column(column: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None) -> list[Any]:
    """The rows of an :func:`encode_column` column, repeated rows sharing one object as they did."""
    uniques = column["u"]
    if not column.get("plain"):
        uniques = from_jsonable(uniques, tensors)
    index = column.get("i")
    rows = uniques if index is None else [uniques[i] for i in index]
    if len(rows) != column.get("n"):
        raise CodecError(f"cache column has {len(rows)} rows, its header says {column.get('n')}")
    return rows


MAX_DIMS = 64


def check_shape(shape: Any, rows: int) -> list[int]:
    """A column's shape, checked to hold exactly ``rows`` items without building more containers than
    there are rows (every leading product is at most ``rows``): a tiny file cannot claim a huge column."""
    if type(shape) is not list or len(shape) > MAX_DIMS or not all(type(d) is int and d >= 0 for d in shape):
        raise CodecError(f"cache holds a column with a malformed shape {str(shape)[:80]}")
    product = 1
    for dim in shape:
        product *= dim
        if product > max(rows, 64):
            raise CodecError(f"cache column of {rows} rows claims the shape {shape[:8]}")
    if product != rows and shape:
        raise CodecError(f"cache column of {rows} rows claims the shape {shape[:8]}")
    return shape


def _object_array(rows: list[Any], shape: Sequence[int]) -> Any:
    import numpy as np

    # np.array() would turn lists of chat messages into a 2-D array; fromiter keeps one object per row.
    return np.fromiter(rows, dtype=object, count=len(rows)).reshape(tuple(shape))


def encode_array_column(array: Any, field: str, sink: TensorSink) -> dict[str, Any]:
    """A ``non_tensor_batch`` array: object arrays as a column, numeric arrays as one tensor."""
    import numpy as np

    if not isinstance(array, np.ndarray):
        raise CodecError(f"cannot cache {field}: type {type(array).__name__} is not supported (expected np.ndarray)")
    if array.dtype.kind == "O":
        column = encode_column(list(array.reshape(-1)), field, sink)
        return {"k": "objects", "shape": list(array.shape), "column": column}
    return {"k": "array", "v": to_jsonable(array, field, sink=sink)}


def decode_array_column(spec: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> Any:
    kind = spec.get("k")
    if kind == "objects":
        rows = decode_column(spec["column"], tensors)
        return _object_array(rows, check_shape(spec["shape"], len(rows)))
    if kind == "array":
        return from_jsonable(spec["v"], tensors)
    raise CodecError(f"cache holds a non-tensor column of unknown kind {kind!r}")
