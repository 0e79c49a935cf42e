"""Steps under an fsspec URL (``s3://``, ``gs://``, ``hdfs://``, ``memory://``...): the :class:`FsspecFiles`
backend of the one :class:`~skipinject.store.StepStore` (same format, same checks, same commit rule).

Object stores have no rename and no directories, so the commit is the object that appears last:
every data file is uploaded whole under a fresh name (an object appears complete or not at all;
a multipart upload that is interrupted leaves nothing visible), then ``meta.json`` is put in one
request. A reader loads only the files ``meta.json`` names, after checking each one's size before
reading a byte and its checksum after, so a torn or forged upload is reported and regenerated,
never loaded. Two writers of one step each upload their own files and the last ``meta.json`` wins:
a reader sees one writer's step whole. Loading streams each file into memory (no local copy), in
bounded chunks, reading at most the size ``meta.json`` records; nothing read runs code.

Object stores have no POSIX owners, so ``trust_dir_permissions`` does not apply: who may write the
bucket is the store's own access control. ``file://`` URLs are plain local paths (see
:class:`skipinject.dump_root.DumpRoot`), with every local guarantee.
"""

from __future__ import annotations

import contextlib
import hashlib
import posixpath
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar, cast

from skipinject.errors import CacheError, CorruptCacheError
from skipinject.store.backend import StoredFile
from skipinject.store.checksums import _Hasher
from skipinject.store.format import (
    CLAIM_PREFIX,
    DATA_NAME,
    MAX_CLAIMS,
    MAX_META_BYTES,
    META_NAME,
    PART_NAME,
    step_name,
)
from skipinject.store.garbage import ACTIVE_WRITE_IDS

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from skipinject.store.hit_memory import Decoded

T = TypeVar("T")

#: Bytes moved per request when reading a data file (a multiple of the tree checksum's 32 MiB
#: chunk). Large: some servers (moto, and any that do not index objects) pay for a ranged read in
#: proportion to the whole object; at most this much is held twice while it is copied.
READ_CHUNK = 128 << 20
#: Bytes requested at a time when a compressed file is read: its frames are decoded as they come,
#: so a smaller request lets decoding start sooner; the stored bytes held are about this plus the
#: frames being decoded.
STREAM_CHUNK = 8 << 20
#: Bytes handed to an upload at a time (see :class:`_Pieces`).
WRITE_PIECE = 8 << 20
#: An object store gives no process ids to ask whether a writer is alive: a data file no
#: ``meta.json`` names is removed only once it is this old (a writer slower than this would
#: lose its upload, and simply save the step again next time).
ABANDONED_AFTER = 3600.0


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


@dataclass(frozen=True)
class RemotePath:
    """A location in a remote store: the store's own path (``bucket/a/b``) and its URL prefix."""

    prefix: str  # "s3://"
    path: str  # "bucket/a/b", as the fsspec filesystem names it

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(self.prefix, posixpath.join(self.path, name) if name else self.path)

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.prefix, posixpath.dirname(self.path))

    def __str__(self) -> str:
        return self.prefix + self.path


def open_remote(url: str) -> tuple[AbstractFileSystem, RemotePath]:
    """The fsspec filesystem of ``url`` (credentials and endpoints from the environment, e.g.
    ``AWS_ENDPOINT_URL``, ``AWS_PROFILE`` or fsspec's ``FSSPEC_S3_*``) and the root location."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    scheme = url.partition("://")[0]
    return fs, RemotePath(f"{scheme}://", str(path).rstrip("/"))


def _at(location: Path) -> RemotePath:
    """A location the store handed this backend: a RemotePath standing in for a Path."""
    return cast(RemotePath, location)


class FsspecFiles:
    """A store's files in an fsspec filesystem (see the module doc)."""

    checks_owners = False

    def __init__(self, fs: AbstractFileSystem) -> None:
        self.fs = fs

    def check_trust(self, chain: list[Path], role: str) -> None:
        """Nothing to check: an object store's access control says who may write it."""

    # ------------------------------------------------------------ listing

    def _names(self, location: RemotePath) -> list[str]:
        """Base names under ``location`` (FileNotFoundError when there is nothing)."""
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(location.path)
        entries = self.fs.ls(location.path, detail=False)
        return [posixpath.basename(str(entry).rstrip("/")) for entry in entries]

    def names(self, location: Path, *, directories: bool = False) -> list[str]:
        return self._names(_at(location))  # no directories in an object store: names are prefixes

    def list_part(self, step_dir: Path, sub: str) -> list[str]:
        return self._names(_at(step_dir) / sub)

    def open_step(self, directory: Path, role: str) -> _RemoteStep:
        return _RemoteStep(self.fs, _at(directory))

    def is_regular(self, directory: Path, name: str) -> bool:
        """verl's own caches are pickles on local disks; never looked for in a remote store."""
        return False

    def stat(self, location: Path) -> tuple[str, int] | None:
        try:
            info = self.fs.info(_at(location).path)
        except Exception:
            return None
        size = info.get("size")
        return ("file" if info.get("type") == "file" else "directory"), size if type(size) is int else 0

    def step_files(self, step_dir: Path) -> list[StoredFile]:
        """One recursive listing of the step's prefix (keys below a part directory's are left out)."""
        step = _at(step_dir)
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(step.path)
        listed: dict[str, Any] = self.fs.find(step.path, detail=True)
        if not listed:
            raise FileNotFoundError(str(step))
        out = []
        for key, info in listed.items():
            part, _, name = str(key)[len(step.path) + 1 :].rpartition("/")
            if str(key).startswith(step.path + "/") and name and "/" not in part:
                size = info.get("size")
                out.append(StoredFile(part, name, "file", size if type(size) is int else 0, _modified(info, 0.0)))
        return out

    def read_bytes(self, location: Path, limit: int) -> bytes:
        data = bytes(self.fs.cat_file(_at(location).path, start=0, end=limit + 1))
        if len(data) > limit:
            raise CorruptCacheError(f"{location}: larger than {limit} bytes")
        return data

    def versions(self, root: Path, locations: list[Path]) -> dict[Path, int]:
        """An object's ETag (or modification time) and size, digested; many from one recursive listing."""
        try:
            if len(locations) == 1:
                return {locations[0]: _object_version(self.fs.info(_at(locations[0]).path))}
            keys = {_at(location).path: location for location in locations}
            with contextlib.suppress(Exception):
                self.fs.invalidate_cache(_at(root).path)
            listed = self.fs.find(_at(root).path, detail=True)
        except Exception:
            return {}
        found = {str(name).rstrip("/"): info for name, info in listed.items()}
        return {keys[name]: _object_version(info) for name, info in found.items() if name in keys}

    # ------------------------------------------------------------ writing

    def prepare(self, step_dir: Path, folder: Path) -> list[Path]:
        return []  # no directories to create: keys appear with their objects

    def write(self, location: Path, produce: Callable[[BinaryIO], T], write_id: str | None = None) -> tuple[int, T]:
        handle = self.fs.open(_at(location).path, "wb")
        try:
            result = produce(_Pieces(handle))  # type: ignore[arg-type]
            size = int(handle.tell())
        except BaseException:
            _discard(handle)
            raise
        handle.close()  # the upload completes here: the object appears whole
        return size, result

    def commit(self, step_dir: Path, meta: bytes, write_id: str) -> None:
        self.fs.pipe_file((_at(step_dir) / META_NAME).path, meta)

    def claim(self, project: Path, first: int, token: str) -> int:
        """No exclusive create in an object store: put a claim object in the step, list the step, and
        take the number only if this claim is the only one there and no ``meta.json`` is (strongly
        consistent listings: of two racing writers at most one sees only its own; both may step on)."""
        for number in range(first, first + MAX_CLAIMS):
            step = _at(project) / step_name(number)
            marker = step / f"{CLAIM_PREFIX}{token}"
            self.fs.pipe_file(marker.path, b"")
            try:
                names = self._names(step)
            except FileNotFoundError:
                names = []
            if [n for n in names if n.startswith(CLAIM_PREFIX) or n == META_NAME] == [marker.name]:
                return number
            with contextlib.suppress(Exception):
                self.fs.rm_file(marker.path)
        raise CacheError(f"{project}: steps {first} to {first + MAX_CLAIMS - 1} are all taken")

    def release(self, project: Path, number: int, token: str) -> None:
        with contextlib.suppress(Exception):
            self.fs.rm_file((_at(project) / step_name(number) / f"{CLAIM_PREFIX}{token}").path)

    def remove(self, location: Path, anchor: Path | None = None) -> None:
        with contextlib.suppress(Exception):
            self.fs.rm_file(_at(location).path)

    def remove_step(self, anchor: Path, step_dir: Path, wanted: Callable[[str, str], bool]) -> tuple[int, int]:
        """Delete the step's chosen objects, ``meta.json`` first (no directories to remove)."""
        try:
            listed = self.step_files(step_dir)
        except FileNotFoundError:
            return 0, 0
        chosen = sorted(
            (f for f in listed if wanted(f.part, f.name)), key=lambda f: bool(f.part) or f.name != META_NAME
        )
        files = size = 0
        for found in chosen:
            where = _at(step_dir) / found.part / found.name if found.part else _at(step_dir) / found.name
            self.fs.rm_file(where.path)
            files += 1
            size += found.size
        return files, size

    def collect(self, project: Path, step: int, named: set[str] | None) -> tuple[int, int]:
        """Remove data files of ``step`` that no ``meta.json`` names (``named``) and that are older than
        :data:`ABANDONED_AFTER` (interrupted or superseded uploads). Never raises."""
        removed = freed = 0
        if named is None:  # no readable meta.json: nothing can be told apart from a live upload
            return removed, freed
        try:
            step_dir = _at(project) / step_name(step)
            folders = [step_dir] + [step_dir / n for n in self._names(step_dir) if PART_NAME.fullmatch(n)]
            now = time.time()
            for folder in folders:
                for name in self._names(folder):
                    location = folder / name
                    if not DATA_NAME.fullmatch(name) or str(location) in named:
                        continue
                    if any(write_id in name for write_id in ACTIVE_WRITE_IDS):
                        continue
                    info = self.fs.info(location.path)
                    if now - _modified(info, now) < ABANDONED_AFTER:
                        continue
                    self.fs.rm_file(location.path)
                    removed += 1
                    freed += int(info.get("size") or 0)
        except Exception:
            pass
        return removed, freed


class _RemoteStep:
    """One remote step: ``meta.json`` in one bounded request, files streamed after a size check."""

    def __init__(self, fs: AbstractFileSystem, directory: RemotePath) -> None:
        self.fs = fs
        self.directory = directory

    def read_meta(self) -> bytes:
        location = self.directory / META_NAME
        try:
            # One ranged GET, no size query first: meta.json is replaced in place by later commits, and
            # a size from one version with the bytes of another would be a spurious damaged step.
            data = self.fs.cat_file(location.path, start=0, end=MAX_META_BYTES + 1)
            if len(data) > MAX_META_BYTES:
                raise CorruptCacheError(
                    f"{location}: larger than {MAX_META_BYTES} bytes, far larger than any meta.json"
                )
        except (FileNotFoundError, CacheError):
            raise
        except Exception as exc:
            raise CorruptCacheError(
                f"{location}: unreadable meta.json ({type(exc).__name__}: {_one_line(exc)})"
            ) from exc
        return bytes(data)

    def _size(self, location: RemotePath) -> int:
        """The object's size; FileNotFoundError when absent, CorruptCacheError when it is no file."""
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(location.parent.path)
        info = self.fs.info(location.path)
        size = info.get("size")
        if info.get("type") != "file" or type(size) is not int or size < 0:
            raise CorruptCacheError(f"{location}: not a regular object")
        return size

    def _stream(self, location: RemotePath, size: int, hasher: _Hasher) -> bytearray:
        """Exactly ``size`` bytes of an object, streamed into memory chunk by chunk (hashed as they come)."""
        buffer = bytearray(size)
        view = memoryview(buffer)
        got = 0
        with self.fs.open(location.path, "rb", block_size=READ_CHUNK, cache_type="none") as handle:
            while got < size:
                piece = handle.read(min(READ_CHUNK, size - got))
                if not piece:
                    break
                view[got : got + len(piece)] = piece
                hasher.update(piece)
                got += len(piece)
        if got != size:
            raise CorruptCacheError(f"{location}: {got} bytes read, meta.json records {size}")
        return buffer

    def read(self, sub: str, name: str, size: object, kind: str, algo: str) -> tuple[bytes | bytearray, str]:
        location = self._location(sub, name)
        with self._reading(location, size) as size:
            hasher = _Hasher(algo)
            data = self._stream(location, size, hasher)
        return (data if kind == "tensors" else bytes(data)), hasher.hexdigest()  # tensors are views of it

    def read_decoded(
        self, sub: str, name: str, spec: Mapping[str, Any], algo: str, make: Callable[[int], Decoded]
    ) -> tuple[Decoded, str]:
        """A compressed data file decoded while it downloads, and the checksum of its stored bytes
        (the caller discards the decoded bytes unless it matches): requested in
        :data:`STREAM_CHUNK` pieces, each complete frame decompressed in a thread while the next
        piece arrives; the whole stored file is never held. Same size and frame checks as a read; a
        file whose stored bytes do not match ``spec["checksum"]`` is reported as such, whatever its
        frames did."""
        from skipinject.store.compression import FrameDecoder

        location = self._location(sub, name)
        with self._reading(location, spec.get("size")) as size:
            decoder = FrameDecoder(spec, size, location, make)  # type: ignore[arg-type]
            try:
                hasher = _Hasher(algo)
                got = 0
                failure: CorruptCacheError | None = None
                with self.fs.open(location.path, "rb", block_size=STREAM_CHUNK, cache_type="none") as handle:
                    while got < size:
                        piece = handle.read(min(STREAM_CHUNK, size - got))
                        if not piece:
                            break
                        hasher.update(piece)
                        got += len(piece)
                        if failure is None:
                            try:
                                decoder.feed(piece)
                            except CorruptCacheError as exc:  # read on: a changed file is reported as such
                                failure = exc
                if got != size:
                    raise CorruptCacheError(f"{location}: {got} bytes read, meta.json records {size}")
                if hasher.hexdigest() != spec.get("checksum"):
                    raise CorruptCacheError(f"{location}: checksum mismatch (the file was damaged or changed)")
                if failure is not None:
                    raise failure
                decoded = decoder.finish()
            except BaseException:
                decoder.abandon()
                raise
        return decoded, hasher.hexdigest()

    def _location(self, sub: str, name: str) -> RemotePath:
        return self.directory / sub / name if sub else self.directory / name

    @contextlib.contextmanager
    def _reading(self, location: RemotePath, size: object) -> Iterator[int]:
        """Reading ``location``: its size checked against the record first; failures made CorruptCacheErrors."""
        if type(size) is not int or size < 0:
            raise CorruptCacheError(f"{location}: meta.json records no size")
        try:
            found = self._size(location)
            if found != size:
                raise CorruptCacheError(f"{location}: {found} bytes, meta.json records {size}")
            yield size
        except FileNotFoundError as exc:
            raise CorruptCacheError(f"{location}: missing (named by meta.json)") from exc
        except CacheError:
            raise
        except Exception as exc:  # network, permission, memory: not a cache we use
            raise CorruptCacheError(f"{location}: cannot read it ({type(exc).__name__}: {_one_line(exc)})") from exc

    def close(self) -> None:
        """Nothing is held open between requests."""


def _modified(info: Mapping[str, Any], default: float) -> float:
    """An object's modification time (seconds) from fsspec's ``info``; ``default`` when unknown."""
    for key in ("LastModified", "mtime", "updated", "created", "last_modified"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            from datetime import datetime

            with contextlib.suppress(ValueError):
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return default


def _object_version(info: Mapping[str, Any]) -> int:
    """A 56-bit digest of what tells one upload of an object from another."""
    tag = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or info.get("created")
    text = f"{tag}|{info.get('size')}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "big")


class _Pieces:
    """A write-only handle passing at most :data:`WRITE_PIECE` bytes per ``write`` to ``handle``:
    fsspec's buffered files copy what they are given into their buffer before uploading a block,
    so a 600 MB tensor written at once would be held twice in memory."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def write(self, data: Any) -> int:
        with memoryview(data) as whole, whole.cast("B") as view:
            for start in range(0, len(view), WRITE_PIECE):
                self._handle.write(view[start : start + WRITE_PIECE])
            return len(view)

    def tell(self) -> int:
        return int(self._handle.tell())

    def flush(self) -> None:
        """Uploads happen block by block as written; nothing to hand to the kernel."""

    def fileno(self) -> int:
        raise OSError("not a local file")


def _discard(handle: Any) -> None:
    """Abandon an upload in progress so that no partial object appears: fsspec's buffered files
    abort their multipart upload on ``discard``; the handle is then marked closed without the
    final flush that would publish what was written."""
    discard = getattr(handle, "discard", None)
    if callable(discard):
        with contextlib.suppress(Exception):
            discard()
    with contextlib.suppress(Exception):
        handle.closed = True
