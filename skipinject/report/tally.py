"""What the cache did in this process: counts per role, for the run's summary and the trainer's metrics.

The engine adds to :data:`TALLY` at each decision (a step served, generated, failed; rows; bytes read;
the generation time a hit saved, as the step's ``meta.json`` recorded it). verl runs the trainer and
the rollout in Ray actors, other processes than the driver that prints the summary: each process with
counts writes them, whole, to ``{SKIPINJECT_RUN_REPORT}/{pid}.json`` after each change (a directory the
driver made private to the user and hands to the run's processes in the environment), and the driver
adds the files up at the end (:func:`collect`). A process on another node writes to a directory there
that the driver does not read: its counts are in that trainer's metrics only.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from skipinject.config.environment import ENV_RUN_REPORT

__all__ = [
    "ENV_RUN_REPORT",
    "FIELDS",
    "METRICS_TARGET",
    "TALLY",
    "MetricsInterceptor",
    "Tally",
    "collect",
    "hit_amounts",
]

#: Where verl's trainers log a step's metrics (every verl this supports).
METRICS_TARGET = "verl.utils.tracking:Tracking.log"


#: What is counted per role (every value a number; ``*_s`` in seconds).
FIELDS = (
    "served_steps",
    "generated_steps",
    "failed_steps",
    "served_rows",
    "generated_rows",
    "rescored_rows",
    "bytes_read",
    "generation_s_saved",
)
#: Most process files :func:`collect` reads, and the largest one it reads (a file is a few hundred bytes).
MAX_FILES = 4096
MAX_FILE_BYTES = 64 << 10


class Tally:
    """The counts of this process, per role."""

    def __init__(self) -> None:
        self.roles: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()

    def add(self, role: str, **amounts: float) -> None:
        """Add ``amounts`` (keys of :data:`FIELDS`) to ``role``'s counts, and publish them."""
        with self._lock:
            counts = self.roles.setdefault(role, dict.fromkeys(FIELDS, 0))
            for key, amount in amounts.items():
                counts[key] += amount
            snapshot = {name: dict(values) for name, values in self.roles.items()}
        publish(snapshot)

    def metrics(self) -> dict[str, float]:
        """Running totals over the roles, as the trainer logs them (``skipinject/served_steps_total`` ...)."""
        with self._lock:
            return {f"skipinject/{key}_total": total(self.roles, key) for key in FIELDS} if self.roles else {}

    def clear(self) -> None:
        with self._lock:
            self.roles.clear()


#: The counts of this process.
TALLY = Tally()


def total(roles: Mapping[str, Mapping[str, float]], key: str) -> float:
    return sum(counts.get(key, 0) for counts in roles.values())


def count_rescored(role: str, rows: int) -> None:
    """Count ``rows`` a role re-scored with this run's reward in the run's summary (plugin API 1.4)."""
    if rows > 0:
        TALLY.add(role, rescored_rows=rows)


def report_dir() -> Path | None:
    """The run's report directory from the environment, if it is a directory of this user's that only
    this user can write (anything else is ignored: the variable is input like any other)."""
    text = os.environ.get(ENV_RUN_REPORT, "")
    if not text or "\x00" in text or not os.path.isabs(text):
        return None
    try:
        info = os.lstat(text)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        return None
    return Path(text)


def publish(roles: Mapping[str, Mapping[str, float]]) -> None:
    """Replace this process's file in the run's report directory (never raises)."""
    directory = report_dir()
    if directory is None:
        return
    final = directory / f"{os.getpid()}.json"
    temporary = directory / f".{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump({"roles": roles}, handle)
        os.replace(temporary, final)
    except OSError:
        return


def collect(directory: Path) -> dict[str, dict[str, float]]:
    """The counts of every process that wrote to ``directory``, added up per role. Files that are not what
    :func:`publish` writes (too large, not JSON, other keys, not numbers) are left out."""
    merged: dict[str, dict[str, float]] = {}
    try:
        names = sorted(name for name in os.listdir(directory) if name.endswith(".json"))[:MAX_FILES]
    except OSError:
        return merged
    for name in names:
        try:
            fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                data = json.loads(os.read(fd, MAX_FILE_BYTES + 1)[:MAX_FILE_BYTES])
            finally:
                os.close(fd)
        except (OSError, ValueError, RecursionError):
            continue
        roles = data.get("roles") if isinstance(data, dict) else None
        if not isinstance(roles, dict):
            continue
        for role, counts in roles.items():
            if not isinstance(role, str) or not role.isidentifier() or not isinstance(counts, dict):
                continue
            into = merged.setdefault(role, dict.fromkeys(FIELDS, 0))
            for key in FIELDS:
                value = counts.get(key, 0)
                if type(value) in (int, float) and 0 <= value < 1e18:
                    into[key] += value
    return merged


def hit_amounts(meta: Mapping[str, object]) -> dict[str, float]:
    """What serving a verified step with ``meta.json`` ``meta`` adds: one step, the bytes of its files,
    and the generation time it recorded (``generation_s``)."""
    size = 0
    parts = meta.get("parts")
    for part in parts if isinstance(parts, list) else ():
        files = part.get("files") if isinstance(part, dict) else None
        for spec in files.values() if isinstance(files, dict) else ():
            value = spec.get("size") if isinstance(spec, dict) else None
            size += value if type(value) is int and value > 0 else 0
    recorded = meta.get("generation_s")
    seconds = float(recorded) if isinstance(recorded, (int, float)) and not isinstance(recorded, bool) else 0.0
    seconds = seconds if 0 <= seconds < 1e9 else 0.0
    return {"served_steps": 1, "bytes_read": size, "generation_s_saved": seconds}


class MetricsInterceptor:
    """verl's ``Tracking.log``: the trainer's metrics of a step get this process's running totals."""

    def sync(self, call: Any, proceed: Any) -> Any:
        totals = TALLY.metrics()
        if totals:
            args, kwargs = list(call.args), dict(call.kwargs)
            if "data" in kwargs and isinstance(kwargs["data"], Mapping):
                kwargs["data"] = {**kwargs["data"], **totals}
                return proceed(*args, **kwargs)
            if args and isinstance(args[0], Mapping):
                args[0] = {**args[0], **totals}
                return proceed(*args, **kwargs)
        return proceed()

    async def run_async(self, call: Any, proceed: Any) -> Any:  # pragma: no cover - Tracking.log is sync
        return self.sync(call, proceed)
