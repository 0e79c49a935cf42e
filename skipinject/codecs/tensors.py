"""Plain tensors of a payload: named once each in the tensor file, referenced from the JSON tree."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from skipinject.errors import CodecError
from skipinject.payload import TENSOR_DTYPES

if TYPE_CHECKING:
    import torch


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
