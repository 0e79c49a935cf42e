"""A step's life in one place: each call of a role's step enters it (the step's record; its first call plans
it: :mod:`~skipinject.engine.replay`), is served from the cache or runs and is recorded
(:mod:`~skipinject.engine.record`; ``action=match``: :mod:`~skipinject.engine.matching`), and leaves it (the step
committed once the run moved past it, or without a clock at once; the next chosen step read ahead)."""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from skipinject.config import Action
from skipinject.engine.replay import REGENERATE, not_imported

if TYPE_CHECKING:
    from skipinject.engine.book import StepBook, StepCalls
    from skipinject.engine.matching import RowMatcher
    from skipinject.engine.record import Recorder
    from skipinject.engine.replay import Replay
    from skipinject.engine.services import Services
    from skipinject.roles import Call


class Steps:
    """The steps of one role in this process, driven call by call (:meth:`calls`)."""

    def __init__(
        self, services: Services, book: StepBook, replay: Replay, recorder: Recorder, matcher: RowMatcher
    ) -> None:
        self.services = services
        self.book = book
        self.replay = replay
        self.recorder = recorder
        self.matcher = matcher

    def calls(self, call: Call, step: int, background: bool) -> Generator[Any, Any, Any]:
        """One call at ``step``, written once for waiting and awaiting callers (see
        :func:`~skipinject.engine.phases.drive`): enter, serve or run and record, leave."""
        role = self.services
        record, index = yield lambda: self.enter(call, step)
        try:
            if role.settings.action is Action.match:
                return role.deliver(call, (yield from self.matcher.calls(record, index, call, background)))
            if not record.recording:
                result = yield lambda: self.replay.serve_call(record, index, call)
                if result is not REGENERATE:
                    return role.deliver(call, result)
                if not record.recording:  # a later call of a replayed step: run it, save nothing
                    return role.after_miss(call, (yield (), {}))
            inputs = role.fingerprint(call)  # before the target runs: it may change its inputs
            keys = self.matcher.keys(call)
            began = time.perf_counter()
            result = yield (), {}
            record.generation_seconds += time.perf_counter() - began  # what a hit of the step saves
            yield lambda: self.recorder.record(record, index, call, result, inputs, background=background, keys=keys)
            return role.after_miss(call, result)
        finally:
            yield lambda: self.leave(record)

    def enter(self, call: Call, step: int) -> tuple[StepCalls, int]:
        """Begin a call at ``step``: its step's record (planned at its first call) and index; ``leave`` follows."""
        record = self.recorder.step(call, step)
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
            due = record.running == 0 and (record.closed or not self.book.clocked)
            first, record.left = not record.left, True
        if first and record.plan is not None:
            self.replay.read_after(record.plan)
        if due:
            self.recorder.commit(record)
