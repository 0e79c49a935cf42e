"""The raw tensor file: a JSON index, then 64-byte aligned tensor bytes; loading runs no code. Compressed, tensors
are stored in the exact compact encodings of docs/cache-format.md, checked bit for bit at save; a reader bounds
what it rebuilds by its part's budget before allocating and checks every recipe against its shape and dtype."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from skipinject.errors import CorruptCacheError
from skipinject.store.checksums import _Hasher, workers
from skipinject.store.compression import Compression, write_compressed
from skipinject.store.format import MAX_INDEX_BYTES, MAX_WIDTH, TENSOR_ALIGN, TENSOR_DTYPES, TENSORS_MAGIC
from skipinject.store.hit_memory import FRESH, Claim, memory_budget

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer

    from skipinject.store.hit_memory import Decoded


def _padding(size: int) -> int:
    return -size % TENSOR_ALIGN


def tensor_file(
    handle: BinaryIO,
    tensors: Mapping[str, torch.Tensor],
    algo: str,
    compression: Compression | None,
    concats: Mapping[str, tuple[str, str]] | None = None,
) -> tuple[str, dict[str, Any] | None]:
    """Write the tensor file (plain, or compact and compressed): its stored bytes' checksum and record's additions."""
    if compression is None:
        return _write_and_hash(handle, _file_pieces(tensors, packed=False), algo), None
    hasher = _Hasher(algo)
    written = write_compressed(handle, _file_pieces(tensors, packed=True, concats=concats), compression, hasher)
    return hasher.hexdigest(), written


def _file_pieces(
    tensors: Mapping[str, torch.Tensor], *, packed: bool, concats: Mapping[str, tuple[str, str]] | None = None
) -> list[Buffer]:
    """The tensor file's bytes: magic, index length, index, each stored tensor (``packed``: compactly encoded).
    A payload without tensors is an empty index: torch is not imported for it."""
    checked = {}
    for name, tensor in tensors.items():
        import torch

        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"payload tensors must map str to torch.Tensor, got {name!r}: {type(tensor).__name__}")
        if dtype_name(tensor.dtype) not in TENSOR_DTYPES or tensor.is_nested or tensor.layout != torch.strided:
            raise TypeError(f"payload tensor {name!r}: {tensor.dtype} {tensor.layout} tensors are not supported")
        checked[name] = tensor.detach().cpu().contiguous()
    plans = plan_tensors(checked, concats or {}) if packed else [Plan(name, v, stored=v) for name, v in checked.items()]
    index: list[dict[str, Any]] = []
    data: list[Buffer] = []
    offset = 0
    for plan in plans:
        entry: dict[str, Any] = {
            "name": plan.name,
            "dtype": dtype_name(plan.tensor.dtype),
            "shape": list(plan.tensor.shape),
        }
        index.append(entry)
        if plan.stored is None:
            entry["derive"] = plan.derive
            continue
        nbytes = plan.stored.numel() * plan.stored.element_size()
        entry.update(offset=offset, nbytes=nbytes)
        if plan.stored_dtype is not None:
            entry["stored_dtype"] = plan.stored_dtype
        if nbytes:
            import torch

            data += [plan.stored.reshape(-1).view(torch.uint8).numpy(), bytes(_padding(nbytes))]
        offset += nbytes + _padding(nbytes)
    header = json.dumps({"tensors": index}, separators=(",", ":")).encode()
    header += b" " * _padding(len(TENSORS_MAGIC) + 8 + len(header))
    return [TENSORS_MAGIC, struct.pack("<Q", len(header)), header, *data]


#: Below this many bytes a tensor file is written and hashed in one thread.
_OVERLAP_MIN_BYTES = 64 << 20
#: Written bytes handed to the kernel's writeback at a time (Linux), so the final fsync waits less.
_WRITEBACK_STEP = 64 << 20


def _write_and_hash(handle: BinaryIO, chunks: list[Buffer], algo: str) -> str:
    """Write ``chunks`` and return their checksum; a large file is hashed in a second thread meanwhile, its
    written bytes handed to the kernel's writeback as it goes (durability still comes from the fsync)."""
    hasher = _Hasher(algo)
    if sum(memoryview(chunk).nbytes for chunk in chunks) < _OVERLAP_MIN_BYTES:
        for chunk in chunks:
            handle.write(chunk)
            hasher.update(chunk)
        return hasher.hexdigest()
    from concurrent.futures import ThreadPoolExecutor

    writeback = _writeback_starter(handle)
    written = flushed = handle.tell()
    with ThreadPoolExecutor(1, thread_name_prefix="skipinject-hash") as pool:
        hashed = [pool.submit(hasher.update, chunk) for chunk in chunks]
        for chunk in chunks:
            handle.write(chunk)
            written += memoryview(chunk).nbytes
            if writeback is not None and written - flushed >= _WRITEBACK_STEP:
                handle.flush()
                writeback(flushed, written - flushed)
                flushed = written
        for done in hashed:
            done.result()
    return hasher.hexdigest()


def _writeback_starter(handle: BinaryIO) -> Callable[[int, int], None] | None:
    """``start(offset, nbytes)``: begin writing that range of ``handle`` to disk (Linux), or None."""
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fd = handle.fileno()
        sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
        sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    except (AttributeError, OSError, ValueError):
        return None
    # flag 2, SYNC_FILE_RANGE_WRITE: start writeback, do not wait; best effort (a failure only means no head start)
    return lambda offset, nbytes: sync_file_range(fd, offset, nbytes, 2)


#: torch's own limit on the number of dimensions.
MAX_DIMS = 64


def read_tensors(
    mapped: Decoded | None, path: Path, memory: Claim = FRESH, budget: int | None = None
) -> dict[str, torch.Tensor]:
    """Tensors of a tensor file as views of its buffer, compact ones rebuilt into memory from ``memory``
    (within ``budget``, the part's); runs no code, every extent and shape bounded by the file. An empty index
    (a payload without tensors) imports no torch."""
    try:
        size = 0 if mapped is None else len(mapped)
        if mapped is None or size < len(TENSORS_MAGIC) + 8 or bytes(mapped[: len(TENSORS_MAGIC)]) != TENSORS_MAGIC:
            raise CorruptCacheError(f"{path}: not a skipinject tensor file")
        (header_len,) = struct.unpack_from("<Q", mapped, len(TENSORS_MAGIC))
        data_start = len(TENSORS_MAGIC) + 8 + header_len
        if data_start > size or data_start % TENSOR_ALIGN or header_len > MAX_INDEX_BYTES:
            raise CorruptCacheError(f"{path}: tensor file index is damaged")
        index = json.loads(bytes(mapped[len(TENSORS_MAGIC) + 8 : data_start]))["tensors"]
        if type(index) is not list or not all(type(entry) is dict for entry in index):
            raise ValueError("the index is not a list of records")
        if not index:
            return {}
        import torch

        rebuild_budget = (memory_budget() if budget is None else budget) - size
        rebuilt = 0  # bytes widened and rebuilt, checked before any is allocated
        tensors = {}
        derived: list[dict[str, Any]] = []
        recipes: dict[str, Recipe] = {}  # what is rebuilt into fresh memory, by name: narrowed ones first
        seen: set[str] = set()
        for entry in index:
            name, type_name, shape = entry["name"], entry["dtype"], entry["shape"]
            if type(name) is not str or type_name not in TENSOR_DTYPES or type(shape) is not list:
                raise ValueError(f"bad name, dtype or shape for {name!r:.80}")
            largest = rebuild_budget if "derive" in entry else size
            if len(shape) > MAX_DIMS or not all(type(d) is int and 0 <= d <= largest for d in shape):
                raise ValueError(f"bad shape for {name!r:.80}")
            if name in seen:
                raise ValueError(f"{name!r:.80} is named twice")
            seen.add(name)
            dtype, count = getattr(torch, type_name), math.prod(shape)
            if "derive" in entry or "stored_dtype" in entry:
                rebuilt += count * itemsize(type_name)
            if "derive" in entry:
                derived.append(entry)
                continue
            stored_name = entry.get("stored_dtype", type_name)
            if stored_name != type_name and not narrows(stored_name, type_name):
                raise ValueError(f"bad stored dtype for {name!r:.80}")
            offset, nbytes, stored = entry["offset"], entry["nbytes"], getattr(torch, stored_name)
            if type(offset) is not int or offset < 0 or offset % TENSOR_ALIGN or nbytes != count * stored.itemsize:
                raise ValueError(f"bad extent for {name!r:.80}")
            if data_start + offset + nbytes > size:
                raise ValueError(f"{name!r:.80} runs past the end of the file")
            if count == 0:
                if math.prod(d for d in shape if d) > size:
                    raise ValueError(f"empty tensor {name!r:.80} claims a shape {shape} larger than the file")
                tensors[name] = torch.empty(shape, dtype=dtype)
                continue
            tensors[name] = torch.frombuffer(mapped, dtype=stored, count=count, offset=data_start + offset).view(shape)
            if stored is not dtype:
                recipes[name] = Recipe("widen", shape, dtype, left=tensors[name])
        if rebuilt > rebuild_budget:
            raise ValueError(
                f"its index rebuilds {rebuilt} bytes, more than the step's rows may take ({rebuild_budget})"
            )
        widened = {name: recipe.dtype for name, recipe in recipes.items()}
        for entry in derived:
            recipes[entry["name"]] = Recipe.of(entry, tensors, getattr(torch, entry["dtype"]), widened)
        if recipes:
            _restore(tensors, recipes, memory)
        return {entry["name"]: tensors[entry["name"]] for entry in index}
    except CorruptCacheError:
        raise
    except Exception as exc:  # ValueError, TypeError, RuntimeError from torch, RecursionError, MemoryError
        raise CorruptCacheError(f"{path}: tensor file index is damaged ({type(exc).__name__}: {exc})") from exc


#: Below this many bytes to widen and rebuild, one thread does it (a pool costs more than it saves).
_THREADED_MIN_BYTES = 8 << 20


def _restore(tensors: dict[str, torch.Tensor], recipes: Mapping[str, Recipe], memory: Claim) -> None:
    """Widen narrowed tensors and rebuild derived ones into one buffer from ``memory``, block by block in
    threads, each byte written at most once (in fresh memory a mask's zeros not at all)."""
    import torch

    spans = [recipe.nbytes + _padding(recipe.nbytes) for recipe in recipes.values()]
    arena, zeroed = memory.take(sum(spans))
    jobs: list[Callable[[], object]] = []
    for (name, recipe), offset in zip(recipes.items(), accumulate(spans, initial=0), strict=False):  # one more offset
        count, shape = math.prod(recipe.shape), recipe.shape
        if not count:
            tensors[name] = torch.empty(shape, dtype=recipe.dtype)
            continue
        out = tensors[name] = torch.frombuffer(arena, dtype=recipe.dtype, count=count, offset=offset).view(shape)
        jobs.extend(partial(recipe.write, out, rows, zeroed=zeroed) for rows in recipe.blocks())
    if sum(spans) < _THREADED_MIN_BYTES or workers() == 1:
        for job in jobs:
            job()
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers(), thread_name_prefix="skipinject") as pool:
        for done in [pool.submit(job) for job in jobs]:
            done.result()


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
    derive: dict[str, Any] | None = None


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
    plans = [Plan(name, tensor, derive=_derived(tensor)) for name, tensor in tensors.items()]
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
    import torch

    values = tensor.numpy()
    low, high = int(values.min()), int(values.max())
    for target in NARROW:
        limits = np.iinfo(target)
        if limits.min <= low and high <= limits.max and itemsize(target) < tensor.element_size():
            return torch.from_numpy(values.astype(target)), target
    return tensor, None


_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _bits(tensor: torch.Tensor) -> Any:
    """The tensor's bytes as integers of its shape (bit-for-bit comparison); not for complex tensors."""
    import torch

    return tensor.view(getattr(torch, _BITS[tensor.element_size()])).numpy()


def _derived(tensor: torch.Tensor) -> dict[str, Any] | None:
    """A run (``{"run": starts, "end": ends}``: each row one run of ones) or a ramp (``{"ramp": starts, "top": tops}``:
    row ``b`` is ``clamp(j - start_b, 0, top_b)``, position ids) that rebuilds the tensor bit for bit, or None."""
    if not (tensor.dim() == 2 and tensor.shape[0] > 0 and 0 < tensor.shape[1] <= MAX_WIDTH):
        return None
    if tensor.is_complex() or dtype_name(tensor.dtype) == "bfloat16":  # no recipe of theirs; numpy has no bfloat16
        return None
    # row 0 first: it tells most tensors apart at once (and Recipe.of the dtypes; a float is never cast to int64)
    for kind in ("run",) if tensor.is_floating_point() else ("run", "ramp"):
        if _spec(kind, tensor[:1]) is not None and (spec := _spec(kind, tensor)) is not None:
            return spec
    return None


def _spec(kind: str, tensor: torch.Tensor) -> dict[str, Any] | None:
    import numpy as np

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
    return _rebuilds(spec, tensor, {})


def _concat(plan: Plan, left: Plan, right: Plan) -> dict[str, Any] | None:
    """``{"concat": [left, right]}`` if the tensor is the stored tensors ``left`` and ``right`` side by side."""
    tensor = plan.tensor
    if tensor.dim() < 2 or tensor.is_complex() or left is right or not 0 < left.tensor.shape[-1] < tensor.shape[-1]:
        return None
    if any(part.derive is not None or part is plan for part in (left, right)):
        return None
    return _rebuilds({"concat": [left.name, right.name]}, tensor, {left.name: left.tensor, right.name: right.tensor})


def _rebuilds(spec: dict[str, Any], tensor: torch.Tensor, sources: Mapping[str, torch.Tensor]) -> dict[str, Any] | None:
    """``spec`` if a reader accepts it and rebuilds ``tensor`` from it bit for bit, else None."""
    import numpy as np
    import torch

    try:
        recipe = Recipe.of({"derive": spec, "shape": list(tensor.shape)}, sources, tensor.dtype)
    except ValueError:  # no recipe a reader accepts (a row of negative values, parts of another shape)
        return None
    rebuilt = torch.zeros(tensor.shape, dtype=tensor.dtype)
    for block in recipe.blocks():
        recipe.write(rebuilt, block, zeroed=True)  # as a hit writes it: into fresh (zero) memory
    return spec if np.array_equal(_bits(rebuilt), _bits(tensor)) else None


#: Elements a rebuilding job writes at a time: a block stays in the caches between the passes over it.
BLOCK_ELEMENTS = 1 << 19


@dataclass
class Recipe:
    """A checked ``derive`` entry or a narrowed tensor (``widen``: ``left``), written block by block into memory the
    reader allocated, by several threads; a concatenation copies its parts straight from their stored bytes."""

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
            if any((dtypes or {}).get(name, sources[name].dtype) != dtype for name in parts):
                raise ValueError("a concatenation of tensors of another dtype")
            if (
                not shape
                or any(part.dim() == 0 or list(part.shape[:-1]) != shape[:-1] for part in (left, right))
                or left.shape[-1] + right.shape[-1] != shape[-1]
            ):
                raise ValueError(
                    f"a concatenation of shapes {list(left.shape)} and {list(right.shape)} does not make {shape}"
                )
            return cls("concat", shape, dtype, left=left, right=right)
        keys = ("run", "end") if "run" in derive else ("ramp", "top") if "ramp" in derive else None
        if keys is None or len(shape) != 2:
            raise ValueError("an unknown recipe")
        if not (shape[0] > 0 and 0 < shape[1] <= MAX_WIDTH):
            raise ValueError(f"a {keys[0]} of shape {shape}")
        for key in keys:
            values = derive.get(key)
            if type(values) is not list or len(values) != shape[0] or not all(type(v) is int for v in values):
                raise ValueError(f"a recipe whose {key!r} does not hold one integer per row")
        # what the writer could have recorded: a run inside its row; a ramp of a signed integer dtype, its top
        # a value of that dtype, its start in [-top, width)
        starts, seconds = derive[keys[0]], derive[keys[1]]
        width, name = shape[1], dtype_name(dtype)
        pairs = list(zip(starts, seconds, strict=True))
        if keys[0] == "run":
            if name == "bfloat16" or name.startswith("complex"):
                raise ValueError(f"a run of {name}")
            if not all(0 <= start <= end <= width for start, end in pairs):
                raise ValueError(f"a run outside its row of {width}")
        else:
            if name not in INTEGERS or name.startswith("uint"):
                raise ValueError(f"a ramp of {name}")
            if not all(0 <= top < 1 << (8 * itemsize(name) - 1) for top in seconds):
                raise ValueError(f"a ramp with a negative top or one {name} does not hold")
            if not all(-top <= start < width for start, top in pairs):
                raise ValueError(f"a ramp starting outside its row of {width}")
        return cls(keys[0], shape, dtype, first=starts, second=seconds)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(dtype_name(self.dtype))

    def blocks(self) -> list[slice]:
        """Row ranges of the first dimension covering the tensor (one for a 1-D tensor); ranges of elements to widen."""
        if self.kind == "widen":
            return [slice(lo, lo + BLOCK_ELEMENTS) for lo in range(0, math.prod(self.shape), BLOCK_ELEMENTS)]
        if len(self.shape) < 2 or not self.shape[0]:
            return [slice(None)]
        step = max(1, BLOCK_ELEMENTS // max(1, math.prod(self.shape[1:])))
        return [slice(lo, lo + step) for lo in range(0, self.shape[0], step)]

    def write(self, out: torch.Tensor, rows: slice, *, zeroed: bool = False) -> None:
        """Write rows ``rows`` into ``out``, each byte once; ``zeroed``: ``out`` holds zeros, so only non-zeros
        are written (the padding's pages never faulted in)."""
        import numpy as np

        if self.kind == "widen":
            assert self.left is not None
            copy_into(out.reshape(-1)[rows], self.left.reshape(-1)[rows])
            return
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
        if self.kind == "run":
            for row, (start, end) in enumerate(pairs):  # ones on [begin, stop), zeros around
                begin = min(max(start, 0), width)
                stop = min(max(end, begin), width)
                if not zeroed:
                    view[row, :begin] = 0
                    view[row, stop:] = 0
                view[row, begin:stop] = 1
            return
        positions = np.arange(width, dtype=np.int64)
        for row, (start, top) in enumerate(pairs):  # min(max(j - start, 0), top), -top <= start < width
            if zeroed and not top:
                continue
            lo = min(max(start, 0), width) if zeroed else 0
            np.clip(positions[lo:] - start, 0, top, out=view[row, lo:])


def copy_into(out: torch.Tensor, source: torch.Tensor) -> None:
    """``out.copy_(source)`` through numpy where it can (one thread per copy, no torch intra-op threads)."""
    import numpy as np

    try:
        target, values = out.numpy(), source.numpy()
    except TypeError:  # bfloat16 and the like
        out.copy_(source)
        return
    np.copyto(target, values, casting="unsafe")
