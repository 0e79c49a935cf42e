"""Leftovers of killed or concurrent saves: files no committed ``meta.json`` names, removed once abandoned.

A leftover matches our own name patterns and is at least :data:`ABANDONED_AFTER` old, and its writer
(the write id ``{unix_time}-{pid}-{uuid8}`` in its name) is gone: no such process on this host, not an
open writer of this process, or older than :data:`PID_REUSE_AFTER`. Empty step directories that old go
too; a step whose ``meta.json`` cannot be read is left alone. Locally nothing follows a link (see
:mod:`skipinject.store.files`) and each file is checked again right before its unlink; in an object
store data files are removed by name after :data:`BY_NAME_ABANDONED_AFTER` (:func:`collect_by_name`)."""

from __future__ import annotations

import contextlib
import functools
import os
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from skipinject.store.files import open_below, relative_parts, try_open_dir, unlink_regular
from skipinject.store.format import (
    DATA_NAME,
    MAX_META_BYTES,
    META_NAME,
    PART_NAME,
    STEP_NAME,
    TMP_NAME,
    WRITE_ID,
    is_ours,
)
from skipinject.store.meta import read_named
from skipinject.store.usage import USAGE_NAME

if TYPE_CHECKING:
    from skipinject.store.backend import Backend

ABANDONED_AFTER = 600.0
#: Where no process can be asked whether it is alive (an object store): a writer slower than this
#: loses its upload, and simply saves the step again next time.
BY_NAME_ABANDONED_AFTER = 3600.0
PID_REUSE_AFTER = 86400.0
#: A later save scans its whole project at most this often per process (its own step: every time).
SCAN_INTERVAL = 600.0

#: Write ids of this process's writers that have not committed or aborted yet.
ACTIVE_WRITE_IDS: set[str] = set()
_LAST_SCAN: dict[str, float] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Leftover:
    """A file (or an empty part directory, ``size == 0``) that an abandoned save left behind."""

    path: Path
    size: int
    reason: str
    #: The project directory it was found from: removal walks down from there, never by path.
    anchor: Path | None = None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a pid we wrote: do not pretend to know
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _writer_gone(name: str, age: float) -> bool:
    """Whether the writer named in a file name is certainly not writing any more."""
    match = WRITE_ID.search(name)
    if match is None or age >= PID_REUSE_AFTER:
        return True
    pid = int(match.group(2))
    if pid == os.getpid():
        return match.group(0) not in ACTIVE_WRITE_IDS
    return not _pid_alive(pid)


def _named_by_meta(step_fd: int) -> set[str] | None:
    """What the step's meta.json names; empty if it has none; None if unreadable."""
    try:
        return read_named(step_fd, Path(META_NAME), MAX_META_BYTES)
    except Exception:
        return None


def _abandoned(name: str, info: os.stat_result, now: float, min_age: float) -> bool:
    age = now - info.st_mtime
    return stat.S_ISREG(info.st_mode) and age >= min_age and _writer_gone(name, age)


def _scan_step(
    project_fd: int, project_dir: Path, step_name: str, now: float, min_age: float, out: list[Leftover]
) -> None:
    step_fd = try_open_dir(step_name, project_fd)
    if step_fd is None:
        return  # a symlink, not a directory, or unreadable: not ours to touch
    step_dir = project_dir / step_name
    folders = {"": step_fd}
    try:
        names = os.listdir(step_fd)
        if set(names) <= {USAGE_NAME} and now - os.fstat(step_fd).st_mtime >= min_age:
            out.append(Leftover(step_dir, 0, _DEAD_CLAIM, project_dir))  # a claim or save that never wrote
            return
        for child in names:
            part_fd = try_open_dir(child, step_fd) if PART_NAME.fullmatch(child) else None
            if part_fd is not None:
                folders[child] = part_fd
        listings = {sub: names if not sub else os.listdir(fd) for sub, fd in folders.items()}
        if META_NAME in names and _one_write(listings.values()):
            return  # the usual committed step: nothing to collect, no meta.json parsed
        named = _named_by_meta(step_fd)
        if named is None:
            return
        for sub, fd in folders.items():
            found = [
                item for name in listings[sub] if (item := _leftover(fd, step_dir, sub, name, named, now, min_age))
            ]
            out.extend(found)
            left = set(listings[sub]) - {item.path.name for item in found}
            if sub and not named and not left and now - os.fstat(fd).st_mtime >= min_age:
                out.append(Leftover(step_dir / sub, 0, _DEAD_PART, project_dir))
    except OSError:
        return
    finally:
        for fd in folders.values():
            os.close(fd)


def _leftover(
    folder_fd: int, step_dir: Path, sub: str, name: str, named: set[str], now: float, min_age: float
) -> Leftover | None:
    if not is_ours(name) or f"{sub}/{name}" in named:
        return None
    try:
        info = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
    except OSError:
        return None
    if not _abandoned(name, info, now, min_age):
        return None
    if name.startswith("."):
        reason = "temporary file of an interrupted save"
    elif named:
        reason = "data file not named by the step's meta.json (replaced, or a losing concurrent save)"
    else:
        reason = "data file of a save that never committed (no meta.json)"
    folder = step_dir / sub if sub else step_dir
    return Leftover(folder / name, info.st_size, reason, step_dir.parent)


_DEAD_CLAIM = "empty step directory (a claim or save that never wrote a file)"
_DEAD_PART = "part directory of a save that never committed"


def _one_write(listings: Iterable[list[str]]) -> bool:
    """Only one write's data files and no temporary file (listings only)."""
    ids = set()
    for name in (name for listing in listings for name in listing):
        if TMP_NAME.fullmatch(name):
            return False
        if DATA_NAME.fullmatch(name):
            match = WRITE_ID.search(name)
            ids.add(match.group(0) if match else name)
    return len(ids) <= 1


def find_leftovers(
    project_dir: Path, *, now: float | None = None, min_age: float = ABANDONED_AFTER, steps: Iterable[str] | None = None
) -> list[Leftover]:
    """Abandoned files of our own saves under ``project_dir`` (``steps``: only these step directories)."""
    now = time.time() if now is None else now
    project_fd = try_open_dir(project_dir)
    if project_fd is None:
        return []
    out: list[Leftover] = []
    try:
        try:
            names = os.listdir(project_fd) if steps is None else list(steps)
        except OSError:
            return []
        for name in names:
            if STEP_NAME.fullmatch(name):
                _scan_step(project_fd, Path(project_dir), name, now, min_age, out)
    finally:
        os.close(project_fd)
    return out


def remove_leftovers(leftovers: Iterable[Leftover], *, min_age: float = ABANDONED_AFTER) -> tuple[int, int]:
    """Unlink leftovers (files, then empty part and step directories), each reached from its project directory
    without following a link and checked again right before; returns (files removed, bytes)."""
    items = list(leftovers)
    files = bytes_ = 0
    now = time.time()
    order = {_DEAD_CLAIM: 2, _DEAD_PART: 1}
    for item in sorted(items, key=lambda i: order.get(i.reason, 0) if i.size == 0 else 0):
        anchor = item.anchor if item.anchor is not None else _project_of(item.path)
        try:
            parts = relative_parts(anchor, item.path)
            parent_fd = open_below(anchor, parts[:-1])
        except (OSError, ValueError):
            continue
        try:
            if item.reason in order:
                if item.reason == _DEAD_CLAIM:
                    step_fd = try_open_dir(item.path.name, parent_fd)
                    if step_fd is not None:
                        unlink_regular(step_fd, USAGE_NAME)  # a usage record left without its step
                        os.close(step_fd)
                with contextlib.suppress(OSError):
                    os.rmdir(item.path.name, dir_fd=parent_fd)  # only ever succeeds when empty
                continue
            step_fd = parent_fd if len(parts) == 2 else try_open_dir("..", parent_fd)
            if step_fd is None:
                continue
            try:
                sub = parts[1] if len(parts) == 3 else ""
                keep = functools.partial(_changed, item, step_fd=step_fd, sub=sub, now=now, min_age=min_age)
                size = unlink_regular(parent_fd, item.path.name, keep=keep)
            finally:
                if step_fd != parent_fd:
                    os.close(step_fd)
            if size is not None:
                files += 1
                bytes_ += size
        finally:
            os.close(parent_fd)
    return files, bytes_


def _project_of(path: Path) -> Path:
    in_part = PART_NAME.fullmatch(path.parent.name) and STEP_NAME.fullmatch(path.parent.parent.name)
    return path.parent.parent.parent if in_part else path.parent.parent


def _changed(item: Leftover, info: os.stat_result, *, step_fd: int, sub: str, now: float, min_age: float) -> bool:
    """Whether a leftover, looked at again right before its unlink, must be kept after all."""
    name = item.path.name
    if not is_ours(name) or not _abandoned(name, info, now, min_age):
        return True
    named = _named_by_meta(step_fd)
    return named is None or f"{sub}/{name}" in named


def collect(project_dir: Path, *, step: int | None = None, force: bool = False) -> tuple[int, int]:
    """After a commit: remove leftovers of ``step`` now, of the whole project at most once per
    :data:`SCAN_INTERVAL` per process. Never raises; returns (files removed, bytes)."""
    try:
        key = str(project_dir)
        now = time.monotonic()
        with _LOCK:
            last = _LAST_SCAN.get(key)
            whole = force or last is None or now - last >= SCAN_INTERVAL
            if whole:
                _LAST_SCAN[key] = now
        if whole:
            found = find_leftovers(project_dir)
        elif step is not None:
            found = find_leftovers(project_dir, steps=[str(int(step))])
        else:
            return 0, 0
        return remove_leftovers(found)
    except Exception:
        return 0, 0


def collect_by_name(backend: Backend, step_dir: Path, named: set[str] | None) -> tuple[int, int]:
    """Remove data files of a step no ``meta.json`` names (``named``: None if unreadable, then nothing), no
    writer of this process holds, and :data:`BY_NAME_ABANDONED_AFTER` old. Never raises."""
    removed = freed = 0
    if named is None:
        return removed, freed
    try:
        folders = [step_dir] + [step_dir / n for n in backend.names(step_dir) if PART_NAME.fullmatch(n)]
        now = time.time()
        for folder in folders:
            for name in backend.names(folder):
                location = folder / name
                if not DATA_NAME.fullmatch(name) or str(location) in named:
                    continue
                if any(write_id in name for write_id in ACTIVE_WRITE_IDS):
                    continue
                found = backend.stat(location)
                if found is None or now - (found.modified or now) < BY_NAME_ABANDONED_AFTER:
                    continue
                backend.remove(location)
                removed += 1
                freed += found.size
    except Exception:
        pass
    return removed, freed
