"""The one place where a call is served from the cache or run and saved: :mod:`~skipinject.engine.phases`
hands a call to its role's :mod:`~skipinject.engine.runtime`, whose :mod:`~skipinject.engine.steps` drive the
step: planned and served (:mod:`~skipinject.engine.replay`), recorded (:mod:`~skipinject.engine.record`) or
its rows matched (:mod:`~skipinject.engine.matching`), each on the role's
:mod:`~skipinject.engine.services`. Every decision is one line on the ``skipinject`` logger.

Patching imports only what a patch needs (this module, :mod:`~skipinject.engine.phases`, the injector): a
role's runtime, with the cache code under it, is built when it is first needed (the first call that does not
pass straight through, the run's config seen, the end of the run's steps). Every Ray worker and helper process
of a run patches verl, and most of them never serve or save a step."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from skipinject.clock import CLOCK
from skipinject.config import Action, Config
from skipinject.engine.background import WRITER
from skipinject.engine.phases import RuntimeSlot, TargetInterceptor
from skipinject.errors import ConfigError
from skipinject.injector import INJECTOR, Injector, target_key
from skipinject.report.silence import Silence, StepEnd, watched_roles
from skipinject.report.tally import METRICS_TARGET, MetricsInterceptor
from skipinject.roles import Call, Role
from skipinject.verl.builtin_guard import BUILTIN_SKIP_INIT, BuiltinGuard
from skipinject.verl.compat import is_run_config, module_exists, verl_version, version_matches

if TYPE_CHECKING:
    from skipinject.engine.runtime import RoleRuntime

logger = logging.getLogger("skipinject")

__all__ = ["Engine", "RoleRuntime", "TargetInterceptor"]


def __getattr__(name: str) -> Any:
    if name == "RoleRuntime":
        from skipinject.engine.runtime import RoleRuntime

        return RoleRuntime
    raise AttributeError(f"module 'skipinject.engine' has no attribute {name!r}")


class Runtimes(Mapping[str, "RoleRuntime"]):
    """The enabled roles' runtimes by name, each built at its first look-up (:class:`RuntimeSlot`)."""

    def __init__(self) -> None:
        self.slots: dict[str, RuntimeSlot] = {}

    def __getitem__(self, name: str) -> RoleRuntime:
        return self.slots[name].get()

    def __iter__(self) -> Iterator[str]:
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def built(self) -> list[RoleRuntime]:
        """The runtimes that exist (none is built for the asking)."""
        return [slot.runtime for slot in list(self.slots.values()) if slot.runtime is not None]

    def clear(self) -> None:
        self.slots.clear()


class Engine:
    """Patches the targets of the enabled roles and holds their runtimes."""

    def __init__(self, config: Config, roles: Mapping[str, tuple[Role, str]], injector: Injector = INJECTOR) -> None:
        self.config = config
        self.roles = dict(roles)
        self.injector = injector
        self.runtimes = Runtimes()
        self._paths: list[str] = []
        self._seen_configs: set[int] = set()
        self._lock = threading.Lock()
        #: The enabled roles no process has called at a chosen step yet, judged at a step's end.
        self.silence = Silence(())

    def start(self) -> None:
        unknown = [name for name in self.config.enabled_roles if name not in self.roles]
        if unknown:
            raise ConfigError(f"skip.{unknown[0]}: no loaded plugin provides role {unknown[0]!r}")
        installed: str | None = None
        clocks: list[str] = []
        for name in self.config.enabled_roles:
            role, owner = self.roles[name]
            slot = self.runtimes.slots[name] = RuntimeSlot(role, self.config.role(name), owner)
            if slot.settings.action is Action.match:
                from skipinject.engine.matching import check_matchable

                check_matchable(role, slot.get().codec)
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
                    TargetInterceptor(slot, target),
                    f"{owner}/{name}",
                    attribute=target.attribute,
                    overrides=target.overrides,
                )
            clocks.extend(c for c in role.clocks if c not in clocks)
        clock = ClockInterceptor(self)
        for path in clocks:
            # A recipe's trainer overriding fit (verl's DAPO trainer) runs its own fit: that is the clock too.
            self._instrument(path, clock, "skipinject/clock", overrides=True)
        if any(slot.role.builtin for slot in self.runtimes.slots.values()):
            self._instrument(BUILTIN_SKIP_INIT, BuiltinGuard(self), "skipinject/builtin-guard")
        self.injector.say_earlier_names()  # a role's target imported by name before skipinject: said once
        if self.runtimes:
            self.silence = Silence(
                watched_roles(self.runtimes.slots.values(), lambda target: version_matches(target.verl, installed))
            )
            # the trainer's metrics get the cache's running totals (skipinject/served_steps_total, ...); a
            # training step's log ends the step: an enabled role never called by then is said
            self._instrument(METRICS_TARGET, StepEnd(self.silence, MetricsInterceptor()), "skipinject/metrics")
            atexit.register(self.end_of_run)  # after the writer's own exit flush was registered: runs first
            logger.debug("skipinject active for %s", ", ".join(self.runtimes))

    def check_targets(self) -> list[str]:
        """Warn (and return the lines) for each enabled role that has no target for this verl or a target
        whose module is missing; nothing is imported."""
        installed = verl_version()
        lines = []
        for name, slot in self.runtimes.slots.items():
            targets = [t for t in slot.role.targets if version_matches(t.verl, installed)]
            if not targets:
                ranges = ", ".join(sorted({t.verl or "any" for t in slot.role.targets}))
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
        for runtime in self.runtimes.built():
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

    def read_first_steps(self, config: Any) -> None:
        """The trainer's ``fit`` began in this process (the run's config composed, its workers starting): each
        clocked role with steps to serve reads its first chosen cached step ahead, so that the run's first hit
        only waits for what is left of that read."""
        for slot in list(self.runtimes.slots.values()):
            settings = slot.settings
            if not slot.role.clocks or not settings.read_ahead or not settings.steps:
                continue
            if settings.action in (Action.match, Action.refresh):
                continue
            try:
                runtime = slot.get()
                runtime.replay.read_from(runtime.store_of(config), 0, start=True)
            except Exception as exc:  # the first call plans the step again and says what is wrong
                logger.debug("%s: no read-ahead at the start: %s: %s", slot.role.name, type(exc).__name__, exc)

    def observe_config(self, config: Any) -> None:
        """Run every enabled role's ``check`` against a run config once; warn when it cannot fire."""
        if not is_run_config(config):
            return
        with self._lock:
            if id(config) in self._seen_configs:
                return
            self._seen_configs.add(id(config))
        for name, slot in self.runtimes.slots.items():
            if slot.role.check is None:
                continue
            with contextlib.suppress(Exception):
                reason = slot.role.check(config)
                if reason:
                    message = f"skip.{name} is enabled but cannot act in this run: {reason}"
                    slot.get().once(("check", reason), logging.WARNING, message)


class ClockInterceptor:
    """Records the trainer entering ``fit`` (the clock) and checks each role against its config once."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def sync(self, call: Call, proceed: Callable[[], Any]) -> Any:
        self._enter(call)
        try:
            result = proceed()
        finally:
            self.engine.end_of_run()  # the run is over (or failed): its steps are committed before the process may end
        self.engine.silence.run_ended(call.instance)  # a role never called by now is said (strict: an error)
        return result

    async def run_async(self, call: Call, proceed: Callable[[], Any]) -> Any:
        self._enter(call)
        try:
            result = await proceed()
        finally:
            await asyncio.to_thread(self.engine.end_of_run)
        self.engine.silence.run_ended(call.instance)
        return result

    def _enter(self, call: Call) -> None:
        if call.instance is not None:
            CLOCK.enter(call.instance)
            self.engine.observe_config(getattr(call.instance, "config", None))
            self.engine.read_first_steps(call.run_config)
