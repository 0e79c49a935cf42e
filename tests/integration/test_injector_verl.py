"""The injector on verl's own calling conventions (the verl-free injector tests are in tests/unit)."""

from __future__ import annotations

import asyncio
import inspect
import sys

import pytest

from skipinject.injector import Injector
from tests.unit.test_injector import Recorder


def test_real_verl_auto_await_keeps_its_contract(injector: Injector):
    auto_await = pytest.importorskip("verl.utils.ray_utils").auto_await
    module = type(sys)("verl_auto_await_probe")

    class Manager:
        @auto_await
        async def generate(self, x: int) -> int:
            await asyncio.sleep(0)
            return x + 1

    module.Manager = Manager
    sys.modules[module.__name__] = module
    try:
        injector.instrument("verl_auto_await_probe:Manager.generate", Recorder())
        assert Manager().generate(1) == 1002

        async def awaiting() -> int:
            pending = Manager().generate(1)
            assert inspect.iscoroutine(pending)
            return await pending

        assert asyncio.run(awaiting()) == 1002
    finally:
        injector.uninstrument_all()
        sys.modules.pop(module.__name__)
