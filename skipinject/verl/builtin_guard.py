"""Living beside verl's own SkipManager (verl >= 0.9): exactly one mechanism acts per role."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from skipinject.roles import Call

#: verl's built-in skip is set up here; after it returns, the roles skipinject handles are removed.
BUILTIN_SKIP_INIT = "verl.utils.skip.skip_manager:SkipManager.init"


class Guarding(Protocol):
    """What the guard asks of the engine: its roles' runtimes, and each run config seen."""

    @property
    def runtimes(self) -> Mapping[str, Any]: ...

    def observe_config(self, config: Any) -> None: ...


class BuiltinGuard:
    """After verl's ``SkipManager.init``, turns off built-in roles that skipinject handles."""

    def __init__(self, engine: Guarding) -> None:
        self.engine = engine

    def sync(self, call: Call, proceed: Callable[[], Any]) -> Any:
        result = proceed()
        self.engine.observe_config(call.argument("config"))
        instances = getattr(call.instance, "skip_instances", None)
        if isinstance(instances, dict):
            for runtime in self.engine.runtimes.values():
                builtin = runtime.role.builtin
                instance = instances.get(builtin) if builtin else None
                if instance is not None and getattr(instance, "enable", False):
                    instances.pop(builtin)
                    runtime.once(
                        "builtin",
                        logging.WARNING,
                        "verl's built-in skip.%s is enabled in the trainer config and skipinject's %s role is on: "
                        "skipinject handles it, the built-in one is turned off for this run",
                        builtin,
                        runtime.name,
                    )
        return result

    async def run_async(self, call: Call, proceed: Callable[[], Any]) -> Any:  # pragma: no cover - init is sync
        return self.sync(call, proceed)
