"""Patch / unpatch / import order, for every target of every installed role, on the real verl.

Like dd-trace-py's patch tests, per target: (a) instrumented before its module is imported, the
import patches it; (b) imported first, instrumenting patches it; (c) instrumenting twice (same or
another injector) wraps once; (d) uninstrumenting puts back the exact original object and calling
it still works; (e) instrumenting again patches again; (f) the calling convention (sync, async,
``auto_await`` trampoline) is unchanged; (g) a module-level function is replaced, and put back, under every
name another module of its package bound it. Targets are the roles' targets and clocks of the plugins
``load_plugins()`` finds (a new plugin is covered without editing this file), and the built-in guard
on verl's ``SkipManager.init``; a target whose ``verl`` range excludes the installed verl is skipped.

(a) and (e) from a clean interpreter run in one subprocess per role: in this process the verl
modules are already imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import subprocess
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from skipinject.injector import Injector, SkipinjectWrapper, convention_of
from skipinject.plugin_manager import load_plugins
from skipinject.roles import Call, TargetPath
from skipinject.verl.builtin_guard import BUILTIN_SKIP_INIT
from skipinject.verl.compat import verl_version, version_matches
from tests.conftest import ROOT


@dataclass(frozen=True)
class Case:
    role: str
    kind: str  # "target", "clock" or "guard"
    path: str
    verl: str | None = None

    @property
    def id(self) -> str:
        return f"{self.role}-{self.kind}-{self.path.rsplit(':', 1)[1]}"


def _cases() -> list[Case]:
    cases = []
    for name, role in sorted(load_plugins("").roles.items()):
        cases += [Case(name, "target", target.path, target.verl) for target in role.targets]
        cases += [Case(name, "clock", clock) for clock in role.clocks]
    cases.append(Case("builtin_guard", "guard", BUILTIN_SKIP_INIT, ">=0.9"))
    return cases


CASES = _cases()
ROLES = sorted({case.role for case in CASES})


def _applicable(case: Case) -> None:
    if not version_matches(case.verl, verl_version()):
        pytest.skip(f"{case.path} is for verl {case.verl}, installed {verl_version()}")
    if importlib.util.find_spec(TargetPath.parse(case.path).module) is None:
        pytest.skip(f"{case.path}: module not in this verl")


class PassThrough:
    """An interceptor that only calls the original (sync or awaiting)."""

    def sync(self, call: Call, proceed: Callable[[], Any]) -> Any:
        return proceed()

    async def run_async(self, call: Call, proceed: Callable[[], Any]) -> Any:
        return await proceed()


def resolve(path: str) -> tuple[Any, str]:
    """The object holding the target's attribute, and the attribute's name."""
    target = TargetPath.parse(path)
    parent: Any = importlib.import_module(target.module)
    *owners, attribute = target.qualname.split(".")
    for name in owners:
        parent = getattr(parent, name)
    return parent, attribute


def function_of(raw: Any) -> Any:
    return raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw


@pytest.fixture(params=CASES, ids=[case.id for case in CASES])
def case(request: pytest.FixtureRequest) -> Case:
    _applicable(request.param)
    return request.param


@pytest.fixture
def injectors() -> Any:
    made: list[Injector] = []

    def make() -> Injector:
        made.append(Injector())
        return made[-1]

    yield make
    for injector in reversed(made):
        injector.uninstrument_all()


# ---------------------------------------------------------------- in this process: (b), (c), (d), (f)


def test_import_first_then_instrument_patches(case: Case, injectors: Any) -> None:  # (b)
    parent, attribute = resolve(case.path)
    original = inspect.getattr_static(parent, attribute)
    injector = injectors()
    injector.instrument(case.path, PassThrough())
    assert injector.is_patched(case.path)
    patched = inspect.getattr_static(parent, attribute)
    assert isinstance(patched, SkipinjectWrapper) and patched is not original


def test_instrument_twice_wraps_once(case: Case, injectors: Any) -> None:  # (c)
    parent, attribute = resolve(case.path)
    first = injectors()
    first.instrument(case.path, PassThrough())
    wrapper = inspect.getattr_static(parent, attribute)
    first.instrument(case.path, PassThrough())
    injectors().instrument(case.path, PassThrough())  # another injector in the same process
    assert inspect.getattr_static(parent, attribute) is wrapper
    assert not isinstance(wrapper.__wrapped__, SkipinjectWrapper)


def test_uninstrument_restores_the_exact_original(case: Case, injectors: Any) -> None:  # (d), (e)
    parent, attribute = resolve(case.path)
    original = inspect.getattr_static(parent, attribute)
    own = vars(parent).get(attribute)
    signature = inspect.signature(getattr(parent, attribute))
    injector = injectors()
    injector.instrument(case.path, PassThrough())
    injector.uninstrument(case.path)
    assert not injector.is_patched(case.path)
    assert inspect.getattr_static(parent, attribute) is original
    assert vars(parent).get(attribute) is own  # nothing left behind on a subclass
    # Calling works: the restored function is the original, bound as before.
    assert getattr(parent, attribute) == getattr(parent, attribute)
    assert inspect.signature(getattr(parent, attribute)) == signature

    injector.instrument(case.path, PassThrough())  # (e) again, in the same process
    assert injector.is_patched(case.path)
    assert isinstance(inspect.getattr_static(parent, attribute), SkipinjectWrapper)


def _bound(value: Any, package: str = "verl") -> set[str]:
    """``module:name`` of every binding of ``value`` (by identity) in the imported modules of ``package``."""
    return {
        f"{name}:{attribute}"
        for name, module in list(sys.modules.items())
        if name.partition(".")[0] == package and isinstance(module, types.ModuleType)
        for attribute, each in list(vars(module).items())
        if each is value
    }


def test_a_function_target_is_patched_under_every_name_it_is_bound(case: Case, injectors: Any) -> None:  # (g)
    """A module-level function is also replaced where another module imported it (verl's fully async and
    one-step-off trainers import ``extract_reward`` from ``verl.trainer.ppo.reward``), and put back there."""
    parent, attribute = resolve(case.path)
    original = inspect.getattr_static(parent, attribute)
    if not isinstance(parent, types.ModuleType) or not inspect.isfunction(original):
        pytest.skip(f"{case.path} is not a module-level function")
    for name in ALIASING_MODULES:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    bound = _bound(original, case.path.partition(".")[0])
    injector = injectors()
    injector.instrument(case.path, PassThrough())
    wrapper = inspect.getattr_static(parent, attribute)
    assert bound and _bound(wrapper, case.path.partition(".")[0]) == bound
    injector.uninstrument(case.path)
    assert _bound(original, case.path.partition(".")[0]) == bound


#: Modules importing a target function under its own name (verl 0.9.1), imported for (g).
ALIASING_MODULES = (
    "verl.experimental.separation.ray_trainer",
    "verl.experimental.one_step_off_policy.ray_trainer",
    "verl.trainer.ppo.v1.utils",
)


def test_calling_convention_is_unchanged(case: Case, injectors: Any) -> None:  # (f)
    parent, attribute = resolve(case.path)
    before = getattr(parent, attribute)
    convention, _ = convention_of(function_of(inspect.getattr_static(parent, attribute)))
    injector = injectors()
    injector.instrument(case.path, PassThrough())
    after = getattr(parent, attribute)
    assert injector.convention(case.path) is convention
    assert convention_of(after)[0] is convention
    assert inspect.iscoroutinefunction(after) == inspect.iscoroutinefunction(before)
    assert inspect.signature(after) == inspect.signature(before)


# ---------------------------------------------------------------- clean interpreter: (a), (d), (e)

_CHILD = r"""
import importlib, inspect, json, sys
from skipinject.injector import Injector, SkipinjectWrapper
from skipinject.roles import TargetPath

paths = json.loads(sys.argv[1])

class PassThrough:
    def sync(self, call, proceed):
        return proceed()
    async def run_async(self, call, proceed):
        return await proceed()

def resolve(path):
    target = TargetPath.parse(path)
    parent = sys.modules[target.module]
    *owners, attribute = target.qualname.split(".")
    for name in owners:
        parent = getattr(parent, name)
    return parent, attribute

report = {"imported_before": sorted(p for p in paths if TargetPath.parse(p).module in sys.modules)}
injector = Injector()
for path in paths:
    injector.instrument(path, PassThrough())
report["patched_before_import"] = [p for p in paths if injector.is_patched(p)]
for path in paths:
    importlib.import_module(TargetPath.parse(path).module)
report["patched_on_import"] = [p for p in paths if injector.is_patched(p)]
report["wrapped"] = [p for p in paths if isinstance(inspect.getattr_static(*resolve(p)), SkipinjectWrapper)]
injector.uninstrument_all()
originals = {p: inspect.getattr_static(*resolve(p)) for p in paths}
report["unwrapped"] = [p for p in paths if not isinstance(originals[p], SkipinjectWrapper)]
for path in paths:
    injector.instrument(path, PassThrough())
report["patched_again"] = [p for p in paths if injector.is_patched(p)]
injector.uninstrument_all()
report["restored"] = [p for p in paths if inspect.getattr_static(*resolve(p)) is originals[p]]
print(json.dumps(report))
"""


@pytest.mark.parametrize("role", ROLES)
def test_instrument_before_import_in_a_clean_interpreter(role: str) -> None:  # (a), (d), (e)
    cases = [c for c in CASES if c.role == role and version_matches(c.verl, verl_version())]
    paths = [c.path for c in cases if importlib.util.find_spec(TargetPath.parse(c.path).module) is not None]
    if not paths:
        pytest.skip(f"no target of {role} in verl {verl_version()}")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(paths)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["imported_before"] == [], "skipinject imported verl before any target module was asked for"
    assert report["patched_before_import"] == []
    assert report["patched_on_import"] == paths
    assert report["wrapped"] == paths
    assert report["unwrapped"] == paths
    assert report["patched_again"] == paths
    assert report["restored"] == paths
