"""A data file compressed in independent zstd frames of :data:`~skipinject.store.format.FRAME_BYTES` decoded
bytes each, (de)compressed on every core, each into its place. Hostile input is refused before its memory
is spent: the frame table must match the stored size, each frame's header its recorded size, and it
decompresses into a buffer of exactly that size."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from skipinject.errors import CorruptCacheError
from skipinject.payload import Compression as Compression
from skipinject.payload import parse_compression as parse_compression
from skipinject.store.checksums import workers
from skipinject.store.format import FRAME_BYTES, MAX_EXPANSION
from skipinject.store.hit_memory import close
from skipinject.store.mounts import is_network_path

if TYPE_CHECKING:
    from concurrent.futures import Future

    from typing_extensions import Buffer

    from skipinject.store.checksums import _Hasher
    from skipinject.store.hit_memory import Decoded

ENCODING = "zstd"


def compression_for(value: str, root: object) -> Compression | None:
    """The compression a store under ``root`` (a local ``Path`` or a remote location) uses for ``value``."""
    if not isinstance(root, Path):
        return parse_compression(value, remote=True)
    network = value == "auto" and bool(is_network_path(root))
    return parse_compression(value, network_fs=network)


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError as exc:  # a core dependency; only missing in a broken install
        raise CorruptCacheError("this cache is compressed (zstd) but the zstandard package is not installed") from exc
    return zstandard


def _blocks(pieces: Sequence[Buffer], size: int) -> Iterator[Buffer]:
    """The bytes of ``pieces`` in blocks of ``size``: views within a piece, a joined copy across pieces."""
    pending: list[memoryview] = []
    filled = 0
    for piece in pieces:
        with memoryview(piece) as whole:
            view = whole.cast("B")
            start = 0
            while start < len(view):
                take = min(len(view) - start, size - filled)
                part = view[start : start + take]
                start += take
                if not pending and take == size:
                    yield part
                    continue
                pending.append(part)
                filled += take
                if filled == size:
                    yield b"".join(pending)
                    pending, filled = [], 0
    if pending:
        yield b"".join(pending)


def write_compressed(
    handle: BinaryIO, pieces: Sequence[Buffer], compression: Compression, hasher: _Hasher
) -> dict[str, Any]:
    """Compress the concatenated ``pieces`` frame by frame on every core, hashing the stored bytes; the
    file's record beside its size and checksum (decoded size, frame table)."""
    from concurrent.futures import ThreadPoolExecutor

    zstandard = _zstd()
    local = threading.local()

    def compress(block: Buffer) -> bytes:
        compressor = getattr(local, "compressor", None)
        if compressor is None:
            compressor = local.compressor = zstandard.ZstdCompressor(level=compression.level, write_content_size=True)
        return bytes(compressor.compress(block))

    frames: list[int] = []
    threads = workers()

    def emit(future: Future[bytes]) -> None:
        frame = future.result()
        handle.write(frame)
        hasher.update(frame)
        frames.append(len(frame))

    with ThreadPoolExecutor(threads, thread_name_prefix="skipinject-zstd") as pool:
        in_flight: list[Future[bytes]] = []
        for block in _blocks(pieces, FRAME_BYTES):
            in_flight.append(pool.submit(compress, block))
            if len(in_flight) > 2 * threads:
                emit(in_flight.pop(0))
        for future in in_flight:
            emit(future)
    return {"encoding": ENCODING, "decoded_size": sum(memoryview(p).nbytes for p in pieces), "frames": frames}


def check_record(spec: Mapping[str, Any], stored: int, shown: Path) -> tuple[int, list[int]]:
    """A compressed file's decoded size and frame table, checked against each other and the stored size."""
    decoded, frames = spec.get("decoded_size"), spec.get("frames")
    if spec.get("encoding") != ENCODING:
        raise CorruptCacheError(f"{shown}: unknown encoding {str(spec.get('encoding'))[:40]!r}")
    if type(decoded) is not int or decoded < 0 or type(frames) is not list:
        raise CorruptCacheError(f"{shown}: meta.json records no valid decoded size or frame table")
    if len(frames) != -(-decoded // FRAME_BYTES) or not all(type(f) is int and f > 0 for f in frames):
        raise CorruptCacheError(f"{shown}: its frame table does not match its decoded size {decoded}")
    if sum(frames) != stored:
        raise CorruptCacheError(f"{shown}: its frames add up to {sum(frames)} bytes, the file has {stored}")
    if decoded > MAX_EXPANSION * stored:
        raise CorruptCacheError(
            f"{shown}: claims to expand {stored} bytes to {decoded} (more than zstd's {MAX_EXPANSION}x: not ours)"
        )
    return decoded, frames


class FrameDecoder:
    """Decodes a compressed file frame by frame as its stored bytes come, each complete frame in a thread
    straight into its place; :meth:`finish` returns the buffer, :meth:`abandon` frees it after a failure."""

    def __init__(self, spec: Mapping[str, Any], stored_size: int, shown: Path, make: Callable[[int], Decoded]) -> None:
        self.decoded, self.frames = check_record(spec, stored_size, shown)
        self.shown = shown
        self._zstandard = _zstd()
        self.out = make(self.decoded)
        self._local = threading.local()
        self._next = 0  # the next frame to assemble
        self._pending: list[memoryview] = []  # its stored bytes so far
        self._filled = 0
        self._threads = min(workers(), max(1, len(self.frames)))
        self._pool: Any = None
        self._in_flight: list[Future[None]] = []

    def feed(self, data: Buffer) -> None:
        """The next stored bytes (held only while a frame being assembled or decoded needs them)."""
        with memoryview(data) as whole, whole.cast("B") as view:
            start = 0
            while start < len(view):
                if self._next >= len(self.frames):
                    raise CorruptCacheError(f"{self.shown}: more bytes than its frames hold")
                need = self.frames[self._next] - self._filled
                take = min(need, len(view) - start)
                self._pending.append(view[start : start + take])
                self._filled += take
                start += take
                if self._filled == self.frames[self._next]:
                    frame = self._pending[0] if len(self._pending) == 1 else memoryview(b"".join(self._pending))
                    self._pending, self._filled = [], 0
                    self._submit(self._next, frame)
                    self._next += 1

    def _submit(self, number: int, frame: memoryview) -> None:
        if self._threads == 1:
            self._decode_frame(number, frame)
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="skipinject-zstd")
        self._in_flight.append(self._pool.submit(self._decode_frame, number, frame))
        while len(self._in_flight) > 2 * self._threads:
            self._in_flight.pop(0).result()

    def _decode_frame(self, number: int, frame: memoryview) -> None:
        """Decompress one frame into its place; one more byte than recorded is read to refuse a longer one."""
        zstandard, shown = self._zstandard, self.shown
        expected = min(FRAME_BYTES, self.decoded - number * FRAME_BYTES)
        try:
            try:
                claimed = zstandard.frame_content_size(frame)
            except zstandard.ZstdError as exc:
                raise CorruptCacheError(f"{shown}: frame {number} is not a zstd frame ({exc})") from exc
            if claimed != expected:
                raise CorruptCacheError(
                    f"{shown}: frame {number} claims {claimed} decoded bytes, meta.json records {expected}; not decoded"
                )
            decompressor = getattr(self._local, "decompressor", None)
            if decompressor is None:
                decompressor = self._local.decompressor = zstandard.ZstdDecompressor()
            reader = decompressor.stream_reader(frame, read_across_frames=False, closefd=False)
            got = 0
            at = number * FRAME_BYTES
            with memoryview(self.out) as whole, whole[at : at + expected] as place:
                while got < expected:
                    with place[got:] as rest:
                        count = reader.readinto(rest)
                    if not count:
                        break
                    got += count
            got += len(reader.read(1))
        except zstandard.ZstdError as exc:
            raise CorruptCacheError(f"{shown}: frame {number} is damaged ({exc})") from exc
        finally:
            reader = None  # it holds the frame's buffer until it is freed (close() does not let go of it)
            frame.release()  # the stored bytes (a view of the caller's mapping) are let go even on failure
        if got != expected:
            raise CorruptCacheError(f"{shown}: frame {number} decodes to {got} bytes, not {expected}")

    def _wait(self) -> None:
        try:
            for done in self._in_flight:
                done.result()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._in_flight = None, []

    def finish(self) -> Decoded:
        """The decoded buffer, once every frame has come and been decoded."""
        try:
            self._wait()
            if self._next != len(self.frames):
                raise CorruptCacheError(f"{self.shown}: {self._next} of {len(self.frames)} frames arrived")
        except BaseException:
            self.abandon()
            raise
        return self.out

    def abandon(self) -> None:
        """Give up: wait for the threads (they write into the buffer) and free it."""
        try:
            self._wait()
        except BaseException:
            pass
        for piece in self._pending:
            piece.release()
        self._pending = []
        close(self.out)
