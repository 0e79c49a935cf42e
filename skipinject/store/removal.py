"""Removing files of a cache without a path look-up after a check: one primitive for every remover.

A check on a path followed by a second look-up of the same path is a race: between the two, another
user of a shared (sticky, 1777) dump directory can swap a step they own for a symbolic link to
someone else's step, and a removal by path then empties the victim's directory. Here a directory is
reached from an *anchor* (the dump or project directory, opened once) one name at a time with
``O_DIRECTORY | O_NOFOLLOW`` and held by its descriptor; files are listed, ``fstat``-ed and unlinked
relative to the descriptor they were listed in (``unlinkat``), directories removed with
``rmdir(name, dir_fd=)``. A link anywhere below the anchor ends the removal there; a directory
renamed away after it was opened is still the directory that was checked.

Used by ``skipinject cache prune`` and ``import``, the store's garbage collection
(:mod:`skipinject.store.garbage`) and the writer's clean-up after a failed save
(:meth:`skipinject.store.local.LocalFiles.remove`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from skipinject.store.format import META_NAME, PART_NAME

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)

#: Called with (descriptor of the directory, name) right before a name is unlinked; tests use it
#: to make a race deterministic. Production code never sets it.
BEFORE_UNLINK: Callable[[int, str], None] | None = None


class LinkedPath(OSError):
    """A name below the anchor is a symbolic link or not a directory: nothing is removed through it."""


def relative_parts(anchor: Path, path: Path) -> tuple[str, ...]:
    """The names leading from ``anchor`` to ``path`` (ValueError when ``path`` is not below it)."""
    parts = Path(path).relative_to(anchor).parts
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"{path}: not a plain path below {anchor}")
    return parts


def open_below(anchor: Path | int, parts: Sequence[str]) -> int:
    """A descriptor of ``anchor/parts...``: the anchor opened once (a path, or a descriptor that is
    duplicated), every name below it with ``O_NOFOLLOW``. Raises :class:`LinkedPath` for a link."""
    fd = os.dup(anchor) if isinstance(anchor, int) else os.open(anchor, DIR_FLAGS & ~os.O_NOFOLLOW)
    try:
        for part in parts:
            if part in ("", ".", "..") or "/" in part:
                raise LinkedPath(errno.EINVAL, f"{part!r} is not a plain name")
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise LinkedPath(exc.errno, f"{part}: a symbolic link or not a directory") from exc
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def opened_below(anchor: Path | int, parts: Sequence[str]) -> Iterator[int]:
    fd = open_below(anchor, parts)
    try:
        yield fd
    finally:
        os.close(fd)


def unlink_regular(dir_fd: int, name: str, keep: Callable[[os.stat_result], bool] | None = None) -> int | None:
    """Unlink ``name`` in ``dir_fd`` if it is a regular file (never a link's target: ``unlinkat``
    removes the name itself) and ``keep`` does not veto it; its size, or None when kept."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or (keep is not None and keep(info)):
        return None
    if BEFORE_UNLINK is not None:
        BEFORE_UNLINK(dir_fd, name)
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        return None
    return info.st_size


def remove_name(anchor: Path, path: Path) -> None:
    """Remove one file or empty directory ``path`` below ``anchor`` (best effort, never raises):
    the writer's clean-up. The anchor itself, or a directory above it, is only removed when empty
    (``rmdir`` never follows a link); a path not below the anchor is anchored at its parent."""
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
        with opened_below(anchor, parts[:-1]) as parent:
            try:
                os.unlink(parts[-1], dir_fd=parent)  # never follows a link: removes the name
            except (IsADirectoryError, PermissionError):
                os.rmdir(parts[-1], dir_fd=parent)


def remove_step(
    anchor: Path,
    step_dir: Path,
    wanted: Callable[[str, str], bool],
    keep: Callable[[os.stat_result], bool] | None = None,
) -> tuple[int, int]:
    """Remove the files of a step directory below ``anchor`` that ``wanted(part, name)`` selects
    (``part`` is ``""`` for the step directory itself), ``meta.json`` first (the step is absent at
    once), then empty part directories and the step directory. Everything relative to descriptors
    opened once from ``anchor``; a link on the way removes nothing. Returns (files, bytes)."""
    parts = relative_parts(anchor, step_dir)
    if not parts:
        raise ValueError(f"{step_dir}: the anchor itself is no step directory")
    files = size = 0
    with opened_below(anchor, parts[:-1]) as parent_fd, opened_below(parent_fd, parts[-1:]) as step_fd:
        names = os.listdir(step_fd)
        ordered = sorted(names, key=lambda n: n != META_NAME)
        for name in ordered:
            if PART_NAME.fullmatch(name):
                continue
            if wanted("", name):
                removed = unlink_regular(step_fd, name, keep)
                if removed is not None:
                    files += 1
                    size += removed
        for name in names:
            if not PART_NAME.fullmatch(name):
                continue
            try:
                part_fd = open_below(step_fd, [name])
            except OSError:
                continue  # a link or a file named like a part: not ours to follow
            try:
                for leaf in os.listdir(part_fd):
                    if wanted(name, leaf):
                        removed = unlink_regular(part_fd, leaf, keep)
                        if removed is not None:
                            files += 1
                            size += removed
            finally:
                os.close(part_fd)
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=step_fd)  # only ever succeeds when empty
        with contextlib.suppress(OSError):
            os.rmdir(parts[-1], dir_fd=parent_fd)
    return files, size
