"""The local backend: a directory tree, with every guarantee of docs/reliability.md. Reads go through
:mod:`skipinject.store.files`; writes through a temporary name, fsynced and renamed into place; directories
are created 0700."""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import takewhile
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TypeVar

from skipinject.errors import CacheError, CorruptCacheError, UntrustedCacheError
from skipinject.store.backend import Stat
from skipinject.store.checksums import _digest, read_private
from skipinject.store.files import (
    file_kind,
    open_dir,
    open_regular,
    read_fd,
    read_small,
    refuse_untrusted,
    remove_name,
    unresolved_problem,
)
from skipinject.store.format import MAX_META_BYTES, META_NAME, tmp_name

if TYPE_CHECKING:
    from skipinject.store.hit_memory import Decoded


T = TypeVar("T")
_KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "directory", stat.S_IFLNK: "link"}


@dataclass(eq=False, kw_only=True)
class LocalFiles:
    """``given_root``: the dump directory as given (links unresolved), checked before its resolved form."""

    checks_owners = True
    trust_permissions: bool = False
    given_root: Path | None = None

    def check_trust(self, chain: list[Path], role: str) -> None:
        """Every existing directory of ``chain`` only this user (or root) can write, unless trusted."""
        problem = None if self.trust_permissions or self.given_root is None else unresolved_problem(self.given_root)
        if problem is not None:
            raise UntrustedCacheError(
                f"{problem}: another user could redirect the cache; not loaded or saved. Fix: use a "
                f"dump_dir only you control, or set skip.{role}.trust_dir_permissions=true to use it anyway"
            )
        for directory in chain:
            try:
                info = os.stat(directory)
            except FileNotFoundError:
                raise
            except OSError as exc:
                raise CorruptCacheError(
                    f"{directory}: cannot check the directory ({type(exc).__name__}: {exc})"
                ) from exc
            if not stat.S_ISDIR(info.st_mode):
                raise CorruptCacheError(
                    f"{directory} is {file_kind(info.st_mode)}, not a directory: nothing is cached there"
                )
            if not self.trust_permissions:
                refuse_untrusted(directory, info, role)

    def _check_fd(self, fd: int, path: Path, role: str) -> None:
        if not self.trust_permissions:
            refuse_untrusted(path, os.fstat(fd), role)

    def names(self, location: Path, *, directories: bool = False, follow: bool = False) -> list[str]:
        """``follow``: ``location`` itself may be a link (the cache tool's walk from a root as given)."""
        if directories or follow:
            with os.scandir(location) as entries:
                return [entry.name for entry in entries if not directories or entry.is_dir(follow_symlinks=False)]
        fd = open_dir(location)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def open_step(self, directory: Path, role: str) -> _LocalStep:
        fd = open_dir(directory)
        try:
            self._check_fd(fd, directory, role)
        except BaseException:
            os.close(fd)
            raise
        return _LocalStep(self, directory, fd, role)

    def stat(self, location: Path, *, follow: bool = False) -> Stat | None:
        try:
            info = os.stat(location) if follow else os.lstat(location)
        except OSError:
            return None
        return Stat(_KINDS.get(stat.S_IFMT(info.st_mode), "other"), info.st_size, info.st_mtime)

    def read_bytes(self, location: Path, limit: int) -> bytes:
        return read_small(location, limit)

    def versions(self, root: Path, locations: list[Path]) -> dict[Path, int]:
        found = {}
        for location in locations:
            with contextlib.suppress(OSError, ValueError):
                found[location] = os.stat(location, follow_symlinks=False).st_mtime_ns
        return found

    def prepare(self, step_dir: Path, folder: Path) -> list[Path]:
        if os.path.lexists(step_dir):
            _refuse_link(step_dir)
        created = make_private_dirs(folder)
        for directory in {step_dir, folder}:
            _refuse_link(directory)
        return list(created)

    def write(self, location: Path, produce: Callable[[BinaryIO], T], write_id: str | None = None) -> tuple[int, T]:
        result = _write_file_atomic(location, produce, write_id)
        return location.stat().st_size, result

    def replace(self, location: Path, data: bytes, write_id: str) -> None:
        _refuse_link(location.parent)
        _write_file_atomic(location, lambda h: h.write(data), write_id)
        _fsync_dir(location.parent)

    def make_dir(self, location: Path) -> bool:
        """``mkdir`` relative to the parent's descriptor: it fails for every other creator."""
        fd = open_dir(location.parent)
        try:
            os.mkdir(location.name, 0o700, dir_fd=fd)
        except FileExistsError:
            return False
        finally:
            os.close(fd)
        return True

    def remove(self, location: Path, anchor: Path | None = None) -> None:
        remove_name(anchor if anchor is not None else location.parent, location)


@dataclass(eq=False)
class _LocalStep:
    """One step directory, held by its descriptor; part directories opened relative to it."""

    files: LocalFiles
    directory: Path
    fd: int
    role: str
    _parts: dict[str, int] = field(default_factory=dict)
    _seen: set[tuple[int, int]] = field(default_factory=set)  # (st_dev, st_ino) of every data file opened

    def read_meta(self) -> bytes:
        return read_small(META_NAME, MAX_META_BYTES, self.fd, self.directory / META_NAME)

    def _part_fd(self, sub: str) -> int:
        if not sub:
            return self.fd
        fd = self._parts.get(sub)
        if fd is None:
            shown = self.directory / sub
            try:
                fd = open_dir(sub, self.fd, shown=shown)
            except FileNotFoundError as exc:
                raise CorruptCacheError(f"{shown}: missing (named by meta.json)") from exc
            self._parts[sub] = fd
            self.files._check_fd(fd, shown, self.role)
        return fd

    def read(
        self, sub: str, name: str, size: object, algo: str, *, into: Callable[[int], Decoded] | None = None
    ) -> tuple[Decoded | bytes, str]:
        fd, info, path = self._open(sub, name, size)
        try:
            if into is not None:
                return read_private(fd, info.st_size, into, algo, path)
            blob = read_fd(fd, info.st_size, path)
            return blob, _digest(blob, algo)
        except CacheError:
            raise
        except Exception as exc:  # OSError, MemoryError, ValueError: not a cache we use
            raise CorruptCacheError(f"{path}: cannot read it ({type(exc).__name__}: {exc})") from exc
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def stream(self, sub: str, name: str, size: object) -> Iterator[Iterator[bytes]]:
        """The file in pieces of :data:`STREAM_PIECE` bytes (a compressed file: its frames decode while the next
        piece is read and hashed, and its stored bytes are never all held in fresh memory at once), one byte more
        asked for at the end: a file that shrank or grew meanwhile yields fewer or more bytes than ``size``."""
        fd, info, _ = self._open(sub, name, size)
        try:
            yield _pieces(fd, info.st_size)
        finally:
            os.close(fd)

    def _open(self, sub: str, name: str, size: object) -> tuple[int, os.stat_result, Path]:
        part_fd = self._part_fd(sub)
        path = self.directory / sub / name if sub else self.directory / name
        try:
            fd, info = open_regular(name, part_fd, path, size)
        except FileNotFoundError as exc:
            raise CorruptCacheError(f"{path}: missing (named by meta.json)") from exc
        if (info.st_dev, info.st_ino) in self._seen:  # a hard link to another file of the step: never written so
            os.close(fd)
            raise CorruptCacheError(f"{path}: the same file as another file of the step (a hard link); not read")
        self._seen.add((info.st_dev, info.st_ino))
        return fd, info, path

    def close(self) -> None:
        for fd in self._parts.values():
            os.close(fd)
        self._parts.clear()
        os.close(self.fd)


#: Bytes of a streamed local file read at a time (a few of zstd's frames).
STREAM_PIECE = 8 << 20


def _pieces(fd: int, size: int) -> Iterator[bytes]:
    """``fd``'s bytes from its position, in pieces, until its end or ``size + 1`` bytes."""
    left = size + 1
    while left > 0 and (piece := os.read(fd, min(left, STREAM_PIECE))):
        left -= len(piece)
        yield piece


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_file_atomic(path: Path, write: Callable[[BinaryIO], T], write_id: str | None = None) -> T:
    """Through a temporary name carrying the writer's id, fsynced, then renamed; what ``write`` returned."""
    tmp = path.with_name(tmp_name(path.name, write_id or uuid.uuid4().hex[:8]))
    handle = open(tmp, "wb", opener=lambda at, flags: os.open(at, flags | os.O_EXCL | os.O_NOFOLLOW, 0o666))  # noqa: SIM115
    try:
        with handle:
            result = write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        return result
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def make_private_dirs(path: Path) -> list[Path]:
    """Create ``path`` and missing parents private to the owner; those it created."""
    created = []
    for directory in reversed(list(takewhile(lambda probe: not probe.exists(), (path, *path.parents)))):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)
            created.append(directory)
    return created


def _refuse_link(directory: Path) -> None:
    """Never write through a step or part directory that is a symlink (or not a directory)."""
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise CorruptCacheError(f"{directory} is {kind}; not writing through it")
