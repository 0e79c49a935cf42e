"""The generation log: one JSON line per event in ``$VERL_CPU_GEN_LOG`` (imports nothing from verl)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

GEN_LOG_ENV = "VERL_CPU_GEN_LOG"


def log_event(event: str, **fields: Any) -> None:
    """Append one JSON line ``{"event", "pid", "time", **fields}`` to ``$VERL_CPU_GEN_LOG`` (if set).

    Events: ``server_start`` (a generation server loaded its model), ``generate`` (one request
    served) and ``weight_sync`` (a server loaded the weights a trainer sent). One ``os.write`` on an
    ``O_APPEND`` descriptor per line, so lines written by concurrent processes never interleave.
    """
    path = os.environ.get(GEN_LOG_ENV)
    if not path:
        return
    record = {"event": event, "pid": os.getpid(), "time": time.time(), **fields}
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def prompt_digest(prompt_ids: list[int]) -> str:
    """A short digest of a request's prompt tokens: which prompt a ``generate`` event served."""
    return hashlib.blake2b(",".join(map(str, prompt_ids)).encode(), digest_size=8).hexdigest()
