"""The run's summary, in the driver: one block when verl's ``run_ppo`` returns (or the driver exits),
adding up what every process of the run counted (:mod:`skipinject.report.tally`)::

    skipinject INFO: summary: rollout: 2 steps served, 1 generated, 0 failed; 1.4 MiB read; 41.2 s of generation saved
    skipinject INFO: summary: 41.2 s of generation saved in all

The same numbers go as JSON to the file ``SKIPINJECT_SUMMARY`` names (for CI and sweeps).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from skipinject.config.environment import ENV_RUN_REPORT, ENV_SUMMARY
from skipinject.report.tally import FIELDS, collect, total

__all__ = ["ENV_SUMMARY", "RunEnd", "begin", "render"]

logger = logging.getLogger("skipinject")


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def render(roles: Mapping[str, Mapping[str, float]], order: Sequence[str] = ()) -> list[str]:
    """The summary's lines: one per role (those of ``order`` first, counted or not), then the total."""
    names = [*order, *sorted(name for name in roles if name not in order)]
    lines = []
    for name in names:
        counts = roles.get(name, {})

        def get(key: str, counts: Mapping[str, float] = counts) -> float:
            return counts.get(key, 0)

        parts = [
            f"{get('served_steps'):.0f} steps served, {get('generated_steps'):.0f} generated, "
            f"{get('failed_steps'):.0f} failed"
        ]
        if get("served_rows") or get("generated_rows"):
            parts.append(f"rows {get('served_rows'):.0f} served, {get('generated_rows'):.0f} generated")
        if get("rescored_rows"):
            parts.append(f"{get('rescored_rows'):.0f} rows re-scored")
        parts.append(f"{_size(get('bytes_read'))} read")
        parts.append(f"{get('generation_s_saved'):.1f} s of generation saved")
        lines.append(f"summary: {name}: " + "; ".join(parts))
    lines.append(f"summary: {total(roles, 'generation_s_saved'):.1f} s of generation saved in all")
    return lines


def as_json(roles: Mapping[str, Mapping[str, float]], order: Sequence[str] = ()) -> dict[str, Any]:
    names = [*order, *sorted(name for name in roles if name not in order)]
    filled = {name: {key: roles.get(name, {}).get(key, 0) for key in FIELDS} for name in names}
    return {"roles": filled, "total": {key: total(filled, key) for key in FIELDS}}


class RunEnd:
    """Says the summary once: when the driver's ``run_ppo`` returns, or at exit."""

    def __init__(self, directory: Path, roles: Sequence[str]) -> None:
        self.directory = directory
        self.roles = list(roles)
        self._said = False
        self._lock = threading.Lock()

    def say(self) -> None:
        with self._lock:
            if self._said:
                return
            self._said = True
        try:
            counted = collect(self.directory)
            for line in render(counted, self.roles):
                logger.info("%s", line)
            target = os.environ.get(ENV_SUMMARY)
            if target:
                write_json(Path(target), as_json(counted, self.roles))
        except Exception as exc:  # a report must never break the program's end
            logger.debug("summary failed: %s: %s", type(exc).__name__, exc)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def cancel(self) -> None:
        """No run follows: nothing is said at exit, the directory is removed."""
        with self._lock:
            self._said = True
        atexit.unregister(self.say)
        if os.environ.get(ENV_RUN_REPORT) == str(self.directory):
            del os.environ[ENV_RUN_REPORT]
        shutil.rmtree(self.directory, ignore_errors=True)


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` to ``path`` whole (a reader sees the old file or the new one); one warning if it cannot."""
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as handle:
            json.dump(data, handle, indent=1, sort_keys=True)
        os.replace(handle.name, path)
    except OSError as exc:
        logger.warning("%s=%s: cannot write the summary there (%s)", ENV_SUMMARY, path, exc.strerror or exc)


def begin(roles: Sequence[str]) -> RunEnd | None:
    """In the driver: make the run's report directory (private to the user), hand it to every process
    the run starts, and say the summary at exit if nothing said it before."""
    try:
        directory = Path(tempfile.mkdtemp(prefix="skipinject-run-"))
    except OSError as exc:
        logger.debug("no run summary: %s", exc)
        return None
    os.environ[ENV_RUN_REPORT] = str(directory)
    end = RunEnd(directory, roles)
    atexit.register(end.say)
    return end
