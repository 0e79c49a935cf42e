"""A role in this process, the engine's side of :class:`~skipinject.roles.PhaseContext`: it finds a
call's step and hands the rest to its stores (:mod:`~skipinject.engine.stores`), replay and recorder."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from skipinject.config import RoleConfig
from skipinject.engine.matching import Found, RowMatcher, row_keys
from skipinject.engine.record import Recorder, StepBook
from skipinject.engine.replay import REGENERATE, Replay, regenerated
from skipinject.engine.stores import RoleContext
from skipinject.roles import Call, Loaded, Plan, Role
from skipinject.store import StepStore

__all__ = ["REGENERATE", "RoleRuntime"]


class RoleRuntime(RoleContext):
    """A role with its settings in this process: its stores, replay and recording."""

    def __init__(self, role: Role, settings: RoleConfig, owner: str) -> None:
        super().__init__(role, settings, owner)
        steps = StepBook(clocked=bool(role.clocks))
        self.replay = Replay(self, steps)
        self.recorder = Recorder(self, self.replay, steps)
        #: ``action=match`` (and the row keys every recording of a keyed role saves).
        self.matcher = RowMatcher(self, self.recorder)

    def applicable_step(self, call: Call, *, any_step: bool = False) -> int | None:
        """The call's step if this role may act on it, else ``None`` (the original runs); ``any_step``:
        also steps outside ``skip.<role>.steps`` (targets declared ``every_step``)."""
        try:
            if self.role.bypass(call):
                return None
        except Exception as exc:
            message = f"{self.name}: validation check failed ({exc}); not skipping"
            self.once(("bypass", type(exc)), logging.WARNING, message)
            return None
        try:
            step = self.role.step.resolve(call)
        except Exception as exc:  # a plugin's step extractor must not break the user's call
            message = f"{self.name}: finding the step of {call.target} failed ({type(exc).__name__}: {exc})"
            self.once(("step", type(exc)), logging.WARNING, message + "; not skipping")
            return None
        if step is None:
            message = f"{self.name}: no training step found for {call.target} (looked at {self.role.step.describe()})"
            self.once("nostep", logging.WARNING, message + "; not skipping")
            return None
        self.recorder.moved_to(step)
        self.replay.read_ahead.moved_to(step)
        if not any_step and not self.settings.allows(step):
            return None
        return step

    def close_all(self) -> None:
        """The run ended (``fit`` returned, the engine stops, the interpreter exits): close every step."""
        self.recorder.close_all()

    # PhaseContext (see skipinject.roles)

    def plan(self, call: Call, step: int) -> Plan:
        return self.replay.plan(call, step)

    def load(self, call: Call, step: int, prepare: Callable[[Loaded], Any] | None = None) -> Loaded | None:
        """The step is then served, or recorded, in this run (its later calls follow)."""
        record = self.recorder.step(call, step)
        plan = self.replay.plan(call, step)
        loaded = None
        try:
            loaded = self.replay.load(plan, call, prepare)
        finally:
            with record.lock:
                if record.writer is None:
                    record.plan = regenerated(plan, plan.serves and loaded is None)
        return loaded

    def served(self, call: Call, step: int) -> bool | None:
        return self.recorder.served(call, step)

    def notes(self, call: Call, step: int) -> dict[str, Any]:
        return self.recorder.step(call, step).notes

    def record(self, call: Call, step: int, result: Any) -> int | None:
        return self.recorder.record_part(call, step, result)

    def commit(
        self, call: Call, step: int, meta: Mapping[str, Any] | None = None, *, unit: str = "rows", note: str = ""
    ) -> None:
        self.recorder.commit_step(call, step, meta, unit, note)

    def in_background(self, store: StepStore, job: Callable[[], None]) -> None:
        self.recorder.in_background(store, job)

    def row_keys(self, call: Call, digests: Sequence[str]) -> list[str]:
        return row_keys(self.role, call, digests)

    def match_rows(self, call: Call, keys: list[str], group: int = 1) -> Found:
        return self.matcher.find(self.store_for(call), call, keys, group)

    def record_rows(self, call: Call, step: int, result: Any, keys: Sequence[str]) -> None:
        self.matcher.save_rows(self.store_for(call), call, step, result, keys)
