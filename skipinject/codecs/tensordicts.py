"""TensorDicts (jagged NestedTensors and NonTensorStacks included) to payload entries and back."""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

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
    append = out.append
    for item in stack.tensordicts:
        if type(item) is NonTensorData:
            data = _plain_data(item)
            append(item.data if data is _NO_DATA else data)
        elif isinstance(item, NonTensorStack):
            _flatten_stack(item, path, out)
        elif isinstance(item, NonTensorData):
            append(item.data)
        else:
            raise _Encoder(None).fail(f"{path} item", item)


_NO_DATA = object()


def _plain_data(item: Any) -> Any:
    """``item.data`` read from its state, as tensordict's ``__getattr__`` reads it when the item is
    neither shared nor memory-mapped (~0.2 us instead of ~10); ``_NO_DATA`` when unsure."""
    fields = item.__dict__.get("_non_tensordict")
    inner = item.__dict__.get("_tensordict")
    inner_state = getattr(inner, "__dict__", None)
    if (
        type(fields) is not dict
        or inner_state is None
        or inner_state.get("_is_shared", getattr(type(inner), "_is_shared", True))
        or inner_state.get("_is_memmap", getattr(type(inner), "_is_memmap", True))
        or "data" in inner_state.get("_tensordict", ())
    ):
        return _NO_DATA
    return fields.get("data", _NO_DATA)


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
        return non_tensor_stack(rows)
    step = math.prod(shape[1:])
    return NonTensorStack(*[_build_stack(rows[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])])


_PLAIN_ROWS = (str, int, float, bool, type(None), list, dict, tuple)
#: The state tensordict's constructors give the empty TensorDict inside a ``NonTensorData``, and the
#: attributes of a ``NonTensorStack``; the fast paths below rebuild exactly these or step aside.
_INNER_STATE = {"_device", "_tensordict", "_batch_size", "_td_dim_names"}
_STACK_STATE = {"_is_locked", "stack_dim", "_batch_size", "tensordicts", "hook_out", "hook_in"}
_stack_unsafe_ok: bool | None = None


def non_tensor_stack(rows: Sequence[Any]) -> Any:
    """``NonTensorStack(*[NonTensorData(row) for row in rows])``, about 20x faster.

    The rows come from :func:`non_tensor_items`; the stack is assembled by tensordict's own
    ``_new_lazy_unsafe`` (what its ``stack``/indexing use internally), which skips the per-item
    batch-size and device validation of the public constructor. That shortcut is taken only if, on
    this tensordict version, it builds the same attributes as the constructor (checked once).
    """
    from tensordict import NonTensorStack

    items = non_tensor_items(rows)
    if not items or not _stack_shortcut_ok():
        return NonTensorStack(*items)
    return NonTensorStack._new_lazy_unsafe(*items)


def _stack_shortcut_ok() -> bool:
    global _stack_unsafe_ok
    if _stack_unsafe_ok is None:
        from tensordict import NonTensorData, NonTensorStack

        _stack_unsafe_ok = False
        make = getattr(NonTensorStack, "_new_lazy_unsafe", None)
        if make is not None:
            items = [NonTensorData("a"), NonTensorData({"b": 1})]
            try:
                fast, slow = make(*items), NonTensorStack(*items)
            except Exception:  # any failure: use the public constructor
                return False
            fast_state, slow_state = dict(fast.__dict__), dict(slow.__dict__)
            _stack_unsafe_ok = (
                type(fast) is NonTensorStack
                and set(slow_state) == _STACK_STATE
                and fast_state.keys() == slow_state.keys()
                and _same_items(fast_state.pop("tensordicts"), items)
                and _same_items(slow_state.pop("tensordicts"), items)
                and fast_state == slow_state
            )
    return _stack_unsafe_ok


def _same_items(got: Any, items: list[Any]) -> bool:
    return type(got) is list and len(got) == len(items) and all(a is b for a, b in zip(got, items, strict=True))


def non_tensor_items(rows: Sequence[Any]) -> list[Any]:
    """One ``NonTensorData`` per row, ~50x faster than the constructor (~40 us each, mostly validation).

    The first item is built by the public constructor; plain rows (JSON-like values) then get a
    copy of its state with their own data and their own empty TensorDict (a copy of the template's,
    with its own key dict), which is exactly what the constructor would have built. The copies are
    made without going through tensordict's ``__setattr__`` and with the cyclic garbage collector
    paused (the new objects hold no cycles; collecting while tens of thousands are made would scan
    them over and over). If the template's state is not the layout this relies on (another
    tensordict version), or a row is not plain, the public constructor is used.
    """
    from tensordict import NonTensorData, TensorDict

    if not rows:
        return []
    template = NonTensorData(rows[0])
    state = template.__dict__
    inner = state.get("_tensordict")
    fields = state.get("_non_tensordict")
    inner_state = getattr(inner, "__dict__", {})
    usable = (
        set(state) <= {"_tensordict", "_non_tensordict", "_is_initialized"}
        and isinstance(fields, dict)
        and set(fields) == {"data", "_metadata", "_is_non_tensor"}
        and fields["data"] is rows[0]
        and type(inner) is TensorDict
        and set(inner_state) == _INNER_STATE
        and type(inner_state["_tensordict"]) in (dict, _string_only_dict())
        and not inner_state["_tensordict"]
        and len(inner.batch_size) == 0
    )
    items = [template]
    if not usable:
        items.extend(NonTensorData(row) for row in rows[1:])
        return items
    extra = {key: value for key, value in state.items() if key not in ("_tensordict", "_non_tensordict")}
    key_dict = type(inner_state["_tensordict"])
    new = object.__new__
    set_state = object.__setattr__
    append = items.append
    with gc_paused():
        for row in rows[1:]:
            if type(row) not in _PLAIN_ROWS:
                append(NonTensorData(row))
                continue
            empty = new(TensorDict)
            set_state(empty, "__dict__", {**inner_state, "_tensordict": key_dict()})
            item = new(NonTensorData)
            set_state(item, "__dict__", {**extra, "_tensordict": empty, "_non_tensordict": {**fields, "data": row}})
            append(item)
    return items


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (and back on after it if it was on)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _string_only_dict() -> type[dict[str, Any]]:
    try:
        from tensordict.utils import _StringOnlyDict
    except ImportError:  # pragma: no cover - other tensordict versions
        return dict
    return cast("type[dict[str, Any]]", _StringOnlyDict)  # a dict subclass; tensordict is untyped here
