"""The local backend: a directory tree, with every guarantee of docs/reliability.md.

Reading (:mod:`skipinject.store.files`): a step is opened by its directory's descriptor
(``O_DIRECTORY|O_NOFOLLOW``), its files relative to it with ``O_NOFOLLOW|O_NONBLOCK``, each opened
descriptor ``fstat``-ed (a regular file of the recorded size before a byte is read), tensor files
mapped copy-on-write and checksummed through the mapping; directories other users could write are
refused unless trusted (ssh's StrictModes). Writing: every file through a temporary name, fsynced,
renamed into place; ``meta.json`` last, then the directory fsynced; never through a linked
directory; directories created private to the user (0700).
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TypeVar

from skipinject.errors import CacheError, CorruptCacheError, UntrustedCacheError
from skipinject.store.backend import StoredFile
from skipinject.store.checksums import _digest, _digest_parallel
from skipinject.store.files import (
    file_kind,
    map_fd,
    open_dir,
    open_regular,
    read_fd,
    read_small,
    remove_name,
    remove_step,
    trust_problem,
    unresolved_problem,
    untrusted_reason,
)
from skipinject.store.format import MAX_CLAIMS, MAX_META_BYTES, META_NAME, PART_NAME, step_name, tmp_name
from skipinject.store.garbage import collect

if TYPE_CHECKING:
    import mmap


T = TypeVar("T")


class LocalFiles:
    """A store's files in a local directory tree (see the module doc)."""

    checks_owners = True

    def __init__(self, *, trust_permissions: bool = False, given_root: Path | None = None) -> None:
        """``trust_permissions``: load from directories other users could write (the user's opt-in).
        ``given_root``: the dump directory as the user gave it (``~`` expanded, links not resolved),
        checked for links and parents other users control before its resolved form is trusted."""
        self.trust_permissions = trust_permissions
        self.given_root = given_root

    # ------------------------------------------------------------ trust

    def check_trust(self, chain: list[Path], role: str) -> None:
        """Every existing directory of ``chain`` must be a directory (a FIFO, ``/dev/null`` or a file
        as ``dump_dir`` is a CorruptCacheError naming it) and, unless trusted, one only this user
        (or root) can write; the dump directory as given must not be redirectable by another user."""
        if not self.trust_permissions and self.given_root is not None:
            problem = unresolved_problem(self.given_root)
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
            if not self.trust_permissions and untrusted_reason(info) is not None:
                raise UntrustedCacheError(trust_problem(directory, info, role))

    def check_fd(self, fd: int, path: Path, role: str) -> None:
        if self.trust_permissions:
            return
        info = os.fstat(fd)
        if untrusted_reason(info) is not None:
            raise UntrustedCacheError(trust_problem(path, info, role))

    # ------------------------------------------------------------ reading

    def names(self, location: Path, *, directories: bool = False) -> list[str]:
        if directories:
            with os.scandir(location) as entries:
                return [entry.name for entry in entries if entry.is_dir(follow_symlinks=False)]
        fd = open_dir(location)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def list_part(self, step_dir: Path, sub: str) -> list[str]:
        """Names in part ``sub`` of a step, opened relative to the step's descriptor (no link followed)."""
        fd = open_dir(step_dir)
        try:
            part_fd = open_dir(sub, fd)
            try:
                return os.listdir(part_fd)
            finally:
                os.close(part_fd)
        finally:
            os.close(fd)

    def open_step(self, directory: Path, role: str) -> _LocalStep:
        fd = open_dir(directory)
        try:
            self.check_fd(fd, directory, role)
        except BaseException:
            os.close(fd)
            raise
        return _LocalStep(self, directory, fd, role)

    def is_regular(self, directory: Path, name: str) -> bool:
        try:
            step = self.open_step(directory, "")
        except Exception:
            return False
        try:
            parent_fd, leaf = step.fd, name
            sub, _, rest = name.partition("/")
            if rest:  # one part directory level, e.g. "0/tq_batch.pt"
                parent_fd, leaf = open_dir(sub, step.fd), rest
            try:
                fd, _ = open_regular(leaf, parent_fd, directory / name)
                os.close(fd)
            finally:
                if parent_fd != step.fd:
                    os.close(parent_fd)
        except Exception:
            return False
        finally:
            step.close()
        return True

    def stat(self, location: Path) -> tuple[str, int] | None:
        try:
            info = os.lstat(location)
        except OSError:
            return None
        return _kind(info.st_mode), info.st_size

    def step_files(self, step_dir: Path) -> list[StoredFile]:
        """Listed relative to the step's descriptor (``O_NOFOLLOW``), each name ``lstat``-ed there."""
        out: list[StoredFile] = []

        def listed(fd: int, part: str) -> None:
            for name in os.listdir(fd):
                with contextlib.suppress(OSError):
                    info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    out.append(StoredFile(part, name, _kind(info.st_mode), info.st_size, info.st_mtime))
                    if not part and stat.S_ISDIR(info.st_mode) and PART_NAME.fullmatch(name):
                        part_fd = open_dir(name, fd)
                        try:
                            listed(part_fd, name)
                        finally:
                            os.close(part_fd)

        step_fd = open_dir(step_dir)
        try:
            listed(step_fd, "")
        finally:
            os.close(step_fd)
        return out

    def read_bytes(self, location: Path, limit: int) -> bytes:
        return read_small(location, limit)

    def versions(self, root: Path, locations: list[Path]) -> dict[Path, int]:
        found = {}
        for location in locations:
            with contextlib.suppress(OSError, ValueError):
                found[location] = os.stat(location, follow_symlinks=False).st_mtime_ns
        return found

    # ------------------------------------------------------------ writing

    def prepare(self, step_dir: Path, folder: Path) -> list[Path]:
        if os.path.lexists(step_dir):
            _refuse_link(step_dir)
        created = make_private_dirs(folder)
        for directory in {step_dir, folder}:
            _refuse_link(directory)
        return list(created)

    def write(self, location: Path, produce: Callable[[BinaryIO], T], write_id: str | None = None) -> tuple[int, T]:
        done: list[T] = []
        _write_file_atomic(location, lambda handle: done.append(produce(handle)), write_id)
        return location.stat().st_size, done[0]

    def commit(self, step_dir: Path, meta: bytes, write_id: str) -> None:
        _refuse_link(step_dir)
        _write_file_atomic(step_dir / META_NAME, lambda h: h.write(meta), write_id)
        _fsync_dir(step_dir)

    def claim(self, project: Path, first: int, token: str) -> int:
        """The first number whose step directory this call creates: ``mkdir`` (relative to the
        project's descriptor, no link followed) fails for every other writer of that number."""
        fd = open_dir(project)
        try:
            for number in range(first, first + MAX_CLAIMS):
                try:
                    os.mkdir(step_name(number), 0o700, dir_fd=fd)
                except FileExistsError:
                    continue
                return number
        finally:
            os.close(fd)
        raise CacheError(f"{project}: steps {first} to {first + MAX_CLAIMS - 1} are all taken")

    def release(self, project: Path, number: int, token: str) -> None:
        """Nothing to release: the claimed directory is the record's."""

    def remove(self, location: Path, anchor: Path | None = None) -> None:
        """Reached from ``anchor`` (the dump or project directory) without following a link, never by
        a path looked up again after a check (:func:`~skipinject.store.files.remove_name`)."""
        remove_name(anchor if anchor is not None else location.parent, location)

    def remove_step(self, anchor: Path, step_dir: Path, wanted: Callable[[str, str], bool]) -> tuple[int, int]:
        """Relative to descriptors opened once from ``anchor`` (:func:`~skipinject.store.files.remove_step`)."""
        return remove_step(anchor, step_dir, wanted)

    def collect(self, project: Path, step: int, named: set[str] | None) -> tuple[int, int]:
        """The garbage rule of :mod:`skipinject.store.garbage` (which rereads meta.json itself)."""
        return collect(project, step=step)


class _LocalStep:
    """One step directory, held by its descriptor; part directories opened relative to it."""

    def __init__(self, files: LocalFiles, directory: Path, fd: int, role: str) -> None:
        self.files = files
        self.directory = directory
        self.fd = fd
        self.role = role
        self._parts: dict[str, int] = {}

    def read_meta(self) -> bytes:
        path = self.directory / META_NAME
        fd, info = open_regular(META_NAME, self.fd, path)
        try:
            if info.st_size > MAX_META_BYTES:
                raise CorruptCacheError(f"{path}: {info.st_size} bytes, far larger than any meta.json; not read")
            return read_fd(fd, info.st_size, path)
        except OSError as exc:
            raise CorruptCacheError(f"{path}: unreadable meta.json ({type(exc).__name__}: {exc})") from exc
        finally:
            os.close(fd)

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
            self.files.check_fd(fd, shown, self.role)
        return fd

    def read(
        self, sub: str, name: str, size: object, kind: str, algo: str
    ) -> tuple[mmap.mmap | bytes | bytearray, str]:
        part_fd = self._part_fd(sub)
        path = self.directory / sub / name if sub else self.directory / name
        try:
            fd, info = open_regular(name, part_fd, path, size)
        except FileNotFoundError as exc:
            raise CorruptCacheError(f"{path}: missing (named by meta.json)") from exc
        try:
            if kind == "tensors":
                mapped = map_fd(fd, info.st_size)
                data: mmap.mmap | bytes = b"" if mapped is None else mapped
                return data, _digest_parallel(data, algo)
            blob = read_fd(fd, info.st_size, path)
            return blob, _digest(blob, algo)
        except CacheError:
            raise
        except Exception as exc:  # OSError, MemoryError, ValueError from mmap: not a cache we use
            raise CorruptCacheError(f"{path}: cannot read it ({type(exc).__name__}: {exc})") from exc
        finally:
            os.close(fd)

    def close(self) -> None:
        for fd in self._parts.values():
            os.close(fd)
        self._parts.clear()
        os.close(self.fd)


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    return "link" if stat.S_ISLNK(mode) else "other"


# ---------------------------------------------------------------- writing


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_file_atomic(path: Path, write: Callable[[BinaryIO], object], write_id: str | None = None) -> None:
    """Write through a temporary name, fsync, then rename: the name holds all or nothing.

    The temporary name carries the writer's id (see :mod:`skipinject.store.garbage`)."""
    tmp = path.with_name(tmp_name(path.name, write_id or uuid.uuid4().hex[:8]))
    handle = open(tmp, "wb", opener=_exclusive)  # noqa: SIM115 - closed below
    try:
        with handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _exclusive(path: str, flags: int) -> int:
    """A fresh file, never a name planted there: no link followed, nothing truncated."""
    return os.open(path, flags | os.O_EXCL | os.O_NOFOLLOW, 0o666)


def make_private_dirs(path: Path) -> list[Path]:
    """Create ``path`` and missing parents readable by the owner only; returns those it created."""
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    created = []
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            continue
        created.append(directory)
    return created


def _refuse_link(directory: Path) -> None:
    """Never write through a step or part directory that is a symlink (or not a directory)."""
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise CorruptCacheError(f"{directory} is {kind}; not writing through it")
