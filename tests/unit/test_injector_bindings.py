"""A target is patched wherever its function is bound, subclass overrides are followed or refused by the
target's check, and what the injector puts in place pickles as a class pickled by value needs it."""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from skipinject.injector import INJECTOR, Injector, SkipinjectWrapper
from tests.conftest import ROOT
from tests.unit.test_injector import Recorder, Witness

_counter = itertools.count()

#: A package whose function ``score`` is imported under other names by its other modules.
PACKAGE = {
    "__init__.py": "",
    "defs.py": """
        def score(x):
            return x * 2

        def caller(x):
            return score(x)
        """,
    "early.py": """
        from {pkg}.defs import score as early_score

        def run(x):
            return early_score(x)
        """,
    "late.py": """
        from {pkg}.defs import score as late_score
        from {pkg}.early import early_score as again

        def run(x):
            return late_score(x) + again(x)
        """,
}


@pytest.fixture
def package(tmp_path: Path) -> Iterator[str]:
    """The name of a fresh, not yet imported copy of :data:`PACKAGE`."""
    name = f"aliased_pkg_{next(_counter)}"
    root = tmp_path / name
    root.mkdir()
    for file, text in PACKAGE.items():
        (root / file).write_text(textwrap.dedent(text.format(pkg=name)))
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    try:
        yield name
    finally:
        sys.path.remove(str(tmp_path))
        for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            del sys.modules[module]


def _bindings(package: str) -> dict[str, Any]:
    """Every name binding ``score``'s function object (or a wrapper of it) in the imported modules."""
    found = {}
    for module_name in ("defs", "early", "late"):
        module = sys.modules.get(f"{package}.{module_name}")
        for name in ("score", "early_score", "late_score", "again"):
            if module is not None and name in vars(module):
                found[f"{module_name}.{name}"] = vars(module)[name]
    return found


@pytest.mark.parametrize("order", ["import_first", "hooks_first"])
def test_a_function_is_replaced_under_every_name_before_and_after_the_patch(
    package: str, injector: Injector, order: str
) -> None:
    path = f"{package}.defs:score"
    recorder = Recorder()
    if order == "import_first":
        early = importlib.import_module(f"{package}.early")  # imports defs: score bound under another name
        original = sys.modules[f"{package}.defs"].score
        injector.instrument(path, recorder)
    else:
        injector.instrument(path, recorder)
        early = importlib.import_module(f"{package}.early")
        original = sys.modules[f"{package}.defs"].score.__wrapped__
    late = importlib.import_module(f"{package}.late")  # imported after the patch, under two more names
    defs = sys.modules[f"{package}.defs"]
    bindings = _bindings(package)
    assert set(bindings) == {"defs.score", "early.early_score", "late.late_score", "late.again"}
    wrapper = defs.score
    assert isinstance(wrapper, SkipinjectWrapper) and all(each is wrapper for each in bindings.values())
    assert early.run(2) == 1004 and defs.caller(2) == 1004 and late.run(2) == 2008
    assert len(recorder.seen) == 4

    injector.uninstrument(path)
    assert all(each is original for each in _bindings(package).values()), "every binding gets the original back"
    assert early.run(2) == 4 and late.run(2) == 8 and len(recorder.seen) == 4


def test_a_target_declared_where_the_function_is_re_imported_patches_its_defining_module(
    package: str, injector: Injector
) -> None:
    early = importlib.import_module(f"{package}.early")
    defs = sys.modules[f"{package}.defs"]
    original = defs.score
    injector.instrument(f"{package}.early:early_score", Recorder())
    assert defs.score is early.early_score and isinstance(defs.score, SkipinjectWrapper)
    assert defs.caller(1) == 1002
    injector.uninstrument(f"{package}.early:early_score")
    assert defs.score is original and early.early_score is original


def test_instrumenting_again_wraps_each_binding_once(package: str, injector: Injector) -> None:
    importlib.import_module(f"{package}.early")
    other = Injector()
    try:
        for _ in range(2):
            injector.instrument(f"{package}.defs:score", Recorder())
            other.instrument(f"{package}.early:early_score", Recorder())  # another injector, another name
        wrapper = sys.modules[f"{package}.defs"].score
        assert not isinstance(wrapper.__wrapped__, SkipinjectWrapper)
        assert all(each is wrapper for each in _bindings(package).values())
        assert not other.is_patched(f"{package}.early:early_score"), "the binding was the first injector's"
    finally:
        other.uninstrument_all()


def test_a_wrapper_left_behind_after_uninstrument_calls_the_original(package: str, injector: Injector) -> None:
    early = importlib.import_module(f"{package}.early")
    recorder = Recorder()
    injector.instrument(f"{package}.defs:score", recorder)
    kept = early.early_score  # held somewhere no module scan finds (a local, a partial, a registry)
    injector.uninstrument(f"{package}.defs:score")
    assert isinstance(kept, SkipinjectWrapper) and kept(3) == 6 and recorder.seen == []


# ---------------------------------------------------------------- subclass overrides: follow or refuse


def _refuse_unless_super(cls: type) -> str | None:
    code = vars(cls)["fit"].__code__
    return None if "super" in code.co_names else "its fit does not run the base's"


def test_an_override_is_followed_when_the_check_accepts_it_and_refused_in_one_line_when_not(
    fresh_module_name: str, injector: Injector, caplog: pytest.LogCaptureFixture
) -> None:
    module = importlib.import_module(fresh_module_name)
    path = f"{fresh_module_name}:Trainer.fit"
    recorder = Witness()

    class Extending(module.Trainer):  # defined before the patch: found by walking the subclasses
        def fit(self, steps: int) -> list[Any]:
            return ["extending", *super().fit(steps)]

    injector.instrument(path, recorder, owner="toy/role", overrides=_refuse_unless_super)

    class Replacing(module.Trainer):  # defined after: found by the subclass hook
        def fit(self, steps: int) -> list[Any]:
            return ["replacing", steps]

    with caplog.at_level(logging.WARNING, logger="skipinject"):
        assert Replacing().fit(1) == ["replacing", 1] and Replacing().fit(2) == ["replacing", 2]
        assert Extending().fit(1)[0] == "extending"
    assert [type(who).__name__ for _, _, who in recorder.seen] == ["Extending"], "refused: its calls run as they are"
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert refusals == [
        f"toy/role: {Replacing.__module__}:{Replacing.__qualname__}.fit overrides the target {path} and is refused: "
        "its fit does not run the base's; this role does not act on Replacing"
    ]
    injector.uninstrument(path)
    assert not isinstance(vars(Replacing)["fit"], SkipinjectWrapper)
    assert not isinstance(vars(Extending)["fit"], SkipinjectWrapper)


def test_an_override_check_that_raises_refuses_the_class(fresh_module_name: str, injector: Injector) -> None:
    module = importlib.import_module(fresh_module_name)

    def broken(cls: type) -> str | None:
        raise RuntimeError("no")

    injector.instrument(f"{fresh_module_name}:Trainer.fit", Witness(), overrides=broken)

    class Recipe(module.Trainer):
        def fit(self, steps: int) -> list[Any]:
            return ["recipe"]

    assert Recipe().fit(1) == ["recipe"]


# ---------------------------------------------------------------- pickling (as Ray pickles classes)


def test_a_wrapper_pickles_as_a_reference_to_where_it_is_bound(package: str, injector: Injector) -> None:
    importlib.import_module(f"{package}.late")
    injector.instrument(f"{package}.defs:score", Recorder())
    wrapper = sys.modules[f"{package}.defs"].score
    assert pickle.loads(pickle.dumps(wrapper)) is wrapper
    assert cloudpickle.loads(cloudpickle.dumps(wrapper)) is wrapper


def _by_value_subclass(base: type) -> type:
    class Recipe(base):  # type: ignore[misc,valid-type]  # a local class: cloudpickle pickles it by value
        def fit(self, steps: int) -> list[Any]:
            return ["recipe", steps]

    return Recipe


LOAD = """
import sys
import cloudpickle
from skipinject.injector import INJECTOR, SkipinjectWrapper

class Count:
    calls = 0
    def sync(self, call, proceed):
        Count.calls += 1
        return proceed()

if sys.argv[2] == "active":
    INJECTOR.instrument(sys.argv[3], Count(), overrides=True)
loaded, bound = cloudpickle.loads(bytes.fromhex(sys.argv[1]))
assert loaded().fit(3) == ["recipe", 3]
assert bound(loaded(), 4) == ["recipe", 4]  # as Ray's method wrappers call what they keep
print(isinstance(vars(loaded)["fit"], SkipinjectWrapper), Count.calls)
"""


@pytest.mark.parametrize("where", ["active", "not active"])
def test_a_class_pickled_by_value_loads_with_the_loading_process_wrapper_or_the_original(
    fresh_module_name: str, where: str
) -> None:
    module = importlib.import_module(fresh_module_name)
    path = f"{fresh_module_name}:Trainer.fit"
    INJECTOR.instrument(path, Witness(), overrides=True)
    try:
        recipe = _by_value_subclass(module.Trainer)
        assert isinstance(vars(recipe)["fit"], SkipinjectWrapper)
        assert isinstance(vars(module.Trainer)["__init_subclass__"], classmethod)
        # the override's wrapper pickles, and so does it bound by attribute access (what Ray's wrappers keep)
        blob = cloudpickle.dumps((recipe, recipe.fit))
        cloudpickle.dumps(recipe.__init_subclass__)  # the subclass hook too (Ray lists it as a method)
    finally:
        INJECTOR.uninstrument(path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path[:1], str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", LOAD, blob.hex(), where, path], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == (["True", "2"] if where == "active" else ["False", "0"])


def test_the_subclass_hook_holds_no_injector(fresh_module_name: str, injector: Injector) -> None:
    module = importlib.import_module(fresh_module_name)
    injector.instrument(f"{fresh_module_name}:Trainer.fit", Witness(), overrides=True)
    hook: Callable[..., Any] = vars(module.Trainer)["__init_subclass__"].__func__
    cells = [cell.cell_contents for cell in hook.__closure__ or ()]
    assert not any(isinstance(value, Injector) for value in cells)
    loaded = cloudpickle.loads(cloudpickle.dumps(hook))
    assert callable(loaded)
