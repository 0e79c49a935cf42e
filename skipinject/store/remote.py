"""Steps under an fsspec URL (``s3://``, ``gs://``, ``hdfs://``, ``memory://``...): one format, one rule.

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
:func:`split_dump_dir`), with every local guarantee.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skipinject.cluster import is_remote, local_path_text
from skipinject.errors import CacheError, ConfigError, CorruptCacheError
from skipinject.store.checksums import _digest, _Hasher
from skipinject.store.files import MAX_META_BYTES, MAX_META_DEPTH, parse_json
from skipinject.store.format import _SAFE_NAME, META_NAME
from skipinject.store.garbage import ACTIVE_WRITE_IDS
from skipinject.store.payload import Payload, StepEntry
from skipinject.store.step_store import _DATA_NAME, _PART_NAME, STEP_NAME, StepStore
from skipinject.store.tensorfile import write_tensors
from skipinject.store.writer import StepWriter

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

#: Bytes moved per request when reading a data file (a multiple of the tree checksum's 32 MiB
#: chunk). Large: some servers (moto, and any that do not index objects) pay for a ranged read in
#: proportion to the whole object; at most this much is held twice while it is copied.
READ_CHUNK = 128 << 20
#: Bytes handed to an upload at a time (see :class:`_Pieces`).
WRITE_PIECE = 8 << 20
#: An object store gives no process ids to ask whether a writer is alive: a data file no
#: ``meta.json`` names is removed only once it is this old (a writer slower than this would
#: lose its upload, and simply save the step again next time).
ABANDONED_AFTER = 3600.0


def split_dump_dir(dump_dir: str) -> str | Path:
    """A local ``Path`` (``file://`` URLs included) or the URL of a remote store, as given."""
    if is_remote(dump_dir):
        return dump_dir.rstrip("/") or dump_dir
    return Path(local_path_text(dump_dir)).expanduser().resolve()


def check_url(dump_dir: str, key: str) -> None:
    """Refuse (ConfigError naming ``key``) a URL no installed fsspec implementation can open.

    Imports fsspec and the protocol's package: only runs for a ``dump_dir`` that is a URL."""
    scheme = dump_dir.partition("://")[0].lower()
    try:
        import fsspec
    except ImportError as exc:
        raise ConfigError(
            f"{key}={dump_dir}: a URL needs fsspec (pip install fsspec and, for {scheme}://, "
            "its package, e.g. s3fs or gcsfs)"
        ) from exc
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError as exc:
        raise ConfigError(f"{key}={dump_dir}: fsspec knows no protocol {scheme!r}") from exc
    except ImportError as exc:
        raise ConfigError(f"{key}={dump_dir}: {_one_line(exc)}") from exc


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


class RemoteStepStore(StepStore):
    """:class:`StepStore` over an fsspec filesystem: the same format, commit rule and checks."""

    def __init__(
        self,
        project_dir: RemotePath,
        role: str,
        context: Mapping[str, Any],
        fs: AbstractFileSystem,
        plugin: str | None = None,
    ) -> None:
        # Paths are only shown and compared by the engine, so a RemotePath stands in for a Path.
        super().__init__(project_dir, role, context, trust_permissions=True, plugin=plugin)  # type: ignore[arg-type]
        self.location = project_dir
        self.fs = fs

    # ------------------------------------------------------------ locations

    def step_dir(self, step: int) -> Path:
        return self.location / str(int(step))  # type: ignore[return-value]

    def _at(self, step: int, *names: str) -> RemotePath:
        location = self.location / str(int(step))
        for name in names:
            location = location / name
        return location

    def begin(self, step: int) -> StepWriter:
        return RemoteStepWriter(self, step)

    def check_trust(self) -> None:
        """Nothing to check: an object store's access control says who may write it."""

    # ------------------------------------------------------------ listing

    def _names(self, location: RemotePath) -> list[str]:
        """Base names under ``location`` (FileNotFoundError when there is nothing)."""
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(location.path)
        entries = self.fs.ls(location.path, detail=False)
        return [posixpath.basename(str(entry).rstrip("/")) for entry in entries]

    def step_numbers_on_disk(self) -> list[int]:
        """Step numbers under the project: one listing, names only; ``[]`` when it cannot be listed."""
        try:
            names = self._names(self.location)
        except Exception:
            return []
        return sorted({int(name) for name in names if STEP_NAME.fullmatch(name)})

    def _names_in(self, step: int, sub: str = "") -> list[str]:
        return self._names(self._at(step, sub) if sub else self._at(step))

    def upstream_file(self, step: int, name: str, directory_name: str | None = None) -> Path | None:
        """verl's own caches are pickles on local disks; never looked for in a remote store."""
        return None

    # ------------------------------------------------------------ reading

    def _size(self, location: RemotePath) -> int:
        """The object's size; FileNotFoundError when absent, CorruptCacheError when it is no file."""
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(location.parent.path)
        info = self.fs.info(location.path)
        size = info.get("size")
        if info.get("type") != "file" or type(size) is not int or size < 0:
            raise CorruptCacheError(f"{location}: not a regular object")
        return size

    def read_meta(self, step: int) -> dict[str, Any]:
        location = self._at(step, META_NAME)
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
        meta = parse_json(bytes(data), location, what="meta.json", max_depth=MAX_META_DEPTH)  # type: ignore[arg-type]
        try:
            return self._check_meta(meta, location, step)  # type: ignore[arg-type]
        except CacheError:
            raise
        except Exception as exc:
            raise CorruptCacheError(f"{location}: meta.json is malformed ({type(exc).__name__}: {exc})") from exc

    def _read(self, location: RemotePath, size: int, hasher: _Hasher | None) -> bytearray:
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
                if hasher is not None:
                    hasher.update(piece)
                got += len(piece)
        if got != size:
            raise CorruptCacheError(f"{location}: {got} bytes read, meta.json records {size}")
        return buffer

    def verified(self, step: int) -> StepEntry:
        """The step's entry after reading and checking every file ``meta.json`` names."""
        meta = self.read_meta(step)
        directory = self.step_dir(step)
        entry = StepEntry(step, directory, meta)
        try:
            for location, spec in self.named_files(step, meta):
                self._verify_file(entry, location, spec)  # type: ignore[arg-type]
        except BaseException:
            entry.release()
            raise
        return entry

    def _verify_file(self, entry: StepEntry, location: RemotePath, spec: dict[str, Any]) -> None:
        expected = spec.get("size")
        if type(expected) is not int or expected < 0:
            raise CorruptCacheError(f"{location}: meta.json records no size")
        try:
            size = self._size(location)
            if size != expected:
                raise CorruptCacheError(f"{location}: {size} bytes, meta.json records {expected}")
            hasher = _Hasher(entry.meta["checksum_algo"])
            data = self._read(location, size, hasher)
        except FileNotFoundError as exc:
            raise CorruptCacheError(f"{location}: missing (named by meta.json)") from exc
        except CacheError:
            raise
        except Exception as exc:  # network, permission, memory: not a cache we use
            raise CorruptCacheError(f"{location}: cannot read it ({type(exc).__name__}: {_one_line(exc)})") from exc
        if hasher.hexdigest() != spec.get("checksum"):
            raise CorruptCacheError(f"{location}: checksum mismatch (the file was damaged or changed)")
        if spec["kind"] == "tensors":
            entry.mapped[location] = data  # type: ignore[index]  # tensors are views of it
        else:
            entry.blobs[location] = bytes(data)  # type: ignore[index]

    # ------------------------------------------------------------ garbage

    def collect_garbage(self, step: int, meta: Mapping[str, Any] | None = None) -> tuple[int, int]:
        """Remove data files of ``step`` that no ``meta.json`` names and that are older than
        :data:`ABANDONED_AFTER` (interrupted or superseded uploads). Never raises."""
        removed = freed = 0
        try:
            named = {str(location) for location, _ in self.named_files(step, meta or self.read_meta(step))}
            folders = [self._at(step)]
            folders += [self._at(step, n) for n in self._names(self._at(step)) if _PART_NAME.fullmatch(n)]
            now = time.time()
            for folder in folders:
                for name in self._names(folder):
                    location = folder / name
                    if not _DATA_NAME.fullmatch(name) or str(location) in named:
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


class RemoteStepWriter(StepWriter):
    """Uploads a step's files under fresh names, then ``meta.json`` last (see the module doc)."""

    store: RemoteStepStore

    def __init__(self, store: RemoteStepStore, step: int) -> None:
        super().__init__(store, step)
        self._uploaded: list[RemotePath] = []

    def add_part(self, payload: Payload, part: str = "") -> None:
        """Upload one part's files (invisible to readers until :meth:`commit`)."""
        if part and not _SAFE_NAME.match(part):
            raise ValueError(f"bad part name {part!r}")
        ACTIVE_WRITE_IDS.add(self.write_id)  # again, after a commit (a step growing call by call)
        store = self.store
        folder = store._at(self.step, part) if part else store._at(self.step)
        algo = store.checksum_algo
        files: dict[str, Any] = {}

        tensors_at = folder / f"tensors-{self.write_id}.bin"
        self._uploaded.append(tensors_at)
        handle = store.fs.open(tensors_at.path, "wb")
        try:
            checksum = write_tensors(_Pieces(handle), payload.tensors, algo)  # type: ignore[arg-type]
            size = handle.tell()
        except BaseException:
            _discard(handle)
            raise
        handle.close()  # the upload completes here: the object appears whole
        files["tensors"] = {"name": tensors_at.name, "size": size, "checksum": checksum}

        objects_at = folder / f"objects-{self.write_id}.json"
        self._uploaded.append(objects_at)
        blob = json.dumps(payload.objects, separators=(",", ":"), allow_nan=True).encode()
        store.fs.pipe_file(objects_at.path, blob)
        files["objects"] = {"name": objects_at.name, "size": len(blob), "checksum": _digest(blob, algo)}
        self.parts[part] = {"dir": part, "rows": payload.rows, "files": files}

    def commit(self, meta: Mapping[str, Any]) -> Path:
        """Publish the step: put ``meta.json`` (one request) after every data file is uploaded."""
        text = self.meta_record(meta)
        self.store.fs.pipe_file(self.store._at(self.step, META_NAME).path, text)
        self._uploaded.clear()
        ACTIVE_WRITE_IDS.discard(self.write_id)
        self.store.collect_garbage(self.step, json.loads(text))
        return self.directory

    def abort(self) -> None:
        """Remove what this writer uploaded (best effort)."""
        for location in self._uploaded:
            with contextlib.suppress(Exception):
                self.store.fs.rm_file(location.path)
        self._uploaded.clear()
        ACTIVE_WRITE_IDS.discard(self.write_id)


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
