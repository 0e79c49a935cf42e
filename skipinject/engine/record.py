"""Recording the steps a role's calls are in (:mod:`~skipinject.engine.book`): call k saved
as part k, in the background writer for clocked roles, committed once the run has moved past the step or, without
a clock, after every call (docs/how-it-works.md); a step with a part that cannot be saved is dropped whole."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from skipinject.config import Action
from skipinject.engine.background import WRITER
from skipinject.engine.book import StepBook, StepCalls
from skipinject.engine.replay import Replay, committed
from skipinject.report.start import said_at_start
from skipinject.report.tally import TALLY
from skipinject.roles import Call, Plan, RowCodec
from skipinject.store import StepStore

if TYPE_CHECKING:
    from skipinject.engine.services import Services

logger = logging.getLogger("skipinject")


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

    def __init__(self, services: Services, replay: Replay, steps: StepBook) -> None:
        self.services = services
        self.replay = replay
        self.steps = steps

    def step(self, call: Call, step: int) -> StepCalls:
        """The record of ``step`` in the run of ``call``; steps the run moved past are closed first."""
        record, passed = self.steps.get(self.services.store_for(call).project_dir, step)
        self.close(passed, step)
        return record

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
            snapshot = self.services.codec.encode(result).private_copy()
        except Exception as exc:
            self.drop(record, f"cannot encode {what} ({type(exc).__name__}: {exc})")
            return
        extra = self.services.extra_meta(call) if index == 0 else {}
        with record.lock:
            if index == 0:
                record.extra_meta = extra
            if record.writer is None:
                record.writer = plan.store.begin(plan.step)
                self.steps.mark_recorded(record.project, record.step)
            writer = record.writer
            record.inputs[index] = list(inputs) if inputs is not None else self.services.fingerprint(call)
            ratio = rows_per_key(self.services.codec, result, keys)
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
        name = self.services.name

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
        TALLY.add(self.services.name, failed_steps=1)
        if writer is not None:
            if in_job:
                writer.abort()
            else:
                self.in_background(plan.store, writer.abort)
        rt = self.services
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
        if self.services.role.clocks:
            WRITER.submit(store.project_dir, job)
        else:
            job()

    def record_part(self, call: Call, step: int, result: Any) -> int | None:
        """:meth:`skipinject.roles.PhaseContext.record`."""
        record = self.step(call, step)
        store = self.services.store_for(call)
        if not self.steps.clocked:  # another step of this store recorded by a phase ends here
            self.close(self.steps.by_phase(store.project_dir, other_than=step), step)
        with record.lock:
            if record.plan is None:  # no phase planned the step in this run: record it unless cached
                settings = self.services.settings
                usable = self.services.unusable(store) is None and settings.save
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
