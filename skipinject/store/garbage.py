"""Leftovers of killed or concurrent saves: files no committed ``meta.json`` names, removed once abandoned
(``min_age`` old and their writer gone: docs/cache-tool.md, ``prune --partial``); a step whose ``meta.json``
cannot be read is left alone, and locally each file is checked again right before its unlink."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import skipinject.store.format as fmt
from skipinject.store.backend import Backend
from skipinject.store.files import relative_parts, remove_step
from skipinject.store.local import LocalFiles
from skipinject.store.meta import StepMeta
from skipinject.store.tree import read_json

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
    """A file (or an empty part or step directory, ``size == 0``) that an abandoned save left behind."""

    path: Path
    size: int
    reason: str
    #: The project directory it was found from: removal walks down from there, never by path.
    anchor: Path
    #: What removal unlinks: ``part/name`` of a file (``/name`` in the step directory), ``part/`` of an
    #: empty part directory, ``/`` of an empty step directory.
    key: str


def _abandoned(name: str, age: float, min_age: float, local: bool) -> bool:
    """Old enough, and the writer named in it certainly not writing any more."""
    if age < min_age:
        return False
    match = fmt.WRITE_ID.search(name)
    if match is None or age >= PID_REUSE_AFTER:
        return True
    if match.group(0) in ACTIVE_WRITE_IDS:
        return False
    pid = int(match.group(2))
    if pid == os.getpid() or not local:
        return True
    if not 0 < pid < 1 << 31:
        return False  # not a pid we wrote (nor one ``kill`` takes): do not pretend to know
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass
    return False


def _named(backend: Backend, step_dir: Path) -> set[str] | None:
    """What the step's meta.json names; empty if it has none; None if unreadable."""
    shown = step_dir / fmt.META_NAME
    try:
        raw = read_json(shown, backend)
        return StepMeta(raw, shown).named() if isinstance(raw, dict) else None
    except FileNotFoundError:
        return set()
    except Exception:
        return None


def _one_write(listings: Iterable[list[str]]) -> bool:
    """Only one write's data files and no temporary file (listings only)."""
    ids = set()
    for name in (name for listing in listings for name in listing):
        if fmt.TMP_NAME.fullmatch(name):
            return False
        if fmt.DATA_NAME.fullmatch(name):
            match = fmt.WRITE_ID.search(name)
            ids.add(match.group(0) if match else name)
    return len(ids) <= 1


def _old(backend: Backend, location: Path, now: float, min_age: float) -> bool:
    found = backend.stat(location)
    return found is not None and found.kind == "directory" and now - (found.modified or now) >= min_age


def _step_leftovers(backend: Backend, step_dir: Path, now: float, min_age: float) -> list[Leftover]:
    anchor, local = step_dir.parent, backend.checks_owners
    try:
        listings = {"": backend.names(step_dir)}
    except Exception:
        return []  # a link, not a directory, or unreadable: not ours to touch
    if set(listings[""]) <= {fmt.USAGE_NAME}:  # a claim or save that never wrote, or a usage record left alone
        dead = Leftover(step_dir, 0, "empty step directory (a claim or save that never wrote a file)", anchor, "/")
        return [dead] if _old(backend, step_dir, now, min_age) else []
    for sub in filter(fmt.PART_NAME.fullmatch, listings[""]):
        try:
            listings[sub] = backend.names(step_dir / sub)
        except Exception:
            continue  # a link or a file named like a part
    if fmt.META_NAME in listings[""] and _one_write(listings.values()):
        return []  # the usual committed step: nothing to collect, no meta.json parsed
    named = _named(backend, step_dir)
    if named is None:
        return []
    unnamed = (
        "data file not named by the step's meta.json (replaced, or a losing concurrent save)"
        if named
        else "data file of a save that never committed (no meta.json)"
    )
    out = []
    for sub, names in listings.items():
        folder = step_dir / sub if sub else step_dir
        found = []
        for name in names:
            info = backend.stat(folder / name) if fmt.is_ours(name) and f"{sub}/{name}" not in named else None
            if info is None or info.kind != "file" or not info.modified:
                continue
            if _abandoned(name, now - info.modified, min_age, local):
                reason = "temporary file of an interrupted save" if name.startswith(".") else unnamed
                found.append(Leftover(folder / name, info.size, reason, anchor, f"{sub}/{name}"))
        out += found
        if sub and not named and len(found) == len(names) and _old(backend, folder, now, min_age):
            out.append(Leftover(folder, 0, "part directory of a save that never committed", anchor, f"{sub}/"))
    return out


def find_leftovers(
    project_dir: Path,
    *,
    now: float | None = None,
    min_age: float = ABANDONED_AFTER,
    steps: Iterable[str] | None = None,
    backend: Backend | None = None,
) -> list[Leftover]:
    """Abandoned files of our own saves under ``project_dir`` (``steps``: only these step directories)."""
    backend = LocalFiles() if backend is None else backend
    now = time.time() if now is None else now
    try:
        names = backend.names(project_dir) if steps is None else list(steps)
    except Exception:
        return []
    step_dirs = [project_dir / name for name in names if fmt.STEP_NAME.fullmatch(name)]
    return [leftover for step_dir in step_dirs for leftover in _step_leftovers(backend, step_dir, now, min_age)]


def remove_leftovers(leftovers: Iterable[Leftover], *, min_age: float = ABANDONED_AFTER) -> tuple[int, int]:
    """Unlink local leftovers (files, then empty part and step directories), each step opened from its project
    directory without following a link and each file checked again right before; returns (files, bytes)."""
    now = time.time()
    steps: dict[tuple[Path, str], set[str]] = {}
    for item in leftovers:
        steps.setdefault((item.anchor, relative_parts(item.anchor, item.path)[0]), set()).add(item.key)
    removed = [_remove_chosen(anchor, anchor / step, chosen, now, min_age) for (anchor, step), chosen in steps.items()]
    return sum(files for files, _ in removed), sum(size for _, size in removed)


def _remove_chosen(anchor: Path, step_dir: Path, chosen: set[str], now: float, min_age: float) -> tuple[int, int]:
    meta: list[set[str] | None] = []

    def wanted(part: str, name: str, info: os.stat_result) -> bool:
        key = f"{part}/{name}"
        if key == f"/{fmt.USAGE_NAME}":
            return "/" in chosen  # a dead claim's usage record goes with it
        if key not in chosen or not (fmt.is_ours(name) and _abandoned(name, now - info.st_mtime, min_age, True)):
            return False
        if not meta:  # read again once the step is open: a save may have committed meanwhile
            meta.append(_named(LocalFiles(), step_dir))
        return meta[0] is not None and key not in meta[0]

    try:
        return remove_step(anchor, step_dir, wanted, lambda part: f"{part}/" in chosen)
    except (OSError, ValueError):
        return 0, 0


def collect(
    project_dir: Path, *, step: int | None = None, force: bool = False, backend: Backend | None = None
) -> tuple[int, int]:
    """After a commit: remove leftovers of ``step`` now; locally of the whole project at most once per
    :data:`SCAN_INTERVAL` per process. Never raises; returns (files removed, bytes)."""
    try:
        backend = LocalFiles() if backend is None else backend
        local = backend.checks_owners
        with _LOCK:
            last = _LAST_SCAN.get(str(project_dir))
            whole = local and (force or last is None or time.monotonic() - last >= SCAN_INTERVAL)
            if whole:
                _LAST_SCAN[str(project_dir)] = time.monotonic()
        if not whole and step is None:
            return 0, 0
        min_age = ABANDONED_AFTER if local else BY_NAME_ABANDONED_AFTER
        found = find_leftovers(project_dir, min_age=min_age, steps=None if whole else [str(step)], backend=backend)
        if local:
            return remove_leftovers(found)
        files = []
        for item in (item for item in found if not item.key.endswith("/")):
            with contextlib.suppress(OSError):
                backend.remove(item.path)
                files.append(item)
        return len(files), sum(item.size for item in files)
    except Exception:
        return 0, 0
