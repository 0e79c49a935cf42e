"""The one module that opens, reads and removes a cache's local files, as docs/reliability.md says: no link
followed, regular files of the recorded size before a byte is read, trust as ssh's ``StrictModes``. Failures
are CorruptCacheError (a missing file stays ``FileNotFoundError``)."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, cast

from skipinject.errors import CorruptCacheError, UntrustedCacheError
from skipinject.store.format import MAX_META_BYTES, META_NAME, PART_NAME, SPARSE_FACTOR, SPARSE_MIN_SIZE

_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _why(exc: OSError) -> str:
    return f"{type(exc).__name__}: {exc.strerror or exc}"


def open_dir(path: Path | str, dir_fd: int | None = None, *, shown: Path | None = None) -> int:
    shown = shown or Path(path)
    try:
        return os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                is_link = stat.S_ISLNK(os.lstat(path, dir_fd=dir_fd).st_mode)
            except OSError:
                is_link = exc.errno == errno.ELOOP
            kind = "a symbolic link" if is_link else "not a directory"
            raise CorruptCacheError(
                f"{shown} is {kind}; not loaded (a step is read only from a real directory)"
            ) from exc
        raise CorruptCacheError(f"{shown}: cannot open the directory ({_why(exc)})") from exc


def open_regular(
    name: str, dir_fd: int | None, shown: Path, expected_size: object = None
) -> tuple[int, os.stat_result]:
    """Open ``name`` in ``dir_fd`` as a regular file, refused unless of ``expected_size`` (when given)."""

    def regular(info: os.stat_result) -> os.stat_result:
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCacheError(f"{shown}: cannot read it (not a regular file but {file_kind(info.st_mode)})")
        return info

    try:
        regular(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CorruptCacheError(f"{shown}: cannot read it ({_why(exc)})") from exc
    try:
        info = regular(os.fstat(fd))
        if expected_size is not None:
            if type(expected_size) is not int or expected_size < 0:
                raise CorruptCacheError(f"{shown}: meta.json records no valid size ({expected_size!r})")
            if info.st_size != expected_size:
                raise CorruptCacheError(f"{shown}: {info.st_size} bytes, meta.json says {expected_size} (truncated?)")
        blocks = getattr(info, "st_blocks", None)  # a sparse file: hashing it would cost its size, not its disk
        if blocks is not None and info.st_size >= SPARSE_MIN_SIZE and blocks * 512 * SPARSE_FACTOR < info.st_size:
            raise CorruptCacheError(
                f"{shown}: {info.st_size} bytes, but only {blocks * 512} on disk "
                "(a sparse file, not written by skipinject)"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, info


_KINDS = {
    stat.S_IFREG: "a regular file",
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a pipe",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def file_kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), f"file type {stat.S_IFMT(mode):o}")


def read_fd(fd: int, size: int, shown: Path) -> bytes:
    """Exactly ``size`` bytes (the fstat-ed size); a file that grew or shrank meanwhile is refused."""
    chunks = []
    left = size + 1
    while left > 0:
        chunk = os.read(fd, min(left, 0x7FFFF000))  # one read (no copy on join) for any real file
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    data = b"".join(chunks)
    if len(data) != size:
        raise CorruptCacheError(f"{shown}: changed while being read ({len(data)} bytes, expected {size})")
    return data


def parse_json(data: bytes, shown: Path, *, what: str = "JSON file", max_depth: int | None = None) -> Any:
    """``json.loads`` whose every failure (syntax, nesting past ``max_depth``, memory) is CorruptCacheError."""
    try:
        value = json.loads(data)
    except RecursionError as exc:
        raise CorruptCacheError(f"{shown}: unreadable {what} (JSON nested too deeply)") from exc
    except MemoryError as exc:
        raise CorruptCacheError(f"{shown}: unreadable {what} (too large to parse)") from exc
    except Exception as exc:
        raise CorruptCacheError(f"{shown}: unreadable {what} ({type(exc).__name__}: {exc})") from exc
    stack = [(value, 1)] if max_depth is not None else []  # nesting, counted without recursion
    while stack:
        item, depth = stack.pop()
        if depth > cast(int, max_depth):
            raise CorruptCacheError(f"{shown}: unreadable {what} (JSON nested more than {max_depth} levels deep)")
        children = item.values() if type(item) is dict else item if type(item) is list else ()
        stack.extend((child, depth + 1) for child in children if type(child) in (dict, list))
    return value


def refuse_untrusted(path: Path, info: os.stat_result, role: str) -> None:
    """Refuse (UntrustedCacheError naming the fix) a directory with this ``stat`` ssh's StrictModes would not trust."""
    uid = os.geteuid()
    if info.st_uid not in (uid, 0):
        why, fix = f"is owned by uid {info.st_uid}, not by you (uid {uid})", "chown it to you"
    elif info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        who = " and ".join(w for bit, w in ((0o020, "group"), (0o002, "others")) if info.st_mode & bit)
        why = f"is writable by {who} (mode {stat.S_IMODE(info.st_mode):03o}, no sticky bit)"
        fix = f"chmod go-w {path}"
    else:
        return
    raise UntrustedCacheError(
        f"{path} {why}: another user could plant or replace a cache there; not loaded or saved. "
        f"Fix: {fix}, or set skip.{role}.trust_dir_permissions=true to load it anyway"
    )


def bounded_dir_problem(directory: Path, names: re.Pattern[str], max_bytes: int, *, trusted: bool) -> str | None:
    """Why files of ``directory`` whose names match ``names`` are not to be read (a cache's recorded model
    directory), or None: unless ``trusted``, the directory must pass :func:`refuse_untrusted` and those files be
    yours or root's; in any, each (links followed) is a regular file of at most ``max_bytes``."""
    uid = os.geteuid()
    try:
        if not trusted:
            refuse_untrusted(directory, os.stat(directory), "-")  # its fix (a role's key) is not shown
        with os.scandir(directory) as entries:
            found = sorted(entry.name for entry in entries if names.fullmatch(entry.name))
        for name in found:
            info = os.stat(directory / name)
            if not stat.S_ISREG(info.st_mode):
                return f"{name} is {file_kind(info.st_mode)}, not a regular file"
            if info.st_size > max_bytes:
                return f"{name} holds {info.st_size} bytes, more than the {max_bytes} it may hold"
            if not trusted and info.st_uid not in (uid, 0):
                return f"{name} is owned by uid {info.st_uid}, not by you (uid {uid})"
    except UntrustedCacheError as exc:
        return str(exc).split(":", 1)[0]
    except OSError as exc:
        return f"cannot read it ({_why(exc)})"
    return None


def unresolved_problem(path: Path) -> str | None:
    """Why ``path`` as given (links unresolved) could be redirected by another user, or None."""
    uid = os.geteuid()
    given = Path(os.path.abspath(path))  # ``..`` removed by text, no link resolved
    current = Path(given.anchor)
    for name in given.parts[1:]:
        try:
            holder = os.stat(current)
        except OSError:
            return None
        if holder.st_mode & 0o002 and not holder.st_mode & stat.S_ISVTX:
            return (
                f"{given}: {current} is writable by others (mode {stat.S_IMODE(holder.st_mode):03o}, no sticky bit), "
                f"so another user could replace {name!r} in it"
            )
        current = current / name
        try:
            info = os.lstat(current)
        except OSError:
            return None  # missing: created private to the user (and checked again once created)
        if stat.S_ISLNK(info.st_mode) and info.st_uid not in (uid, 0):
            return f"{given}: {current} is a symbolic link owned by uid {info.st_uid}, not by you (uid {uid})"
    return None


def read_small(
    path: Path | str, limit: int = MAX_META_BYTES, dir_fd: int | None = None, shown: Path | None = None
) -> bytes:
    """A small regular file's bytes (at most ``limit``), by path or by name in ``dir_fd``."""
    shown = shown or Path(path)
    fd, info = open_regular(str(path), dir_fd, shown)
    try:
        if info.st_size > limit:
            if Path(path).name == META_NAME:
                raise CorruptCacheError(f"{shown}: {info.st_size} bytes, far larger than any meta.json; not read")
            raise CorruptCacheError(f"{shown}: {info.st_size} bytes, more than the {limit} any such file may have")
        return read_fd(fd, info.st_size, shown)
    except OSError as exc:
        raise CorruptCacheError(f"{shown}: cannot read it ({_why(exc)})") from exc
    finally:
        os.close(fd)


def read_head(path: Path, size: int) -> bytes:
    """The first ``size`` bytes of a regular file (never a link, a FIFO never blocks); OSError otherwise."""
    fd = os.open(path, _FILE_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
        return os.read(fd, size)
    finally:
        os.close(fd)


#: Tests only: called with (directory descriptor, name) right before an unlink, to make a race deterministic.
BEFORE_UNLINK: Callable[[int, str], None] | None = None


class LinkedPath(OSError):
    """A name below the anchor is a link or no directory: nothing is removed through it."""


def relative_parts(anchor: Path, path: Path) -> tuple[str, ...]:
    """The names leading from ``anchor`` to ``path`` (ValueError when ``path`` is not below it)."""
    parts = Path(path).relative_to(anchor).parts
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"{path}: not a plain path below {anchor}")
    return parts


@contextlib.contextmanager
def open_below(anchor: Path | int, parts: Sequence[str]) -> Iterator[int]:
    """A descriptor of ``anchor/parts...``, each name opened with ``O_NOFOLLOW`` (:class:`LinkedPath`)."""
    fd = os.dup(anchor) if isinstance(anchor, int) else os.open(anchor, _DIR_FLAGS & ~os.O_NOFOLLOW)
    try:
        for part in parts:
            if part in ("", ".", "..") or "/" in part:
                raise LinkedPath(errno.EINVAL, f"{part!r} is not a plain name")
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise LinkedPath(exc.errno, f"{part}: a symbolic link or not a directory") from exc
                raise
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def unlink_regular(dir_fd: int, name: str, wanted: Callable[[os.stat_result], bool]) -> int | None:
    """Unlink ``name`` if it is a regular file ``wanted(lstat)`` selects; its size. A wanted file that cannot go
    (a read-only file system, an immutable directory) raises its OSError: the removal stops and says why."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or not wanted(info):
        return None
    if BEFORE_UNLINK is not None:
        BEFORE_UNLINK(dir_fd, name)
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:  # removed meanwhile by another collector
        return None
    return info.st_size


def remove_name(anchor: Path, path: Path) -> None:
    """Remove one file or empty directory below ``anchor`` (best effort, never raises)."""
    with contextlib.suppress(OSError, ValueError):
        try:
            parts = relative_parts(anchor, path)
        except ValueError:
            above = Path(anchor).is_relative_to(path)
            parts = () if above else relative_parts(path.parent, path)
            anchor = path.parent
        if not parts:
            os.rmdir(path)
            return
        with open_below(anchor, parts[:-1]) as parent:
            try:
                os.unlink(parts[-1], dir_fd=parent)  # never follows a link: removes the name
            except (IsADirectoryError, PermissionError):
                os.rmdir(parts[-1], dir_fd=parent)


def remove_step(
    anchor: Path,
    step_dir: Path,
    wanted: Callable[[str, str, os.stat_result], bool],
    emptied: Callable[[str], bool] = lambda part: True,
) -> tuple[int, int]:
    """Remove the files ``wanted(part, name, lstat)`` selects from a step below ``anchor``, ``meta.json`` first,
    then the directories ``emptied(part)`` selects if empty (``""``: the step's); returns (files, bytes)."""
    parts = relative_parts(anchor, step_dir)
    if not parts:
        raise ValueError(f"{step_dir}: the anchor itself is no step directory")
    files = size = 0
    with open_below(anchor, parts[:-1]) as parent_fd, open_below(parent_fd, parts[-1:]) as step_fd:
        for name in sorted(os.listdir(step_fd), key=lambda n: n != META_NAME):
            if not PART_NAME.fullmatch(name):
                found = [unlink_regular(step_fd, name, functools.partial(wanted, "", name))]
            else:
                try:
                    with open_below(step_fd, [name]) as part_fd:
                        leaves = os.listdir(part_fd)
                        found = [
                            unlink_regular(part_fd, leaf, functools.partial(wanted, name, leaf)) for leaf in leaves
                        ]
                except OSError:
                    continue  # a link or a file named like a part: not ours to follow
                if emptied(name):
                    with contextlib.suppress(OSError):
                        os.rmdir(name, dir_fd=step_fd)  # only ever succeeds when empty
            removed = [count for count in found if count is not None]
            files, size = files + len(removed), size + sum(removed)
        if emptied(""):
            with contextlib.suppress(OSError):
                os.rmdir(parts[-1], dir_fd=parent_fd)
    return files, size


def open_plain(path: Path, what: str = "a regular file") -> BinaryIO:
    """A file named on the command line (not a cache's), opened only if it is a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    handle = os.fdopen(fd, "rb")
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        handle.close()
        raise CorruptCacheError(f"{path} is {file_kind(mode)}, not {what}")
    return handle
