"""How a target's result becomes a store :class:`~skipinject.store.Payload` and back, without pickle.

A payload is plain tensors (the store's raw tensor file, mapped copy-on-write when loaded) plus a
JSON tree. Everything that is not a plain tensor goes into the tree with explicit tags, so loading a
cache can only ever build the types listed here; anything else is refused with a :class:`CodecError`
naming the field when the cache is *written*, never guessed at when it is read.

Tagged JSON (see :func:`to_jsonable`): JSON-native values stay as they are; everything else is a
dict ``{"__si__": kind, ...}``. A plain dict that happens to use the key ``"__si__"`` is itself
tagged, so the encoding is unambiguous.

Per-row columns (``non_tensor_batch`` arrays, ``NonTensorStack``) are stored as unique values plus
an index list when rows repeat: GRPO repeats every prompt ``n`` times, and ``np.repeat`` /
``DataProto.repeat`` repeat the *same* object, so deduplicating by identity (and by value for
immutable scalars) shrinks the tree ~n-fold and decodes to the same sharing the original had.

Nothing here imports torch, numpy, verl or tensordict at module level: ``import skipinject``
happens in every process verl starts and must stay cheap.
"""

from __future__ import annotations

import base64
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from skipinject.errors import CodecError
from skipinject.store import TENSOR_DTYPES, Payload

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("skipinject")

TAG = "__si__"
CODEC_VERSION = 1
#: Arrays/tensors inside non-tensor values up to this many elements are inlined in the JSON tree;
#: larger ones go to the tensor file (a tensor there costs an index entry and a view, JSON a parse per element).
INLINE_MAX_ELEMENTS = 1024
#: A column is stored as uniques + index when at most this fraction of its rows is unique.
DEDUP_MAX_UNIQUE_FRACTION = 0.75

_SCALARS = (str, int, float, bool, type(None), bytes)
_NUMPY_TENSOR_KINDS = "biufc"


# ---------------------------------------------------------------- tensors


class TensorSink:
    """Collects the tensors of one payload under unique names (``"<n>:<label>"``).

    Contiguous CPU tensors are kept as they are (no copy; the store writes only their own bytes,
    even for views). The same tensor object added twice is stored once and decodes to one tensor
    again: aliasing survives, and jagged tensors that shared ``offsets`` keep sharing their ragged
    dimension (so ``responses * response_mask`` still works after a load).
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._seen: dict[int, tuple[torch.Tensor, str]] = {}

    def add(self, tensor: torch.Tensor, label: str) -> str:
        known = self._seen.get(id(tensor))
        if known is not None and known[0] is tensor:
            return known[1]
        name = f"{len(self.tensors)}:{label}"
        value = tensor.detach()
        if value.device.type != "cpu":
            value = value.cpu()
        self.tensors[name] = value.contiguous()
        self._seen[id(tensor)] = (tensor, name)
        return name


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in TENSOR_DTYPES:
        raise CodecError(f"cache names an unknown tensor dtype {name!r}")
    return getattr(torch, name)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_ref(tensors: Mapping[str, torch.Tensor], name: Any) -> torch.Tensor:
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


def decode_tensor(spec: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`encode_tensor`. Dense tensors come back as the loaded (memory-mapped) tensor."""
    import torch

    kind = spec.get("k")
    if kind == "dense":
        return _tensor_ref(tensors, spec.get("ref"))
    if kind == "jagged":
        lengths = spec.get("lengths")
        return torch.nested.nested_tensor_from_jagged(
            _tensor_ref(tensors, spec.get("values")),
            offsets=_tensor_ref(tensors, spec.get("offsets")),
            lengths=None if lengths is None else _tensor_ref(tensors, lengths),
            jagged_dim=int(spec.get("ragged_idx", 1)),
        )
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
        array = _tensor_ref(tensors, obj["ref"]).numpy()
        return array if array.dtype == dtype else array.astype(dtype)
    flat = obj["v"]
    if dtype.kind == "c":
        flat = [complex(re, im) for re, im in flat]
    elif dtype.kind == "S":
        flat = [base64.b64decode(item) for item in flat]
    return np.array(flat, dtype=dtype).reshape(obj["shape"])


def _numpy_dtype(text: Any) -> Any:
    import numpy as np

    try:
        dtype = np.dtype(text)
    except TypeError as exc:
        raise CodecError(f"cache names an unknown numpy dtype {text!r}") from exc
    if dtype.kind not in _NUMPY_TENSOR_KINDS + "US":
        raise CodecError(f"cache names an unsupported numpy dtype {text!r}")
    return dtype


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
        values = [encoder.enc(item, f"{field}[{row}]") for item, row in zip(uniques, first_rows, strict=True)]
        column: dict[str, Any] = {TAG: "column", "n": len(items), "u": values, "i": index}
    else:
        values = [encoder.enc(item, f"{field}[{i}]") for i, item in enumerate(items)]
        column = {TAG: "column", "n": len(items), "u": values}
    column["plain"] = not encoder.tagged
    return column


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
        return _object_array(decode_column(spec["column"], tensors), spec["shape"])
    if kind == "array":
        return from_jsonable(spec["v"], tensors)
    raise CodecError(f"cache holds a non-tensor column of unknown kind {kind!r}")


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
            source[key] = _build_stack(decode_column(field["column"], tensors), field["shape"])
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


# ---------------------------------------------------------------- codecs


def _header(objects: Mapping[str, Any], codec: str) -> None:
    if objects.get("codec") != codec:
        raise CodecError(f"cache was written by codec {objects.get('codec')!r}, expected {codec!r}")
    if objects.get("codec_version") != CODEC_VERSION:
        raise CodecError(
            f"cache was written with {codec} codec version {objects.get('codec_version')!r}, "
            f"this skipinject reads version {CODEC_VERSION}"
        )


class DataProtoCodec:
    """verl ``DataProto``: ``batch`` TensorDict, ``non_tensor_batch`` numpy arrays, ``meta_info`` dict."""

    name = "DataProto"

    def encode(self, result: Any) -> Payload:
        sink = TensorSink()
        batch = getattr(result, "batch", None)
        non_tensor = getattr(result, "non_tensor_batch", None)
        meta_info = getattr(result, "meta_info", None)
        if not isinstance(non_tensor, Mapping) or not isinstance(meta_info, Mapping):
            raise CodecError(f"cannot cache a {type(result).__qualname__} with the DataProto codec")
        objects = {
            "codec": self.name,
            "codec_version": CODEC_VERSION,
            "batch": None if batch is None else encode_tensordict(batch, "batch", sink),
            "non_tensor_batch": {
                key: encode_array_column(value, f"non_tensor_batch[{key!r}]", sink) for key, value in non_tensor.items()
            },
            "meta_info": to_jsonable(dict(meta_info), "meta_info", sink=sink),
        }
        return Payload(tensors=sink.tensors, objects=objects, rows=len(result))

    def decode(self, payload: Payload, call: Any = None) -> Any:
        """Rebuild the DataProto; tensors stay the loaded (copy-on-write mapped) ones."""
        from verl.protocol import DataProto

        objects = payload.objects
        _header(objects, self.name)
        tensors = payload.tensors
        batch = objects.get("batch")
        return DataProto(
            batch=None if batch is None else decode_tensordict(batch, tensors),
            non_tensor_batch={
                key: decode_array_column(spec, tensors) for key, spec in objects["non_tensor_batch"].items()
            },
            meta_info=from_jsonable(objects["meta_info"], tensors),
        )

    def merge(self, results: Sequence[Any]) -> Any:
        """Several parts of one step as one batch."""
        from verl.protocol import DataProto

        return results[0] if len(results) == 1 else DataProto.concat(list(results))


class TensorDictCodec:
    """A ``tensordict.TensorDict`` (verl's V1 TransferQueue path), or a mapping holding TensorDicts.

    The mapping form matches upstream's V1 dump (``{"tensordict": td, "keys": [...], "tags": [...],
    "global_steps": 3}``): TensorDict values are encoded as such, every other value as tagged JSON,
    and decoding gives back a dict of the same shape.
    """

    name = "TensorDict"

    def encode(self, result: Any) -> Payload:
        from tensordict import TensorDict

        sink = TensorSink()
        objects: dict[str, Any] = {"codec": self.name, "codec_version": CODEC_VERSION}
        if isinstance(result, TensorDict):
            objects["td"] = encode_tensordict(result, "result", sink)
            rows = _rows(result)
        elif isinstance(result, Mapping):
            entries: dict[str, Any] = {}
            rows = None
            for key, value in result.items():
                if not isinstance(key, str):
                    raise CodecError(f"cannot cache result key {key!r}: keys must be strings")
                if isinstance(value, TensorDict):
                    entries[key] = {"td": encode_tensordict(value, f"result[{key!r}]", sink)}
                    rows = _rows(value) if rows is None else rows
                else:
                    entries[key] = {"v": to_jsonable(value, f"result[{key!r}]", sink=sink)}
            objects["mapping"] = entries
        else:
            raise CodecError(f"cannot cache a {type(result).__qualname__} with the TensorDict codec")
        return Payload(tensors=sink.tensors, objects=objects, rows=rows)

    def decode(self, payload: Payload, call: Any = None) -> Any:
        objects = payload.objects
        _header(objects, self.name)
        tensors = payload.tensors
        if "td" in objects:
            return decode_tensordict(objects["td"], tensors)
        out = {}
        for key, entry in objects["mapping"].items():
            out[key] = decode_tensordict(entry["td"], tensors) if "td" in entry else from_jsonable(entry["v"], tensors)
        return out

    def merge(self, results: Sequence[Any]) -> Any:
        """Several parts (``parameter_sync_step > 1``) as one: TensorDicts concatenated (jagged fields
        too), lists in a mapping extended, other mapping values taken from the first part."""
        from tensordict import TensorDict
        from verl.utils.tensordict_utils import concat_tensordict

        if len(results) == 1:
            return results[0]
        if all(isinstance(r, TensorDict) for r in results):
            return concat_tensordict(list(results))
        merged = dict(results[0])
        for key, first in results[0].items():
            values = [r[key] for r in results]
            if isinstance(first, TensorDict):
                merged[key] = concat_tensordict(values)
            elif isinstance(first, list):
                merged[key] = [item for value in values for item in value]
        return merged


def _rows(td: Any) -> int | None:
    return int(td.batch_size[0]) if len(td.batch_size) else None


CODECS: dict[str, Callable[[], Any]] = {DataProtoCodec.name: DataProtoCodec, TensorDictCodec.name: TensorDictCodec}
