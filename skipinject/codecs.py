"""A result as a store :class:`~skipinject.payload.Payload` and back without pickle (docs/cache-format.md): plain
tensors plus a JSON tree whose non-JSON values carry a tag, so loading builds only the types :func:`to_jsonable`
lists. :mod:`skipinject.verl.codecs` builds verl's types on these; torch and numpy are imported lazily."""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from skipinject.errors import CodecError
from skipinject.payload import TENSOR_DTYPES

if TYPE_CHECKING:
    import torch

__all__ = ["TensorSink", "decode_tensor", "encode_tensor", "from_jsonable", "to_jsonable"]


class TensorSink:
    """Collects the tensors of one payload under unique names (``"<n>:<label>"``), contiguous CPU ones
    uncopied. A tensor added twice is stored once and decodes to one tensor: aliasing survives (jagged
    tensors sharing ``offsets`` keep sharing their ragged dimension)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._seen: dict[int, tuple[torch.Tensor, str]] = {}

    def add(self, tensor: torch.Tensor, label: str) -> str:
        known = self._seen.get(id(tensor))
        if known is not None and known[0] is tensor:
            return known[1]
        name = f"{len(self.tensors)}:{label}"
        self.tensors[name] = tensor.detach().cpu().contiguous()  # each a no-op for a contiguous CPU tensor
        self._seen[id(tensor)] = (tensor, name)
        return name


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_ref(tensors: Mapping[str, torch.Tensor], name: object) -> torch.Tensor:
    if not isinstance(name, str) or name not in tensors:
        raise CodecError(f"cache refers to a tensor {name!r} that its tensor file does not hold")
    return tensors[name]


def encode_tensor(tensor: torch.Tensor, label: str, sink: TensorSink) -> dict[str, Any]:
    """Spec of a dense, jagged (``layout=torch.jagged``) or strided nested tensor; data goes to ``sink``."""
    import torch

    if _dtype_name(tensor.dtype) not in TENSOR_DTYPES:
        raise CodecError(f"cannot cache {label}: tensor dtype {tensor.dtype} is not supported")
    if not tensor.is_nested:
        if tensor.layout != torch.strided:
            raise CodecError(f"cannot cache {label}: tensor layout {tensor.layout} is not supported")
        return {"k": "dense", "ref": sink.add(tensor, label)}
    if tensor.layout == torch.jagged:
        lengths = tensor.lengths()
        return {
            "k": "jagged",
            "values": sink.add(tensor.values(), f"{label}.values"),
            "offsets": sink.add(tensor.offsets(), f"{label}.offsets"),
            "lengths": None if lengths is None else sink.add(lengths, f"{label}.lengths"),
            "ragged_idx": int(tensor._ragged_idx),
        }
    # Strided nested tensors (transfer_queue's fallback when jagged fails): flat buffer + sizes.
    parts = tensor.unbind(0)
    sizes = torch.tensor([list(p.shape) for p in parts], dtype=torch.int64).reshape(len(parts), tensor.dim() - 1)
    flat = torch.cat([p.reshape(-1) for p in parts]) if parts else torch.empty(0, dtype=tensor.dtype)
    return {"k": "nested", "buffer": sink.add(flat, f"{label}.buffer"), "sizes": sink.add(sizes, f"{label}.sizes")}


def _check_jagged(
    values: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor | None, ragged_idx: object
) -> None:
    """Offsets (and lengths) must describe rows inside ``values``: torch does not check them, and a
    forged offset would make a loaded tensor read memory outside its buffer."""
    import torch

    if type(ragged_idx) is not int or not 1 <= ragged_idx <= values.dim():
        raise CodecError(f"cache holds a jagged tensor with a bad ragged dimension {ragged_idx!r}")
    extent = values.shape[ragged_idx - 1]
    if offsets.dim() != 1 or offsets.dtype not in (torch.int64, torch.int32) or offsets.numel() < 1:
        raise CodecError("cache holds a jagged tensor with malformed offsets")
    ends = offsets[1:] if lengths is None else offsets[:-1] + lengths if lengths.shape == offsets[:-1].shape else None
    if ends is None or (lengths is not None and bool((lengths < 0).any())):
        raise CodecError("cache holds a jagged tensor with malformed lengths")
    if bool((offsets < 0).any()) or bool((offsets > extent).any()) or bool((ends > extent).any()):
        raise CodecError("cache holds a jagged tensor whose offsets point outside its values")
    if lengths is None and bool((offsets[1:] < offsets[:-1]).any()):
        raise CodecError("cache holds a jagged tensor whose offsets decrease")


def decode_tensor(spec: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`encode_tensor`. Dense tensors come back as the loaded (memory-mapped) tensor."""
    import torch

    kind = spec.get("k")
    if kind == "dense":
        return _tensor_ref(tensors, spec.get("ref"))
    if kind == "jagged":
        lengths = spec.get("lengths")
        values = _tensor_ref(tensors, spec.get("values"))
        offsets = _tensor_ref(tensors, spec.get("offsets"))
        lengths_t = None if lengths is None else _tensor_ref(tensors, lengths)
        ragged_idx = spec.get("ragged_idx", 1)
        _check_jagged(values, offsets, lengths_t, ragged_idx)
        return torch.nested.nested_tensor_from_jagged(values, offsets=offsets, lengths=lengths_t, jagged_dim=ragged_idx)
    if kind == "nested":
        flat = _tensor_ref(tensors, spec.get("buffer"))
        sizes = _tensor_ref(tensors, spec.get("sizes")).tolist()
        parts, start = [], 0
        for shape in sizes:
            count = math.prod(shape)
            parts.append(flat[start : start + count].view(shape))
            start += count
        return torch.nested.as_nested_tensor(parts, layout=torch.strided)
    raise CodecError(f"cache holds a tensor of unknown kind {kind!r}")


TAG = "__si__"
CODEC_VERSION = 1
#: Arrays/tensors inside non-tensor values up to this many elements are inlined in the JSON tree;
#: larger ones go to the tensor file (a tensor there costs an index entry and a view, JSON a parse per element).
INLINE_MAX_ELEMENTS = 1024
#: A column is stored as uniques + index when at most this fraction of its rows is unique.
DEDUP_MAX_UNIQUE_FRACTION = 0.75

_SCALARS = (str, int, float, bool, type(None), bytes)
_NUMPY_TENSOR_KINDS = "biufc"


def unsupported(path: str, value: Any, why: str = "") -> CodecError:
    """The error for a value at ``path`` that no codec can store."""
    kind = type(value)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return CodecError(f"cannot cache {path}: type {name} is not supported{why}")


class _Encoder:
    """One pass of :func:`to_jsonable`; remembers whether it emitted any tag (decode can then skip)."""

    def __init__(self, sink: TensorSink | None) -> None:
        self.sink = sink
        self.tagged = False

    def tag(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.tagged = True
        return {TAG: kind, **fields}

    def enc(self, value: Any, path: str) -> Any:
        kind = type(value)
        if kind is str or kind is int or kind is bool or kind is float or value is None:
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
        if (module == "torch" and kind.__name__ == "Tensor") or module.startswith("torch.nested"):
            return self.enc_tensor(value, path)
        raise unsupported(path, value)

    def enc_numpy(self, value: Any, path: str) -> Any:
        import numpy as np

        if isinstance(value, np.ndarray):
            return self.enc_array(value, path)
        if isinstance(value, np.generic) and value.dtype.kind in "biufUSc":
            return self.tag("np", dtype=value.dtype.str, v=_json_item(value.dtype.kind, value.item()))
        raise unsupported(path, value, f" (numpy dtype {getattr(value, 'dtype', '?')})")

    def enc_array(self, array: Any, path: str) -> Any:
        kind = array.dtype.kind
        if kind == "O":
            items = [self.enc(item, f"{path}[{i}]") for i, item in enumerate(array.reshape(-1))]
            return self.tag("ndo", shape=list(array.shape), v=items)
        if kind not in "US":
            if kind not in _NUMPY_TENSOR_KINDS or array.dtype.itemsize > 16:
                raise unsupported(path, array, f" (numpy dtype {array.dtype})")
            if self.sink is not None and (array.size > INLINE_MAX_ELEMENTS or kind == "c"):
                import numpy as np
                import torch

                native = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))
                return self.tag("ndt", dtype=array.dtype.str, ref=self.sink.add(torch.from_numpy(native), path))
        flat = array.reshape(-1).tolist()
        if kind in "cS":
            flat = [_json_item(kind, item) for item in flat]
        return self.tag("nd", dtype=array.dtype.str, shape=list(array.shape), v=flat)

    def enc_tensor(self, tensor: torch.Tensor, path: str) -> Any:
        dtype = _dtype_name(tensor.dtype)
        small = not tensor.is_nested and tensor.numel() <= INLINE_MAX_ELEMENTS and not tensor.is_complex()
        if self.sink is None or small:
            if not small or dtype not in TENSOR_DTYPES:
                raise unsupported(path, tensor, " here (large, nested or complex tensors need a tensor file)")
            flat = tensor.detach().cpu().reshape(-1).tolist()
            return self.tag("tensor", dtype=dtype, shape=list(tensor.shape), v=flat)
        return self.tag("tensorref", spec=encode_tensor(tensor, path, self.sink))


def to_jsonable(value: Any, field: str = "value", *, sink: TensorSink | None = None) -> Any:
    """Encode ``value`` as a tagged JSON tree (``field`` names it in errors): JSON's types, bytes, tuples,
    sets, dicts of any such keys, numpy scalars and arrays (object arrays too) and torch tensors; with a
    ``sink``, large arrays and tensors go to the tensor file, else they are inlined."""
    return _Encoder(sink).enc(value, field)


def from_jsonable(obj: Any, tensors: Mapping[str, torch.Tensor] | None = None) -> Any:
    """Inverse of :func:`to_jsonable`. ``obj`` is consumed (decoded in place where possible)."""
    kind = type(obj)
    if kind is dict and obj.get(TAG) is not None:
        return _decode_tagged(obj[TAG], obj, tensors or {})
    if kind is list or kind is dict:
        for key, item in enumerate(obj) if kind is list else obj.items():
            if type(item) is list or type(item) is dict:
                obj[key] = from_jsonable(item, tensors)
    return obj


def _decode_tagged(tag: Any, obj: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> Any:
    if tag == "dict":
        return {_hashable(from_jsonable(k, tensors)): from_jsonable(v, tensors) for k, v in obj["v"]}
    if tag in ("bytes", "bytearray"):
        return (bytes if tag == "bytes" else bytearray)(base64.b64decode(obj["v"]))
    if tag in ("tuple", "set", "frozenset"):
        items = from_jsonable(obj["v"], tensors)
        return tuple(items) if tag == "tuple" else (set if tag == "set" else frozenset)(map(_hashable, items))
    if tag in ("np", "nd", "ndo", "ndt"):
        return _decode_numpy(tag, obj, tensors)
    if tag == "tensor":
        import torch

        if obj["dtype"] not in TENSOR_DTYPES:
            raise CodecError(f"cache names an unknown tensor dtype {obj['dtype']!r}")
        return torch.tensor(obj["v"], dtype=getattr(torch, obj["dtype"])).reshape(obj["shape"])
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
        return dtype.type(_python_item(dtype.kind, obj["v"]))
    if tag == "ndt":
        if dtype.kind not in _NUMPY_TENSOR_KINDS:
            raise CodecError(f"cache names a numpy dtype {dtype.str!r} that the tensor file does not hold")
        array = _tensor_ref(tensors, obj["ref"]).numpy()
        return array if array.dtype == dtype else array.astype(dtype)
    flat = obj["v"]
    if dtype.kind in "US":
        _check_string_array(dtype, flat)
    if dtype.kind in "cS":
        flat = [_python_item(dtype.kind, item) for item in flat]
    return np.array(flat, dtype=dtype).reshape(obj["shape"])


def _json_item(kind: str, item: Any) -> Any:
    """A numpy item of dtype kind ``kind`` in JSON: complex numbers as ``[real, imag]``, bytes in base64."""
    if kind == "c":
        return [item.real, item.imag]
    return base64.b64encode(item).decode("ascii") if kind == "S" else item


def _python_item(kind: str, value: Any) -> Any:
    """Inverse of :func:`_json_item`."""
    if kind == "c":
        return complex(*value)
    return base64.b64decode(value) if kind == "S" else value


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
    column: dict[str, Any] = {TAG: "column", "n": len(items)}
    if uniques and len(uniques) <= DEDUP_MAX_UNIQUE_FRACTION * len(items):
        column.update(u=_encode_rows(encoder, uniques, first_rows, field), i=index)
    else:
        column["u"] = _encode_rows(encoder, items, range(len(items)), field)
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
            break
    if product != rows and shape:
        raise CodecError(f"cache column of {rows} rows claims the shape {shape[:8]}")
    return shape


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
        import numpy as np

        rows = decode_column(spec["column"], tensors)
        shape = tuple(check_shape(spec["shape"], len(rows)))
        # np.array() would turn lists of chat messages into a 2-D array; fromiter keeps one object per row.
        return np.fromiter(rows, dtype=object, count=len(rows)).reshape(shape)
    if kind == "array":
        return from_jsonable(spec["v"], tensors)
    raise CodecError(f"cache holds a non-tensor column of unknown kind {kind!r}")
