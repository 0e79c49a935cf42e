"""The default codecs: verl's DataProto (V0) and TensorDict results (V1 TransferQueue).

A V0 batch is either verl's classic ``verl.protocol.DataProto`` (a TensorDict and dicts) or, on verl's
``neo`` data plane (``trainer.data_plane=neoproto``), a NeoProto (``verl.experimental.neoproto``): a
subclass of it whose columns are references into a storage engine (Ray's object store) behind an index
view, read through proxies. Both are recorded in one format: a NeoProto is materialised into the classic
form first (:func:`classic_dataproto`). A served batch is rebuilt as a classic one, which the role's
hooks and the row operations work on, and handed to the trainer as its own class (:meth:`DataProtoCodec.served`),
so that its ``union``, ``repeat`` and every later use meet what a generated batch would be."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from skipinject.codecs import (
    CODEC_VERSION,
    TensorSink,
    decode_array_column,
    encode_array_column,
    from_jsonable,
    to_jsonable,
)
from skipinject.errors import CodecError
from skipinject.payload import Payload
from skipinject.verl.tensordicts import decode_tensordict, encode_tensordict, gc_paused

#: verl's tensors that are two others side by side (last dimension): ``input_ids`` is the left-padded
#: ``prompts`` then the right-padded ``responses``; the store stores only the parts when that holds bit for bit.
CONCATS = {"input_ids": ("prompts", "responses")}


def concats_of(spec: Mapping[str, Any], found: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """:data:`CONCATS` as tensor file names of an encoded TensorDict ``spec``, at any depth."""
    fields = spec["fields"]
    for name, parts in CONCATS.items():
        entries = [fields.get(key, {}) for key in (name, *parts)]
        if all(entry.get("k") == "dense" for entry in entries):
            found[entries[0]["ref"]] = (entries[1]["ref"], entries[2]["ref"])
    for entry in fields.values():
        if entry.get("k") == "td":
            concats_of(entry["td"], found)
    return found


def _header(objects: Mapping[str, Any], codec: str) -> None:
    if objects.get("codec") != codec:
        raise CodecError(f"cache was written by codec {objects.get('codec')!r}, expected {codec!r}")
    if objects.get("codec_version") != CODEC_VERSION:
        raise CodecError(
            f"cache was written with {codec} codec version {objects.get('codec_version')!r}, "
            f"this skipinject reads version {CODEC_VERSION}"
        )


class DataProtoCodec:
    """verl ``DataProto``, also a :class:`~skipinject.roles.RowCodec`: ``divisor(call)``, the number of workers
    the target splits a batch into, to which a batch of some rows is padded (``None``: any size)."""

    name = "DataProto"

    def __init__(self, divisor: Callable[[Any], int] | None = None) -> None:
        self.divisor = divisor

    def encode(self, result: Any) -> Payload:
        sink = TensorSink()
        non_tensor = getattr(result, "non_tensor_batch", None)
        if not isinstance(non_tensor, Mapping) and is_neoproto(result):
            result = classic_dataproto(result)  # its columns read once from their storage
            non_tensor = result.non_tensor_batch
        batch = getattr(result, "batch", None)
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
        concats = {} if objects["batch"] is None else concats_of(objects["batch"], {})
        return Payload(tensors=sink.tensors, objects=objects, rows=len(result), concats=concats)

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

        return results[0] if len(results) == 1 else DataProto.concat([classic_dataproto(r) for r in results])

    def served(self, result: Any, call: Any) -> Any:
        """``result`` as the class of the batch ``call`` received, when that is another DataProto class (verl's
        NeoProto): built by that class's ``from_dict`` from the columns (a NeoProto puts them into its storage
        engine; not its constructor, which sizes a 2-D tensor's rows by its width and drops the rows beyond
        it). A classic batch for a classic call is returned as it is."""
        target = trainer_class(call)
        if target is None or type(result) is target or not _is_classic(result):
            return result
        tensors = {} if result.batch is None else {key: result.batch[key] for key in result.batch.keys()}
        return target.from_dict(
            tensors=tensors, non_tensors=dict(result.non_tensor_batch), meta_info=dict(result.meta_info)
        )

    # -- RowCodec (action=match)

    def input_rows(self, call: Any) -> int:
        return len(call.batch)

    def result_rows(self, result: Any) -> int:
        return len(result)

    def with_rows(self, call: Any, rows: Sequence[int]) -> tuple[tuple[Any, ...], dict[str, Any], int]:
        """The call with only ``rows`` of its batch, padded like verl pads a batch to its workers
        (``pad_dataproto_to_divisor``: the first rows repeated)."""
        batch, padding = self.select_rows(call.batch, rows), 0
        size = 1 if self.divisor is None else int(self.divisor(call))
        if size > 1 and len(batch) % size:
            from verl.protocol import pad_dataproto_to_divisor

            batch, padding = pad_dataproto_to_divisor(batch, size)
        args, kwargs = call.with_batch(self.served(batch, call))
        return args, kwargs, int(padding)

    def select_rows(self, result: Any, rows: Sequence[int]) -> Any:
        """A new DataProto holding ``rows`` of ``result`` in that order (copies; ``meta_info`` copied)."""
        import numpy as np
        import torch
        from verl.protocol import DataProto

        result = classic_dataproto(result)
        index = np.asarray(list(rows), dtype=np.int64)
        batch = None if result.batch is None else result.batch[torch.from_numpy(index)]
        non_tensor = {key: value[index] for key, value in result.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(result.meta_info))

    def merge_rows(self, pieces: Sequence[Any], order: Sequence[int], call: Any) -> Any:
        """The call's own per-row inputs (``uid`` and the other non-tensor columns it passes in) replace the
        recorded ones, repeated when the target returns several rows per input; ``meta_info`` is the first
        piece's, with this call's values for the keys its batch carries (its step). Rows of one key have one
        width (the padded lengths are in the key): pieces differing in columns, dtypes or widths are a
        :class:`CodecError` (the call runs whole), never padded."""
        import numpy as np
        import torch
        from verl.protocol import DataProto

        if not pieces:
            raise CodecError("nothing to merge")
        pieces = [classic_dataproto(piece) for piece in pieces]
        _check_alike(pieces)
        index = np.asarray(list(order), dtype=np.int64)
        batch = None
        if pieces[0].batch is not None:
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


def is_neoproto(value: Any) -> bool:
    """Whether ``value`` is a batch of verl's NeoProto data plane: columns referenced through an index view
    (``dim0_index``), read by ``materialize`` (told by its attributes: verl is not imported)."""
    return hasattr(value, "dim0_index") and callable(getattr(value, "materialize", None))


def _is_classic(value: Any) -> bool:
    return isinstance(getattr(value, "non_tensor_batch", None), dict) and not is_neoproto(value)


def trainer_class(call: Any) -> type[Any] | None:
    """The DataProto class the call's batch is (verl's NeoProto on its data plane), else ``None``."""
    batch = getattr(call, "batch", None) if call is not None else None
    if batch is None or not hasattr(batch, "non_tensor_batch") or not callable(getattr(batch, "from_dict", None)):
        return None
    return type(batch)


def classic_dataproto(value: Any) -> Any:
    """``value`` as a classic ``verl.protocol.DataProto``: a NeoProto's columns are read from their storage
    (every referenced tensor and array materialised, in the view's row order; ``value`` keeps no copy);
    a classic one is returned as it is."""
    if not is_neoproto(value):
        return value
    import numpy as np
    from tensordict import TensorDict
    from verl.protocol import DataProto

    tensor_keys = list(value.batch.keys())
    non_tensor_keys = list(value.non_tensor_batch.keys())
    columns = value.materialize(keys=tensor_keys + non_tensor_keys) if tensor_keys or non_tensor_keys else {}
    rows = len(value)
    non_tensor: dict[str, Any] = {}
    for key in non_tensor_keys:
        column = columns[key]
        if not isinstance(column, np.ndarray):  # a list of row objects
            array = np.empty(len(column), dtype=object)
            array[:] = list(column)
            column = array
        non_tensor[key] = column
    batch = TensorDict({key: columns[key] for key in tensor_keys}, batch_size=[rows]) if tensor_keys else None
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(value.meta_info))


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


class TensorDictCodec:
    """A ``TensorDict`` (verl's V1 TransferQueue path), or a mapping holding TensorDicts (upstream's V1 dump,
    ``{"tensordict": td, "keys": [...], "global_steps": 3}``), other values as tagged JSON."""

    name = "TensorDict"

    def encode(self, result: Any) -> Payload:
        from tensordict import TensorDict

        # GC paused: collections over the batch's row objects cost more than the encode (16k rows: 815/345 ms)
        with gc_paused():
            sink = TensorSink()
            objects: dict[str, Any] = {"codec": self.name, "codec_version": CODEC_VERSION}
            concats: dict[str, tuple[str, str]] = {}
            if isinstance(result, TensorDict):
                objects["td"] = encode_tensordict(result, "result", sink)
                concats_of(objects["td"], concats)
                rows = objects["td"]["batch_size"][0] if objects["td"]["batch_size"] else None
            elif isinstance(result, Mapping):
                entries: dict[str, Any] = {}
                rows = None
                for key, value in result.items():
                    if not isinstance(key, str):
                        raise CodecError(f"cannot cache result key {key!r}: keys must be strings")
                    if isinstance(value, TensorDict):
                        entries[key] = {"td": encode_tensordict(value, f"result[{key!r}]", sink)}
                        concats_of(entries[key]["td"], concats)
                        if rows is None and len(value.batch_size):
                            rows = int(value.batch_size[0])
                    else:
                        entries[key] = {"v": to_jsonable(value, f"result[{key!r}]", sink=sink)}
                objects["mapping"] = entries
            else:
                raise CodecError(f"cannot cache a {type(result).__qualname__} with the TensorDict codec")
            return Payload(tensors=sink.tensors, objects=objects, rows=rows, concats=concats)

    def decode(self, payload: Payload, call: Any = None) -> Any:
        objects = payload.objects
        _header(objects, self.name)
        tensors = payload.tensors
        # One GC pause over the whole decode: between columns, collections over the tens of thousands of
        # fresh row objects cost more than building them (16k rows: 1.39 s with, 0.47 s without).
        with gc_paused():
            if "td" in objects:
                return decode_tensordict(objects["td"], tensors)
            return {
                key: decode_tensordict(entry["td"], tensors) if "td" in entry else from_jsonable(entry["v"], tensors)
                for key, entry in objects["mapping"].items()
            }

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


def codec_named(header: object) -> DataProtoCodec | TensorDictCodec | None:
    """The codec whose ``objects["codec"]`` is ``header`` (``skipinject cache`` without the role's plugin)."""
    if header == DataProtoCodec.name:
        return DataProtoCodec()
    return TensorDictCodec() if header == TensorDictCodec.name else None


def is_tensordict(value: Any) -> bool:
    """Whether ``value`` is a TensorDict (told by its type's name: tensordict is not imported)."""
    return type(value).__name__ == "TensorDict"


def verl_fields(value: Any, prefix: str, flatten: Callable[[Any, str], dict[str, Any]]) -> dict[str, Any] | None:
    """A ``DataProto``'s or TensorDict's leaf fields by dotted name (``batch.responses``, ``meta_info.global_steps``),
    nested values through ``flatten``; ``None`` for any other value (``skipinject cache show``/``diff``)."""
    out: dict[str, Any] = {}
    kind = type(value).__name__
    if hasattr(value, "non_tensor_batch") and hasattr(value, "meta_info") and hasattr(value, "batch"):
        if value.batch is not None:
            out.update(flatten(value.batch, f"{prefix}batch."))
        for key, column in value.non_tensor_batch.items():
            out[f"{prefix}non_tensor_batch.{key}"] = column
        for key, item in dict(value.meta_info).items():
            out[f"{prefix}meta_info.{key}"] = item
        return out
    if is_tensordict(value):
        for key in value.keys():
            out.update(flatten(value.get(key), f"{prefix}{key}."))
        return out
    if kind == "NonTensorStack":
        return {prefix.rstrip("."): value.tolist()}
    if kind == "NonTensorData":
        return {prefix.rstrip("."): value.data}
    return None
