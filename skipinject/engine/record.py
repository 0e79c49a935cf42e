"""The steps a role's calls are in (a step's first call decides for all of them), and recording: call k saved
as part k, in the background writer for clocked roles, committed once the run has moved past the step or, without
a clock, after every call (docs/how-it-works.md); a step with a part that cannot be saved is dropped whole."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from skipinject.config import Action
from skipinject.engine.background import WRITER
from skipinject.engine.replay import Replay, committed, not_imported
from skipinject.report.start import said_at_start
from skipinject.report.tally import TALLY
from skipinject.roles import Call, Plan, RowCodec
from skipinject.store import Payload, StepStore, StepWriter

if TYPE_CHECKING:
    from skipinject.engine.runtime import RoleRuntime

logger = logging.getLogger("skipinject")

#: Steps a role without a clock remembers as recorded in this run (a later call of one of them is
#: recorded too, never served); the oldest are forgotten first.
REMEMBERED_STEPS = 4096


@dataclass
class StepCalls:
    """One step of one role's cache, as the calls of this run meet it."""

    step: int
    project: Hashable
    lock: threading.Lock = field(default_factory=threading.Lock)
    plan: Plan | None = None
    started: int = 0  # calls begun (the next call's index)
    running: int = 0  # calls begun and not finished
    closed: bool = False  # the run moved past the step (commit when the last running call ends)
    left: bool = False  # a call of the step has returned (the next chosen step is then read ahead)
    # -- recording
    writer: StepWriter | None = None
    inputs: dict[int, list[str] | None] = field(default_factory=dict)
    row_keys: dict[int, tuple[list[str], int]] = field(default_factory=dict)  # per call: keys, rows per key
    extra_meta: dict[str, Any] = field(default_factory=dict)  # ``record_meta`` of the first call
    rows: int = 0
    parts: int = 0  # parts handed to the writer
    failed: bool = False
    committed_parts: int = 0
    saving_seconds: float = 0.0  # encoding, copying, writing and committing the parts (not generating them)
    generation_seconds: float = 0.0  # the target's time for the step: what a hit saves
    by_phase: bool = False  # a phase records it: committed with phase_meta, saved line counts unit, ends with note
    phase_meta: dict[str, Any] = field(default_factory=dict)
    unit: str = "rows"
    note: str = ""
    notes: dict[str, Any] = field(default_factory=dict)  # PhaseContext.notes
    # -- replaying
    payloads: Sequence[Payload] | None = None
    recorded_inputs: list[Any] = field(default_factory=list)
    planning_s: float = 0.0  # finding, verifying and reading the step served: part of its hit's time
    absent: tuple[str, ...] = ()  # libraries not imported when the step was planned (a hit says their first use)

    @property
    def recording(self) -> bool:
        return self.plan is not None and self.plan.entry is None and self.plan.upstream_file is None

    def commit_meta(self) -> dict[str, Any]:
        """The role's part of ``meta.json``: how many calls the step holds and each one's inputs."""
        calls = self.parts
        meta: dict[str, Any] = {**self.extra_meta, "inputs": self.inputs.get(0), "calls": calls}
        if self.generation_seconds > 0:
            meta["generation_s"] = round(self.generation_seconds, 6)
        if calls > 1:
            meta["call_inputs"] = [self.inputs.get(index) for index in range(calls)]
        if self.row_keys:
            keyed = [self.row_keys.get(index) for index in range(calls)]
            meta["row_keys"] = [None if k is None else k[0] for k in keyed]
            meta["rows_per_input"] = [None if k is None else k[1] for k in keyed]
        return meta


class StepBook:
    """The steps a role's calls are in, in this process: ``open`` (clocked roles; while not empty the fast
    path is off, so a call at another step closes them) or ``remembered`` (recent steps, bounded)."""

    def __init__(self, clocked: bool, open_steps: dict[tuple[Hashable, int], StepCalls] | None = None) -> None:
        self.clocked = clocked
        self.lock = threading.Lock()
        #: ``open_steps``: the dict the role's fast path already reads (patched before this book existed).
        self.open: dict[tuple[Hashable, int], StepCalls] = {} if open_steps is None else open_steps
        self.remembered: OrderedDict[tuple[Hashable, int], StepCalls] = OrderedDict()
        #: Steps this run recorded (bounded): a call coming back to one (1 -> 2 -> 1) is never served it.
        self.recorded: OrderedDict[tuple[Hashable, int], None] = OrderedDict()

    def mark_recorded(self, project: Hashable, step: int) -> None:
        with self.lock:
            _remember(self.recorded, (project, step), None)

    def recorded_here(self, project: Hashable, step: int) -> bool:
        with self.lock:
            return (project, step) in self.recorded

    def get(self, project: Hashable, step: int) -> tuple[StepCalls, list[StepCalls]]:
        """The step's record (new if none), and the records the run has moved past (clocked roles)."""
        key = (project, step)
        with self.lock:
            if self.clocked:
                passed = self._take_other(step)
                return self.open.setdefault(key, StepCalls(step, project)), passed
            record = self.remembered.get(key) or StepCalls(step, project)
            _remember(self.remembered, key, record)
            return record, []

    def find(self, project: Hashable, step: int) -> StepCalls | None:
        key = (project, step)
        with self.lock:
            return self.open.get(key) or self.remembered.get(key)

    def by_phase(self, project: Hashable, other_than: int) -> list[StepCalls]:
        """The remembered steps of ``project`` a phase records, except ``other_than`` (taken out)."""
        with self.lock:
            keys = [k for k, r in self.remembered.items() if k[0] == project and k[1] != other_than and r.by_phase]
            return [self.remembered.pop(key) for key in keys]

    def moved_to(self, step: int) -> list[StepCalls]:
        """The run is at ``step``: the open steps it has moved past (taken out of ``open``)."""
        with self.lock:
            return self._take_other(step)

    def take_all(self) -> list[StepCalls]:
        """The run ended: every open step (taken out); the remembered ones (committed) forgotten."""
        with self.lock:
            records = list(self.open.values())
            self.open.clear()
            self.remembered.clear()
            self.recorded.clear()  # a next fit in this process is another run: it may be served them
            return records

    def _take_other(self, step: int) -> list[StepCalls]:
        passed = [record for (_, at), record in self.open.items() if at != step]
        for record in passed:
            del self.open[(record.project, record.step)]
        return passed


def _remember(bounded: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    """``bounded[key] = value`` as its newest item; the oldest beyond :data:`REMEMBERED_STEPS` forgotten."""
    bounded[key] = value
    bounded.move_to_end(key)
    while len(bounded) > REMEMBERED_STEPS:
        bounded.popitem(last=False)


def rows_per_key(codec: Any, result: Any, keys: Sequence[str] | None) -> int | None:
    """Output rows per row key of ``result``, if a whole number."""
    if not keys or not isinstance(codec, RowCodec):
        return None
    try:
        rows = codec.result_rows(result)
    except Exception:
        return None
    return rows // len(keys) if rows and rows % len(keys) == 0 else None


class Recorder:
    """The steps of one role this process meets, and the saving of those it records."""

    def __init__(self, runtime: RoleRuntime, replay: Replay, steps: StepBook) -> None:
        self.runtime = runtime
        self.replay = replay
        self.steps = steps

    def step(self, call: Call, step: int) -> StepCalls:
        """The record of ``step`` in the run of ``call``; steps the run moved past are closed first."""
        record, passed = self.steps.get(self.runtime.store_for(call).project_dir, step)
        self.close(passed, step)
        return record

    def enter(self, call: Call, step: int) -> tuple[StepCalls, int]:
        """Begin a call at ``step``: its step's record (planned at its first call) and index; ``leave`` follows."""
        record = self.step(call, step)
        with record.lock:
            if record.plan is None:
                started, record.absent = time.perf_counter(), not_imported()
                record.plan = self.replay.plan(call, step)
                record.planning_s = time.perf_counter() - started
            index = record.started
            record.started += 1
            record.running += 1
        return record, index

    def leave(self, record: StepCalls) -> None:
        """A call of ``record`` ended: commit the step if the run moved past it (or, without a clock, now)."""
        with record.lock:
            record.running -= 1
            due = record.running == 0 and (record.closed or not self.steps.clocked)
            first, record.left = not record.left, True
        if first and record.plan is not None:
            self.replay.read_after(record.plan)
        if due:
            self.commit(record)

    def moved_to(self, step: int) -> None:
        """A call of this role is at ``step``: close the steps the run moved past."""
        if self.steps.open:
            self.close(self.steps.moved_to(step), step)

    def close_all(self) -> None:
        self.replay.read_ahead.close()
        self.close(self.steps.take_all(), None)

    def close(self, records: Sequence[StepCalls], at: int | None) -> None:
        for record in records:
            with record.lock:
                record.closed = True
                record.payloads = None if record.running == 0 else record.payloads
                due = record.running == 0
            if not due:
                continue
            if record.by_phase and record.parts > record.committed_parts:
                began = "the run ended" if at is None else f"step {at} began"
                self.drop(record, f"{record.parts} part(s) recorded and not committed before {began}")
            else:
                self.commit(record)

    def record(
        self,
        record: StepCalls,
        index: int,
        call: Call,
        result: Any,
        inputs: Sequence[str] | None = None,
        *,
        background: bool = True,
        keys: Sequence[str] | None = None,
    ) -> None:
        """Save call ``index``'s result as part ``index`` (logged, never raised); ``inputs``: from before it ran."""
        plan = record.plan
        assert plan is not None
        if record.failed or not plan.saves:
            return  # an unusable or untrusted cache directory was reported once already
        what = f"{'part' if record.by_phase else 'call'} {index + 1}"
        if result is None:
            self.drop(record, f"{what} returned None")
            return
        started = time.perf_counter()
        try:
            snapshot = self.runtime.codec.encode(result).private_copy()
        except Exception as exc:
            self.drop(record, f"cannot encode {what} ({type(exc).__name__}: {exc})")
            return
        extra = self.runtime.extra_meta(call) if index == 0 else {}
        with record.lock:
            if index == 0:
                record.extra_meta = extra
            if record.writer is None:
                record.writer = plan.store.begin(plan.step)
                self.steps.mark_recorded(record.project, record.step)
            writer = record.writer
            record.inputs[index] = list(inputs) if inputs is not None else self.runtime.fingerprint(call)
            ratio = rows_per_key(self.runtime.codec, result, keys)
            if keys and ratio:
                record.row_keys[index] = (list(keys), ratio)
            record.parts += 1
            record.rows += snapshot.rows or 0
            record.saving_seconds += time.perf_counter() - started

        def write() -> None:
            if record.failed:
                return
            began = time.perf_counter()
            try:
                writer.add_part(snapshot, part=str(index) if record.by_phase or index else "")
                record.saving_seconds += time.perf_counter() - began
            except Exception as exc:
                self.drop(record, f"cannot write {what} ({type(exc).__name__}: {exc})", in_job=True)

        if background:
            self.in_background(plan.store, write)
        else:
            write()

    def commit(self, record: StepCalls) -> None:
        """Queue the commit of a recorded step's parts (after their writes, in order)."""
        plan = record.plan
        with record.lock:
            writer = record.writer
            if plan is None or writer is None or record.failed or record.parts <= record.committed_parts:
                return
            meta = {**record.extra_meta, **record.phase_meta} if record.by_phase else record.commit_meta()
            record.committed_parts = parts = record.parts
        name = self.runtime.name

        def commit() -> None:
            if record.failed:
                return
            began = time.perf_counter()
            try:
                directory = writer.commit(meta)
                record.saving_seconds += time.perf_counter() - began
            except Exception as exc:
                self.drop(record, f"cannot commit ({type(exc).__name__}: {exc})", in_job=True)
                return
            if record.by_phase:
                what, note = f"{record.rows} {record.unit} in {parts} part(s)", record.note
            else:
                what, note = (f"{record.rows} rows" if parts == 1 else f"{parts} calls ({record.rows} rows)"), ""
            seconds = record.saving_seconds
            logger.info("%s step %d: saved %s to %s in %.3f s%s", name, plan.step, what, directory, seconds, note)

        self.in_background(plan.store, commit)

    def drop(self, record: StepCalls, why: str, *, in_job: bool = False) -> None:
        """Nothing of the step is cached (one warning); ``in_job``: called in the writer."""
        plan = record.plan
        assert plan is not None
        with record.lock:
            already, record.failed = record.failed, True
            writer = record.writer
        if already:
            return
        TALLY.add(self.runtime.name, failed_steps=1)
        if writer is not None:
            if in_job:
                writer.abort()
            else:
                self.in_background(plan.store, writer.abort)
        rt = self.runtime
        message = f"{rt.name} step {plan.step}: could not save the cache to {plan.store.step_dir(plan.step)} ({why})"
        if rt.unwritable_root:  # the dump_dir cannot be written: said once, at start where this process said it
            level = logging.DEBUG if said_at_start(rt.settings) else logging.WARNING
            message += f"; skip.{rt.name}.dump_dir cannot be written: no step is saved in this run"
            rt.once(("save", str(plan.store.project_dir)), level, message)
            return
        rt.once(
            ("save", str(plan.store.project_dir), plan.step), logging.WARNING, f"{message}; training goes on without it"
        )

    def in_background(self, store: StepStore, job: Callable[[], None]) -> None:
        """:meth:`skipinject.roles.PhaseContext.in_background`."""
        if self.runtime.role.clocks:
            WRITER.submit(store.project_dir, job)
        else:
            job()

    def record_part(self, call: Call, step: int, result: Any) -> int | None:
        """:meth:`skipinject.roles.PhaseContext.record`."""
        record = self.step(call, step)
        store = self.runtime.store_for(call)
        if not self.steps.clocked:  # another step of this store recorded by a phase ends here
            self.close(self.steps.by_phase(store.project_dir, other_than=step), step)
        with record.lock:
            if record.plan is None:  # no phase planned the step in this run: record it unless cached
                settings = self.runtime.settings
                usable = self.runtime.unusable(store) is None and settings.save
                anew = settings.action is Action.refresh or not committed(
                    store, step, siblings=settings.action is Action.match
                )
                record.plan = Plan(store, step, reason="recorded", saves=usable and anew)
            record.by_phase = True
            if not (record.recording and record.plan.saves) or record.failed or record.closed or record.committed_parts:
                return None  # served, cached, unusable, failed, or committed already
            index = record.started
            record.started += 1
        self.record(record, index, call, result)
        return None if record.failed else index
