"""The raw tensor file: a JSON index, then 64-byte aligned tensor bytes. Loading runs no code."""

from __future__ import annotations

import json
import math
import mmap
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from skipinject.errors import CorruptCacheError
from skipinject.store.checksums import _Hasher
from skipinject.store.format import MAX_INDEX_BYTES, TENSOR_ALIGN, TENSORS_MAGIC

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer


_ALIGN = TENSOR_ALIGN
#: Tensor dtypes the tensor file holds (by ``torch`` attribute name).
TENSOR_DTYPES = frozenset(
    {
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    }
)


# ---------------------------------------------------------------- the tensor file


def _padding(size: int) -> int:
    return -size % _ALIGN


def write_tensors(handle: BinaryIO, tensors: Mapping[str, torch.Tensor], algo: str) -> str:
    """Write the tensor file to ``handle``; returns its checksum. Contiguous CPU tensors are not copied."""
    import torch

    views = []
    index = []
    offset = 0
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"payload tensors must map str to torch.Tensor, got {name!r}: {type(tensor).__name__}")
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in TENSOR_DTYPES or tensor.is_nested or tensor.layout != torch.strided:
            raise TypeError(f"payload tensor {name!r}: {tensor.dtype} {tensor.layout} tensors are not supported")
        value = tensor.detach().cpu().contiguous()
        nbytes = value.numel() * value.element_size()
        index.append({"name": name, "dtype": dtype, "shape": list(value.shape), "offset": offset, "nbytes": nbytes})
        views.append(value.reshape(-1).view(torch.uint8).numpy() if nbytes else None)
        offset += nbytes + _padding(nbytes)
    header = json.dumps({"tensors": index}, separators=(",", ":")).encode()
    header += b" " * _padding(len(TENSORS_MAGIC) + 8 + len(header))
    chunks: list[Buffer] = [TENSORS_MAGIC, struct.pack("<Q", len(header)), header]
    for view, entry in zip(views, index, strict=True):
        if view is None:
            continue
        chunks.append(view)
        pad = bytes(_padding(entry["nbytes"]))
        if pad:
            chunks.append(pad)
    return _write_and_hash(handle, chunks, algo)


#: Below this many bytes a tensor file is written and hashed in one thread.
_OVERLAP_MIN_BYTES = 64 << 20
#: Written bytes handed to the kernel's writeback at a time (Linux), so the final fsync waits less.
_WRITEBACK_STEP = 64 << 20


def _write_and_hash(handle: BinaryIO, chunks: list[Buffer], algo: str) -> str:
    """Write ``chunks`` in order and return their checksum.

    For a large file the checksum runs in a second thread, chunk by chunk in order, while this one
    writes (xxhash and file writes release the GIL), and on Linux the bytes written so far are
    handed to the kernel's writeback every ``_WRITEBACK_STEP`` bytes (``sync_file_range``, which
    only starts the disk writes: durability still comes from the caller's fsync).
    """
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


def read_tensors(mapped: mmap.mmap | bytearray | None, path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a mapped tensor file, as views of the mapping. Runs no code from the file.

    Work and memory are bounded by the file's size: the index is at most :data:`MAX_INDEX_BYTES`
    and inside the file, every tensor's bytes lie inside the file, and a tensor without elements
    may not claim more rows/columns (the product of its non-zero dimensions) than the file has
    bytes. Any failure is a :class:`CorruptCacheError`.
    """
    try:
        return _read_tensors(mapped, path)
    except CorruptCacheError:
        raise
    except Exception as exc:  # ValueError, TypeError, RuntimeError from torch, RecursionError, MemoryError
        raise CorruptCacheError(f"{path}: tensor file index is damaged ({type(exc).__name__}: {exc})") from exc


def _read_tensors(mapped: mmap.mmap | bytearray | None, path: Path) -> dict[str, torch.Tensor]:
    import torch

    size = 0 if mapped is None else len(mapped)
    if mapped is None or size < len(TENSORS_MAGIC) + 8 or mapped[: len(TENSORS_MAGIC)] != TENSORS_MAGIC:
        raise CorruptCacheError(f"{path}: not a skipinject tensor file")
    (header_len,) = struct.unpack_from("<Q", mapped, len(TENSORS_MAGIC))
    data_start = len(TENSORS_MAGIC) + 8 + header_len
    if data_start > size or data_start % _ALIGN or header_len > MAX_INDEX_BYTES:
        raise CorruptCacheError(f"{path}: tensor file index is damaged")
    index = json.loads(mapped[len(TENSORS_MAGIC) + 8 : data_start])["tensors"]
    if type(index) is not list:
        raise ValueError("the index is not a list")
    tensors = {}
    for entry in index:
        name, dtype_name, shape = entry["name"], entry["dtype"], entry["shape"]
        offset, nbytes = entry["offset"], entry["nbytes"]
        if type(name) is not str or dtype_name not in TENSOR_DTYPES or type(shape) is not list:
            raise ValueError(f"bad name, dtype or shape for {name!r:.80}")
        if len(shape) > MAX_DIMS or not all(type(d) is int and 0 <= d <= size << 3 for d in shape):
            raise ValueError(f"bad shape for {name!r:.80}")
        dtype = getattr(torch, dtype_name)
        count = math.prod(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if type(offset) is not int or offset < 0 or offset % _ALIGN or nbytes != count * itemsize:
            raise ValueError(f"bad extent for {name!r:.80}")
        if data_start + offset + nbytes > size:
            raise ValueError(f"{name!r:.80} runs past the end of the file")
        if count == 0:
            if math.prod(d for d in shape if d) > size:
                raise ValueError(f"empty tensor {name!r:.80} claims a shape {shape} larger than the file")
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            tensors[name] = torch.frombuffer(mapped, dtype=dtype, count=count, offset=data_start + offset).view(shape)
    return tensors
