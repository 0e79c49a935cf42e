"""File checksums: xxh3 trees hashed on all cores, crc32 without xxhash."""

from __future__ import annotations

import mmap
import os
import stat
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from skipinject.errors import CorruptCacheError
from skipinject.store.format import TREE_CHUNK

if TYPE_CHECKING:
    from collections.abc import Callable

    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12 on

    from skipinject.store.hit_memory import Decoded


#: Checksum algorithms a cache may name. ``xxh3_64-tree`` (the default with xxhash installed) is the
#: xxh3_64 of the concatenated 8-byte xxh3_64 digests of the file's 32 MiB chunks: the chunks can
#: be hashed on several cores, which halves a verified hit of a large batch on two.
CHECKSUM_ALGOS = ("xxh3_64-tree", "xxh3_64", "crc32")
_TREE_CHUNK = TREE_CHUNK


def workers() -> int:
    """Threads for work that releases the GIL: the usable cores, at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores))


def _checksum_algo() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "crc32"
    return "xxh3_64-tree"


def file_checksum(path: Path, algo: str) -> str:
    """Checksum of a whole regular file (never a link, pipe or device), read through mmap."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCacheError(f"{path}: not a regular file")
        if info.st_size == 0:
            return _digest(b"", algo)
        with mmap.mmap(fd, info.st_size, access=mmap.ACCESS_READ) as mapped:
            return _digest_parallel(mapped, algo)
    finally:
        os.close(fd)


class _XXH3(Protocol):
    def update(self, data: Buffer, /) -> None: ...

    def digest(self) -> bytes: ...


def _digest(data: Buffer, algo: str) -> str:
    hasher = _Hasher(algo)
    hasher.update(data)
    return hasher.hexdigest()


def _digest_parallel(data: bytes | mmap.mmap, algo: str) -> str:
    if algo != "xxh3_64-tree" or len(data) <= _TREE_CHUNK or workers() < 2:
        return _digest(data, algo)
    from concurrent.futures import ThreadPoolExecutor

    view = memoryview(data)
    chunks = [view[start : start + _TREE_CHUNK] for start in range(0, len(view), _TREE_CHUNK)]
    try:
        with ThreadPoolExecutor(min(workers(), len(chunks)), thread_name_prefix="skipinject-hash") as pool:
            digests = list(pool.map(lambda chunk: _Leaf("xxh3_64", chunk).digest(), chunks))
    finally:
        for chunk in chunks:
            chunk.release()
        view.release()
    return _Leaf("xxh3_64", b"".join(digests)).hexdigest()


def read_private(fd: int, size: int, make: Callable[[int], Decoded], algo: str, shown: Path) -> tuple[Decoded, str]:
    """The ``size`` bytes of ``fd`` copied into a private buffer from ``make`` (what is checksummed is what is
    served) and their checksum, a tree checksum's chunks hashed in threads while the next is read."""
    buffer = make(size)
    tree = algo == "xxh3_64-tree" and size > _TREE_CHUNK
    with memoryview(buffer) as whole, whole.cast("B") as view:
        if not tree:
            _pread_exact(fd, view, 0, shown)
            return buffer, _digest(view, algo)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, workers() - 1), thread_name_prefix="skipinject-hash") as pool:
            digests = []
            for start in range(0, size, _TREE_CHUNK):
                chunk = view[start : start + _TREE_CHUNK]
                _pread_exact(fd, chunk, start, shown)
                digests.append(pool.submit(_chunk_digest, chunk))
            joined = b"".join(done.result() for done in digests)
        return buffer, _Leaf("xxh3_64", joined).hexdigest()


def _chunk_digest(chunk: memoryview) -> bytes:
    try:
        return _Leaf("xxh3_64", chunk).digest()
    finally:
        chunk.release()


def _pread_exact(fd: int, view: memoryview, offset: int, shown: Path) -> None:
    got = 0
    while got < len(view):
        with view[got:] as rest:
            count = os.preadv(fd, [rest], offset + got)
        if not count:
            raise CorruptCacheError(f"{shown}: changed while being read (ends at {offset + got} bytes)")
        got += count


class _Leaf:
    def __init__(self, algo: str, data: Buffer = b"") -> None:
        self.algo = algo
        if algo == "xxh3_64":
            try:
                import xxhash
            except ImportError as exc:
                raise CorruptCacheError("cache was checksummed with xxh3_64 but xxhash is not installed") from exc
            self._xxh: _XXH3 = xxhash.xxh3_64(data)
        elif algo == "crc32":
            self._crc = zlib.crc32(data)
        else:
            raise CorruptCacheError(f"unknown checksum algorithm {algo!r}")

    def update(self, data: Buffer) -> None:
        if self.algo == "xxh3_64":
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def digest(self) -> bytes:
        if self.algo == "xxh3_64":
            return self._xxh.digest()
        return struct.pack(">I", self._crc & 0xFFFFFFFF)

    def hexdigest(self) -> str:
        return self.digest().hex()


class _Hasher:
    """Incremental checksum, so a writer checksums what it writes instead of reading it back."""

    def __init__(self, algo: str) -> None:
        if algo not in CHECKSUM_ALGOS:
            raise CorruptCacheError(f"unknown checksum algorithm {algo!r}")
        self.algo = algo
        self.tree = algo == "xxh3_64-tree"
        self._leaf = _Leaf(algo.removesuffix("-tree"))
        self._filled = 0
        self._digests: list[bytes] = []

    def update(self, data: Buffer) -> None:
        if not self.tree:
            self._leaf.update(data)
            return
        with memoryview(data) as whole, whole.cast("B") as view:
            start = 0
            while start < len(view):
                take = min(len(view) - start, _TREE_CHUNK - self._filled)
                with view[start : start + take] as piece:
                    self._leaf.update(piece)
                start += take
                self._filled += take
                if self._filled == _TREE_CHUNK:
                    self._digests.append(self._leaf.digest())
                    self._leaf = _Leaf("xxh3_64")
                    self._filled = 0

    def hexdigest(self) -> str:
        if not self.tree:
            return self._leaf.hexdigest()
        digests = self._digests
        if self._filled or not digests:
            digests = [*digests, self._leaf.digest()]
        return _Leaf("xxh3_64", b"".join(digests)).hexdigest()
