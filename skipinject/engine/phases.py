"""How patched calls reach their role: the interceptors the injector calls, and the default phase.

A patched call goes: validation batches (and calls without a step) run the original untouched;
steps not in ``skip.<role>.steps`` run the original; otherwise the target's phase decides. The
default phase, :class:`WholeCall`, treats one call as one unit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from skipinject.engine.runtime import REGENERATE, RoleRuntime
from skipinject.roles import CLOCK, Call, Phase, Target

if TYPE_CHECKING:
    from skipinject.engine import Engine


class WholeCall:
    """One call is one unit: serve it from the cache, or run it and save what it returned."""

    def run(self, role: RoleRuntime, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        plan = role.plan(call, step)
        if plan.entry is not None or plan.upstream_file is not None:
            result = role.serve(plan, call)
            if result is not REGENERATE:
                return result
        inputs = role.fingerprint(call)  # before the target runs: it may change its inputs
        result = proceed()
        role.save(plan, call, result, inputs)
        return role.after_miss(call, result)

    async def run_async(self, role: RoleRuntime, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        plan = await asyncio.to_thread(role.plan, call, step)
        if plan.entry is not None or plan.upstream_file is not None:
            result = await asyncio.to_thread(role.serve, plan, call)
            if result is not REGENERATE:
                return result
        inputs = role.fingerprint(call)
        result = await proceed()
        await asyncio.to_thread(role.save, plan, call, result, inputs)
        return role.after_miss(call, result)


WHOLE_CALL = WholeCall()


class TargetInterceptor:
    """Connects one patched target to its role's phase (see :class:`skipinject.injector.Interceptor`)."""

    def __init__(self, runtime: RoleRuntime, target: Target) -> None:
        self.runtime = runtime
        self.phase: Phase | WholeCall = target.phase or WHOLE_CALL
        self.every_step = target.every_step

    def sync(self, call: Call, proceed: Callable[[], Any]) -> Any:
        step = self.runtime.applicable_step(call, any_step=self.every_step)
        if step is None:
            return proceed()
        return self.phase.run(self.runtime, call, step, proceed)

    async def run_async(self, call: Call, proceed: Callable[[], Any]) -> Any:
        step = self.runtime.applicable_step(call, any_step=self.every_step)
        if step is None:
            return await proceed()
        return await self.phase.run_async(self.runtime, call, step, proceed)


class ClockInterceptor:
    """Records the trainer entering ``fit`` (the clock) and checks each role against its config once."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def sync(self, call: Call, proceed: Callable[[], Any]) -> Any:
        self._enter(call)
        return proceed()

    async def run_async(self, call: Call, proceed: Callable[[], Any]) -> Any:
        self._enter(call)
        return await proceed()

    def _enter(self, call: Call) -> None:
        if call.instance is not None:
            CLOCK.enter(call.instance)
            self.engine.observe_config(getattr(call.instance, "config", None))
