"""What the cache did: each process's counts per role, in ``{SKIPINJECT_RUN_REPORT}/{pid}.json`` (a private
directory the driver made) or on another node in Ray's key-value store, summed by the driver when ``run_ppo``
returns (or at exit) into the summary it says and writes to ``SKIPINJECT_SUMMARY``'s file."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from skipinject.config.environment import ENV_RUN_REPORT, ENV_SUMMARY
from skipinject.node import _ray
from skipinject.text import human_size, shown

logger = logging.getLogger("skipinject")

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
    "weight_syncs_skipped",
    "weight_sync_s_saved",
)
#: Most process records :func:`collect` reads, and their largest size (a record is a few hundred bytes).
MAX_FILES = 4096
MAX_FILE_BYTES = 64 << 10
KV_NAMESPACE = "skipinject"
RUN_PREFIX = "skipinject-run-"
#: A role's summary line, part by part, shown always (no keys) or when a count it keys is not 0.
SUMMARY_PARTS = (
    ((), "{served_steps:.0f} steps served, {generated_steps:.0f} generated, {failed_steps:.0f} failed"),
    (("served_rows", "generated_rows"), "rows {served_rows:.0f} served, {generated_rows:.0f} generated"),
    (("rescored_rows",), "{rescored_rows:.0f} rows re-scored"),
    ((), "{read} read"),
    (("weight_syncs_skipped",), "{weight_syncs_skipped:.0f} weight syncs skipped ({weight_sync_s_saved:.1f} s)"),
    ((), "{generation_s_saved:.1f} s of generation saved"),
)


class Tally:
    """The counts of this process, per role; the roles called here at a chosen step, and those found never called
    (the line said, by role: :mod:`skipinject.report.silence`)."""

    def __init__(self) -> None:
        self.roles: dict[str, dict[str, float]] = {}
        self.called: set[str] = set()
        self.silent: dict[str, str] = {}
        self._lock = threading.Lock()

    def add(self, role: str, **amounts: float) -> None:
        """Add ``amounts`` (keys of :data:`FIELDS`) to ``role``'s counts, and publish them."""
        with self._lock:
            counts = self.roles.setdefault(role, dict.fromkeys(FIELDS, 0))
            for key, amount in amounts.items():
                counts[key] += amount
            self._publish()

    def note_called(self, role: str) -> None:
        """``role``'s target was called at a chosen step in this process (published the first time)."""
        if role in self.called:
            return
        with self._lock:
            self.called.add(role)
            self._publish()

    def note_silent(self, role: str, line: str) -> None:
        with self._lock:
            self.silent[role] = line
            self._publish()

    def _publish(self) -> None:
        record: dict[str, Any] = {"roles": self.roles}
        if self.called:
            record["called"] = sorted(self.called)
        if self.silent:
            record["silent"] = self.silent
        publish(json.dumps(record))

    def metrics(self) -> dict[str, float]:
        """Running totals over the roles, as the trainer logs them (``skipinject/served_steps_total`` ...)."""
        with self._lock:
            return {f"skipinject/{key}_total": total(self.roles, key) for key in FIELDS} if self.roles else {}

    def clear(self) -> None:
        with self._lock:
            self.roles.clear()
            self.called.clear()
            self.silent.clear()


TALLY = Tally()


def total(roles: Mapping[str, Mapping[str, float]], key: str) -> float:
    return sum(counts.get(key, 0) for counts in roles.values())


def count_rescored(role: str, rows: int) -> None:
    """Count ``rows`` a role re-scored with this run's reward (plugin API 1.4)."""
    if rows > 0:
        TALLY.add(role, rescored_rows=rows)


def count_weight_syncs(role: str, skipped: int, seconds: float = 0.0) -> None:
    """Count weight syncs ``role`` skipped and the seconds they took in the recording run (plugin API 1.6); a
    deferred sync carried out after all is taken back with negative amounts (a process's totals stay >= 0)."""
    if skipped or seconds:
        TALLY.add(role, weight_syncs_skipped=skipped, weight_sync_s_saved=seconds)


def report_dir() -> Path | None:
    """The run's report directory, if it is a directory only this user can write (else ignored)."""
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


def publish(record: str) -> None:
    """Replace this process's record: its file in the report directory, else its key in Ray's store."""
    with contextlib.suppress(Exception):  # a count must never break the program
        directory, run = report_dir(), os.path.basename(os.environ.get(ENV_RUN_REPORT, ""))
        if directory is not None:
            write_whole(directory / f"{os.getpid()}.json", record)
        elif (ray := _ray()) is not None and run.startswith(RUN_PREFIX) and run.isprintable() and len(run) < 100:
            from ray.experimental.internal_kv import _internal_kv_put

            key = f"{run}/{ray.get_runtime_context().get_worker_id()}"
            _internal_kv_put(key, record, overwrite=True, namespace=KV_NAMESPACE)


def cluster_counts(run: str, *, take: bool = True) -> list[bytes]:
    """The records processes on other nodes put in Ray's store for ``run``, taken out of it (``take``) or read."""
    if _ray() is None:
        return []
    try:
        from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_list

        records = []
        for key in _internal_kv_list(f"{run}/", namespace=KV_NAMESPACE)[:MAX_FILES]:
            value = _internal_kv_get(key, namespace=KV_NAMESPACE)
            if take:
                _internal_kv_del(key, namespace=KV_NAMESPACE)
            records.append((value or b"")[:MAX_FILE_BYTES])
        return records
    except Exception:
        return []


def read_records(directory: Path | None, more: Iterable[bytes] = ()) -> list[dict[str, Any]]:
    """The process records in ``directory`` (if any) and ``more`` that parse as JSON objects."""
    records, names = list(more), []
    if directory is not None:
        from skipinject.store import read_head  # the driver's end only: not in every process's start

        with contextlib.suppress(OSError):
            names = sorted(name for name in os.listdir(directory) if name.endswith(".json"))[:MAX_FILES]
        for name in names:
            with contextlib.suppress(OSError):  # a link, a FIFO, gone: not a process's file
                records.append(read_head(directory / name, MAX_FILE_BYTES))
    parsed = []
    for record in records:
        try:
            data = json.loads(record)
        except (ValueError, RecursionError):
            continue
        if isinstance(data, dict):
            parsed.append(data)
    return parsed


def called_roles(records: Iterable[Mapping[str, Any]]) -> set[str]:
    """The roles some process of the run called at a chosen step."""
    names = [name for data in records if isinstance(called := data.get("called"), list) for name in called]
    return {name for name in names if isinstance(name, str) and name.isidentifier()}


def silent_roles(records: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """The roles a process found never called, with the line it said (the first found)."""
    found: dict[str, str] = {}
    for data in records:
        silent = data.get("silent")
        for name, line in silent.items() if isinstance(silent, dict) else ():
            if isinstance(name, str) and name.isidentifier() and isinstance(line, str) and line.isprintable():
                found.setdefault(name, line[:1000])
    return found


def never_called(records: Sequence[Mapping[str, Any]], roles: Iterable[str]) -> dict[str, str]:
    """Of ``roles``, those a process found never called and no process called after all, with its line."""
    called = called_roles(records)
    return {name: line for name, line in silent_roles(records).items() if name in roles and name not in called}


def run_records() -> list[dict[str, Any]]:
    """Every process's record of this run so far (this node's files, other nodes' keys, left in place)."""
    directory = report_dir()
    run = os.path.basename(os.environ.get(ENV_RUN_REPORT, ""))
    remote = cluster_counts(run, take=False) if run.startswith(RUN_PREFIX) else []
    return read_records(directory, remote)


def collect(directory: Path, more: Iterable[bytes] = ()) -> dict[str, dict[str, float]]:
    """The counts per role of ``directory``'s records and ``more``; malformed records are left out."""
    return merge_counts(read_records(directory, more))


def merge_counts(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """The counts per role of the process ``records``, added up."""
    merged: dict[str, dict[str, float]] = {}
    for data in records:
        roles = data.get("roles")
        for role, counts in roles.items() if isinstance(roles, dict) else ():
            if not isinstance(role, str) or not role.isidentifier() or not isinstance(counts, dict):
                continue
            into = merged.setdefault(role, dict.fromkeys(FIELDS, 0))
            for key in FIELDS:
                value = counts.get(key, 0)
                if type(value) in (int, float) and 0 <= value < 1e18:
                    into[key] += value
    return merged


def hit_amounts(meta: Mapping[str, object]) -> dict[str, float]:
    """What serving a step adds: one step, its files' bytes, the generation time its ``meta`` recorded (a
    :class:`~skipinject.store.StepMeta`; anything else adds a step only)."""
    from skipinject.store import StepMeta

    size, seconds = (meta.stored_size, meta.generation_s) if isinstance(meta, StepMeta) else (0, None)
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds < 1e9:
        seconds = 0.0
    return {"served_steps": 1, "bytes_read": size, "generation_s_saved": float(seconds)}


class MetricsInterceptor:
    """verl's ``Tracking.log``: the trainer's metrics of a step get this process's running totals."""

    def sync(self, call: Any, proceed: Any) -> Any:
        totals = TALLY.metrics()
        args, kwargs = list(call.args), dict(call.kwargs)
        if totals and isinstance(kwargs.get("data"), Mapping):
            kwargs["data"] = {**kwargs["data"], **totals}
        elif totals and args and isinstance(args[0], Mapping):
            args[0] = {**args[0], **totals}
        else:
            return proceed()
        return proceed(*args, **kwargs)

    async def run_async(self, call: Any, proceed: Any) -> Any:  # pragma: no cover - Tracking.log is sync
        return self.sync(call, proceed)


def _filled(roles: Mapping[str, Mapping[str, float]], order: Sequence[str]) -> dict[str, dict[str, float]]:
    """Every field of each role, ``order``'s first (counted or not), then the others by name."""
    names = [*order, *sorted(name for name in roles if name not in order)]
    return {name: {key: roles.get(name, {}).get(key, 0) for key in FIELDS} for name in names}


def render(roles: Mapping[str, Mapping[str, float]], order: Sequence[str] = ()) -> list[str]:
    """The summary's lines: one per role, then the total."""
    lines = []
    for name, count in _filled(roles, order).items():
        values = {**count, "read": human_size(int(count["bytes_read"]))}
        parts = [text.format(**values) for keys, text in SUMMARY_PARTS if not keys or any(count[k] for k in keys)]
        lines.append(f"summary: {name}: " + "; ".join(parts))
    saved, syncs = total(roles, "generation_s_saved"), total(roles, "weight_syncs_skipped")
    if not syncs:
        return [*lines, f"summary: {saved:.1f} s of generation saved in all"]
    synced = total(roles, "weight_sync_s_saved")
    return [*lines, f"summary: {saved + synced:.1f} s of generation and weight syncs saved in all"]


class RunEnd:
    """Says the summary once, when ``run_ppo`` returns or at exit; at ``ray.shutdown`` (intercepted) it
    first takes other nodes' counts out of the cluster."""

    def __init__(self, directory: Path, roles: Sequence[str]) -> None:
        self.directory = directory
        self.roles = list(roles)
        self.remote: list[bytes] = []
        self._once = threading.Lock()  # held from the first say (or cancel) on
        from skipinject.report.summary_file import summary_target  # the driver's end only

        self.summary = summary_target()  # named now: the program may change directory before the end

    def sync(self, call: Any, proceed: Any) -> Any:
        self.remote += cluster_counts(self.directory.name)
        return proceed()

    async def run_async(self, call: Any, proceed: Any) -> Any:  # pragma: no cover - ray.shutdown is sync
        return self.sync(call, proceed)

    def say(self) -> None:
        if not self._once.acquire(blocking=False):
            return
        try:
            records = read_records(self.directory, [*self.remote, *cluster_counts(self.directory.name)])
            counted = merge_counts(records)
            for line in render(counted, self.roles):
                logger.info("%s", line)
            silent = never_called(records, self.roles)
            for line in silent.values():
                logger.warning("summary: %s", line)
            target = self.summary
            if target:
                filled = _filled(counted, self.roles)
                data = {"roles": filled, "total": {key: total(filled, key) for key in FIELDS}, "never_called": silent}
                try:
                    from skipinject.report.summary_file import write_summary

                    why = write_summary(target, json.dumps(data, indent=1, sort_keys=True))
                except OSError as exc:
                    why = str(exc.strerror or exc)
                if why is not None:
                    logger.warning("%s=%s: cannot write the summary there (%s)", ENV_SUMMARY, shown(target), why)
        except Exception as exc:  # a report must never break the program's end
            logger.debug("summary failed: %s: %s", type(exc).__name__, exc)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def cancel(self) -> None:
        """No run follows: nothing is said at exit, the directory is removed."""
        self._once.acquire(blocking=False)
        atexit.unregister(self.say)
        if os.environ.get(ENV_RUN_REPORT) == str(self.directory):
            del os.environ[ENV_RUN_REPORT]
        shutil.rmtree(self.directory, ignore_errors=True)


def write_whole(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` whole, through a new private file beside it."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(name, path)
    except BaseException:  # ``path`` a directory, a full disk: no private copy is left beside it
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise


def begin(roles: Sequence[str]) -> RunEnd | None:
    """In the driver: make the run's private report directory, hand it on, say the summary at exit."""
    try:
        directory = Path(tempfile.mkdtemp(prefix=RUN_PREFIX))
    except OSError as exc:
        logger.debug("no run summary: %s", exc)
        return None
    os.environ[ENV_RUN_REPORT] = str(directory)
    end = RunEnd(directory, roles)
    atexit.register(end.say)
    return end
