"""The raw tensor file: a JSON index, then 64-byte aligned tensor bytes. Loading runs no code."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import skipinject.store.compact as compact
from skipinject.errors import CorruptCacheError
from skipinject.store.checksums import _Hasher, workers
from skipinject.store.compact import BLOCK_ELEMENTS, Plan, Recipe, check_rebuilt, copy_into, plan_tensors
from skipinject.store.compression import Compression, write_compressed
from skipinject.store.format import MAX_INDEX_BYTES, TENSOR_ALIGN, TENSOR_DTYPES, TENSORS_MAGIC
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
    """Write the tensor file, plain or compactly encoded and compressed: its checksum (of the stored bytes)
    and what its record adds (None: stored as it is). Contiguous CPU tensors are not copied."""
    if compression is None:
        return _write_and_hash(handle, _file_pieces(tensors, packed=False), algo), None
    hasher = _Hasher(algo)
    written = write_compressed(handle, _file_pieces(tensors, packed=True, concats=concats), compression, hasher)
    return hasher.hexdigest(), written


def _file_pieces(
    tensors: Mapping[str, torch.Tensor], *, packed: bool, concats: Mapping[str, tuple[str, str]] | None = None
) -> list[Buffer]:
    """The tensor file's bytes in order: magic, index length, index, then each tensor's bytes (``packed``:
    in compact encodings)."""
    import torch

    checked = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"payload tensors must map str to torch.Tensor, got {name!r}: {type(tensor).__name__}")
        if compact.dtype_name(tensor.dtype) not in TENSOR_DTYPES or tensor.is_nested or tensor.layout != torch.strided:
            raise TypeError(f"payload tensor {name!r}: {tensor.dtype} {tensor.layout} tensors are not supported")
        checked[name] = tensor.detach().cpu().contiguous()
    plans = plan_tensors(checked, concats or {}) if packed else [Plan(name, v, stored=v) for name, v in checked.items()]
    views = []
    index: list[dict[str, Any]] = []
    offset = 0
    for plan in plans:
        entry: dict[str, Any] = {
            "name": plan.name,
            "dtype": compact.dtype_name(plan.tensor.dtype),
            "shape": list(plan.tensor.shape),
        }
        if plan.derive is not None:
            entry["derive"] = plan.derive
            index.append(entry)
            continue
        value = plan.stored if plan.stored is not None else plan.tensor
        nbytes = value.numel() * value.element_size()
        entry.update(offset=offset, nbytes=nbytes)
        if plan.stored_dtype is not None:
            entry["stored_dtype"] = plan.stored_dtype
        index.append(entry)
        if nbytes:
            views.append((value.reshape(-1).view(torch.uint8).numpy(), nbytes))
        offset += nbytes + _padding(nbytes)
    header = json.dumps({"tensors": index}, separators=(",", ":")).encode()
    header += b" " * _padding(len(TENSORS_MAGIC) + 8 + len(header))
    pieces: list[Buffer] = [TENSORS_MAGIC, struct.pack("<Q", len(header)), header]
    for view, nbytes in views:
        pieces.append(view)
        pad = bytes(_padding(nbytes))
        if pad:
            pieces.append(pad)
    return pieces


#: Below this many bytes a tensor file is written and hashed in one thread.
_OVERLAP_MIN_BYTES = 64 << 20
#: Written bytes handed to the kernel's writeback at a time (Linux), so the final fsync waits less.
_WRITEBACK_STEP = 64 << 20


def _write_and_hash(handle: BinaryIO, chunks: list[Buffer], algo: str) -> str:
    """Write ``chunks`` and return their checksum; a large file is hashed in a second thread meanwhile, its
    written bytes handed to the kernel's writeback as it goes (durability still comes from the fsync)."""
    hasher = _Hasher(algo)
    total = sum(memoryview(chunk).nbytes for chunk in chunks)
    if total < _OVERLAP_MIN_BYTES:
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


#: torch's own limit on the number of dimensions.
MAX_DIMS = 64


def _writeback_starter(handle: BinaryIO) -> Callable[[int, int], None] | None:
    """``start(offset, nbytes)``: begin writing that range of ``handle`` to disk (Linux), or None."""
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fd = handle.fileno()
        libc = ctypes.CDLL(None, use_errno=True)
        sync_file_range = libc.sync_file_range
        sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        sync_file_range.restype = ctypes.c_int
    except (AttributeError, OSError, ValueError):
        return None
    start_write = 2  # SYNC_FILE_RANGE_WRITE: start writeback of dirty pages, do not wait

    def start(offset: int, nbytes: int) -> None:
        sync_file_range(fd, offset, nbytes, start_write)  # best effort: a failure only means no head start

    return start


def read_tensors(
    mapped: Decoded | None, path: Path, memory: Claim = FRESH, budget: int | None = None
) -> dict[str, torch.Tensor]:
    """Tensors of a tensor file as views of its buffer, compact ones rebuilt into memory from ``memory``
    (within ``budget``, the part's); runs no code, every extent and shape bounded by the file."""
    import torch

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
        rebuild_budget = (memory_budget() if budget is None else budget) - size
        check_rebuilt(index, rebuild_budget)
        tensors = {}
        derived: list[dict[str, Any]] = []
        widened: list[tuple[str, torch.dtype]] = []
        seen: set[str] = set()
        for entry in index:
            name, dtype_name, shape = entry["name"], entry["dtype"], entry["shape"]
            if type(name) is not str or dtype_name not in TENSOR_DTYPES or type(shape) is not list:
                raise ValueError(f"bad name, dtype or shape for {name!r:.80}")
            largest = rebuild_budget if "derive" in entry else size
            if len(shape) > MAX_DIMS or not all(type(d) is int and 0 <= d <= largest for d in shape):
                raise ValueError(f"bad shape for {name!r:.80}")
            if name in seen:
                raise ValueError(f"{name!r:.80} is named twice")
            seen.add(name)
            dtype = getattr(torch, dtype_name)
            if "derive" in entry:
                derived.append(entry)
                continue
            stored_name = entry.get("stored_dtype", dtype_name)
            if stored_name != dtype_name and not compact.narrows(stored_name, dtype_name):
                raise ValueError(f"bad stored dtype for {name!r:.80}")
            stored = getattr(torch, stored_name)
            offset, nbytes = entry["offset"], entry["nbytes"]
            count = math.prod(shape)
            itemsize = compact.itemsize(stored_name)
            if type(offset) is not int or offset < 0 or offset % TENSOR_ALIGN or nbytes != count * itemsize:
                raise ValueError(f"bad extent for {name!r:.80}")
            if data_start + offset + nbytes > size:
                raise ValueError(f"{name!r:.80} runs past the end of the file")
            if count == 0:
                if math.prod(d for d in shape if d) > size:
                    raise ValueError(f"empty tensor {name!r:.80} claims a shape {shape} larger than the file")
                tensors[name] = torch.empty(shape, dtype=dtype)
            else:
                tensor = torch.frombuffer(mapped, dtype=stored, count=count, offset=data_start + offset).view(shape)
                tensors[name] = tensor
                if stored is not dtype:
                    widened.append((name, dtype))
        if widened or derived:
            _restore(tensors, widened, derived, memory)
        return {entry["name"]: tensors[entry["name"]] for entry in index}

    except CorruptCacheError:
        raise
    except Exception as exc:  # ValueError, TypeError, RuntimeError from torch, RecursionError, MemoryError
        raise CorruptCacheError(f"{path}: tensor file index is damaged ({type(exc).__name__}: {exc})") from exc


#: Below this many bytes to widen and rebuild, one thread does it (a pool costs more than it saves).
_THREADED_MIN_BYTES = 8 << 20


def _restore(
    tensors: dict[str, torch.Tensor],
    widened: list[tuple[str, torch.dtype]],
    derived: list[dict[str, Any]],
    memory: Claim,
) -> None:
    """Widen narrowed tensors and rebuild derived ones into one buffer from ``memory``, block by block in
    threads, each byte written at most once (in fresh memory a mask's zeros not at all)."""
    import torch

    stored = dict(tensors)
    dtypes = dict(widened)
    recipes = [Recipe.of(entry, stored, getattr(torch, entry["dtype"]), dtypes) for entry in derived]
    sizes = [stored[name].numel() * dtype.itemsize for name, dtype in widened]
    sizes += [recipe.nbytes for recipe in recipes]
    arena, zeroed = memory.take(sum(size + _padding(size) for size in sizes))
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += size + _padding(size)

    def slot(number: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        if not sizes[number]:
            return torch.empty(shape, dtype=dtype)
        count = math.prod(shape)
        return torch.frombuffer(arena, dtype=dtype, count=count, offset=offsets[number]).view(shape)

    jobs: list[Callable[[], object]] = []
    for number, (name, dtype) in enumerate(widened):
        source = stored[name].reshape(-1)
        out = slot(number, dtype, list(source.shape))
        blocks = [slice(lo, lo + BLOCK_ELEMENTS) for lo in range(0, source.numel(), BLOCK_ELEMENTS)]
        jobs.extend(partial(copy_into, out[block], source[block]) for block in blocks)
        tensors[name] = out.view(stored[name].shape)
    for number, (entry, recipe) in enumerate(zip(derived, recipes, strict=True), start=len(widened)):
        out = tensors[entry["name"]] = slot(number, recipe.dtype, recipe.shape)
        if out.numel():
            jobs.extend(partial(recipe.write, out, rows, zeroed=zeroed) for rows in recipe.blocks())
    if sum(sizes) < _THREADED_MIN_BYTES or workers() == 1:
        for job in jobs:
            job()
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers(), thread_name_prefix="skipinject") as pool:
        for done in [pool.submit(job) for job in jobs]:
            done.result()
