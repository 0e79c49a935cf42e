"""Steps under an fsspec URL (``s3://``, ``gs://``, ``memory://``...): the :class:`FsspecFiles` backend.

No rename, no directories, no POSIX owners: data files are uploaded whole under fresh names, then
``meta.json`` in one request (the commit). Reads check each object's size before a byte is read."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import posixpath
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar, cast

from skipinject.errors import CacheError, CorruptCacheError
from skipinject.store.backend import Stat
from skipinject.store.checksums import _Hasher
from skipinject.store.format import MAX_META_BYTES, META_NAME

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

T = TypeVar("T")

#: Bytes per request reading a data file: large, as some servers pay for a ranged read per whole object.
READ_CHUNK = 128 << 20
#: Bytes per request reading a compressed file: smaller, so decoding its frames starts sooner.
STREAM_CHUNK = 8 << 20
#: Bytes handed to an upload at a time (see :class:`_Pieces`).
WRITE_PIECE = 8 << 20


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
    """The fsspec filesystem of ``url`` (credentials from the environment) and the root location."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    scheme = url.partition("://")[0]
    return fs, RemotePath(f"{scheme}://", str(path).rstrip("/"))


def _at(location: Path) -> RemotePath:
    return cast(RemotePath, location)


@dataclass(eq=False)
class FsspecFiles:
    checks_owners = False
    fs: AbstractFileSystem

    def names(self, location: Path, *, directories: bool = False) -> list[str]:
        """Every name: no directories in an object store, names are prefixes."""
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(_at(location).path)
        return [posixpath.basename(str(entry).rstrip("/")) for entry in self.fs.ls(_at(location).path, detail=False)]

    def open_step(self, directory: Path, role: str) -> _RemoteStep:
        return _RemoteStep(self.fs, _at(directory))

    def stat(self, location: Path) -> Stat | None:
        try:
            info = self.fs.info(_at(location).path)
        except Exception:
            return None
        size = info.get("size")
        kind = "file" if info.get("type") == "file" else "directory"
        return Stat(kind, size if type(size) is int else 0, _modified(info))

    def read_bytes(self, location: Path, limit: int) -> bytes:
        return _read_small(self.fs, _at(location), limit)

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

    def replace(self, location: Path, data: bytes, write_id: str) -> None:
        self.fs.pipe_file(_at(location).path, data)  # one request: the object appears whole

    def remove(self, location: Path, anchor: Path | None = None) -> None:
        """Delete one object (gone already: nothing to do); a denied delete raises OSError."""
        try:
            self.fs.rm_file(_at(location).path)
        except FileNotFoundError:
            pass
        except OSError:
            raise
        except Exception as exc:  # an object store's own error type: one line, as an OSError
            raise OSError(errno.EIO, _one_line(exc), str(location)) from exc

    def prepare(self, step_dir: Path, folder: Path) -> list[Path]:
        return []  # no directories to create: keys appear with their objects

    def make_dir(self, location: Path) -> None:
        """No directories, so no exclusive create: see :meth:`~skipinject.store.StepStore.claim`."""

    def check_trust(self, chain: list[Path], role: str) -> None: ...


@dataclass(eq=False)
class _RemoteStep:
    """One remote step: ``meta.json`` in one bounded request, files streamed after a size check."""

    fs: AbstractFileSystem
    directory: RemotePath

    def read_meta(self) -> bytes:
        return _read_small(self.fs, self.directory / META_NAME, MAX_META_BYTES)

    def read(
        self, sub: str, name: str, size: object, algo: str, *, into: object = None
    ) -> tuple[bytes | bytearray, str]:
        """Downloaded whole into memory of this process, :data:`READ_CHUNK` at a time."""
        hasher = _Hasher(algo)
        with self.stream(sub, name, size, READ_CHUNK) as pieces:
            data = bytearray(cast(int, size))
            got = 0
            for piece in pieces:
                data[got : got + len(piece)] = piece
                hasher.update(piece)
                got += len(piece)
            if got != size:
                raise CorruptCacheError(f"{self.directory / sub / name}: {got} bytes read, meta.json records {size}")
        return (data if into is not None else bytes(data)), hasher.hexdigest()  # tensors are views of it

    @contextlib.contextmanager
    def stream(self, sub: str, name: str, size: object, chunk: int | None = None) -> Iterator[Iterator[bytes]]:
        """``chunk`` (:data:`STREAM_CHUNK`) bytes per request, never held whole; every failure a CorruptCacheError."""
        location, chunk = self.directory / sub / name, chunk or STREAM_CHUNK
        if type(size) is not int or size < 0:
            raise CorruptCacheError(f"{location}: meta.json records no size")
        try:
            with contextlib.suppress(Exception):
                self.fs.invalidate_cache(location.parent.path)
            info = self.fs.info(location.path)
            if info.get("type") != "file" or type(info.get("size")) is not int or info["size"] < 0:
                raise CorruptCacheError(f"{location}: not a regular object")
            if info["size"] != size:
                raise CorruptCacheError(f"{location}: {info['size']} bytes, meta.json records {size}")
            with self.fs.open(location.path, "rb", block_size=chunk, cache_type="none") as handle:

                def pieces() -> Iterator[bytes]:
                    got = 0
                    while got < size and (piece := handle.read(min(chunk, size - got))):
                        got += len(piece)
                        yield piece

                yield pieces()
        except FileNotFoundError as exc:
            raise CorruptCacheError(f"{location}: missing (named by meta.json)") from exc
        except CacheError:
            raise
        except Exception as exc:  # network, permission, memory: not a cache we use
            raise CorruptCacheError(f"{location}: cannot read it ({type(exc).__name__}: {_one_line(exc)})") from exc

    def close(self) -> None: ...


def _read_small(fs: AbstractFileSystem, location: RemotePath, limit: int) -> bytes:
    """A whole small object in one ranged GET, no size query first (it may be replaced in between)."""
    what = "meta.json" if location.name == META_NAME else "file"
    try:
        data = bytes(fs.cat_file(location.path, start=0, end=limit + 1))
    except (FileNotFoundError, CacheError):
        raise
    except Exception as exc:
        raise CorruptCacheError(f"{location}: unreadable {what} ({type(exc).__name__}: {_one_line(exc)})") from exc
    if len(data) > limit:
        far = ", far larger than any meta.json" if what == "meta.json" else ""
        raise CorruptCacheError(f"{location}: larger than {limit} bytes{far}")
    return data


def _modified(info: Mapping[str, Any]) -> float | None:
    """An object's modification time (seconds) from fsspec's ``info``, if known."""
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
    return None


def _object_version(info: Mapping[str, Any]) -> int:
    tag = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or info.get("created")
    text = f"{tag}|{info.get('size')}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "big")


@dataclass(eq=False)
class _Pieces:
    """A write-only handle passing at most :data:`WRITE_PIECE` bytes per ``write`` (fsspec copies what it is
    given, so a large tensor written at once would be held twice)."""

    _handle: Any

    def write(self, data: Any) -> int:
        with memoryview(data) as whole, whole.cast("B") as view:
            for start in range(0, len(view), WRITE_PIECE):
                self._handle.write(view[start : start + WRITE_PIECE])
            return len(view)

    def tell(self) -> int:
        return int(self._handle.tell())

    def flush(self) -> None: ...

    def fileno(self) -> int:
        raise OSError("not a local file")


def _discard(handle: Any) -> None:
    """Abandon an upload in progress (fsspec aborts a multipart upload on ``discard``) so no partial object appears."""
    with contextlib.suppress(Exception):
        handle.discard()
    with contextlib.suppress(Exception):
        handle.closed = True
