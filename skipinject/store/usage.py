"""When a step was last served and how often: a side record for upkeep (``cache ls``, ``prune --max-size``).

The record is ``{step}/usage.json`` beside the step's files: a few dozen bytes, replaced whole
through the store's backend (a temporary name and a rename on a local disk, one upload in an object
store), never named by ``meta.json``. So a hit never rewrites the committed step, and no checksum
or commit depends on the record. Two runs serving one step at once may each read ``n`` hits and
write ``n + 1``: an increment is lost, never the file.

Its bytes are hostile input like any under a cache: a record that is too large, not JSON, or holds
values out of range (a count below zero or past 2^53, a time in the future) is ignored, the
statistics of that step start again, and the process says so in at most one line.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from skipinject.errors import CacheError
from skipinject.store.backend import Backend, Stat
from skipinject.store.files import parse_json
from skipinject.store.format import META_NAME

logger = logging.getLogger("skipinject")

#: The record's name in a step directory (and ``.usage.json.tmp-*`` while a local one is replaced).
USAGE_NAME = "usage.json"
USAGE_TMP_PREFIX = f".{USAGE_NAME}.tmp-"
#: Larger records are not ours (a real one is under 100 bytes).
MAX_USAGE_BYTES = 1024
#: Counts past this are forged (JSON's exact integers end here).
MAX_HITS = 1 << 53
#: A last use further in the future than this (clock skew between nodes) is forged.
FUTURE_SLACK = 86400.0

_warned = False
_lock = threading.Lock()


class UsageStore(Protocol):
    """What the record uses of its :class:`~skipinject.store.StepStore`."""

    backend: Backend
    role: str

    def step_dir(self, step: int) -> Path: ...

    def at(self, step: int, *names: str) -> Path: ...

    def check_writable(self, directories: list[Path]) -> None: ...


@dataclass(frozen=True)
class Usage:
    """A step's statistics: how often it was served, and when last (unix time)."""

    hits: int
    last_served: float

    def encoded(self) -> bytes:
        return json.dumps({"hits": self.hits, "last_served": round(self.last_served, 3)}).encode()


def is_usage_name(name: str) -> bool:
    """The record or a temporary file of its local replacement (removed with the step)."""
    return name == USAGE_NAME or name.startswith(USAGE_TMP_PREFIX)


def parse_usage(data: bytes, shown: object, now: float) -> Usage:
    """A record's bytes checked; a CacheError naming what is wrong."""
    if len(data) > MAX_USAGE_BYTES:
        raise CacheError(f"{shown}: {len(data)} bytes, larger than any usage record")
    raw = parse_json(data, shown, what="usage record", max_depth=1)  # type: ignore[arg-type]
    hits = raw.get("hits") if isinstance(raw, dict) else None
    served = raw.get("last_served") if isinstance(raw, dict) else None
    if type(hits) is not int or not 0 <= hits <= MAX_HITS:
        raise CacheError(f"{shown}: no hit count in the usage record")
    if not isinstance(served, (int, float)) or type(served) is bool or not math.isfinite(served):
        raise CacheError(f"{shown}: no last-served time in the usage record")
    if not 0 <= served <= now + FUTURE_SLACK:
        raise CacheError(f"{shown}: no plausible last-served time in the usage record")
    return Usage(hits, float(served))


def _ignored(problem: str) -> None:
    """Say once per process that a record was ignored (its statistics are all that is lost)."""
    global _warned
    with _lock:
        first, _warned = not _warned, True
    if first:
        logger.warning("%s; its step's usage statistics start again (further such records: not reported)", problem)
    else:
        logger.debug("%s", problem)


def read_usage(store: UsageStore, step: int, now: float | None = None) -> Usage | None:
    """The step's record, or None (none yet, or one not to be trusted). Never raises."""
    location = store.at(step, USAGE_NAME)
    try:
        data = store.backend.read_bytes(location, MAX_USAGE_BYTES)
        return parse_usage(data, location, time.time() if now is None else now)
    except FileNotFoundError:
        return None
    except Exception as exc:
        _ignored(str(exc) if isinstance(exc, CacheError) else f"{location}: {type(exc).__name__}: {exc}")
        return None


def note_hit(store: UsageStore, step: int, now: float | None = None) -> None:
    """Count a hit of ``step`` (one more, now). Only into a committed step in a directory the run
    trusts; never raises (a failure costs the statistics, never the hit)."""
    now = time.time() if now is None else now
    try:
        backend = store.backend
        step_dir = store.step_dir(step)
        linked = backend.checks_owners and _kind(backend.stat(step_dir)) != "directory"  # object stores: no links
        if linked or _kind(backend.stat(step_dir / META_NAME)) != "file":
            return  # removed meanwhile (or a link): nothing to count in
        store.check_writable([step_dir])
        before = read_usage(store, step, now)
        hits = min(MAX_HITS, (before.hits if before is not None else 0) + 1)
        record = Usage(hits, now).encoded()
        backend.write(store.at(step, USAGE_NAME), lambda handle: handle.write(record))
    except Exception as exc:
        logger.debug("%s step %d: usage not recorded (%s: %s)", store.role, step, type(exc).__name__, exc)


def _kind(found: Stat | None) -> str:
    return found.kind if found is not None else "missing"
