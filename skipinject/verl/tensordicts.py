"""TensorDicts (jagged NestedTensors and NonTensorStacks included) to payload entries and back."""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from skipinject.codecs import (
    TensorSink,
    check_shape,
    decode_column,
    decode_tensor,
    encode_column,
    encode_tensor,
    from_jsonable,
    to_jsonable,
    unsupported,
)
from skipinject.errors import CodecError

if TYPE_CHECKING:
    import torch


def encode_tensordict(td: Any, label: str, sink: TensorSink) -> dict[str, Any]:
    """Spec of a TensorDict: tensors (dense/jagged/nested), NonTensorData/NonTensorStack, sub-TensorDicts."""
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    if type(td) is not TensorDict:
        raise CodecError(f"cannot cache {label}: type {type(td).__qualname__} is not supported (expected TensorDict)")
    fields: dict[str, Any] = {}
    for key, value in td.items():
        path = f"{label}[{key!r}]"
        if isinstance(value, NonTensorStack):
            shape = list(value.batch_size)
            flat: list[Any] = []
            _flatten_stack(value, path, flat)
            if len(flat) != math.prod(shape):
                raise CodecError(f"cannot cache {path}: a ragged NonTensorStack of shape {shape} is not supported")
            fields[key] = {"k": "nts", "shape": shape, "column": encode_column(flat, path, sink)}
        elif isinstance(value, NonTensorData):
            fields[key] = {"k": "ntd", "v": to_jsonable(value.data, path, sink=sink)}
        elif type(value) is TensorDict:
            fields[key] = {"k": "td", "td": encode_tensordict(value, path, sink)}
        elif _is_tensor(value):
            fields[key] = encode_tensor(value, path, sink)
        else:
            raise unsupported(path, value)
    return {
        "batch_size": list(td.batch_size),
        "device": None if td.device is None else str(td.device),
        "fields": fields,
    }


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and type(value).__name__ in ("Tensor", "NestedTensor")


def _flatten_stack(stack: Any, path: str, out: list[Any]) -> None:
    from tensordict import NonTensorData, NonTensorStack

    if getattr(stack, "stack_dim", 0) != 0:
        raise CodecError(f"cannot cache {path}: NonTensorStack stacked on dim {stack.stack_dim} is not supported")
    items = stack.tensordicts
    if type(items) is LazyRows:
        pending = items._pending
        if pending is not None:  # a hit's rows nobody has read: their decoded values, no items made
            out.extend(pending)
            return
    append = out.append
    for item in items:
        if type(item) is NonTensorData:
            append(_data(item))
        elif isinstance(item, NonTensorStack):
            _flatten_stack(item, path, out)
        elif isinstance(item, NonTensorData):
            append(item.data)
        else:
            raise unsupported(f"{path} item", item)


def _data(item: Any) -> Any:
    """``item.data``, read from its state (~0.2 us instead of ~10) unless shared, memory-mapped or unsure."""
    fields = item.__dict__.get("_non_tensordict")
    inner = item.__dict__.get("_tensordict")
    inner_state = getattr(inner, "__dict__", None)
    if (
        type(fields) is not dict
        or inner_state is None
        or inner_state.get("_is_shared", getattr(type(inner), "_is_shared", True))
        or inner_state.get("_is_memmap", getattr(type(inner), "_is_memmap", True))
        or "data" in inner_state.get("_tensordict", ())
        or "data" not in fields
    ):
        return item.data
    return fields["data"]


def decode_tensordict(spec: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode_tensordict`."""
    import torch
    from tensordict import NonTensorData, TensorDict

    batch_size, device = list(spec["batch_size"]), spec.get("device")
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
    # ``_new_unsafe`` when it gives the same (no device, leading dims fit): the constructor's validation
    # reads every row :class:`LazyRows` defers.
    if device is None and _td_shortcut_ok() and all(_leading(value, batch_size) for value in source.values()):
        return TensorDict._new_unsafe(source, batch_size=torch.Size(batch_size), device=None)
    return TensorDict(source, batch_size=batch_size, device=device)


def _leading(value: Any, batch_size: list[int]) -> bool:
    """Whether ``value``'s leading dims are ``batch_size`` (without reading a stack's rows)."""
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    if isinstance(value, (NonTensorStack, NonTensorData)) or type(value) is TensorDict:
        shape = list(value.batch_size)
    elif _is_tensor(value):
        try:  # strided nested tensors have no shape, only the sizes of their regular dims
            shape = [value.size(dim) for dim in range(min(len(batch_size), value.dim()))]
        except RuntimeError:
            return False
    else:
        return False
    return shape[: len(batch_size)] == batch_size


@functools.cache
def _td_shortcut_ok() -> bool:
    """Whether ``_new_unsafe`` gives the public constructor's TensorDict here (checked once)."""
    import torch
    from tensordict import NonTensorStack, TensorDict

    try:
        source = {"x": torch.ones(2, 3), "s": NonTensorStack("a", "b")}
        slow = TensorDict(dict(source), batch_size=[2])
        fast = TensorDict._new_unsafe(dict(source), batch_size=torch.Size([2]), device=None)
    except Exception:  # any failure: use the public constructor
        return False
    slow_state = {k: v for k, v in slow.__dict__.items() if k != "_validate_value_cached"}
    fast_state = dict(fast.__dict__)
    return (
        type(fast) is TensorDict
        and slow_state.keys() == fast_state.keys()
        and type(slow_state.pop("_tensordict")) is type(fast_state["_tensordict"])
        and dict(fast_state.pop("_tensordict")) == source
        and fast_state == slow_state
    )


def _build_stack(rows: list[Any], shape: Sequence[int]) -> Any:
    from tensordict import NonTensorStack

    if len(shape) <= 1:
        return non_tensor_stack(rows)
    step = math.prod(shape[1:])
    return NonTensorStack(*[_build_stack(rows[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])])


_PLAIN_ROWS = (str, int, float, bool, type(None), list, dict, tuple)
#: The state the constructors give a ``NonTensorData``'s empty TensorDict and a ``NonTensorStack``.
_INNER_STATE = {"_device", "_tensordict", "_batch_size", "_td_dim_names"}
_STACK_STATE = {"_is_locked", "stack_dim", "_batch_size", "tensordicts", "hook_out", "hook_in"}


def non_tensor_stack(rows: Sequence[Any]) -> Any:
    """``NonTensorStack(*[NonTensorData(row) for row in rows])``, its rows made on first use (:class:`LazyRows`:
    a hit costs nothing per row for the fields training never reads)."""
    from tensordict import NonTensorStack

    state = _stack_layout()
    if not rows or state is None:
        return NonTensorStack(*non_tensor_items(rows))
    return _lazy_stack(state, rows)


def _lazy_stack(state: dict[str, Any], rows: Sequence[Any]) -> Any:
    """A ``NonTensorStack`` with the constructor's ``state``, holding ``rows`` as :class:`LazyRows`."""
    import torch
    from tensordict import NonTensorStack

    stack = NonTensorStack.__new__(NonTensorStack)
    stack.__dict__.update(state)
    stack.__dict__["tensordicts"] = LazyRows(rows)
    stack.__dict__["_batch_size"] = torch.Size([len(rows)])
    return stack


@functools.cache
def _stack_layout() -> dict[str, Any] | None:
    """The constructor's ``NonTensorStack`` state if a stack built from it behaves the same, else ``None``."""
    from tensordict import NonTensorData, NonTensorStack

    rows = ["a", {"b": 1}]
    try:
        slow = NonTensorStack(*[NonTensorData(row) for row in rows])
        state = dict(slow.__dict__)
        fast = _lazy_stack(state, rows)
        usable = (
            set(state) == _STACK_STATE
            and type(state["tensordicts"]) is list
            and all(type(item) is NonTensorData and item.batch_size == () for item in state["tensordicts"])
            and state["_batch_size"] == fast.batch_size
            and fast.batch_size == slow.batch_size
            and fast.tolist() == slow.tolist()
            and type(fast.tensordicts) is _Rows
            and list(fast.__dict__) == list(state)
            and all(fast.__dict__[key] == state[key] for key in state if key not in ("tensordicts", "_batch_size"))
        )
    except Exception:  # any failure: use the public constructor
        return None
    return {**state, "tensordicts": None} if usable else None  # the constructor's key order


_FILL_LOCK = threading.Lock()


class _Rows(list):  # type: ignore[type-arg]  # holds tensordict's untyped NonTensorData items
    """The items of a decoded ``NonTensorStack`` once made; pickled and copied as a plain list."""

    __slots__ = ("_pending",)
    _pending: Sequence[Any] | None

    def _fill(self) -> None:
        with _FILL_LOCK:
            pending = self._pending
            if pending is None:  # another thread made them
                return
            list.extend(self, non_tensor_items(pending))
            self._pending = None
            self.__class__ = _Rows

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.__reduce__()

    def __reduce__(self) -> Any:
        if type(self) is LazyRows:
            self._fill()
        return (list, (list.copy(self),))

    def __copy__(self) -> list[Any]:
        return list(self)


class LazyRows(_Rows):
    """A ``NonTensorStack``'s ``tensordicts`` list whose items are made on first use: ``len()`` answers from
    the rows; any other list operation first makes every item (under a lock) and turns the object into a
    :class:`_Rows`. C code reads list storage directly only for exact lists, and goes through ``__iter__`` here."""

    __slots__ = ()

    def __init__(self, rows: Sequence[Any]) -> None:  # the list's storage stays empty until used
        self._pending = rows

    def __len__(self) -> int:
        pending = self._pending
        return list.__len__(self) if pending is None else len(pending)

    def __radd__(self, other: Any) -> Any:
        self._fill()
        return list.__add__(other, self) if isinstance(other, list) else NotImplemented


def _filling(name: str) -> Any:
    method = getattr(list, name)

    def call(self: _Rows, *args: Any, **kwargs: Any) -> Any:
        if self._pending is not None:
            self._fill()
        return method(self, *args, **kwargs)

    call.__name__ = name
    return call


for _name in (
    "__getitem__", "__setitem__", "__delitem__", "__iter__", "__reversed__", "__contains__",
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__add__", "__iadd__", "__mul__",
    "__rmul__", "__imul__", "__repr__", "__sizeof__", "append", "clear", "copy", "count", "extend",
    "index", "insert", "pop", "remove", "reverse", "sort",
):  # fmt: skip
    setattr(LazyRows, _name, _filling(_name))
del _name


def non_tensor_items(rows: Sequence[Any]) -> list[Any]:
    """One ``NonTensorData`` per row, ~50x faster than the constructor (~40 us each, mostly validation):
    plain rows get a copy of the first (constructor-built) item's state with their own data, the garbage
    collector paused; another state layout (tensordict version), or a row not plain, the constructor."""
    from tensordict import NonTensorData, TensorDict

    try:
        from tensordict.utils import _StringOnlyDict as _string_only_dict
    except ImportError:  # pragma: no cover - other tensordict versions
        _string_only_dict = dict
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
        and type(inner_state["_tensordict"]) in (dict, _string_only_dict)
        and not inner_state["_tensordict"]
        and len(inner.batch_size) == 0
    )
    items = [template]
    if not usable:
        items.extend(NonTensorData(row) for row in rows[1:])
        return items
    # dict.copy() then setting the keys it already has: ~35% faster than {**d, k: v}, same key order.
    copy_inner, copy_state, copy_fields = inner_state.copy, state.copy, fields.copy
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
            empty_state = copy_inner()
            empty_state["_tensordict"] = key_dict()
            set_state(empty, "__dict__", empty_state)
            own_fields = copy_fields()
            own_fields["data"] = row
            item_state = copy_state()
            item_state["_tensordict"] = empty
            item_state["_non_tensordict"] = own_fields
            item = new(NonTensorData)
            set_state(item, "__dict__", item_state)
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
