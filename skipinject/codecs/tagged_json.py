"""Tagged JSON: every value that is not JSON-native carries an explicit tag; nothing else decodes."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from skipinject.codecs.tensors import TensorSink, _dtype_name, _tensor_ref, _torch_dtype, decode_tensor, encode_tensor
from skipinject.errors import CodecError
from skipinject.payload import TENSOR_DTYPES

if TYPE_CHECKING:
    import torch


TAG = "__si__"
CODEC_VERSION = 1
#: Arrays/tensors inside non-tensor values up to this many elements are inlined in the JSON tree;
#: larger ones go to the tensor file (a tensor there costs an index entry and a view, JSON a parse per element).
INLINE_MAX_ELEMENTS = 1024
#: A column is stored as uniques + index when at most this fraction of its rows is unique.
DEDUP_MAX_UNIQUE_FRACTION = 0.75

_SCALARS = (str, int, float, bool, type(None), bytes)
_NUMPY_TENSOR_KINDS = "biufc"


# ---------------------------------------------------------------- tagged JSON


class _Encoder:
    """One pass of :func:`to_jsonable`; remembers whether it emitted any tag (decode can then skip)."""

    def __init__(self, sink: TensorSink | None) -> None:
        self.sink = sink
        self.tagged = False

    def fail(self, path: str, value: Any, why: str = "") -> CodecError:
        kind = type(value)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        return CodecError(f"cannot cache {path}: type {name} is not supported{why}")

    def tag(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.tagged = True
        return {TAG: kind, **fields}

    def enc(self, value: Any, path: str) -> Any:
        kind = type(value)
        if kind is str or kind is int or kind is bool or value is None:
            return value
        if kind is float:
            return value
        if kind is list:
            return [self.enc(item, f"{path}[{i}]") for i, item in enumerate(value)]
        if kind is dict:
            if TAG not in value and all(type(key) is str for key in value):
                return {key: self.enc(item, f"{path}[{key!r}]") for key, item in value.items()}
            pairs = [[self.enc(key, f"{path} key"), self.enc(item, f"{path}[{key!r}]")] for key, item in value.items()]
            return self.tag("dict", v=pairs)
        if kind is tuple:
            return self.tag("tuple", v=[self.enc(item, f"{path}[{i}]") for i, item in enumerate(value)])
        if kind is bytes or kind is bytearray:
            return self.tag(kind.__name__, v=base64.b64encode(value).decode("ascii"))
        if kind is set or kind is frozenset:
            return self.tag(kind.__name__, v=[self.enc(item, f"{path} item") for item in value])
        module = kind.__module__
        if module == "numpy":
            return self.enc_numpy(value, path)
        if module == "torch" and kind.__name__ == "Tensor":
            return self.enc_tensor(value, path)
        if module.startswith("torch.nested"):
            return self.enc_tensor(value, path)
        raise self.fail(path, value)

    def enc_numpy(self, value: Any, path: str) -> Any:
        import numpy as np

        if isinstance(value, np.ndarray):
            return self.enc_array(value, path)
        if isinstance(value, np.generic) and value.dtype.kind in "biufUS":
            item = value.item()
            if value.dtype.kind == "S":
                item = base64.b64encode(item).decode("ascii")
            return self.tag("np", dtype=value.dtype.str, v=item)
        if isinstance(value, np.generic) and value.dtype.kind == "c":
            return self.tag("np", dtype=value.dtype.str, v=[value.real.item(), value.imag.item()])
        raise self.fail(path, value, f" (numpy dtype {getattr(value, 'dtype', '?')})")

    def enc_array(self, array: Any, path: str) -> Any:
        kind = array.dtype.kind
        if kind == "O":
            items = [self.enc(item, f"{path}[{i}]") for i, item in enumerate(array.reshape(-1))]
            return self.tag("ndo", shape=list(array.shape), v=items)
        if kind in "US":
            flat = array.reshape(-1).tolist()
            if kind == "S":
                flat = [base64.b64encode(item).decode("ascii") for item in flat]
            return self.tag("nd", dtype=array.dtype.str, shape=list(array.shape), v=flat)
        if kind not in _NUMPY_TENSOR_KINDS or array.dtype.itemsize > 16:
            raise self.fail(path, array, f" (numpy dtype {array.dtype})")
        if self.sink is not None and (array.size > INLINE_MAX_ELEMENTS or kind == "c"):
            return self.tag("ndt", dtype=array.dtype.str, ref=_array_to_sink(array, path, self.sink))
        flat = array.reshape(-1).tolist()
        if kind == "c":
            flat = [[z.real, z.imag] for z in flat]
        return self.tag("nd", dtype=array.dtype.str, shape=list(array.shape), v=flat)

    def enc_tensor(self, tensor: torch.Tensor, path: str) -> Any:
        dtype = _dtype_name(tensor.dtype)
        small = not tensor.is_nested and tensor.numel() <= INLINE_MAX_ELEMENTS and not tensor.is_complex()
        if self.sink is None or small:
            if not small or dtype not in TENSOR_DTYPES:
                raise self.fail(path, tensor, " here (large, nested or complex tensors need a tensor file)")
            flat = tensor.detach().cpu().reshape(-1).tolist()
            return self.tag("tensor", dtype=dtype, shape=list(tensor.shape), v=flat)
        return self.tag("tensorref", spec=encode_tensor(tensor, path, self.sink))


def _array_to_sink(array: Any, path: str, sink: TensorSink) -> str:
    import numpy as np
    import torch

    native = array.dtype.newbyteorder("=")
    if array.dtype != native:
        array = array.astype(native)
    return sink.add(torch.from_numpy(np.ascontiguousarray(array)), path)


def to_jsonable(value: Any, field: str = "value", *, sink: TensorSink | None = None) -> Any:
    """Encode ``value`` as a tagged JSON tree; ``field`` names it in errors.

    Supported: None, bool, int, float (nan/inf too), str, bytes, list, tuple, dict (any keys that are
    themselves supported), set, numpy scalars and arrays (object arrays too), and torch tensors. With
    a ``sink``, large arrays and tensors go to the tensor file; without one they are inlined.
    """
    return _Encoder(sink).enc(value, field)


def from_jsonable(obj: Any, tensors: Mapping[str, torch.Tensor] | None = None) -> Any:
    """Inverse of :func:`to_jsonable`. ``obj`` is consumed (decoded in place where possible)."""
    kind = type(obj)
    if kind is list:
        for i, item in enumerate(obj):
            if type(item) is list or type(item) is dict:
                obj[i] = from_jsonable(item, tensors)
        return obj
    if kind is not dict:
        return obj
    tag = obj.get(TAG)
    if tag is None:
        for key, item in obj.items():
            if type(item) is list or type(item) is dict:
                obj[key] = from_jsonable(item, tensors)
        return obj
    return _decode_tagged(tag, obj, tensors or {})


def _decode_tagged(tag: Any, obj: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> Any:
    if tag == "tuple":
        return tuple(from_jsonable(obj["v"], tensors))
    if tag == "dict":
        return {_hashable(from_jsonable(k, tensors)): from_jsonable(v, tensors) for k, v in obj["v"]}
    if tag == "bytes":
        return base64.b64decode(obj["v"])
    if tag == "bytearray":
        return bytearray(base64.b64decode(obj["v"]))
    if tag == "set":
        return {_hashable(item) for item in from_jsonable(obj["v"], tensors)}
    if tag == "frozenset":
        return frozenset(_hashable(item) for item in from_jsonable(obj["v"], tensors))
    if tag in ("np", "nd", "ndo", "ndt"):
        return _decode_numpy(tag, obj, tensors)
    if tag == "tensor":
        import torch

        return torch.tensor(obj["v"], dtype=_torch_dtype(obj["dtype"])).reshape(obj["shape"])
    if tag == "tensorref":
        return decode_tensor(obj["spec"], tensors)
    raise CodecError(f"cache holds a value with unknown tag {tag!r} (written by a newer skipinject?)")


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError as exc:
        raise CodecError(f"cache holds an unhashable dict key or set item {value!r}") from exc
    return value


def _decode_numpy(tag: str, obj: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> Any:
    import numpy as np

    if tag == "ndo":
        items = from_jsonable(obj["v"], tensors)
        return np.fromiter(items, dtype=object, count=len(items)).reshape(obj["shape"])
    dtype = _numpy_dtype(obj["dtype"])
    if tag == "np":
        value = obj["v"]
        if dtype.kind == "c":
            value = complex(*value)
        elif dtype.kind == "S":
            value = base64.b64decode(value)
        return dtype.type(value)
    if tag == "ndt":
        if dtype.kind not in _NUMPY_TENSOR_KINDS:
            raise CodecError(f"cache names a numpy dtype {dtype.str!r} that the tensor file does not hold")
        array = _tensor_ref(tensors, obj["ref"]).numpy()
        return array if array.dtype == dtype else array.astype(dtype)
    flat = obj["v"]
    if dtype.kind in "US":
        _check_string_array(dtype, flat)
    if dtype.kind == "c":
        flat = [complex(re, im) for re, im in flat]
    elif dtype.kind == "S":
        flat = [base64.b64decode(item) for item in flat]
    return np.array(flat, dtype=dtype).reshape(obj["shape"])


#: A fixed-width string array may take this many bytes of memory per byte of its JSON text, plus
#: :data:`STRING_ARRAY_ALLOWANCE` (numpy pads every item to the widest, so a forged dtype such as
#: ``<U1000000000`` would otherwise claim gigabytes per element).
STRING_ARRAY_FACTOR = 64
STRING_ARRAY_ALLOWANCE = 64 << 10


def _check_string_array(dtype: Any, flat: Any) -> None:
    if type(flat) is not list:
        raise CodecError("cache holds a string array whose values are not a list")
    text = 3 * len(flat) + 64 + sum(len(item) for item in flat if type(item) is str)
    if dtype.itemsize * len(flat) > STRING_ARRAY_FACTOR * text + STRING_ARRAY_ALLOWANCE:
        raise CodecError(
            f"cache holds a {dtype.str} array of {len(flat)} items ({dtype.itemsize * len(flat)} bytes) "
            f"from {text} bytes of JSON: out of proportion"
        )


def _numpy_dtype(text: Any) -> Any:
    import numpy as np

    try:
        dtype = np.dtype(text)
    except TypeError as exc:
        raise CodecError(f"cache names an unknown numpy dtype {text!r}") from exc
    if dtype.kind not in _NUMPY_TENSOR_KINDS + "US":
        raise CodecError(f"cache names an unsupported numpy dtype {text!r}")
    return dtype
