"""The injector: every import/patch order, every kind of target, calling conventions kept."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

import pytest

from skipinject.injector import Convention, Injector, SkipinjectWrapper
from skipinject.roles import Call


class Recorder:
    """Adds 1000 to results and records which path (sync/async) served each call."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, Any]] = []

    def sync(self, call: Call, proceed: Callable[[], Any]) -> Any:
        self.seen.append(("sync", call.target, call.instance))
        return proceed() + 1000

    async def run_async(self, call: Call, proceed: Callable[[], Any]) -> Any:
        self.seen.append(("async", call.target, call.instance))
        return (await proceed()) + 1000


TARGETS = {
    "plain": ("plain", lambda m: m.plain(2), 4),
    "method": ("Worker.method", lambda m: m.Worker().method(2), 6),
    "smethod": ("Worker.smethod", lambda m: m.Worker.smethod(2), 1),
    "smethod_on_instance": ("Worker.smethod", lambda m: m.Worker().smethod(2), 1),
    "cmethod": ("Worker.cmethod", lambda m: m.Worker.cmethod(2), 7),
    "cmethod_on_instance": ("Worker.cmethod", lambda m: m.Worker().cmethod(2), 7),
    "inherited": ("Worker.inherited", lambda m: m.Worker().inherited(2), 102),
    "nested": ("Outer.Inner.deep", lambda m: m.Outer.Inner().deep(2), -2),
    "looked_up": ("plain", lambda m: m.caller_of_plain(2), 4),
    "trampoline_sync": ("Worker.trampoline", lambda m: m.Worker().trampoline(2), 6),
    "async": ("Worker.amethod", lambda m: asyncio.run(m.Worker().amethod(2)), 6),
}


def _originals(module: Any) -> dict[str, Any]:
    return {
        "plain": module.__dict__["plain"],
        "method": module.Worker.__dict__["method"],
        "smethod": module.Worker.__dict__["smethod"],
        "cmethod": module.Worker.__dict__["cmethod"],
        "amethod": module.Worker.__dict__["amethod"],
        "trampoline": module.Worker.__dict__["trampoline"],
        "deep": module.Outer.Inner.__dict__["deep"],
    }


@pytest.mark.parametrize("order", ["import_first", "hooks_first"])
@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_every_target_kind_in_both_import_orders(fresh_module_name: str, injector: Injector, order: str, kind: str):
    qualname, call, expected = TARGETS[kind]
    path = f"{fresh_module_name}:{qualname}"
    recorder = Recorder()
    if order == "import_first":
        module = importlib.import_module(fresh_module_name)
        injector.instrument(path, recorder)
    else:
        injector.instrument(path, recorder)
        assert not injector.is_patched(path)
        module = importlib.import_module(fresh_module_name)
    assert injector.is_patched(path)
    assert call(module) == expected + 1000
    assert len(recorder.seen) == 1


def test_patch_unpatch_patch_again_restores_exact_objects(fresh_module_name: str, injector: Injector):
    module = importlib.import_module(fresh_module_name)
    before = _originals(module)
    paths = [
        f"{fresh_module_name}:{q}"
        for q in (
            "plain",
            "Worker.method",
            "Worker.smethod",
            "Worker.cmethod",
            "Worker.amethod",
            "Worker.trampoline",
            "Outer.Inner.deep",
            "Worker.inherited",
        )
    ]
    for _ in range(3):
        for path in paths:
            injector.instrument(path, Recorder())
        assert isinstance(module.Worker.__dict__["method"], SkipinjectWrapper)
        assert "inherited" in module.Worker.__dict__
        for path in paths:
            injector.uninstrument(path)
        assert _originals(module) == before
        assert "inherited" not in module.Worker.__dict__, "an inherited method must be un-shadowed again"
        assert module.Worker().method(2) == 6


def test_never_wrapped_twice(fresh_module_name: str):
    module = importlib.import_module(fresh_module_name)
    first, second = Injector(), Injector()
    try:
        first.instrument(f"{fresh_module_name}:Worker.method", Recorder())
        second.instrument(f"{fresh_module_name}:Worker.method", Recorder())
        first.instrument(f"{fresh_module_name}:Worker.method", Recorder())
        wrapper = module.Worker.__dict__["method"]
        assert isinstance(wrapper, SkipinjectWrapper)
        assert not isinstance(wrapper.__wrapped__, SkipinjectWrapper)
        assert module.Worker().method(1) == 1003
    finally:
        first.uninstrument_all()
        second.uninstrument_all()


def test_hook_fires_on_reimport_after_module_dropped(fresh_module_name: str, injector: Injector):
    path = f"{fresh_module_name}:plain"
    injector.instrument(path, Recorder())
    module = importlib.import_module(fresh_module_name)
    assert module.plain(1) == 1002
    injector.uninstrument(path)
    sys.modules.pop(fresh_module_name)
    injector.instrument(path, Recorder())
    module = importlib.import_module(fresh_module_name)
    assert module.plain(1) == 1002


def test_conventions_are_detected_and_kept(fresh_module_name: str, injector: Injector):
    module = importlib.import_module(fresh_module_name)
    for qualname, convention in (
        ("Worker.method", Convention.SYNC),
        ("Worker.amethod", Convention.ASYNC),
        ("Worker.trampoline", Convention.TRAMPOLINE),
    ):
        injector.instrument(f"{fresh_module_name}:{qualname}", Recorder())
        assert injector.convention(f"{fresh_module_name}:{qualname}") is convention
    assert inspect.iscoroutinefunction(module.Worker.amethod)
    assert inspect.iscoroutinefunction(module.Worker().amethod)
    assert not inspect.iscoroutinefunction(module.Worker.method)
    assert module.Worker.method.__name__ == "method"
    assert inspect.signature(module.Worker.method) == inspect.signature(_originals(module)["method"])


def test_trampoline_gives_awaiting_callers_an_awaitable_and_sync_callers_a_value(
    fresh_module_name: str, injector: Injector
):
    module = importlib.import_module(fresh_module_name)
    recorder = Recorder()
    injector.instrument(f"{fresh_module_name}:Worker.trampoline", recorder)
    worker = module.Worker()

    assert worker.trampoline(2) == 1006  # no loop: a value
    assert recorder.seen[-1][0] == "sync"

    async def awaiting() -> Any:
        pending = worker.trampoline(2)
        assert inspect.isawaitable(pending)
        return await pending

    assert asyncio.run(awaiting()) == 1006
    assert recorder.seen[-1][0] == "async"

    async def sync_inside_loop() -> Any:
        return helper()

    def helper() -> Any:  # a sync function called from a running loop: gets a value (thread pool)
        return worker.trampoline(2)

    assert asyncio.run(sync_inside_loop()) == 1006
    assert recorder.seen[-1][0] == "sync"


def test_async_target_returns_a_coroutine(fresh_module_name: str, injector: Injector):
    module = importlib.import_module(fresh_module_name)
    injector.instrument(f"{fresh_module_name}:Worker.amethod", Recorder())
    pending = module.Worker().amethod(1)
    assert inspect.iscoroutine(pending)
    assert asyncio.run(pending) == 1003


def test_missing_target_is_reported_not_raised(fresh_module_name: str, injector: Injector, caplog):
    module = importlib.import_module(fresh_module_name)
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        injector.instrument(f"{fresh_module_name}:Worker.nope", Recorder(), owner="myplugin/myrole")
        injector.instrument(f"{fresh_module_name}:Missing.method", Recorder(), owner="myplugin/myrole")
    messages = [r.getMessage() for r in caplog.records]
    assert any("myplugin/myrole" in m and f"{fresh_module_name}:Worker.nope" in m for m in messages)
    assert any(f"{fresh_module_name}:Missing.method" in m for m in messages)
    # the target, not the role: the role's other targets still act, and a role never called is said apart
    assert all("this target will not act" in m and "role will not act" not in m for m in messages)
    assert module.Worker().method(1) == 3


def test_target_whose_module_is_never_imported_changes_nothing(injector: Injector):
    injector.instrument("no_such_module_xyz.sub:Thing.method", Recorder())
    assert not injector.is_patched("no_such_module_xyz.sub:Thing.method")
    assert "no_such_module_xyz" not in sys.modules


class Witness(Recorder):
    """Records each call and passes its result through unchanged."""

    def sync(self, call: Call, proceed: Callable[[], Any]) -> Any:
        self.seen.append(("sync", call.target, call.instance))
        return proceed()


@pytest.mark.parametrize("order", ["import_first", "hooks_first"])
def test_overrides_in_subclasses_are_patched_now_and_later_and_restored(
    fresh_module_name: str, injector: Injector, order: str
):
    """A recipe's trainer overriding fit (verl's DAPO trainer) is seen like the base trainer's fit."""
    path = f"{fresh_module_name}:Trainer.fit"
    recorder = Witness()

    def existing_subclass(base: type) -> type:
        class Existing(base):  # type: ignore[misc,valid-type]
            def fit(self, steps: int) -> list[Any]:
                return ["existing", *super().fit(steps)]

        return Existing

    if order == "import_first":  # a subclass defined before the patch: found by walking the subclasses
        module = importlib.import_module(fresh_module_name)
        Existing = existing_subclass(module.Trainer)
        injector.instrument(path, recorder, overrides=True)
    else:
        injector.instrument(path, recorder, overrides=True)
        module = importlib.import_module(fresh_module_name)
        Existing = existing_subclass(module.Trainer)

    class Recipe(module.Trainer):  # a recipe's own fit, not calling the base one
        def fit(self, steps: int) -> list[Any]:
            return ["recipe", steps]

    class Deeper(Recipe):
        def fit(self, steps: int) -> list[Any]:
            return ["deeper", steps]

    class Plain(module.Trainer):  # no override: the base's wrapper serves it
        pass

    assert Recipe().fit(1) == ["recipe", 1] and Deeper().fit(2) == ["deeper", 2]
    assert len(Plain().fit(1)) == 2
    assert Existing().fit(1)[0] == "existing"
    seen = [who for _, _, who in recorder.seen]
    # Existing's fit calls the base's: the base's wrapper, inside the override's, passes (one call seen)
    assert [type(who).__name__ for who in seen] == ["Recipe", "Deeper", "Plain", "Existing"]
    injector.uninstrument(path)
    assert not isinstance(Recipe.__dict__["fit"], SkipinjectWrapper)
    assert not isinstance(module.Trainer.__dict__["fit"], SkipinjectWrapper)
    assert "__init_subclass__" not in module.Trainer.__dict__, "the subclass hook is removed again"
    recorder.seen.clear()

    class After(module.Trainer):
        def fit(self, steps: int) -> list[Any]:
            return ["after"]

    assert After().fit(1) == ["after"] and Recipe().fit(1) == ["recipe", 1] and recorder.seen == []


def test_overrides_keep_the_base_class_own_init_subclass(fresh_module_name: str, injector: Injector):
    module = importlib.import_module(fresh_module_name)
    registered: list[str] = []

    class Base:
        def __init_subclass__(cls, tag: str = "", **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            registered.append(tag or cls.__name__)

        def fit(self) -> int:
            return 1

    module.Base = Base
    original = Base.__dict__["__init_subclass__"]
    injector.instrument(f"{fresh_module_name}:Base.fit", Recorder(), overrides=True)

    class Child(Base, tag="child"):
        def fit(self) -> int:
            return 2

    assert registered == ["child"] and Child().fit() == 1002
    injector.uninstrument(f"{fresh_module_name}:Base.fit")
    assert Base.__dict__["__init_subclass__"] is original and Child().fit() == 2


def test_a_function_imported_by_name_before_it_is_patched_is_said_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``enable()`` after the program ran ``from module import f``: that name keeps the original; one line
    names it (a name bound after the patch, or the module's own attribute, is not named)."""
    (tmp_path / "si_early_target.py").write_text("def work(x):\n    return x\n")
    (tmp_path / "si_early_user.py").write_text("from si_early_target import work\nalias = work\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("si_early_target", "si_early_user"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.import_module("si_early_user")
    injector = Injector()
    try:
        with caplog.at_level(logging.WARNING, logger="skipinject"):
            injector.instrument("si_early_target:work", Recorder(), owner="toy")
            injector.say_earlier_names()
            injector.say_earlier_names()  # said once
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1, said
        assert "si_early_target:work was imported by name before skipinject was installed" in said[0]
        assert "(si_early_user.alias, si_early_user.work)" in said[0] and "\n" not in said[0]
        assert sys.modules["si_early_target"].work(1) == 1001 and sys.modules["si_early_user"].work(1) == 1
    finally:
        injector.uninstrument_all()


def test_an_engine_started_after_a_target_was_imported_by_name_names_it_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What ``enable()`` does after the program ran ``from module import f``: one warning for that name;
    a second target bound under the other name (a role following it there) is patched, not named."""
    from skipinject import Role, StepSource, Target
    from skipinject.config import Config, RoleConfig
    from skipinject.engine import Engine
    from skipinject.testing import IntCodec

    (tmp_path / "si_late_target.py").write_text("def work(x):\n    return x\n")
    (tmp_path / "si_late_user.py").write_text("from si_late_target import work\n")
    (tmp_path / "si_late_other.py").write_text("from si_late_target import work\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("si_late_target", "si_late_user", "si_late_other"):
        monkeypatch.delitem(sys.modules, name, raising=False)
        importlib.import_module(name)
    role = Role(
        name="late",
        targets=[Target("si_late_target:work"), Target("si_late_other:work")],
        step=StepSource.argument("x"),
        codec=IntCodec(),
        cache_subdir="",
    )
    config = Config(roles={"late": RoleConfig(enable=True, dump_dir=str(tmp_path / "dump"), steps=(1,))})
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        engine = Engine(config, {"late": (role, "test")}, injector=Injector())
        engine.start()
    try:
        said = [r.getMessage() for r in caplog.records if "imported by name" in r.getMessage()]
        assert said == [
            "test/late: si_late_target:work was imported by name before skipinject was installed (si_late_user.work): "
            "calls through those names are not skipped; install skipinject (enable()) before importing them"
        ], said
    finally:
        engine.stop()
