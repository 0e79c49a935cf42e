"""Several calls in one step: the k-th call of a chosen step is part k of that step's one commit.

DAPO's dynamic sampling, agent loops and per-micro-batch roles call a target more than once per step.
The step's first call decides for all of them (its :class:`Plan`). Recording: every call runs and its
result is the next part (call 0 in the step directory, call k in ``{k}/``), committed once the run has
moved past the step (another step's call, ``fit`` returning, exit); roles without a clock commit after
every call. Replaying: call k is served part k, checked against call k's inputs; a call beyond what was
recorded runs the target, unsaved. A part that cannot be saved drops the whole step (one line).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
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
    #: Per call, its row keys and output rows per input row (``action=match``).
    row_keys: dict[int, tuple[list[str], int]] = field(default_factory=dict)
    #: What the role's ``record_meta`` added for the step's first recorded call.
    extra_meta: dict[str, Any] = field(default_factory=dict)
    rows: int = 0
    parts: int = 0  # parts handed to the writer
    failed: bool = False
    committed_parts: int = 0
    saving_seconds: float = 0.0  # encoding, copying, writing and committing the parts (not generating them)
    #: The wall time of the target's calls that made the step (``generation_s`` in ``meta.json``: a hit saves it).
    generation_seconds: float = 0.0
    #: A phase records the step and commits it with ``phase_meta`` (its save line counts ``unit`` and
    #: ends with ``note``); uncommitted when the run moves past: dropped.
    by_phase: bool = False
    phase_meta: dict[str, Any] = field(default_factory=dict)
    unit: str = "rows"
    note: str = ""
    #: What this run's phases noted about the step (:meth:`~skipinject.roles.PhaseContext.notes`).
    notes: dict[str, Any] = field(default_factory=dict)
    # -- replaying
    payloads: Sequence[Payload] | None = None
    recorded_inputs: list[Any] = field(default_factory=list)

    @property
    def recording(self) -> bool:
        return self.plan is not None and self.plan.entry is None and self.plan.upstream_file is None

    def commit_meta(self) -> dict[str, Any]:
        """The role-level part of ``meta.json``: how many calls the step holds and each one's inputs."""
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


def recorded_inputs(meta: Mapping[str, Any], calls: int) -> list[Any]:
    """Each recorded call's input digests (``None`` where unknown), from a committed ``meta.json``
    (one-call caches keep theirs in ``inputs``)."""
    per_call = meta.get("call_inputs")
    if isinstance(per_call, list) and len(per_call) == calls:
        return list(per_call)
    return [meta.get("inputs")] + [None] * (calls - 1)


class StepBook:
    """The steps a role's calls are in, in this process: ``open`` (clocked roles; while not empty the fast
    path is off, so a call at another step closes them) or ``remembered`` (recent steps, bounded)."""

    def __init__(self, clocked: bool) -> None:
        self.clocked = clocked
        self.lock = threading.Lock()
        self.open: dict[tuple[Hashable, int], StepCalls] = {}
        self.remembered: OrderedDict[tuple[Hashable, int], StepCalls] = OrderedDict()
        #: Steps this run recorded (bounded): a call coming back to one (1 -> 2 -> 1) is never served it.
        self.recorded: OrderedDict[tuple[Hashable, int], None] = OrderedDict()

    def mark_recorded(self, project: Hashable, step: int) -> None:
        with self.lock:
            self.recorded[(project, step)] = None
            self.recorded.move_to_end((project, step))
            while len(self.recorded) > REMEMBERED_STEPS:
                self.recorded.popitem(last=False)

    def recorded_here(self, project: Hashable, step: int) -> bool:
        with self.lock:
            return (project, step) in self.recorded

    def get(self, project: Hashable, step: int) -> tuple[StepCalls, list[StepCalls]]:
        """The step's record (new if none), and the records the run has moved past (clocked roles)."""
        key = (project, step)
        with self.lock:
            if self.clocked:
                passed = self._take_other(step)
                record = self.open.get(key)
                if record is None:
                    record = self.open[key] = StepCalls(step, project)
                return record, passed
            record = self.remembered.get(key)
            if record is None:
                record = self.remembered[key] = StepCalls(step, project)
                while len(self.remembered) > REMEMBERED_STEPS:
                    self.remembered.popitem(last=False)
            else:
                self.remembered.move_to_end(key)
            return record, []

    def find(self, project: Hashable, step: int) -> StepCalls | None:
        """The step's record, if a call of this run has met it."""
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
        """The run ended: every open step (taken out), and the remembered ones forgotten (each committed)."""
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
