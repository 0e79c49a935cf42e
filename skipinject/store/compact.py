"""Exact compact encodings of a tensor file's tensors (used with compression on).

A rollout batch stores much that follows from the rest: verl's ``input_ids`` is ``prompts`` and
``responses`` side by side, the masks are one run of ones per row, the position ids a clamped ramp
per row, and token ids fit in 32 bits. At save time each tensor is checked, bit for bit, against
what its compact form rebuilds; only an exact match is stored compactly, anything else as it is:

* ``concat``: the tensor is two other stored tensors of the same dtype side by side (last dimension);
* ``run``: a 2-D tensor whose row ``b`` is 1 on ``[start_b, end_b)`` and 0 elsewhere;
* ``ramp``: a 2-D integer tensor whose row ``b`` is ``clamp(j - start_b, 0, top_b)``;
* ``narrow``: an integer tensor stored in the smallest dtype holding its values, restored to its
  own dtype on load.

Training sees the same dtypes, shapes and values. Rebuilt tensors are new memory, so a reader
bounds what it builds by the file's size (:data:`~skipinject.store.format.MAX_REBUILT_FACTOR`)
before allocating: a tiny forged index cannot make it build gigabytes. The writer keeps the same
bound (it stores tensors as they are rather than write a file no reader would accept).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from skipinject.store.format import MAX_REBUILT_FACTOR, MAX_REBUILT_SLACK

if TYPE_CHECKING:
    import torch

#: Integer dtypes a tensor may be narrowed to, smallest first (types every torch build converts).
_NARROW = ("uint8", "int8", "int16", "int32")
_INTEGERS = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})
_RANGES = {
    "uint8": (0, 255),
    "int8": (-128, 127),
    "int16": (-(1 << 15), (1 << 15) - 1),
    "int32": (-(1 << 31), (1 << 31) - 1),
}


@dataclass
class Plan:
    """How one tensor is stored: as it is (``stored`` set, maybe narrowed) or rebuilt (``derive``)."""

    name: str
    tensor: torch.Tensor
    stored: torch.Tensor | None = None
    stored_dtype: str | None = None
    derive: dict[str, Any] | None = field(default=None)


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _itemsize(dtype_name: str) -> int:
    import torch

    return int(torch.empty((), dtype=getattr(torch, dtype_name)).element_size())


def plan_tensors(tensors: Mapping[str, torch.Tensor]) -> list[Plan]:
    """The compact plan of every tensor (input order), each one checked to rebuild exactly."""
    plans = [Plan(name, tensor) for name, tensor in tensors.items()]
    for plan in plans:
        plan.derive = _run(plan.tensor) or _ramp(plan.tensor)
    for plan in plans:
        if plan.derive is None:
            plan.derive = _concat(plan, [p for p in plans if p is not plan and p.derive is None])
    for plan in plans:
        if plan.derive is None:
            plan.stored, plan.stored_dtype = _narrowed(plan.tensor)
    file_bytes = sum(p.stored.numel() * p.stored.element_size() for p in plans if p.stored is not None)
    if rebuilt_bytes(plans) > rebuilt_limit(file_bytes):
        for plan in plans:  # beyond what a reader accepts: everything as it is
            plan.derive, plan.stored, plan.stored_dtype = None, plan.tensor, None
    for plan in plans:
        if plan.derive is None and plan.stored is None:
            plan.stored = plan.tensor
    return plans


def rebuilt_limit(file_bytes: int) -> int:
    """The most bytes a reader builds (rebuilt and widened tensors) for a file of ``file_bytes``."""
    return MAX_REBUILT_FACTOR * file_bytes + MAX_REBUILT_SLACK


def rebuilt_bytes(plans: list[Plan]) -> int:
    return sum(
        p.tensor.numel() * p.tensor.element_size() for p in plans if p.derive is not None or p.stored_dtype is not None
    )


def _narrowed(tensor: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    dtype = _name(tensor.dtype)
    if dtype not in _INTEGERS or tensor.numel() == 0 or dtype in ("uint8", "int8"):
        return tensor, None
    low, high = int(tensor.min()), int(tensor.max())
    size = tensor.element_size()
    for target in _NARROW:
        lo, hi = _RANGES[target]
        if lo <= low and high <= hi and _itemsize(target) < size:
            import torch

            return tensor.to(getattr(torch, target)), target
    return tensor, None


def _rows_of(tensor: torch.Tensor) -> bool:
    return bool(tensor.dim() == 2 and tensor.shape[0] > 0 and tensor.shape[1] > 0)


def _run(tensor: torch.Tensor) -> dict[str, Any] | None:
    """``{"run": starts, "end": ends}`` if every row is one run of ones (and zeros elsewhere)."""
    import torch

    if not _rows_of(tensor) or tensor.is_complex():
        return None
    ones = tensor != 0
    starts = ones.to(torch.uint8).argmax(dim=1)
    ends = starts + ones.sum(dim=1)
    spec = {"run": starts.tolist(), "end": ends.tolist()}
    return spec if torch.equal(rebuild_run(spec, tensor.shape, tensor.dtype), tensor) else None


def rebuild_run(spec: Mapping[str, Any], shape: Any, dtype: Any) -> torch.Tensor:
    import torch

    columns = torch.arange(shape[1])
    starts = torch.tensor(spec["run"], dtype=torch.int64)[:, None]
    ends = torch.tensor(spec["end"], dtype=torch.int64)[:, None]
    return ((columns >= starts) & (columns < ends)).to(dtype)


def _ramp(tensor: torch.Tensor) -> dict[str, Any] | None:
    """``{"ramp": starts, "top": tops}`` if row ``b`` is ``clamp(j - start_b, 0, top_b)`` (position ids)."""
    import torch

    if not _rows_of(tensor) or _name(tensor.dtype) not in _INTEGERS or _name(tensor.dtype).startswith("uint"):
        return None
    positive = tensor > 0
    first = positive.to(torch.uint8).argmax(dim=1)
    at_first = tensor.gather(1, first[:, None])[:, 0].to(torch.int64)
    starts = torch.where(positive.any(dim=1), first - at_first, torch.zeros_like(first))
    tops = tensor.max(dim=1).values.to(torch.int64)
    spec = {"ramp": starts.tolist(), "top": tops.tolist()}
    return spec if torch.equal(rebuild_ramp(spec, tensor.shape, tensor.dtype), tensor) else None


def rebuild_ramp(spec: Mapping[str, Any], shape: Any, dtype: Any) -> torch.Tensor:
    import torch

    columns = torch.arange(shape[1])
    starts = torch.tensor(spec["ramp"], dtype=torch.int64)[:, None]
    tops = torch.tensor(spec["top"], dtype=torch.int64)[:, None]
    return torch.minimum((columns - starts).clamp_(min=0), tops).to(dtype)


def _concat(plan: Plan, candidates: list[Plan]) -> dict[str, Any] | None:
    """``{"concat": [a, b]}`` if the tensor is stored tensors ``a`` and ``b`` side by side (last dim)."""
    import torch

    tensor = plan.tensor
    if tensor.dim() < 2:
        return None
    lead, width = tuple(tensor.shape[:-1]), tensor.shape[-1]
    fits = [c for c in candidates if c.tensor.dtype == tensor.dtype and tuple(c.tensor.shape[:-1]) == lead]
    for left in fits:
        split = left.tensor.shape[-1]
        if not 0 < split < width:
            continue
        for right in fits:
            if right is left or right.tensor.shape[-1] != width - split:
                continue
            if torch.equal(tensor[..., :split], left.tensor) and torch.equal(tensor[..., split:], right.tensor):
                return {"concat": [left.name, right.name]}
    return None


def check_rebuilt(entries: list[Mapping[str, Any]], file_bytes: int) -> None:
    """Refuse (ValueError) an index whose rebuilt tensors would be larger than the file allows."""
    from skipinject.store.tensorfile import TENSOR_DTYPES

    total = 0
    for entry in entries:
        if "derive" in entry or "stored_dtype" in entry:
            if entry["dtype"] not in TENSOR_DTYPES or type(entry["shape"]) is not list:
                raise ValueError(f"bad dtype or shape for {str(entry['name'])[:80]!r}")
            total += math.prod(entry["shape"]) * _itemsize(entry["dtype"])
    if total > rebuilt_limit(file_bytes):
        raise ValueError(f"its index rebuilds {total} bytes from a {file_bytes}-byte file")


def rebuild(entry: Mapping[str, Any], stored: Mapping[str, torch.Tensor], dtype: Any) -> torch.Tensor:
    """The tensor a ``derive`` entry describes (``stored``: the tensors the file holds, already restored)."""
    import torch

    derive, shape = entry["derive"], entry["shape"]
    if type(derive) is not dict:
        raise ValueError("a derived tensor without a recipe")
    if "concat" in derive:
        parts = derive["concat"]
        if type(parts) is not list or len(parts) != 2 or not all(type(p) is str and p in stored for p in parts):
            raise ValueError("a concatenation of tensors the file does not hold")
        left, right = stored[parts[0]], stored[parts[1]]
        if left.dtype != dtype or right.dtype != dtype:
            raise ValueError("a concatenation of tensors of another dtype")
        out = torch.cat([left, right], dim=-1)
        if list(out.shape) != shape:
            raise ValueError(f"a concatenation of shape {list(out.shape)}, the index says {shape}")
        return out
    keys = ("run", "end") if "run" in derive else ("ramp", "top") if "ramp" in derive else None
    if keys is None or len(shape) != 2:
        raise ValueError("an unknown recipe")
    for key in keys:
        values = derive.get(key)
        if type(values) is not list or len(values) != shape[0] or not all(type(v) is int for v in values):
            raise ValueError(f"a recipe whose {key!r} does not hold one integer per row")
    return (rebuild_run if keys[0] == "run" else rebuild_ramp)(derive, shape, dtype)
