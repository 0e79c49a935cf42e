"""TensorDicts (jagged NestedTensors and NonTensorStacks included) to payload entries and back."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from skipinject.codecs.columns import check_shape, decode_column, encode_column
from skipinject.codecs.tagged_json import _Encoder, from_jsonable, to_jsonable
from skipinject.codecs.tensors import TensorSink, decode_tensor, encode_tensor
from skipinject.errors import CodecError

if TYPE_CHECKING:
    import torch


# ---------------------------------------------------------------- TensorDict


def encode_tensordict(td: Any, label: str, sink: TensorSink) -> dict[str, Any]:
    """Spec of a TensorDict: tensors (dense/jagged/nested), NonTensorData/NonTensorStack, sub-TensorDicts."""
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    if type(td) is not TensorDict:
        raise CodecError(f"cannot cache {label}: type {type(td).__qualname__} is not supported (expected TensorDict)")
    fields: dict[str, Any] = {}
    for key, value in td.items():
        path = f"{label}[{key!r}]"
        if isinstance(value, NonTensorStack):
            fields[key] = _encode_non_tensor_stack(value, path, sink)
        elif isinstance(value, NonTensorData):
            fields[key] = {"k": "ntd", "v": to_jsonable(value.data, path, sink=sink)}
        elif type(value) is TensorDict:
            fields[key] = {"k": "td", "td": encode_tensordict(value, path, sink)}
        elif _is_tensor(value):
            fields[key] = encode_tensor(value, path, sink)
        else:
            raise _Encoder(sink).fail(path, value)
    return {
        "batch_size": list(td.batch_size),
        "device": None if td.device is None else str(td.device),
        "fields": fields,
    }


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and type(value).__name__ in ("Tensor", "NestedTensor")


def _encode_non_tensor_stack(stack: Any, path: str, sink: TensorSink) -> dict[str, Any]:
    shape = list(stack.batch_size)
    flat: list[Any] = []
    _flatten_stack(stack, path, flat)
    if len(flat) != math.prod(shape):
        raise CodecError(f"cannot cache {path}: a ragged NonTensorStack of shape {shape} is not supported")
    return {"k": "nts", "shape": shape, "column": encode_column(flat, path, sink)}


def _flatten_stack(stack: Any, path: str, out: list[Any]) -> None:
    from tensordict import NonTensorData, NonTensorStack

    if getattr(stack, "stack_dim", 0) != 0:
        raise CodecError(f"cannot cache {path}: NonTensorStack stacked on dim {stack.stack_dim} is not supported")
    for item in stack.tensordicts:
        if isinstance(item, NonTensorStack):
            _flatten_stack(item, path, out)
        elif isinstance(item, NonTensorData):
            out.append(item.data)
        else:
            raise _Encoder(None).fail(f"{path} item", item)


def decode_tensordict(spec: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode_tensordict`."""
    from tensordict import NonTensorData, TensorDict

    batch_size = list(spec["batch_size"])
    source: dict[str, Any] = {}
    for key, field in spec["fields"].items():
        kind = field.get("k")
        if kind == "nts":
            rows = decode_column(field["column"], tensors)
            source[key] = _build_stack(rows, check_shape(field["shape"], len(rows)))
        elif kind == "ntd":
            source[key] = NonTensorData(from_jsonable(field["v"], tensors), batch_size=batch_size)
        elif kind == "td":
            source[key] = decode_tensordict(field["td"], tensors)
        else:
            source[key] = decode_tensor(field, tensors)
    return TensorDict(source, batch_size=batch_size, device=spec.get("device"))


def _build_stack(rows: list[Any], shape: Sequence[int]) -> Any:
    from tensordict import NonTensorStack

    if len(shape) <= 1:
        return NonTensorStack(*non_tensor_items(rows))
    step = math.prod(shape[1:])
    return NonTensorStack(*[_build_stack(rows[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])])


_PLAIN_ROWS = (str, int, float, bool, type(None), list, dict, tuple)


def non_tensor_items(rows: Sequence[Any]) -> list[Any]:
    """One ``NonTensorData`` per row, ~10x faster than the constructor (~40 us each, mostly validation).

    The first item is built by the public constructor; plain rows (JSON-like values) then get a
    clone of its state with their own data and their own empty TensorDict, which is exactly what the
    constructor would have built. If the template's state is not the layout this relies on (another
    tensordict version), or a row is not plain, the public constructor is used.
    """
    from tensordict import NonTensorData

    if not rows:
        return []
    template = NonTensorData(rows[0])
    state = template.__dict__
    inner = state.get("_tensordict")
    fields = state.get("_non_tensordict")
    usable = (
        set(state) <= {"_tensordict", "_non_tensordict", "_is_initialized"}
        and isinstance(fields, dict)
        and set(fields) == {"data", "_metadata", "_is_non_tensor"}
        and fields["data"] is rows[0]
        and inner is not None
        and len(inner.batch_size) == 0
        and not list(inner.keys())
    )
    items = [template]
    if not usable:
        items.extend(NonTensorData(row) for row in rows[1:])
        return items
    extra = {key: value for key, value in state.items() if key not in ("_tensordict", "_non_tensordict")}
    new = NonTensorData.__new__
    for row in rows[1:]:
        if type(row) not in _PLAIN_ROWS:
            items.append(NonTensorData(row))
            continue
        item = new(NonTensorData)
        attrs = item.__dict__
        attrs.update(extra)
        attrs["_tensordict"] = inner.empty()
        attrs["_non_tensordict"] = {**fields, "data": row}
        items.append(item)
    return items
