"""File checksums: xxh3 trees hashed on all cores, crc32 without xxhash."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    """Checksum of a whole regular file (never a link, pipe or device)."""
    from skipinject.store.files import open_regular

    fd, info = open_regular(str(path), None, path)
    try:
        return read_private(fd, info.st_size, bytearray, algo, path)[1]
    finally:
        os.close(fd)


def _digest(data: Buffer, algo: str) -> str:
    return _Hasher(algo, data).hexdigest()


def read_private(fd: int, size: int, make: Callable[[int], Decoded], algo: str, shown: Path) -> tuple[Decoded, str]:
    """The ``size`` bytes of ``fd`` copied into a private buffer from ``make`` (what is checksummed is what is
    served) and their checksum. A tree checksum's chunks are read on every core, each hashed by the thread that
    read it while it is still in that core's cache, and the fresh pages it lands in fault in on all of them."""
    buffer = make(size)
    with memoryview(buffer) as whole, whole.cast("B") as view:
        if algo != "xxh3_64-tree" or size <= TREE_CHUNK:
            _pread_exact(fd, view, 0, shown)
            return buffer, _digest(view, algo)
        from concurrent.futures import ThreadPoolExecutor

        starts = range(0, size, TREE_CHUNK)
        with ThreadPoolExecutor(min(workers(), len(starts)), thread_name_prefix="skipinject-read") as pool:
            digests = [pool.submit(_read_chunk, fd, view[start : start + TREE_CHUNK], start, shown) for start in starts]
            joined = b"".join(done.result() for done in digests)
        return buffer, _Hasher("xxh3_64", joined).hexdigest()


def _read_chunk(fd: int, chunk: memoryview, offset: int, shown: Path) -> bytes:
    """One tree chunk read into place and hashed."""
    try:
        _pread_exact(fd, chunk, offset, shown)
        return _Hasher("xxh3_64", chunk).digest()
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


class _Hasher:
    """Incremental checksum, so a writer checksums what it writes instead of reading it back."""

    def __init__(self, algo: str, data: Buffer = b"") -> None:
        if algo not in CHECKSUM_ALGOS:
            raise CorruptCacheError(f"unknown checksum algorithm {algo!r}")
        self.algo = algo
        self._crc = 0
        self._xxh: Any = None
        self._filled = 0  # bytes of the tree's current chunk
        self._digests: list[bytes] = []
        if algo != "crc32":
            try:
                import xxhash
            except ImportError as exc:
                raise CorruptCacheError("cache was checksummed with xxh3_64 but xxhash is not installed") from exc
            self._xxh = xxhash.xxh3_64()
        self.update(data)

    def update(self, data: Buffer) -> None:
        if self.algo == "crc32":
            self._crc = zlib.crc32(data, self._crc)
        elif self.algo == "xxh3_64":
            self._xxh.update(data)
        else:
            with memoryview(data) as whole, whole.cast("B") as view:
                start = 0
                while start < len(view):
                    take = min(len(view) - start, TREE_CHUNK - self._filled)
                    with view[start : start + take] as piece:
                        self._xxh.update(piece)
                    start += take
                    self._filled += take
                    if self._filled == TREE_CHUNK:
                        self._digests.append(self._xxh.digest())
                        self._xxh.reset()
                        self._filled = 0

    def digest(self) -> bytes:
        if self.algo == "crc32":
            return struct.pack(">I", self._crc & 0xFFFFFFFF)
        if self.algo == "xxh3_64":
            return bytes(self._xxh.digest())
        last = [self._xxh.digest()] if self._filled or not self._digests else []
        return _Hasher("xxh3_64", b"".join(self._digests + last)).digest()

    def hexdigest(self) -> str:
        return self.digest().hex()
