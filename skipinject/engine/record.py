"""Recording: a step's fresh results saved as its parts and committed once (see :mod:`skipinject.engine.calls`).

Encoding and a private copy happen in the call (the caller may change the result afterwards); writing
and the commit in the background writer when the role has clocks (``fit`` returning waits for them),
else at once (a Ray actor may be killed without exit hooks). A step whose part cannot be saved is
dropped whole (one warning), as is a step a phase records and does not commit before the run moves on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from skipinject.config import Action
from skipinject.engine.background import WRITER
from skipinject.engine.calls import StepBook, StepCalls
from skipinject.engine.decision import committed
from skipinject.engine.replay import Replay
from skipinject.engine.stores import RoleContext
from skipinject.report.tally import TALLY
from skipinject.roles import Call, Plan, RowCodec
from skipinject.store import StepStore

logger = logging.getLogger("skipinject")


def rows_per_key(codec: Any, result: Any, keys: Sequence[str] | None) -> int | None:
    """Output rows per row key of ``result`` when it is a whole number (``None``: not, or unknown)."""
    if not keys or not isinstance(codec, RowCodec):
        return None
    try:
        rows = codec.result_rows(result)
    except Exception:
        return None
    return rows // len(keys) if rows and rows % len(keys) == 0 else None


class Recorder:
    """The steps of one role this process meets, and the saving of those it records."""

    def __init__(self, runtime: RoleContext, replay: Replay, steps: StepBook) -> None:
        self.runtime = runtime
        self.replay = replay
        #: The steps this process's calls are in (see :mod:`skipinject.engine.calls`).
        self.steps = steps

    def step(self, call: Call, step: int) -> StepCalls:
        """The record of ``step`` in the run of ``call``; steps the run moved past are closed first."""
        record, passed = self.steps.get(self.runtime.store_for(call).project_dir, step)
        self.close(passed, step)
        return record

    def enter(self, call: Call, step: int) -> tuple[StepCalls, int]:
        """Begin a call at ``step``: its step's record (planned at the step's first call) and its index.
        Every ``enter`` that returns is followed by one :meth:`leave`."""
        record = self.step(call, step)
        with record.lock:
            if record.plan is None:
                record.plan = self.replay.plan(call, step)
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
        """The run is at ``step`` (a call of this role was seen there): close the steps it moved past."""
        if self.steps.open:
            self.close(self.steps.moved_to(step), step)

    def close_all(self) -> None:
        """The run ended: close every step."""
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
        """Save call ``index``'s fresh result as the step's part ``index`` (failures logged, never raised);
        ``inputs`` were taken before the target ran; ``background=False``: written here."""
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
        """A part of the step cannot be saved: nothing of it is cached (one warning); ``in_job``: in the writer."""
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
        self.runtime.once(
            ("save", str(plan.store.project_dir), plan.step),
            logging.WARNING,
            f"{self.runtime.name} step {plan.step}: could not save the cache to {plan.store.step_dir(plan.step)} "
            f"({why}); training goes on without it",
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

    def commit_step(self, call: Call, step: int, meta: Mapping[str, Any] | None, unit: str, note: str) -> None:
        """:meth:`skipinject.roles.PhaseContext.commit`."""
        record = self.step(call, step)
        with record.lock:
            record.phase_meta, record.unit, record.note = dict(meta or {}), unit, note
        self.commit(record)

    def served(self, call: Call, step: int) -> bool | None:
        """:meth:`skipinject.roles.PhaseContext.served`."""
        record = self.steps.find(self.runtime.store_for(call).project_dir, step)
        return None if record is None or record.plan is None else record.plan.serves
