"""Attribute targets: a callable bound per instance (verl's worker-group ``generate_sequences``),
wrapped each time the method that binds it returns, with the interceptor, bypass and phases of any
target, and put back by uninstrument."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from skipinject import Call, Payload, Role, StepSource, Target, bootstrap, hookimpl
from skipinject.config import Config, RoleConfig
from skipinject.injector import Convention, Injector, SkipinjectWrapper
from skipinject.plugin_manager import load_plugins

#: Like verl's worker group: ``generate_sequences`` is a functor object set on each instance when the
#: group is built (``_bind_worker_method``); the trainer builds the group in ``init_workers`` and
#: looks the method up on every call (``fit`` and ``validate``).
SOURCE = """
CALLS = []


class Batch:
    def __init__(self, rows, meta_info=None):
        self.rows = list(rows)
        self.meta_info = dict(meta_info or {})


class _Functor:
    def __init__(self, group, name):
        self.group, self.name = group, name

    def __call__(self, batch):
        CALLS.append((self.name, batch.meta_info.get("global_steps"), batch.meta_info.get("validate", False)))
        return {"responses": [row * 10 + self.group.generation for row in batch.rows]}


class WorkerGroup:
    def __init__(self, generation):
        self.generation = generation
        setattr(self, "generate_sequences", _Functor(self, "generate_sequences"))

    async def agenerate(self, batch):
        CALLS.append(("agenerate", None, False))
        return {"responses": list(batch.rows)}


class Trainer:
    def __init__(self, with_step_in_meta=True):
        self.global_steps = 0
        self.with_step_in_meta = with_step_in_meta
        self.config = {"trainer": {"experiment_name": "e", "project_name": "p"}}
        self.builds = 0

    def init_workers(self):
        self.builds += 1
        self.actor_rollout_wg = WorkerGroup(generation=self.builds)
        return "built"

    def fit(self, steps):
        outputs = [self.validate()]
        for step in range(1, steps + 1):
            self.global_steps = step
            meta = {"global_steps": step} if self.with_step_in_meta else {}
            outputs.append(self.actor_rollout_wg.generate_sequences(Batch([step, step + 1], meta)))
        outputs.append(self.validate())
        return outputs

    def validate(self):
        meta = {"validate": True, "global_steps": self.global_steps}
        return self.actor_rollout_wg.generate_sequences(Batch([0], meta))
"""

_counter = itertools.count()
INIT = "init_workers"
ATTRIBUTE = "actor_rollout_wg.generate_sequences"


@pytest.fixture
def wg_module(tmp_path: Path) -> Iterator[str]:
    name = f"wg_targets_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(SOURCE))
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    try:
        yield name
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, Any]] = []

    def sync(self, call: Call, proceed: Callable[[], Any]) -> Any:
        self.seen.append(("sync", call.target, call.instance))
        return {"wrapped": proceed()}

    async def run_async(self, call: Call, proceed: Callable[[], Any]) -> Any:
        self.seen.append(("async", call.target, call.instance))
        return {"wrapped": await proceed()}


@pytest.mark.parametrize("order", ["import_first", "hooks_first"])
def test_the_attribute_is_wrapped_after_the_method_returns(wg_module: str, injector: Injector, order: str):
    path = f"{wg_module}:Trainer.{INIT}"
    recorder = Recorder()
    if order == "import_first":
        module = importlib.import_module(wg_module)
        injector.instrument(path, recorder, attribute=ATTRIBUTE)
    else:
        injector.instrument(path, recorder, attribute=ATTRIBUTE)
        module = importlib.import_module(wg_module)
    assert injector.is_patched(path, ATTRIBUTE)
    assert not injector.is_patched(path), "the attribute target is its own target"
    trainer = module.Trainer()
    assert trainer.init_workers() == "built", "the method runs unchanged"
    assert isinstance(vars(trainer.actor_rollout_wg)["generate_sequences"], SkipinjectWrapper)
    out = trainer.actor_rollout_wg.generate_sequences(module.Batch([3], {"global_steps": 1}))
    assert out == {"wrapped": {"responses": [31]}}
    assert recorder.seen == [("sync", f"{path}->{ATTRIBUTE}", trainer)], "Call.instance is the trainer"
    assert injector.convention(path, ATTRIBUTE) is Convention.SYNC
    # A worker group that the trainer did not build through the method is never touched.
    other = module.WorkerGroup(generation=7)
    assert not isinstance(vars(other)["generate_sequences"], SkipinjectWrapper)


def test_every_build_is_wrapped_once_and_uninstrument_restores_everything(wg_module: str, injector: Injector):
    module = importlib.import_module(wg_module)
    original_method = module.Trainer.__dict__[INIT]
    path = f"{wg_module}:Trainer.{INIT}"
    recorder = Recorder()
    injector.instrument(path, recorder, attribute=ATTRIBUTE)
    trainer = module.Trainer()
    trainer.init_workers()
    first_group = trainer.actor_rollout_wg
    first_functor = vars(first_group)["generate_sequences"].__wrapped__
    trainer.init_workers()  # a second build: a new group, wrapped as well
    second_group = trainer.actor_rollout_wg
    second_functor = vars(second_group)["generate_sequences"].__wrapped__
    assert first_group is not second_group
    # The same group met again (a method that returns without rebuilding) is not wrapped twice.
    injector._wrap_attribute(injector._patches[f"{path}->{ATTRIBUTE}"], trainer)
    assert not isinstance(vars(second_group)["generate_sequences"].__wrapped__, SkipinjectWrapper)
    second_group.generate_sequences(module.Batch([1]))
    assert len(recorder.seen) == 1

    injector.uninstrument(path, ATTRIBUTE)
    assert module.Trainer.__dict__[INIT] is original_method
    assert vars(first_group)["generate_sequences"] is first_functor
    assert vars(second_group)["generate_sequences"] is second_functor
    module.Trainer().init_workers()
    second_group.generate_sequences(module.Batch([1]))
    assert len(recorder.seen) == 1, "nothing is intercepted after uninstrument"


def test_an_async_bound_method_keeps_its_convention(wg_module: str, injector: Injector):
    module = importlib.import_module(wg_module)
    path = f"{wg_module}:Trainer.{INIT}"
    recorder = Recorder()
    injector.instrument(path, recorder, attribute="actor_rollout_wg.agenerate")
    trainer = module.Trainer()
    trainer.init_workers()
    assert injector.convention(path, "actor_rollout_wg.agenerate") is Convention.ASYNC
    result = trainer.actor_rollout_wg.agenerate(module.Batch([5]))
    assert asyncio.iscoroutine(result)
    assert asyncio.run(result) == {"wrapped": {"responses": [5]}}
    assert recorder.seen[0][0] == "async"
    injector.uninstrument(path, "actor_rollout_wg.agenerate")
    assert "agenerate" not in vars(trainer.actor_rollout_wg), "an attribute that was inherited is removed again"


def test_a_missing_attribute_leaves_the_program_alone(wg_module: str, injector: Injector, caplog):
    module = importlib.import_module(wg_module)
    path = f"{wg_module}:Trainer.{INIT}"
    injector.instrument(path, Recorder(), attribute="critic_wg.generate_sequences")
    with caplog.at_level(logging.DEBUG, logger="skipinject"):
        assert module.Trainer().init_workers() == "built"
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)


# ----------------------------------------------------------------- through the engine


class JsonCodec:
    def encode(self, result: Any) -> Payload:
        return Payload(objects={"value": result}, rows=1)

    def decode(self, payload: Payload, call: Call) -> Any:
        return payload.objects["value"]


class WorkerGroupPlugin:
    module = ""

    @hookimpl
    def skipinject_roles(self) -> list[Role]:
        return [
            Role(
                name="wg",
                targets=[Target(f"{self.module}:Trainer.{INIT}", attribute=ATTRIBUTE)],
                step=StepSource.meta("global_steps").or_else(StepSource.clock("global_steps")),
                clocks=[f"{self.module}:Trainer.fit"],
                codec=JsonCodec(),
            )
        ]


plugin = WorkerGroupPlugin()


def _start(tmp_path: Path, module: str) -> None:
    plugin.module = module
    cfg = RoleConfig(enable=True, dump_dir=str(tmp_path / "dump"), steps=(1, 2))
    bootstrap.start(Config(roles={"wg": cfg}), load_plugins(f"{__name__}:plugin"))


@pytest.mark.parametrize("step_in_meta", [True, False], ids=["meta-step", "trainer-clock"])
def test_run_two_is_served_from_the_cache_and_validation_always_runs(
    wg_module: str, tmp_path: Path, caplog, step_in_meta: bool
):
    module = importlib.import_module(wg_module)
    runs = []
    for _ in range(2):
        _start(tmp_path, wg_module)
        try:
            module.CALLS.clear()
            trainer = module.Trainer(with_step_in_meta=step_in_meta)
            trainer.init_workers()
            with caplog.at_level(logging.INFO, logger="skipinject"):
                outputs = trainer.fit(3)
            runs.append((outputs, list(module.CALLS)))
        finally:
            bootstrap.stop()
    (first, calls1), (second, calls2) = runs
    step = (lambda s: s) if step_in_meta else (lambda s: None)
    assert calls1 == [
        ("generate_sequences", 0, True),
        ("generate_sequences", step(1), False),
        ("generate_sequences", step(2), False),
        ("generate_sequences", step(3), False),
        ("generate_sequences", 3, True),
    ]
    assert calls2 == [calls1[0], calls1[3], calls1[4]], "steps 1 and 2 served; step 3 and validation ran"
    assert second == first
    assert sorted(p.name for p in (tmp_path / "dump" / "e_p" / "GBS0_N0_in0_out0" / "wg").iterdir()) == ["1", "2"]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("wg step 1: hit, served step 1" in m for m in messages) == 1
    # After stop, the group is the original again.
    assert not isinstance(vars(trainer.actor_rollout_wg)["generate_sequences"], SkipinjectWrapper)
