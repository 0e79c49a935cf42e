"""The trainer a run's calls belong to: the latest instance seen entering a role's clock (``fit``); apart so
that the roles and :mod:`skipinject.verl.compat` use it without importing each other."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["CLOCK", "Clock"]


def weak_ref(instance: Any) -> Callable[[], Any]:
    """A weak reference to ``instance``, or a strong one for objects that take none."""
    try:
        return weakref.ref(instance)
    except TypeError:
        return lambda: instance


class Clock:
    """The latest live instance seen entering a patched method (e.g. a trainer's ``fit``), weakly held:
    calls that carry no step of their own read it from here (``trainer.global_steps``)."""

    def __init__(self) -> None:
        self._ref: Callable[[], Any] = lambda: None

    def enter(self, instance: Any) -> None:
        self._ref = weak_ref(instance)

    @property
    def instance(self) -> Any:
        return self._ref()


CLOCK = Clock()
