"""Patching targets by dotted path, when their module is imported (wrapt post-import hooks).

Rules the rest of skipinject relies on:

* A target is patched when its module is imported, or at once if it already is.
* Never twice: a target already carrying our wrapper is left alone.
* Reversible: :meth:`Injector.uninstrument` puts back exactly the object that was there
  (or removes the attribute again when the patched method was inherited).
* The calling convention is kept. A sync target stays sync, an ``async def`` stays a coroutine
  function, and a *trampoline* — a sync function over an ``async def`` that looks at its
  caller's frame, like verl's ``auto_await`` — still gives sync callers a value and awaiting
  callers an awaitable.
* A target that does not exist is reported with the plugin and path, never raised into the
  user's program.
* ``overrides=True`` (for methods): every subclass's own override of the method is patched too,
  those that exist and those defined later (through the base class's ``__init_subclass__``), so a
  recipe's trainer that overrides ``fit`` (verl's DAPO trainer) is seen like the base trainer.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any, Protocol

import wrapt

from skipinject.roles import Call, TargetPath

logger = logging.getLogger("skipinject")

_MISSING = object()
_SKIP_FRAME_DIRS = (os.path.dirname(wrapt.__file__), os.path.dirname(__file__))


class Interceptor(Protocol):
    """What runs instead of a patched target. ``proceed`` calls the original.

    An interceptor may also have ``passes(instance, args, kwargs) -> bool``: asked first on every
    call, ``True`` calls the original directly (the fast path of calls it surely leaves alone).
    """

    def sync(self, call: Call, proceed: Callable[[], Any]) -> Any: ...

    def run_async(self, call: Call, proceed: Callable[[], Awaitable[Any]]) -> Awaitable[Any]: ...


class Convention(enum.Enum):
    """How a target is called and what it returns."""

    SYNC = "sync"
    ASYNC = "async"
    TRAMPOLINE = "sync-or-async"


class _Binding(enum.Enum):
    FUNCTION = "function"
    METHOD = "method"
    STATIC = "staticmethod"
    CLASS = "classmethod"


if TYPE_CHECKING:  # wrapt's stubs make FunctionWrapper generic; wrapt 1.x cannot subscript it at run time
    _FunctionWrapper = wrapt.FunctionWrapper[Any, Any]
else:
    _FunctionWrapper = wrapt.FunctionWrapper


class SkipinjectWrapper(_FunctionWrapper):
    """Our wrapper type: recognising it is how we never wrap a target twice."""

    def __init__(self, wrapped: Any, wrapper: Any, path: str) -> None:
        super().__init__(wrapped, wrapper)
        self._self_skipinject_path = path


def convention_of(function: Any) -> tuple[Convention, Any]:
    """The convention of ``function`` and, for trampolines, the ``async def`` it drives."""
    if inspect.iscoroutinefunction(function):
        return Convention.ASYNC, None
    inner = getattr(function, "__wrapped__", None)
    seen = 0
    while inner is not None and seen < 16:
        if inspect.iscoroutinefunction(inner):
            return Convention.TRAMPOLINE, inner
        inner = getattr(inner, "__wrapped__", None)
        seen += 1
    return Convention.SYNC, None


def _awaiting_caller(frame: FrameType | None) -> bool:
    """True when the code calling the target is a coroutine running in an event loop.

    This is the test verl's ``auto_await`` makes; frames of wrapt and of this module are
    skipped so the answer is the user's caller's, not ours.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP_FRAME_DIRS):
        frame = frame.f_back
    return frame is not None and bool(frame.f_code.co_flags & inspect.CO_COROUTINE)


@dataclass
class _Patch:
    path: TargetPath
    interceptor: Interceptor
    owner: str
    applied: bool = False
    parent: Any = None
    attribute: str = ""
    original: Any = _MISSING  # what was in parent.__dict__ (``_MISSING``: it was inherited)
    convention: Convention | None = None
    overrides: bool = False  # also patch subclasses' own overrides (methods only)
    patched_overrides: list[_Patch] = field(default_factory=list)


def _never(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return False


def _build_wrapper(patch: _Patch, raw: Any, binding: _Binding, function: Any) -> SkipinjectWrapper:
    convention, inner = convention_of(function)
    patch.convention = convention
    interceptor = patch.interceptor
    label = str(patch.path)

    passes = getattr(interceptor, "passes", None) or _never

    # Each variant first asks ``passes`` (a step that is surely not chosen): then the original is
    # called at once, with nothing built, logged or inspected — every generation call pays this path.
    if convention is Convention.SYNC:

        def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if passes(instance, args, kwargs):
                return wrapped(*args, **kwargs)
            call = Call(label, function, instance, args, kwargs)
            return interceptor.sync(call, lambda: wrapped(*args, **kwargs))

    elif convention is Convention.ASYNC:

        def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if passes(instance, args, kwargs):
                return wrapped(*args, **kwargs)
            call = Call(label, function, instance, args, kwargs)
            return interceptor.run_async(call, lambda: wrapped(*args, **kwargs))

    else:

        def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if passes(instance, args, kwargs):
                return wrapped(*args, **kwargs)  # the trampoline makes its own sync/async choice
            call = Call(label, function, instance, args, kwargs)
            if _awaiting_caller(sys._getframe(1)):
                target = _bind(inner, instance, binding)
                return interceptor.run_async(call, lambda: target(*args, **kwargs))
            return interceptor.sync(call, lambda: wrapped(*args, **kwargs))

    return SkipinjectWrapper(raw, wrapper, label)


def _bind(function: Any, instance: Any, binding: _Binding) -> Any:
    if binding is _Binding.METHOD and instance is not None:
        return function.__get__(instance, type(instance))
    if binding is _Binding.CLASS and instance is not None:
        return function.__get__(instance, instance)
    return function


class Injector:
    """Installs and removes wrappers on targets given as ``package.module:Qualified.name``."""

    def __init__(self) -> None:
        self._patches: dict[str, _Patch] = {}
        self._hooked_modules: set[str] = set()  # modules with a pending post-import hook
        self._lock = threading.RLock()
        #: Base classes whose ``__init_subclass__`` we replaced: (what was in their __dict__, ours, patches).
        self._subclass_hooks: dict[type, tuple[Any, Any, list[_Patch]]] = {}

    # ------------------------------------------------------------ public API

    def instrument(self, path: str, interceptor: Interceptor, *, owner: str = "", overrides: bool = False) -> None:
        """Patch ``path`` now if its module is imported, else as soon as it is.

        ``overrides``: a method's overrides in subclasses (existing and future) are patched too.
        """
        target = TargetPath.parse(path)
        with self._lock:
            key = str(target)
            if key in self._patches:
                logger.debug("%s is already instrumented (by %s)", key, self._patches[key].owner)
                return
            self._patches[key] = _Patch(target, interceptor, owner, overrides=overrides)
            if target.module in sys.modules:
                self._apply(self._patches[key], sys.modules[target.module])
            elif target.module not in self._hooked_modules:
                self._hooked_modules.add(target.module)
                wrapt.register_post_import_hook(self._on_import, target.module)

    def uninstrument(self, path: str) -> None:
        """Undo :meth:`instrument`: restore the original object and forget the target."""
        with self._lock:
            patch = self._patches.pop(str(TargetPath.parse(path)), None)
            if patch is not None and patch.applied:
                self._restore(patch)

    def uninstrument_all(self) -> None:
        for key in list(self._patches):
            self.uninstrument(key)

    def is_patched(self, path: str) -> bool:
        patch = self._patches.get(str(TargetPath.parse(path)))
        return bool(patch and patch.applied)

    def convention(self, path: str) -> Convention | None:
        patch = self._patches.get(str(TargetPath.parse(path)))
        return patch.convention if patch else None

    @property
    def targets(self) -> list[str]:
        return list(self._patches)

    # ------------------------------------------------------------ internals

    def _on_import(self, module: ModuleType) -> None:
        with self._lock:
            self._hooked_modules.discard(module.__name__)  # wrapt fires a hook once, then drops it
            for patch in list(self._patches.values()):
                if patch.path.module == module.__name__ and not patch.applied:
                    self._apply(patch, module)

    def _apply(self, patch: _Patch, module: ModuleType) -> None:
        try:
            parent: Any = module
            names = patch.path.qualname.split(".")
            for name in names[:-1]:
                parent = getattr(parent, name)
            attribute = names[-1]
            current = inspect.getattr_static(parent, attribute)
        except AttributeError:
            logger.warning(
                "%s: target %s does not exist in this install (module %s has no %s); this role will not act",
                patch.owner or "skipinject",
                patch.path,
                patch.path.module,
                patch.path.qualname,
            )
            return
        except Exception as exc:  # a broken target must not break the user's program
            logger.warning("%s: cannot resolve target %s: %s", patch.owner or "skipinject", patch.path, exc)
            return
        if isinstance(current, SkipinjectWrapper):
            logger.debug("%s is already wrapped; leaving it", patch.path)
            return
        own = vars(parent).get(attribute, _MISSING) if hasattr(parent, "__dict__") else _MISSING
        binding, function = self._classify(parent, current)
        if function is None:
            logger.warning(
                "%s: target %s is not a function (%s); not patched",
                patch.owner or "skipinject",
                patch.path,
                type(current).__name__,
            )
            return
        wrapper = _build_wrapper(patch, current, binding, function)
        setattr(parent, attribute, wrapper)
        patch.parent, patch.attribute, patch.original, patch.applied = parent, attribute, own, True
        logger.debug(
            "patched %s (%s, %s) for %s",
            patch.path,
            binding.value,
            patch.convention.value if patch.convention else "?",
            patch.owner,
        )
        if patch.overrides and binding is _Binding.METHOD and isinstance(parent, type):
            self._follow_subclasses(patch, parent)

    # ------------------------------------------------------------ overrides in subclasses

    def _follow_subclasses(self, patch: _Patch, base: Any) -> None:
        """Patch the overrides of ``patch``'s method in every subclass of ``base``, now and later."""
        pending: list[type] = list(base.__subclasses__())
        seen: set[type] = set()
        while pending:
            cls = pending.pop()
            if cls in seen:
                continue
            seen.add(cls)
            self._patch_override(patch, cls)
            pending.extend(cls.__subclasses__())
        hook = self._subclass_hooks.get(base)
        if hook is not None:
            hook[2].append(patch)
            return
        own = vars(base).get("__init_subclass__", _MISSING)
        patches = [patch]
        injector = self

        def __init_subclass__(cls: Any, /, **kwargs: Any) -> None:
            if own is _MISSING:
                super(base, cls).__init_subclass__(**kwargs)
            else:
                own.__get__(None, cls)(**kwargs)
            with injector._lock:
                for each in list(patches):
                    injector._patch_override(each, cls)

        ours: Any = classmethod(__init_subclass__)
        type.__setattr__(base, "__init_subclass__", ours)
        self._subclass_hooks[base] = (own, ours, patches)

    def _patch_override(self, patch: _Patch, cls: type) -> None:
        raw = vars(cls).get(patch.attribute, _MISSING)
        if raw is _MISSING or isinstance(raw, SkipinjectWrapper) or not inspect.isfunction(raw):
            return
        child = _Patch(
            TargetPath(cls.__module__, f"{cls.__qualname__}.{patch.attribute}"), patch.interceptor, patch.owner
        )
        try:
            wrapper = _build_wrapper(child, raw, _Binding.METHOD, raw)
            setattr(cls, patch.attribute, wrapper)
        except Exception as exc:  # a class that refuses the attribute must not break its definition
            logger.warning("%s: cannot patch the override %s: %s", patch.owner or "skipinject", child.path, exc)
            return
        child.parent, child.attribute, child.original, child.applied = cls, patch.attribute, raw, True
        patch.patched_overrides.append(child)
        logger.debug("patched the override %s of %s for %s", child.path, patch.path, patch.owner)

    def _unfollow_subclasses(self, patch: _Patch) -> None:
        for child in patch.patched_overrides:
            self._restore(child)
        patch.patched_overrides.clear()
        for base, (own, ours, patches) in list(self._subclass_hooks.items()):
            if patch not in patches:
                continue
            patches.remove(patch)
            if patches:
                continue
            del self._subclass_hooks[base]
            if vars(base).get("__init_subclass__") is not ours:
                logger.warning("%s.__init_subclass__ was replaced after we patched it; leaving it", base.__qualname__)
            elif own is _MISSING:
                type.__delattr__(base, "__init_subclass__")
            else:
                type.__setattr__(base, "__init_subclass__", own)

    @staticmethod
    def _classify(parent: Any, raw: Any) -> tuple[_Binding, Any]:
        if isinstance(raw, staticmethod):
            return _Binding.STATIC, raw.__func__
        if isinstance(raw, classmethod):
            return _Binding.CLASS, raw.__func__
        if not callable(raw):
            return _Binding.FUNCTION, None
        if isinstance(parent, type):
            return _Binding.METHOD, raw
        return _Binding.FUNCTION, raw

    def _restore(self, patch: _Patch) -> None:
        if patch.overrides:
            self._unfollow_subclasses(patch)
        current = vars(patch.parent).get(patch.attribute) if hasattr(patch.parent, "__dict__") else None
        if not isinstance(current, SkipinjectWrapper):
            logger.warning("%s was replaced by someone else after we patched it; leaving it", patch.path)
        elif patch.original is _MISSING:
            delattr(patch.parent, patch.attribute)
        else:
            setattr(patch.parent, patch.attribute, patch.original)
        patch.applied = False


#: The injector of this process.
INJECTOR = Injector()
