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
* An *attribute target* (``instrument(path, interceptor, attribute="a.b")``) is for callables bound
  per instance, which no class-level patch sees (verl's worker groups bind ``generate_sequences``
  on each instance): the method at ``path`` runs unchanged, and each time it returns, the callable
  at ``instance.a.b`` is wrapped where it lives (on ``instance.a``). Its calls reach the interceptor
  with ``Call.instance`` = the instance whose method returned (e.g. the trainer), their convention
  kept; uninstrument restores the method and every attribute it wrapped.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
import os
import sys
import threading
import weakref
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


def target_key(path: str, attribute: str | None = None) -> str:
    """How a target is named by :class:`Injector` and in logs: ``module:qualname`` or ``...->attribute``."""
    text = str(TargetPath.parse(path))
    return f"{text}->{attribute}" if attribute else text


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
    #: Attribute targets: the dotted attribute of the instance wrapped each time the method returns.
    instance_attribute: str | None = None
    #: Attribute targets: ``(holder, name, what holder.__dict__ had)`` of every attribute wrapped.
    wrapped: list[tuple[Any, str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.path}->{self.instance_attribute}" if self.instance_attribute else str(self.path)


def _never(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return False


def _build_wrapper(
    patch: _Patch, raw: Any, binding: _Binding, function: Any, owner: Callable[[], Any] | None = None
) -> SkipinjectWrapper:
    """The wrapper of one target. ``owner`` (attribute targets): returns the instance the calls are
    reported with (``Call.instance`` and ``passes``), instead of the one wrapt finds."""
    convention, inner = convention_of(function)
    patch.convention = convention
    interceptor = patch.interceptor
    label = patch.label
    passes = getattr(interceptor, "passes", None) or _never
    # A bound method wrapped on an instance (attribute targets): a trampoline's coroutine needs its self.
    bound_self = getattr(function, "__self__", None) if owner is not None else None

    def reported(instance: Any) -> Any:
        return instance if owner is None else owner()

    # Each variant first asks ``passes`` (a step that is surely not chosen): then the original is
    # called at once, with nothing built, logged or inspected — every generation call pays this path.
    if convention is Convention.SYNC:

        def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if passes(reported(instance), args, kwargs):
                return wrapped(*args, **kwargs)
            call = Call(label, function, reported(instance), args, kwargs)
            return interceptor.sync(call, _proceed(wrapped, args, kwargs))

    elif convention is Convention.ASYNC:

        def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if passes(reported(instance), args, kwargs):
                return wrapped(*args, **kwargs)
            call = Call(label, function, reported(instance), args, kwargs)
            return interceptor.run_async(call, _proceed(wrapped, args, kwargs))

    else:

        def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if passes(reported(instance), args, kwargs):
                return wrapped(*args, **kwargs)  # the trampoline makes its own sync/async choice
            call = Call(label, function, reported(instance), args, kwargs)
            if _awaiting_caller(sys._getframe(1)):
                if bound_self is not None:
                    target = _bind(inner, bound_self, _Binding.METHOD)
                else:
                    target = _bind(inner, instance, binding)
                return interceptor.run_async(call, _proceed(target, args, kwargs))
            return interceptor.sync(call, _proceed(wrapped, args, kwargs))

    return SkipinjectWrapper(raw, wrapper, label)


def _proceed(target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[..., Any]:
    """``proceed()``: the original with the call's arguments; ``proceed(*other, **named)``: with other
    ones (``action=match`` generates only the rows it cannot serve)."""

    def proceed(*other: Any, **named: Any) -> Any:
        if other or named:
            return target(*other, **named)
        return target(*args, **kwargs)

    return proceed


def _weak(instance: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(instance)
    except TypeError:
        return lambda: instance


def _attribute_hook(patch: _Patch, raw: Any, wrap_attribute: Callable[[_Patch, Any], None]) -> SkipinjectWrapper:
    """The wrapper of an attribute target's method: run it, then wrap the instance's attribute."""

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        if instance is not None:
            wrap_attribute(patch, instance)
        return result

    return SkipinjectWrapper(raw, wrapper, str(patch.path))


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

    def instrument(
        self,
        path: str,
        interceptor: Interceptor,
        *,
        owner: str = "",
        attribute: str | None = None,
        overrides: bool = False,
    ) -> None:
        """Patch ``path`` now if its module is imported, else as soon as it is.

        ``attribute`` (dotted): ``path`` is a method; each time it returns, ``instance.<attribute>``
        is wrapped on the object holding it, and its calls go to ``interceptor`` (see the module doc).
        ``overrides``: a method's overrides in subclasses (existing and future) are patched too.
        """
        target = TargetPath.parse(path)
        if attribute is not None:
            TargetPath.parse(f"{target}.{attribute}")  # dotted identifiers only
        with self._lock:
            key = target_key(path, attribute)
            if key in self._patches:
                logger.debug("%s is already instrumented (by %s)", key, self._patches[key].owner)
                return
            self._patches[key] = _Patch(target, interceptor, owner, overrides=overrides, instance_attribute=attribute)
            if target.module in sys.modules:
                self._apply(self._patches[key], sys.modules[target.module])
            elif target.module not in self._hooked_modules:
                self._hooked_modules.add(target.module)
                wrapt.register_post_import_hook(self._on_import, target.module)

    def uninstrument(self, path: str, attribute: str | None = None) -> None:
        """Undo :meth:`instrument`: restore the original object (and every attribute it wrapped)."""
        with self._lock:
            patch = self._patches.pop(self._key(path, attribute), None)
            if patch is not None and patch.applied:
                self._restore(patch)
            if patch is not None:
                self._restore_attributes(patch)

    def uninstrument_all(self) -> None:
        for key in list(self._patches):
            self.uninstrument(key)

    def is_patched(self, path: str, attribute: str | None = None) -> bool:
        patch = self._patches.get(self._key(path, attribute))
        return bool(patch and patch.applied)

    def convention(self, path: str, attribute: str | None = None) -> Convention | None:
        """The convention of the target (attribute targets: of the attribute last wrapped)."""
        patch = self._patches.get(self._key(path, attribute))
        return patch.convention if patch else None

    @property
    def targets(self) -> list[str]:
        return list(self._patches)

    # ------------------------------------------------------------ internals

    @staticmethod
    def _key(path: str, attribute: str | None) -> str:
        if attribute is None and "->" in path:  # a key as :attr:`targets` lists it
            path, _, attribute = path.partition("->")
        return target_key(path, attribute)

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
        if patch.instance_attribute is not None:
            if binding is not _Binding.METHOD or convention_of(function)[0] is not Convention.SYNC:
                logger.warning(
                    "%s: target %s is not a plain method (%s); its attribute %s cannot be wrapped",
                    patch.owner or "skipinject",
                    patch.path,
                    binding.value,
                    patch.instance_attribute,
                )
                return
            wrapper = _attribute_hook(patch, current, self._wrap_attribute)
        else:
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

    def _wrap_attribute(self, patch: _Patch, instance: Any) -> None:
        """Wrap ``instance.<patch.instance_attribute>`` where it lives (after the method returned)."""
        names = (patch.instance_attribute or "").split(".")
        with self._lock:
            if not patch.applied:  # uninstrumented meanwhile
                return
            holder = instance
            try:
                for name in names[:-1]:
                    holder = getattr(holder, name)
                current = getattr(holder, names[-1])
            except AttributeError:
                logger.debug("%s: %s has no attribute %s; not wrapped", patch.label, type(instance).__name__, names)
                return
            if isinstance(current, SkipinjectWrapper):
                return
            if not callable(current):
                logger.warning(
                    "%s: %s is not callable (%s); not wrapped", patch.owner or "skipinject", patch.label, type(current)
                )
                return
            own = vars(holder).get(names[-1], _MISSING) if hasattr(holder, "__dict__") else _MISSING
            wrapper = _build_wrapper(patch, current, _Binding.FUNCTION, current, owner=_weak(instance))
            try:
                setattr(holder, names[-1], wrapper)
            except (AttributeError, TypeError) as exc:
                logger.warning("%s: cannot wrap %s (%s)", patch.owner or "skipinject", patch.label, exc)
                return
            patch.wrapped.append((holder, names[-1], own))
        logger.debug("wrapped %s on a %s for %s", patch.label, type(holder).__name__, patch.owner)

    @staticmethod
    def _restore_attributes(patch: _Patch) -> None:
        for holder, name, own in patch.wrapped:
            current = vars(holder).get(name) if hasattr(holder, "__dict__") else None
            if not isinstance(current, SkipinjectWrapper):
                logger.warning("%s was replaced by someone else after we wrapped it; leaving it", patch.label)
            elif own is _MISSING:
                delattr(holder, name)
            else:
                setattr(holder, name, own)
        patch.wrapped.clear()

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
