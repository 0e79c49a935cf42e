"""The steps a role's calls are in, in this process: each step's record (:class:`StepCalls`: its plan, what was
recorded and what is replayed) and the book of open or recently seen steps (:class:`StepBook`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skipinject.roles import Plan
    from skipinject.store import Payload, StepWriter

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
        from skipinject.store import StepMeta

        calls = self.parts
        keyed = [self.row_keys.get(index) for index in range(calls)] if self.row_keys else None
        return StepMeta.build(
            inputs=self.inputs.get(0),
            calls=calls,
            call_inputs=[self.inputs.get(index) for index in range(calls)],
            generation_s=self.generation_seconds,
            row_keys=None if keyed is None else [None if k is None else k[0] for k in keyed],
            rows_per_input=None if keyed is None else [None if k is None else k[1] for k in keyed],
            extra=self.extra_meta,
        )


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
