"""The trainer a run's calls belong to: the latest instance seen entering a role's clock (``fit``).

Its own module so that the roles (which declare clocks) and :mod:`skipinject.verl.compat` (which
reads the run config from the trainer) both use it without importing each other.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["CLOCK", "Clock"]


class Clock:
    """The latest live instance seen entering a patched method (e.g. a trainer's ``fit``).

    Calls that carry no step of their own read it from here (``trainer.global_steps``). Only a
    weak reference is kept, so a finished trainer is not held alive.
    """

    def __init__(self) -> None:
        self._ref: weakref.ReferenceType[Any] | Callable[[], Any] = lambda: None

    def enter(self, instance: Any) -> None:
        try:
            self._ref = weakref.ref(instance)
        except TypeError:
            self._ref = lambda: instance

    @property
    def instance(self) -> Any:
        return self._ref()


CLOCK = Clock()
