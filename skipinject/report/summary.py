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
from skipinject.report.tally import FIELDS, RUN_PREFIX, cluster_counts, collect, total

logger = logging.getLogger("skipinject")


def _size(count: float) -> str:
    if count < 1024:
        return f"{count:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if count < 1024 or unit == "GiB":
            break
    return f"{count:.1f} {unit}"


def _filled(roles: Mapping[str, Mapping[str, float]], order: Sequence[str]) -> dict[str, dict[str, float]]:
    """Every field of each role, those of ``order`` first (counted or not), then the others by name."""
    names = [*order, *sorted(name for name in roles if name not in order)]
    return {name: {key: roles.get(name, {}).get(key, 0) for key in FIELDS} for name in names}


def render(roles: Mapping[str, Mapping[str, float]], order: Sequence[str] = ()) -> list[str]:
    """The summary's lines: one per role, then the total."""
    lines = []
    for name, count in _filled(roles, order).items():
        parts = [
            f"{count['served_steps']:.0f} steps served, {count['generated_steps']:.0f} generated, "
            f"{count['failed_steps']:.0f} failed"
        ]
        if count["served_rows"] or count["generated_rows"]:
            parts.append(f"rows {count['served_rows']:.0f} served, {count['generated_rows']:.0f} generated")
        if count["rescored_rows"]:
            parts.append(f"{count['rescored_rows']:.0f} rows re-scored")
        parts += [f"{_size(count['bytes_read'])} read", f"{count['generation_s_saved']:.1f} s of generation saved"]
        lines.append(f"summary: {name}: " + "; ".join(parts))
    return [*lines, f"summary: {total(roles, 'generation_s_saved'):.1f} s of generation saved in all"]


class RunEnd:
    """Says the summary once: when the driver's ``run_ppo`` returns, or at exit. As an interceptor of the
    driver's ``ray.shutdown`` it first takes the counts of processes on other nodes out of the cluster."""

    def __init__(self, directory: Path, roles: Sequence[str]) -> None:
        self.directory = directory
        self.roles = list(roles)
        self.remote: list[bytes] = []
        self._said = False
        self._lock = threading.Lock()

    def sync(self, call: Any, proceed: Any) -> Any:
        self.remote += cluster_counts(self.directory.name)
        return proceed()

    async def run_async(self, call: Any, proceed: Any) -> Any:  # pragma: no cover - ray.shutdown is sync
        return self.sync(call, proceed)

    def say(self) -> None:
        with self._lock:
            if self._said:
                return
            self._said = True
        try:
            counted = collect(self.directory, [*self.remote, *cluster_counts(self.directory.name)])
            for line in render(counted, self.roles):
                logger.info("%s", line)
            target = os.environ.get(ENV_SUMMARY)
            if target:
                filled = _filled(counted, self.roles)
                write_json(Path(target), {"roles": filled, "total": {key: total(filled, key) for key in FIELDS}})
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
        directory = Path(tempfile.mkdtemp(prefix=RUN_PREFIX))
    except OSError as exc:
        logger.debug("no run summary: %s", exc)
        return None
    os.environ[ENV_RUN_REPORT] = str(directory)
    end = RunEnd(directory, roles)
    atexit.register(end.say)
    return end
