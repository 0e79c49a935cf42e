"""A role with its settings in this process: the engine's side of :class:`~skipinject.roles.PhaseContext`.

It finds a call's step and hands the rest to its three parts: :class:`~skipinject.engine.stores.RoleStores`
(which store), :class:`~skipinject.engine.replay.Replay` (serving a cached step) and
:class:`~skipinject.engine.record.Recorder` (saving a fresh one).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from skipinject.config import RoleConfig
from skipinject.engine.matching import RowMatcher
from skipinject.engine.record import Recorder
from skipinject.engine.replay import REGENERATE, Replay
from skipinject.engine.stores import RoleStores
from skipinject.roles import Call, Codec, Loaded, Plan, Role, StepCache
from skipinject.store import StepStore

__all__ = ["REGENERATE", "RoleRuntime"]

logger = logging.getLogger("skipinject")


class RoleRuntime:
    """A role with its settings in this process: its stores, replay and recording."""

    def __init__(self, role: Role, settings: RoleConfig, owner: str) -> None:
        self.role = role
        self.settings = settings
        self.owner = owner
        self._lock = threading.Lock()
        self._warned: set[Any] = set()
        self._default_codec: Codec | None = None
        self.stores = RoleStores(self)
        self.replay = Replay(self)
        self.recorder = Recorder(self)
        #: ``action=match`` (and the row keys every recording of a keyed role saves).
        self.matcher = RowMatcher(self)

    @property
    def name(self) -> str:
        return self.role.name

    @property
    def codec(self) -> Codec:
        if self.role.codec is not None:
            return self.role.codec
        if self._default_codec is None:
            from skipinject.codecs import DataProtoCodec

            self._default_codec = DataProtoCodec()
        return self._default_codec

    def once(self, key: Any, level: int, message: str, *args: Any) -> None:
        """Log ``message`` the first time ``key`` is seen."""
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        logger.log(level, message, *args)

    def applicable_step(self, call: Call, *, any_step: bool = False) -> int | None:
        """The call's step if this role may act on it, else ``None`` (the original runs).

        ``any_step``: also steps outside ``skip.<role>.steps`` (targets declared ``every_step``).
        """
        try:
            if self.role.bypass(call):
                return None
        except Exception as exc:
            self.once(
                ("bypass", type(exc)), logging.WARNING, "%s: validation check failed (%s); not skipping", self.name, exc
            )
            return None
        try:
            step = self.role.step.resolve(call)
        except Exception as exc:  # a plugin's step extractor must not break the user's call
            self.once(
                ("step", type(exc)),
                logging.WARNING,
                "%s: finding the step of %s failed (%s: %s); not skipping",
                self.name,
                call.target,
                type(exc).__name__,
                exc,
            )
            return None
        if step is None:
            self.once(
                "nostep",
                logging.WARNING,
                "%s: no training step found for %s (looked at %s); not skipping",
                self.name,
                call.target,
                self.role.step.describe(),
            )
            return None
        self.recorder.moved_to(step)
        self.replay.read_ahead.moved_to(step)
        if not any_step and not self.settings.allows(step):
            return None
        return step

    def fingerprint(self, call: Call) -> list[str] | None:
        if self.role.fingerprint is None:
            return None
        try:
            rows = self.role.fingerprint(call)
        except Exception as exc:
            self.once(
                ("fingerprint", type(exc)),
                logging.WARNING,
                "%s: cannot fingerprint the inputs (%s); mismatches will not be detected",
                self.name,
                exc,
            )
            return None
        return None if rows is None else [str(r) for r in rows]

    def after_miss(self, call: Call, result: Any) -> Any:
        if self.role.on_miss is None:
            return result
        return self.role.on_miss(result, call)

    def close_all(self) -> None:
        """The run ended (``fit`` returned, the engine stops, the interpreter exits): close every step."""
        self.recorder.close_all()

    # ------------------------------------------------------------ PhaseContext (see skipinject.roles)

    def store_for(self, call: Call) -> StepStore:
        return self.stores.store_for(call)

    def plan(self, call: Call, step: int) -> Plan:
        return self.replay.plan(call, step)

    def load(self, call: Call, step: int, prepare: Callable[[Loaded], Any] | None = None) -> Loaded | None:
        return self.replay.load(call, step, prepare)

    def served(self, call: Call, step: int) -> bool | None:
        return self.recorder.served(call, step)

    def notes(self, call: Call, step: int) -> dict[str, Any]:
        return self.recorder.step(call, step).notes

    def record(self, call: Call, step: int, result: Any) -> int | None:
        return self.recorder.record_part(call, step, result)

    def commit(self, call: Call, step: int, meta: Mapping[str, Any] | None = None, *, note: str = "") -> None:
        self.recorder.commit_step(call, step, meta, note)

    def in_background(self, store: StepCache, job: Callable[[], None]) -> None:
        self.recorder.in_background(store, job)
