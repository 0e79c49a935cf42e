"""How patched calls reach their role: the interceptors the injector calls, and the default phase. Validation
batches, calls without a step and steps not in ``skip.<role>.steps`` run the original; otherwise the target's
phase decides (default :class:`WholeCall`: each call of a step is one part)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Generator, Sized
from typing import TYPE_CHECKING, Any

from skipinject.clock import CLOCK
from skipinject.config import RoleConfig
from skipinject.report.tally import TALLY
from skipinject.roles import Call, Phase, Role, StepSource, Target

if TYPE_CHECKING:
    from skipinject.engine.runtime import RoleRuntime


def drive(calls: Generator[Any, Any, Any], proceed: Callable[..., Any]) -> Any:
    """Run a call's handling written once as a generator: it yields a function doing blocking work
    (run here) or ``(args, kwargs)`` for the target, and gets the answer or the exception back."""
    sent, error = None, None
    while True:
        try:
            asked = calls.throw(error) if error is not None else calls.send(sent)
        except StopIteration as done:
            return done.value
        try:
            sent, error = proceed(*asked[0], **asked[1]) if type(asked) is tuple else asked(), None
        except BaseException as exc:
            sent, error = None, exc


async def drive_async(calls: Generator[Any, Any, Any], proceed: Callable[..., Any]) -> Any:
    """:func:`drive` for awaiting callers: the blocking work runs off the event loop."""
    sent, error = None, None
    while True:
        try:
            asked = calls.throw(error) if error is not None else calls.send(sent)
        except StopIteration as done:
            return done.value
        try:
            if type(asked) is tuple:
                sent, error = await proceed(*asked[0], **asked[1]), None
            else:
                sent, error = await asyncio.to_thread(asked), None
        except BaseException as exc:
            sent, error = None, exc


class WholeCall:
    """Each call of a step is one unit: call k of a cached step is served part k, else saved as part k."""

    def run(self, role: RoleRuntime, call: Call, step: int, proceed: Callable[..., Any]) -> Any:
        return drive(self.calls(role, call, step, background=True), proceed)

    async def run_async(self, role: RoleRuntime, call: Call, step: int, proceed: Callable[..., Any]) -> Any:
        # Awaiting callers (the fully async Rollouter) run many samples at once and may be stopped
        # without an exit hook: their samples are written before they are returned.
        return await drive_async(self.calls(role, call, step, background=False), proceed)

    @staticmethod
    def calls(role: RoleRuntime, call: Call, step: int, background: bool) -> Generator[Any, Any, Any]:
        return role.steps.calls(call, step, background)


WHOLE_CALL = WholeCall()


#: Step sets up to this size are checked through a frozenset (one hash), larger ones by bisection.
_HASHED_STEPS = 1 << 16


def compile_passes(
    source: StepSource, chosen: Any, every_step: bool, open_steps: Sized = ()
) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], bool]:
    """``passes(instance, args, kwargs)``: True when a call surely runs the original (no step open, its step a
    plain int read in a few look-ups, not in ``chosen``); anything else takes the full path."""
    if every_step:
        return _never_passes
    if not source.fallbacks and source.kind == "meta":
        key = source.name

        def meta_passes(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
            if open_steps:
                return False
            try:
                meta = (args[0] if args else next(iter(kwargs.values()))).meta_info
            except (AttributeError, StopIteration):
                return False
            step = meta.get(key) if type(meta) is dict else None
            return type(step) is int and step not in chosen

        return meta_passes
    parts = (source, *source.fallbacks)
    if any(part.kind not in ("attribute", "clock") for part in parts):
        return _never_passes  # the step needs the whole call
    readers = [(part.kind == "clock", part.name) for part in parts]

    def attribute_passes(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if open_steps:
            return False
        for clock, name in readers:
            step = getattr(CLOCK.instance if clock else instance, name, None)
            if step is not None:
                return type(step) is int and step not in chosen
        return False

    return attribute_passes


def _never_passes(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return False


class RuntimeSlot:
    """A role's place in this process before its :class:`~skipinject.engine.runtime.RoleRuntime` exists: what
    patching needs (the role, its settings, the set of open steps the fast path reads), and the runtime built
    on first use, so that a process that patches but never calls a chosen step imports no cache code."""

    def __init__(self, role: Role, settings: RoleConfig, owner: str) -> None:
        self.role = role
        self.settings = settings
        self.owner = owner
        #: The role's open steps (clocked roles), shared with its runtime's StepBook once that exists.
        self.open_steps: dict[Any, Any] = {}
        self.runtime: RoleRuntime | None = None
        self._lock = threading.Lock()

    def get(self) -> RoleRuntime:
        runtime = self.runtime
        if runtime is not None:
            return runtime
        with self._lock:
            if self.runtime is None:
                from skipinject.engine.runtime import RoleRuntime

                self.runtime = RoleRuntime(self.role, self.settings, self.owner, open_steps=self.open_steps)
            return self.runtime


class TargetInterceptor:
    """Connects one patched target to its role's phase (see :class:`skipinject.injector.Interceptor`);
    ``runtime`` is the role's runtime or its :class:`RuntimeSlot` (the runtime is then built at the first
    call that does not pass straight through)."""

    def __init__(self, runtime: RoleRuntime | RuntimeSlot, target: Target) -> None:
        self.slot: RuntimeSlot | None
        self.runtime: RoleRuntime | None
        open_steps: Sized
        if isinstance(runtime, RuntimeSlot):
            self.slot, self.runtime, open_steps = runtime, None, runtime.open_steps
        else:
            self.slot, self.runtime, open_steps = None, runtime, runtime.book.open
        self.phase: Phase | WholeCall = target.phase or WHOLE_CALL
        self.every_step = target.every_step
        #: A call of this target at a chosen step is the role being called (never-called check); a target
        #: seeing every step (a sample phase, a switch) does not say the role's own work was reached.
        self.marks = not target.every_step or all(t.every_step for t in runtime.role.targets)
        steps = runtime.settings.steps
        chosen = frozenset(steps) if len(steps) <= _HASHED_STEPS else steps
        #: Asked by the injector first on every call, before a Call exists (see compile_passes).
        self.passes = compile_passes(
            runtime.role.step, chosen, target.every_step or target.before is not None, open_steps
        )
        self.before = target.before

    def _runtime(self) -> RoleRuntime:
        assert self.slot is not None
        self.runtime = self.slot.get()
        return self.runtime

    def _readied(self, call: Call, proceed: Callable[..., Any], awaiting: bool) -> Callable[..., Any]:
        """``proceed`` calling the target's ``before(call)`` first (off the event loop for awaiting callers)."""
        before = self.before
        if before is None:
            return proceed
        if awaiting:

            async def ready_then_proceed_async(*args: Any, **kwargs: Any) -> Any:
                await asyncio.to_thread(before, call)
                return await proceed(*args, **kwargs)

            return ready_then_proceed_async

        def ready_then_proceed(*args: Any, **kwargs: Any) -> Any:
            before(call)
            return proceed(*args, **kwargs)

        return ready_then_proceed

    def sync(self, call: Call, proceed: Callable[[], Any]) -> Any:
        proceed = self._readied(call, proceed, awaiting=False)
        runtime = self.runtime or self._runtime()
        step = runtime.applicable_step(call, any_step=self.every_step)
        if step is None:
            return proceed()
        self._called(runtime, step)
        return self.phase.run(runtime, call, step, proceed)

    async def run_async(self, call: Call, proceed: Callable[[], Any]) -> Any:
        proceed = self._readied(call, proceed, awaiting=True)
        runtime = self.runtime or self._runtime()
        step = runtime.applicable_step(call, any_step=self.every_step)
        if step is None:
            return await proceed()
        self._called(runtime, step)
        return await self.phase.run_async(runtime, call, step, proceed)

    def _called(self, runtime: RoleRuntime, step: int) -> None:
        if self.marks and runtime.name not in TALLY.called and runtime.settings.allows(step):
            TALLY.note_called(runtime.name)
