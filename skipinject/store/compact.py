"""Exact compact encodings of a tensor file's tensors (with compression on), checked bit for bit at save.

``concat``: two stored tensors side by side (the codec names which: :attr:`~skipinject.payload.Payload.concats`);
``run``: a 2-D mask, one run of ones per row; ``ramp``: 2-D position ids ``clamp(j - start_b, 0, top_b)``;
``narrow``: an integer tensor in the smallest dtype holding its values. A reader bounds what it rebuilds by
its part's budget before allocating and checks every recipe whole against its shape and dtype."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from skipinject.store.format import MAX_WIDTH, TENSOR_DTYPES

if TYPE_CHECKING:
    import torch

#: Integer dtypes a tensor may be narrowed to, smallest first (types every torch build converts).
NARROW = ("uint8", "int8", "int16", "int32")
INTEGERS = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})


@dataclass
class Plan:
    """How one tensor is stored: as it is (``stored`` set, maybe narrowed) or rebuilt (``derive``)."""

    name: str
    tensor: torch.Tensor
    stored: torch.Tensor | None = None
    stored_dtype: str | None = None
    derive: dict[str, Any] | None = field(default=None)


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def itemsize(name: str) -> int:
    import torch

    return int(getattr(torch, name).itemsize)


def narrows(stored: str, dtype: str) -> bool:
    """``stored`` is a smaller integer dtype a tensor of ``dtype`` may have been narrowed to."""
    return stored in NARROW and dtype in INTEGERS and itemsize(stored) < itemsize(dtype)


def plan_tensors(tensors: Mapping[str, torch.Tensor], concats: Mapping[str, tuple[str, str]]) -> list[Plan]:
    """The compact plan of every tensor (input order), each checked to rebuild exactly."""
    plans = [Plan(name, tensor) for name, tensor in tensors.items()]
    for plan in plans:
        plan.derive = _derived(plan.tensor)
    named = {plan.name: plan for plan in plans}
    for plan in plans:
        left, right = (named.get(part) for part in concats.get(plan.name, ("", "")))
        if plan.derive is None and left is not None and right is not None:
            plan.derive = _concat(plan, left, right)
    for plan in plans:
        if plan.derive is None:
            plan.stored, plan.stored_dtype = _narrowed(plan.tensor)
    return plans


def _narrowed(tensor: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    dtype = dtype_name(tensor.dtype)
    if dtype not in INTEGERS or tensor.numel() == 0 or dtype in ("uint8", "int8"):
        return tensor, None
    import numpy as np

    values = tensor.numpy()
    low, high = int(values.min()), int(values.max())
    size = tensor.element_size()
    for target in NARROW:
        limits = np.iinfo(target)
        if limits.min <= low and high <= limits.max and itemsize(target) < size:
            import torch

            return torch.from_numpy(values.astype(target)), target
    return tensor, None


_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _bits(tensor: torch.Tensor) -> Any:
    """The tensor's bytes as integers of its shape (bit-for-bit comparison), or None for complex tensors."""
    import torch

    if tensor.is_complex():
        return None
    return tensor.view(getattr(torch, _BITS[tensor.element_size()])).numpy()


def _derived(tensor: torch.Tensor) -> dict[str, Any] | None:
    """A run (``{"run": starts, "end": ends}``: each row one run of ones) or a ramp (``{"ramp": starts, "top": tops}``:
    row ``b`` is ``clamp(j - start_b, 0, top_b)``, position ids) that rebuilds the tensor bit for bit, or None."""
    if not (tensor.dim() == 2 and tensor.shape[0] > 0 and 0 < tensor.shape[1] <= MAX_WIDTH) or tensor.is_complex():
        return None
    dtype = dtype_name(tensor.dtype)
    kinds = [] if dtype == "bfloat16" else ["run"]
    kinds += ["ramp"] if dtype in INTEGERS and not dtype.startswith("uint") else []
    for kind in kinds:  # row 0 first: it tells most tensors apart at once
        if _spec(kind, tensor[:1]) is not None and (spec := _spec(kind, tensor)) is not None:
            return spec
    return None


def _spec(kind: str, tensor: torch.Tensor) -> dict[str, Any] | None:
    import numpy as np
    import torch

    values = tensor.numpy()
    marked = values != 0 if kind == "run" else values > 0
    first = marked.argmax(axis=1)
    rows = np.arange(len(values))
    if kind == "run":
        starts = np.where(marked[rows, first], first, 0)
        spec = {"run": starts.tolist(), "end": (starts + marked.sum(axis=1)).tolist()}
    else:
        starts = np.where(marked[rows, first], first - values[rows, first].astype(np.int64), 0)
        spec = {"ramp": starts.tolist(), "top": values.max(axis=1).astype(np.int64).tolist()}
    try:
        recipe = Recipe.of({"derive": spec, "shape": list(tensor.shape)}, {}, tensor.dtype)
    except ValueError:  # no recipe a reader accepts (a row of negative values)
        return None
    rebuilt = torch.zeros(tensor.shape, dtype=tensor.dtype)
    for block in recipe.blocks():
        recipe.write(rebuilt, block, zeroed=True)  # as a hit writes it: into fresh (zero) memory
    return spec if np.array_equal(_bits(rebuilt), _bits(tensor)) else None


def _concat(plan: Plan, left: Plan, right: Plan) -> dict[str, Any] | None:
    """``{"concat": [left, right]}`` if the tensor is the stored tensors ``left`` and ``right`` side by side."""
    import numpy as np

    tensor, parts = plan.tensor, (left.tensor, right.tensor)
    if tensor.dim() < 2 or tensor.is_complex() or any(p.derive is not None or p is plan for p in (left, right)):
        return None
    split, width = parts[0].shape[-1], tensor.shape[-1]
    if left is right or not 0 < split < width or parts[1].shape[-1] != width - split:
        return None
    if any(p.dtype != tensor.dtype or p.shape[:-1] != tensor.shape[:-1] for p in parts):
        return None
    bits = _bits(tensor)
    if np.array_equal(bits[..., :split], _bits(parts[0])) and np.array_equal(bits[..., split:], _bits(parts[1])):
        return {"concat": [left.name, right.name]}
    return None


def check_rebuilt(entries: list[Mapping[str, Any]], budget: int) -> None:
    """Refuse (ValueError) an index whose rebuilt and widened tensors would take more than ``budget``."""
    total = 0
    for entry in entries:
        if "derive" in entry or "stored_dtype" in entry:
            shape = entry["shape"]
            if entry["dtype"] not in TENSOR_DTYPES or type(shape) is not list or not all(type(d) is int for d in shape):
                raise ValueError(f"bad dtype or shape for {str(entry['name'])[:80]!r}")
            total += math.prod(shape) * itemsize(entry["dtype"])
    if total > budget:
        raise ValueError(f"its index rebuilds {total} bytes, more than the step's rows may take ({budget})")


def _check_recipe(kind: str, starts: list[int], seconds: list[int], width: int, dtype: str) -> None:
    """What the writer could have recorded (ValueError otherwise): a run inside its row; a ramp of a signed
    integer dtype, its top a value of that dtype, its start in ``[-top, width)``."""
    if kind == "run":
        if dtype == "bfloat16" or dtype.startswith("complex"):
            raise ValueError(f"a run of {dtype}")
        if not all(0 <= start <= end <= width for start, end in zip(starts, seconds, strict=True)):
            raise ValueError(f"a run outside its row of {width}")
        return
    if dtype not in INTEGERS or dtype.startswith("uint"):
        raise ValueError(f"a ramp of {dtype}")
    highest = (1 << (8 * itemsize(dtype) - 1)) - 1
    if not all(0 <= top <= highest for top in seconds):
        raise ValueError(f"a ramp with a negative top or one {dtype} does not hold")
    if not all(-top <= start < width for start, top in zip(starts, seconds, strict=True)):
        raise ValueError(f"a ramp starting outside its row of {width}")


#: Elements a rebuilding job writes at a time: a block stays in the caches between the passes over it.
BLOCK_ELEMENTS = 1 << 19


@dataclass
class Recipe:
    """A checked ``derive`` entry, written block by block (rows of its first dimension) into memory the reader
    allocated, by several threads; a concatenation copies its parts straight from their stored bytes."""

    kind: str
    shape: list[int]
    dtype: Any
    left: torch.Tensor | None = None
    right: torch.Tensor | None = None
    first: list[int] | None = None  # per-row starts
    second: list[int] | None = None  # per-row ends or tops

    @classmethod
    def of(
        cls,
        entry: Mapping[str, Any],
        sources: Mapping[str, torch.Tensor],
        dtype: Any,
        dtypes: Mapping[str, Any] | None = None,
    ) -> Recipe:
        """The recipe of ``entry`` (ValueError for anything malformed); ``dtypes``: the sources' restored dtypes."""

        derive, shape = entry["derive"], entry["shape"]
        if type(derive) is not dict:
            raise ValueError("a derived tensor without a recipe")
        if "concat" in derive:
            parts = derive["concat"]
            if type(parts) is not list or len(parts) != 2 or not all(type(p) is str and p in sources for p in parts):
                raise ValueError("a concatenation of tensors the file does not hold")
            left, right = sources[parts[0]], sources[parts[1]]
            restored = dtypes or {}
            if any(restored.get(name, sources[name].dtype) != dtype for name in parts):
                raise ValueError("a concatenation of tensors of another dtype")
            if (
                not shape
                or list(left.shape[:-1]) != shape[:-1]
                or list(right.shape[:-1]) != shape[:-1]
                or left.dim() == 0
                or right.dim() == 0
                or left.shape[-1] + right.shape[-1] != shape[-1]
            ):
                parts_shown = f"{list(left.shape)} and {list(right.shape)}"
                raise ValueError(f"a concatenation of shapes {parts_shown} does not make {shape}")
            return cls("concat", shape, dtype, left=left, right=right)
        keys = ("run", "end") if "run" in derive else ("ramp", "top") if "ramp" in derive else None
        if keys is None or len(shape) != 2:
            raise ValueError("an unknown recipe")
        if not (shape[0] > 0 and 0 < shape[1] <= MAX_WIDTH):
            raise ValueError(f"a {keys[0]} of shape {shape}")
        columns = []
        for key in keys:
            values = derive.get(key)
            if type(values) is not list or len(values) != shape[0] or not all(type(v) is int for v in values):
                raise ValueError(f"a recipe whose {key!r} does not hold one integer per row")
            columns.append(values)
        _check_recipe(keys[0], columns[0], columns[1], shape[1], dtype_name(dtype))
        return cls(keys[0], shape, dtype, first=columns[0], second=columns[1])

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(dtype_name(self.dtype))

    def blocks(self) -> list[slice]:
        """Row ranges of the first dimension covering the tensor (one for a 1-D tensor)."""
        if len(self.shape) < 2 or not self.shape[0]:
            return [slice(None)]
        per_row = max(1, math.prod(self.shape[1:]))
        step = max(1, BLOCK_ELEMENTS // per_row)
        return [slice(lo, lo + step) for lo in range(0, self.shape[0], step)]

    def write(self, out: torch.Tensor, rows: slice, *, zeroed: bool = False) -> None:
        """Write rows ``rows`` into ``out``, a run or ramp row as one window of a template twice its width;
        ``zeroed``: ``out`` holds zeros, so only non-zeros are written (the padding's pages never faulted in)."""
        import numpy as np

        block = out[rows]
        if self.kind == "concat":
            assert self.left is not None and self.right is not None
            split = self.left.shape[-1]
            copy_into(block[..., :split], self.left[rows])
            copy_into(block[..., split:], self.right[rows])
            return
        assert self.first is not None and self.second is not None
        width = self.shape[1]
        view = block.numpy()  # Recipe.of allows runs and ramps only of dtypes numpy has
        pairs = zip(self.first[rows], self.second[rows], strict=True)
        if self.kind == "run":  # ones on [begin, stop): step(j - begin) - step(j - stop)
            step = np.zeros(2 * width, dtype=view.dtype)
            step[width:] = 1
            difference = np.not_equal if view.dtype == np.bool_ else np.subtract
            for row, (start, end) in enumerate(pairs):
                begin = min(max(start, 0), width)
                stop = min(max(end, begin), width)
                if zeroed:
                    view[row, begin:stop] = 1
                else:
                    difference(
                        step[width - begin : 2 * width - begin], step[width - stop : 2 * width - stop], out=view[row]
                    )
            return
        ramp = np.zeros(2 * width, dtype=np.int64)
        ramp[width:] = np.arange(width, dtype=np.int64)
        for row, (start, top) in enumerate(pairs):  # min(max(j - start, 0), top), -top <= start < width
            lo = min(max(start, 0), width) if zeroed else 0
            if zeroed and not top:
                continue
            values = ramp[width - start : 2 * width - start] if start >= 0 else np.arange(-start, width - start)
            np.minimum(values[lo:], top, out=view[row, lo:])


def copy_into(out: torch.Tensor, source: torch.Tensor) -> None:
    """``out.copy_(source)`` through numpy where it can (one thread per copy, no torch intra-op threads)."""
    import numpy as np

    try:
        target, values = out.numpy(), source.numpy()
    except TypeError:  # bfloat16 and the like
        out.copy_(source)
        return
    np.copyto(target, values, casting="unsafe")
