"""The one place where a call is served from the cache or run and saved: :mod:`~skipinject.engine.phases`
hands a call to its role's :mod:`~skipinject.engine.runtime`, which decides and serves
(:mod:`~skipinject.engine.replay`), records (:mod:`~skipinject.engine.record`) or matches rows
(:mod:`~skipinject.engine.matching`). Every decision is one line on the ``skipinject`` logger."""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from skipinject.config import Action, Config
from skipinject.engine.background import WRITER
from skipinject.engine.matching import check_matchable
from skipinject.engine.phases import ClockInterceptor, TargetInterceptor
from skipinject.engine.runtime import RoleRuntime
from skipinject.errors import ConfigError
from skipinject.injector import INJECTOR, Injector, target_key
from skipinject.report.tally import METRICS_TARGET, MetricsInterceptor
from skipinject.roles import Role
from skipinject.verl.builtin_guard import BUILTIN_SKIP_INIT, BuiltinGuard
from skipinject.verl.compat import is_run_config, module_exists, verl_version, version_matches

logger = logging.getLogger("skipinject")

__all__ = ["Engine", "RoleRuntime"]


class Engine:
    """Patches the targets of the enabled roles and holds their runtimes."""

    def __init__(self, config: Config, roles: Mapping[str, tuple[Role, str]], injector: Injector = INJECTOR) -> None:
        self.config = config
        self.roles = dict(roles)
        self.injector = injector
        self.runtimes: dict[str, RoleRuntime] = {}
        self._paths: list[str] = []
        self._seen_configs: set[int] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        unknown = [name for name in self.config.enabled_roles if name not in self.roles]
        if unknown:
            raise ConfigError(f"skip.{unknown[0]}: no loaded plugin provides role {unknown[0]!r}")
        installed: str | None = None
        clocks: list[str] = []
        for name in self.config.enabled_roles:
            role, owner = self.roles[name]
            runtime = RoleRuntime(role, self.config.role(name), owner)
            if runtime.settings.action is Action.match:
                check_matchable(role, runtime.codec)
            self.runtimes[name] = runtime
            for target in role.targets:
                if target.verl and installed is None:
                    installed = verl_version()
                if not version_matches(target.verl, installed):
                    logger.debug(
                        f"{name}: target {target.path} is for verl {target.verl}, installed {installed}; skipped"
                    )
                    continue
                self._instrument(
                    target.path,
                    TargetInterceptor(runtime, target),
                    f"{owner}/{name}",
                    attribute=target.attribute,
                    overrides=target.overrides,
                )
            clocks.extend(c for c in role.clocks if c not in clocks)
        clock = ClockInterceptor(self)
        for path in clocks:
            # A recipe's trainer overriding fit (verl's DAPO trainer) runs its own fit: that is the clock too.
            self._instrument(path, clock, "skipinject/clock", overrides=True)
        if any(rt.role.builtin for rt in self.runtimes.values()):
            self._instrument(BUILTIN_SKIP_INIT, BuiltinGuard(self), "skipinject/builtin-guard")
        if self.runtimes:
            # the trainer's metrics get the cache's running totals (skipinject/served_steps_total, ...)
            self._instrument(METRICS_TARGET, MetricsInterceptor(), "skipinject/metrics")
            atexit.register(self.end_of_run)  # after the writer's own exit flush was registered: runs first
            logger.debug("skipinject active for %s", ", ".join(self.runtimes))

    def check_targets(self) -> list[str]:
        """Warn (and return the lines) for each enabled role that has no target for this verl or a target
        whose module is missing; nothing is imported."""
        installed = verl_version()
        lines = []
        for name, runtime in self.runtimes.items():
            targets = [t for t in runtime.role.targets if version_matches(t.verl, installed)]
            if not targets:
                ranges = ", ".join(sorted({t.verl or "any" for t in runtime.role.targets}))
                lines.append(
                    f"skip.{name} is enabled but has no target for the installed verl {installed} "
                    f"(its targets are for verl {ranges}); it will not act in this run"
                )
                continue
            for target in targets:
                module = target.path.partition(":")[0]
                if not module_exists(module):
                    lines.append(
                        f"skip.{name}: target {target.path} does not exist in this install (no module {module}); "
                        "this target will not act (see `python -m skipinject --list`)"
                    )
        for line in lines:
            logger.warning("%s", line)
        return lines

    def end_of_run(self) -> None:
        """The run ended (``fit`` returned, the engine stops, exit): every open step committed and written."""
        for runtime in list(self.runtimes.values()):
            runtime.close_all()
        WRITER.flush()

    def stop(self) -> None:
        self.end_of_run()
        atexit.unregister(self.end_of_run)
        for path in self._paths:
            self.injector.uninstrument(path)
        self._paths.clear()
        self.runtimes.clear()

    def _instrument(
        self,
        path: str,
        interceptor: Any,
        owner: str,
        attribute: str | None = None,
        *,
        overrides: bool | Callable[[type], str | None] = False,
    ) -> None:
        self.injector.instrument(path, interceptor, owner=owner, attribute=attribute, overrides=overrides)
        self._paths.append(target_key(path, attribute))

    def observe_config(self, config: Any) -> None:
        """Run every enabled role's ``check`` against a run config once; warn when it cannot fire."""
        if not is_run_config(config):
            return
        with self._lock:
            if id(config) in self._seen_configs:
                return
            self._seen_configs.add(id(config))
        for runtime in self.runtimes.values():
            if runtime.role.check is None:
                continue
            with contextlib.suppress(Exception):
                reason = runtime.role.check(config)
                if reason:
                    message = f"skip.{runtime.name} is enabled but cannot act in this run: {reason}"
                    runtime.once(("check", reason), logging.WARNING, message)
