"""The pass-through path: a call at a step that is not chosen does nothing but call the original.

A regression check for the pass-through benchmark (benchmarks/bench_passthrough.py): the mechanism,
not a wall time — no :class:`Call` is built, no phase, no log, no signature inspection.
"""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import skipinject.injector as injector_module
from skipinject import Role, StepSource, Target
from skipinject.config import Config, RoleConfig
from skipinject.engine import Engine


class Batch:
    def __init__(self, step: int) -> None:
        self.meta_info = {"global_steps": step}


@pytest.fixture
def targets() -> Iterator[types.ModuleType]:
    module = types.ModuleType("si_passthrough_targets")

    class Manager:
        global_steps = 0

        def generate(self, prompts: Batch) -> str:
            return "ran"

        async def agenerate(self, prompts: Batch) -> str:
            return "ran"

    module.Manager = Manager  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


@pytest.fixture
def count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    built: list[int] = []
    real = injector_module.Call

    def counting(*args: Any, **kwargs: Any) -> Any:
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(injector_module, "Call", counting)
    return built


def start(tmp_path: Path, step: StepSource, *, every_step: bool = False) -> Engine:
    role = Role(
        name="fast",
        targets=[
            Target("si_passthrough_targets:Manager.generate", every_step=every_step),
            Target("si_passthrough_targets:Manager.agenerate", every_step=every_step),
        ],
        step=step,
    )
    settings = RoleConfig(enable=True, steps=(1000,), dump_dir=str(tmp_path))
    engine = Engine(Config(roles={"fast": settings}), {"fast": (role, "fast")})
    engine.start()
    return engine


@pytest.mark.parametrize("source", [StepSource.meta("global_steps"), StepSource.attribute("global_steps")])
def test_not_chosen_steps_build_nothing(
    targets: Any, count_calls: list[int], tmp_path: Path, source: StepSource
) -> None:
    engine = start(tmp_path, source)
    try:
        manager = targets.Manager()
        assert manager.generate(Batch(5)) == "ran"
        assert asyncio.run(manager.agenerate(Batch(5))) == "ran"
        assert count_calls == [], "the fast path built a Call"
        manager.global_steps = 1000
        manager.generate(Batch(1000))  # a chosen step takes the full path (and caches)
        assert count_calls, "a chosen step must reach the engine"
    finally:
        engine.stop()


def test_every_step_targets_and_unreadable_steps_take_the_full_path(
    targets: Any, count_calls: list[int], tmp_path: Path
) -> None:
    engine = start(tmp_path, StepSource.argument("prompts"))  # needs the signature: no fast path
    try:
        targets.Manager().generate(Batch(5))
        assert len(count_calls) == 1
    finally:
        engine.stop()
    engine = start(tmp_path, StepSource.meta("global_steps"), every_step=True)
    try:
        targets.Manager().generate(Batch(5))
        assert len(count_calls) == 2
    finally:
        engine.stop()
