"""The default codecs: verl's DataProto (V0) and TensorDict results (V1 TransferQueue)."""

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
from skipinject.verl.rows import merge, take, with_rows
from skipinject.verl.tensordicts import decode_tensordict, encode_tensordict, gc_paused

#: verl's tensors that are two others side by side (last dimension): a rollout's ``input_ids`` is its
#: left-padded ``prompts`` then its right-padded ``responses``. The store stores only the parts when
#: that holds bit for bit (:attr:`Payload.concats`); a dense TensorDict's names, at any depth.
CONCATS = {"input_ids": ("prompts", "responses")}


def concats_of(spec: Mapping[str, Any], found: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """:data:`CONCATS` as the tensor file names of an encoded TensorDict ``spec`` (and its sub-TensorDicts)."""
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
    """verl ``DataProto``: ``batch`` TensorDict, ``non_tensor_batch`` numpy arrays, ``meta_info`` dict.

    Also a :class:`~skipinject.roles.RowCodec`: ``divisor(call)`` is the number of workers the target
    splits a batch into, to which a batch of some rows is padded (``None``: any size)."""

    name = "DataProto"

    def __init__(self, divisor: Callable[[Any], int] | None = None) -> None:
        self.divisor = divisor

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

        return results[0] if len(results) == 1 else DataProto.concat(list(results))

    # -- RowCodec (action=match)

    def input_rows(self, call: Any) -> int:
        return len(call.batch)

    def result_rows(self, result: Any) -> int:
        return len(result)

    def with_rows(self, call: Any, rows: Sequence[int]) -> tuple[tuple[Any, ...], dict[str, Any], int]:
        batch, padding = with_rows(call, rows, self.divisor)
        args, kwargs = call.with_batch(batch)
        return args, kwargs, padding

    def select_rows(self, result: Any, rows: Sequence[int]) -> Any:
        return take(result, rows)

    def merge_rows(self, pieces: Sequence[Any], order: Sequence[int], call: Any) -> Any:
        return merge(pieces, order, call)


class TensorDictCodec:
    """A ``tensordict.TensorDict`` (verl's V1 TransferQueue path), or a mapping holding TensorDicts (upstream's
    V1 dump, ``{"tensordict": td, "keys": [...], "global_steps": 3}``), other values as tagged JSON."""

    name = "TensorDict"

    def encode(self, result: Any) -> Payload:
        from tensordict import TensorDict

        # GC paused: collections over the batch's row objects cost more than the encode (16k rows: 815/345 ms)
        with gc_paused():
            sink = TensorSink()
            objects: dict[str, Any] = {"codec": self.name, "codec_version": CODEC_VERSION}
            if isinstance(result, TensorDict):
                objects["td"] = encode_tensordict(result, "result", sink)
                rows = objects["td"]["batch_size"][0] if objects["td"]["batch_size"] else None
            elif isinstance(result, Mapping):
                entries: dict[str, Any] = {}
                rows = None
                for key, value in result.items():
                    if not isinstance(key, str):
                        raise CodecError(f"cannot cache result key {key!r}: keys must be strings")
                    if isinstance(value, TensorDict):
                        entries[key] = {"td": encode_tensordict(value, f"result[{key!r}]", sink)}
                        if rows is None and len(value.batch_size):
                            rows = int(value.batch_size[0])
                    else:
                        entries[key] = {"v": to_jsonable(value, f"result[{key!r}]", sink=sink)}
                objects["mapping"] = entries
            else:
                raise CodecError(f"cannot cache a {type(result).__qualname__} with the TensorDict codec")
            concats: dict[str, tuple[str, str]] = {}
            for entry in [objects] if "td" in objects else objects["mapping"].values():
                if "td" in entry:
                    concats_of(entry["td"], concats)
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
    """The codec whose header (``objects["codec"]``) is ``header``: ``skipinject cache`` decodes a step
    of a role whose plugin is not installed with it when the step's header names it."""
    if header == DataProtoCodec.name:
        return DataProtoCodec()
    return TensorDictCodec() if header == TensorDictCodec.name else None


def is_tensordict(value: Any) -> bool:
    """Whether ``value`` is a TensorDict (told by its type's name: tensordict is not imported)."""
    return type(value).__name__ == "TensorDict"


def verl_fields(value: Any, prefix: str, flatten: Callable[[Any, str], dict[str, Any]]) -> dict[str, Any] | None:
    """A ``DataProto``'s or TensorDict's leaf fields by dotted name (``batch.responses``,
    ``non_tensor_batch.uid``, ``meta_info.global_steps``), nested values through ``flatten``; ``None``
    for any other value (``skipinject cache show``/``diff``)."""
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
