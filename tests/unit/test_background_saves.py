"""Misses are written off the training call's critical path, and what is written is what training saw."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from skipinject import Payload, Role, StepSource, Target
from skipinject.config import Config, RoleConfig
from skipinject.engine import Engine
from skipinject.engine.background import WRITER, BackgroundWriter
from skipinject.store import StepStore
from skipinject.testing import ToyTrainer
from skipinject.verl.layout import layout_of

pytestmark = pytest.mark.background_saves


class TensorCodec:
    """A result that is one tensor (training changes it in place afterwards)."""

    def encode(self, result: torch.Tensor) -> Payload:
        return Payload(
            tensors={"x": result}, objects={"meta": {"rows": int(result.shape[0])}}, rows=int(result.shape[0])
        )

    def decode(self, payload: Payload, call: Any) -> torch.Tensor:
        return payload.tensors["x"].clone()


class Trainer(ToyTrainer):
    """``fit()`` is the run's end: its return waits for the background writer (the role's clock)."""

    def generate(self, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32)


def toy_store(dump: Path) -> StepStore:
    """The store the toy trainer's run saves into (its config names the layout)."""
    relative, context = layout_of(ToyTrainer().config)
    return StepStore(dump / relative / "bg", "bg", context)


@pytest.fixture
def engine(tmp_path: Path) -> Any:
    module = type(sys)("si_background_targets")
    module.Trainer = type("Trainer", (Trainer,), {})  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    role = Role(
        name="bg",
        targets=[Target("si_background_targets:Trainer.generate")],
        step=StepSource.attribute("global_steps"),
        codec=TensorCodec(),
        clocks=["si_background_targets:Trainer.fit"],
    )
    settings = RoleConfig(enable=True, steps=(1, 2, 3), dump_dir=str(tmp_path))
    started = Engine(Config(roles={"bg": settings}), {"bg": (role, "bg")})
    started.start()
    module.dump_dir = tmp_path  # type: ignore[attr-defined]
    yield module
    started.stop()
    del sys.modules[module.__name__]


def test_written_data_is_what_the_call_returned_even_if_training_changes_it(engine: Any, tmp_path: Path) -> None:
    trainer = engine.Trainer()
    trainer.global_steps = 1
    result = trainer.generate(1000)
    result.mul_(-1)  # training changes the batch in place while (or before) the writer runs
    trainer.fit()  # the run ends (the clock returns): the step is committed, every write done
    store = toy_store(tmp_path)
    (payload,) = store.load(store.verified(1))
    assert torch.equal(payload.tensors["x"], torch.arange(1000, dtype=torch.float32))


def test_a_read_of_the_project_waits_for_its_pending_save(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from skipinject.store.writer import StepWriter

    real_add_part = StepWriter.add_part
    gate = threading.Event()

    def slow_add_part(self: StepWriter, *args: Any, **kwargs: Any) -> Any:
        gate.wait(30)
        return real_add_part(self, *args, **kwargs)

    monkeypatch.setattr(StepWriter, "add_part", slow_add_part)
    trainer = engine.Trainer()
    trainer.global_steps = 2
    started = time.perf_counter()
    first = trainer.generate(10)
    assert time.perf_counter() - started < 20, "the miss waited for the write"
    assert WRITER.pending() == 1
    threading.Timer(0.2, gate.set).start()
    trainer.global_steps = 3
    trainer.generate(10)  # the next step: step 2 is committed, and step 3's read waits for it
    store = toy_store(engine_dump(engine))
    (payload,) = store.load(store.verified(2))  # committed before step 3's call returned
    assert torch.equal(payload.tensors["x"], first)
    assert WRITER.pending() <= 1, "only step 3's own save may still be pending"


def engine_dump(module: Any) -> Path:
    return Path(module.dump_dir)


def test_the_queue_is_bounded() -> None:
    writer = BackgroundWriter(max_pending=2)
    gate = threading.Event()
    running: list[int] = []

    def job(i: int) -> Any:
        return lambda: (running.append(i), gate.wait(30))

    for i in range(3):  # one running, two queued
        writer.submit("k", job(i))
    while not running:
        time.sleep(0.01)
    blocked = threading.Thread(target=writer.submit, args=("k", job(3)))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive(), "a fourth save must wait while the queue is full"
    gate.set()
    blocked.join(30)
    writer.flush()
    assert writer.pending() == 0 and sorted(running) == [0, 1, 2, 3]


def test_pending_saves_finish_before_the_interpreter_exits(tmp_path: Path) -> None:
    program = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_background_saves import TensorCodec, Trainer
from skipinject import Role, StepSource, Target
from skipinject.config import Config, RoleConfig
from skipinject.engine import Engine
import skipinject.store.writer as writer
real = writer.StepWriter.add_part
def slow(self, *a, **k):
    import time; time.sleep(1.0); return real(self, *a, **k)
writer.StepWriter.add_part = slow
mod = type(sys)("si_exit_targets")
mod.Trainer = type("Trainer", (Trainer,), {{}})
sys.modules["si_exit_targets"] = mod
role = Role(name="bg", targets=[Target("si_exit_targets:Trainer.generate")], step=StepSource.attribute("global_steps"),
            codec=TensorCodec(), clocks=["si_exit_targets:Trainer.fit"])
settings = RoleConfig(enable=True, steps=(1,), dump_dir={str(tmp_path)!r})
Engine(Config(roles={{"bg": settings}}), {{"bg": (role, "bg")}}).start()
t = mod.Trainer(); t.global_steps = 1; t.generate(5)
"""
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert toy_store(tmp_path).is_committed(1)


def test_awaiting_callers_are_written_before_the_call_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fully async Rollouter's samples: its actor may be stopped with no exit hook, so no background write."""
    import asyncio

    module = type(sys)("si_async_background_targets")

    class AsyncTrainer(ToyTrainer):
        async def generate(self, n: int) -> torch.Tensor:
            return torch.arange(n, dtype=torch.float32)

    module.AsyncTrainer = AsyncTrainer  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    monkeypatch.setattr(WRITER, "submit", lambda key, job: None)  # a background job would never run
    role = Role(
        name="bg",
        targets=[Target("si_async_background_targets:AsyncTrainer.generate")],
        step=StepSource.attribute("global_steps"),
        codec=TensorCodec(),
    )
    settings = RoleConfig(enable=True, steps=(1,), dump_dir=str(tmp_path))
    engine = Engine(Config(roles={"bg": settings}), {"bg": (role, "bg")})
    engine.start()
    try:
        asyncio.run(module.AsyncTrainer(global_steps=1).generate(4))
    finally:
        engine.stop()
        del sys.modules[module.__name__]
    assert toy_store(tmp_path).is_committed(1)


def test_roles_without_a_clock_write_before_the_call_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No clock: nothing tells the engine where the run ends (a Ray actor may be killed), so no background write."""
    module = type(sys)("si_noclock_targets")
    module.Trainer = type("Trainer", (Trainer,), {})  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    monkeypatch.setattr(WRITER, "submit", lambda key, job: None)  # a background job would never run
    role = Role(
        name="bg",
        targets=[Target("si_noclock_targets:Trainer.generate")],
        step=StepSource.attribute("global_steps"),
        codec=TensorCodec(),
    )
    settings = RoleConfig(enable=True, steps=(1,), dump_dir=str(tmp_path))
    engine = Engine(Config(roles={"bg": settings}), {"bg": (role, "bg")})
    engine.start()
    try:
        trainer = module.Trainer()
        trainer.global_steps = 1
        trainer.generate(3)
    finally:
        engine.stop()
        del sys.modules[module.__name__]
    assert toy_store(tmp_path).is_committed(1)
