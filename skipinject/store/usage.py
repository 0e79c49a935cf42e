"""When a step was last served and how often: ``{step}/usage.json`` (``cache ls``, ``prune --max-size``).

A few dozen bytes replaced whole through the backend, never named by ``meta.json``: a hit never
rewrites the committed step, and two runs counting at once may lose an increment, never the file.
A record that is too large, not JSON or out of range is hostile input: ignored, said in one line."""

from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import dataclass

from skipinject.errors import CacheError
from skipinject.store.files import parse_json

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


def ignored(problem: str) -> None:
    """Say once per process that a record was ignored (its statistics are all that is lost)."""
    global _warned
    with _lock:
        first, _warned = not _warned, True
    if first:
        logger.warning("%s; its step's usage statistics start again (further such records: not reported)", problem)
    else:
        logger.debug("%s", problem)
