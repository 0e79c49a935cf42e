"""Patching targets by dotted path when their module is imported (wrapt post-import hooks): once (our
wrapper is left alone), reversibly (exactly what was there is put back), keeping the calling convention:
sync, ``async def``, or a *trampoline* (sync over an ``async def``, looking at its caller's frame, like
verl's ``auto_await``). A missing target is logged, never raised. ``overrides=True`` also patches
subclasses' overrides, existing and future; an *attribute target* wraps ``instance.<attribute>`` each
time the method at ``path`` returns (callables bound per instance)."""

from __future__ import annotations

import asyncio
import enum
import functools
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

from skipinject.clock import weak_ref
from skipinject.roles import Call, TargetPath

logger = logging.getLogger("skipinject")

_MISSING = object()
_SKIP_FRAME_DIRS = (os.path.dirname(wrapt.__file__), os.path.dirname(__file__))


class Interceptor(Protocol):
    """What runs instead of a patched target; ``proceed`` calls the original. An optional
    ``passes(instance, args, kwargs) -> bool``, asked first, lets a call go straight to the original."""

    def sync(self, call: Call, proceed: Callable[[], Any]) -> Any: ...

    def run_async(self, call: Call, proceed: Callable[[], Awaitable[Any]]) -> Awaitable[Any]: ...


class Convention(enum.Enum):
    SYNC = "sync"
    ASYNC = "async"
    TRAMPOLINE = "sync-or-async"


#: How a target is bound: how a trampoline's ``async def`` is bound again, and what logs call it.
FUNCTION, METHOD, STATIC, CLASS = "function", "method", "staticmethod", "classmethod"


if TYPE_CHECKING:  # wrapt's stubs make FunctionWrapper generic; wrapt 1.x cannot subscript it at run time
    _FunctionWrapper = wrapt.FunctionWrapper[Any, Any]
else:
    _FunctionWrapper = wrapt.FunctionWrapper


class SkipinjectWrapper(_FunctionWrapper):
    """Our wrapper type: how we never wrap a target twice."""


def convention_of(function: Any) -> tuple[Convention, Any]:
    """The convention of ``function`` and, for trampolines, the ``async def`` it drives."""
    if inspect.iscoroutinefunction(function):
        return Convention.ASYNC, None
    inner = function
    for _ in range(16):
        inner = getattr(inner, "__wrapped__", None)
        if inner is None:
            break
        if inspect.iscoroutinefunction(inner):
            return Convention.TRAMPOLINE, inner
    return Convention.SYNC, None


def _awaiting_caller(frame: FrameType | None) -> bool:
    """Whether the target's caller (past wrapt's and our frames) is a coroutine in a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP_FRAME_DIRS):
        frame = frame.f_back
    return frame is not None and bool(frame.f_code.co_flags & inspect.CO_COROUTINE)


def target_key(path: str, attribute: str | None = None) -> str:
    """A target's name in :class:`Injector` and logs: ``module:qualname`` or ``...->attribute`` (also as ``path``)."""
    if attribute is None and "->" in path:
        path, _, attribute = path.partition("->")
    text = str(TargetPath.parse(path))
    return f"{text}->{attribute}" if attribute else text


@dataclass
class _Patch:
    path: TargetPath
    interceptor: Interceptor
    owner: str
    overrides: bool = False  # also patch subclasses' own overrides (methods only)
    instance_attribute: str | None = None  # attribute targets: the dotted attribute
    convention: Convention | None = None
    applied: bool = False
    #: What to put back on uninstrument, oldest first: ``(holder, name, what holder.__dict__ had, what, done)``.
    undo: list[tuple[Any, str, Any, str, str]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.path}->{self.instance_attribute}" if self.instance_attribute else str(self.path)

    @property
    def who(self) -> str:
        return self.owner or "skipinject"


def _build_wrapper(
    patch: _Patch, raw: Any, binding: str, function: Any, owner: Callable[[], Any] | None = None, label: str = ""
) -> tuple[SkipinjectWrapper, Convention]:
    """The wrapper of one target (``label``: an override's own). ``owner`` (attribute targets): the instance
    calls are reported with."""
    convention, inner = convention_of(function)
    interceptor = patch.interceptor
    label = label or patch.label
    passes = getattr(interceptor, "passes", None)
    # A bound method wrapped on an instance (attribute targets): a trampoline's coroutine needs its self.
    bound_self = getattr(function, "__self__", None) if owner is not None else None

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        reported = instance if owner is None else owner()
        # every generation call pays this path: nothing else is done
        if passes is not None and passes(reported, args, kwargs):
            return wrapped(*args, **kwargs)
        call = Call(label, function, reported, args, kwargs)
        if convention is Convention.ASYNC:
            return interceptor.run_async(call, _proceed(wrapped, args, kwargs))
        if convention is Convention.TRAMPOLINE and _awaiting_caller(sys._getframe(1)):
            receiver = (instance, binding) if bound_self is None else (bound_self, METHOD)
            target = _bind(inner, *receiver)
            return interceptor.run_async(call, _proceed(target, args, kwargs))
        return interceptor.sync(call, _proceed(wrapped, args, kwargs))

    return SkipinjectWrapper(raw, wrapper), convention


def _proceed(target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[..., Any]:
    """``proceed()``: the original with the call's arguments; ``proceed(*other, **named)``: with other ones."""

    def proceed(*other: Any, **named: Any) -> Any:
        if other or named:
            return target(*other, **named)
        return target(*args, **kwargs)

    return proceed


def _bind(function: Any, instance: Any, binding: str) -> Any:
    if binding in (METHOD, CLASS) and instance is not None:
        return function.__get__(instance, type(instance) if binding == METHOD else instance)
    return function


def _own(holder: Any, name: str) -> Any:
    """What ``holder.__dict__`` has at ``name`` (``_MISSING``: nothing, the value is inherited)."""
    return vars(holder).get(name, _MISSING) if hasattr(holder, "__dict__") else _MISSING


class Injector:
    """Installs and removes wrappers on targets given as ``package.module:Qualified.name``."""

    def __init__(self) -> None:
        self._patches: dict[str, _Patch] = {}
        self._hooked_modules: set[str] = set()  # modules with a pending post-import hook
        self._lock = threading.RLock()
        #: Base classes whose ``__init_subclass__`` we replaced: (what was in their __dict__, ours, patches).
        self._subclass_hooks: dict[type, tuple[Any, Any, list[_Patch]]] = {}
        #: Targets patched after their module was imported, not yet checked for names bound to the original.
        self._patched_late: list[str] = []

    def instrument(
        self,
        path: str,
        interceptor: Interceptor,
        *,
        owner: str = "",
        attribute: str | None = None,
        overrides: bool = False,
    ) -> None:
        """Patch ``path`` now if its module is imported, else as soon as it is."""
        target = TargetPath.parse(path)
        if attribute is not None:
            TargetPath.parse(f"{target}.{attribute}")  # dotted identifiers only
        key = target_key(path, attribute)
        with self._lock:
            if key in self._patches:
                logger.debug("%s is already instrumented (by %s)", key, self._patches[key].owner)
                return
            self._patches[key] = _Patch(target, interceptor, owner, overrides, attribute)
            if target.module in sys.modules:
                self._apply(self._patches[key], sys.modules[target.module])
                self._patched_late.append(key)  # see say_earlier_names
            elif target.module not in self._hooked_modules:
                self._hooked_modules.add(target.module)
                wrapt.register_post_import_hook(self._on_import, target.module)

    def uninstrument(self, path: str, attribute: str | None = None) -> None:
        """Undo :meth:`instrument`: restore the original object (and every override and attribute it wrapped)."""
        with self._lock:
            patch = self._patches.pop(target_key(path, attribute), None)
            if patch is None:
                return
            patch.applied = False
            for base, (own, ours, patches) in list(self._subclass_hooks.items()):
                if patch not in patches:
                    continue
                patches.remove(patch)
                if patches:
                    continue
                del self._subclass_hooks[base]
                if vars(base).get("__init_subclass__") is not ours:
                    logger.warning(
                        "%s.__init_subclass__ was replaced after we patched it; leaving it", base.__qualname__
                    )
                elif own is _MISSING:
                    type.__delattr__(base, "__init_subclass__")
                else:
                    type.__setattr__(base, "__init_subclass__", own)
            while patch.undo:
                holder, name, own, what, done = patch.undo.pop()
                if not isinstance(_own(holder, name), SkipinjectWrapper):
                    logger.warning("%s was replaced by someone else after we %s it; leaving it", what, done)
                elif own is _MISSING:
                    delattr(holder, name)
                else:
                    setattr(holder, name, own)

    def uninstrument_all(self) -> None:
        for key in list(self._patches):
            self.uninstrument(key)

    def is_patched(self, path: str, attribute: str | None = None) -> bool:
        patch = self._patches.get(target_key(path, attribute))
        return bool(patch and patch.applied)

    def convention(self, path: str, attribute: str | None = None) -> Convention | None:
        """The convention of the target (attribute targets: of the attribute last wrapped)."""
        patch = self._patches.get(target_key(path, attribute))
        return patch.convention if patch else None

    def say_earlier_names(self) -> None:
        """Once every target is instrumented: for each module-level function patched after its module was
        imported, the names other modules bound to it before (``from verl... import f``), which still call the
        original, in one line (names that are targets themselves are patched, not named)."""
        with self._lock:
            late, self._patched_late = self._patched_late, []
            said: set[int] = set()  # one line per function, however many of its names are targets
            for key in late:
                patch = self._patches.get(key)
                if patch is not None:
                    self._say_earlier_names(patch, said)

    def _say_earlier_names(self, patch: _Patch, said: set[int]) -> None:
        if not patch.applied or "." in patch.path.qualname or not patch.undo:
            return
        wrapper = getattr(sys.modules[patch.path.module], patch.path.qualname, None)
        original = getattr(wrapper, "__wrapped__", None)
        if original is None or id(original) in said:
            return
        said.add(id(original))
        patched = {(p.path.module, p.path.qualname) for p in self._patches.values()}
        earlier = [
            f"{name}.{attribute}"
            for name, module in list(sys.modules.items())
            if name != patch.path.module
            for attribute, value in list(getattr(module, "__dict__", {}).items())
            if value is original and (name, attribute) not in patched
        ]
        if earlier:
            shown = ", ".join(sorted(earlier)[:3]) + (f" and {len(earlier) - 3} more" if len(earlier) > 3 else "")
            logger.warning(
                "%s: %s was imported by name before skipinject was installed (%s): calls through those names are "
                "not skipped; install skipinject (enable()) before importing them",
                patch.who,
                patch.path,
                shown,
            )

    def _on_import(self, module: ModuleType) -> None:
        with self._lock:
            self._hooked_modules.discard(module.__name__)  # wrapt fires a hook once, then drops it
            for patch in list(self._patches.values()):
                if patch.path.module == module.__name__ and not patch.applied:
                    self._apply(patch, module)

    def _apply(self, patch: _Patch, module: ModuleType) -> None:
        try:
            *outer, attribute = patch.path.qualname.split(".")
            parent = functools.reduce(getattr, outer, module)
            current = inspect.getattr_static(parent, attribute)
        except AttributeError:
            logger.warning(
                "%s: target %s does not exist in this install (module %s has no %s); this role will not act",
                patch.who,
                patch.path,
                patch.path.module,
                patch.path.qualname,
            )
            return
        except Exception as exc:  # a broken target must not break the user's program
            logger.warning("%s: cannot resolve target %s: %s", patch.who, patch.path, exc)
            return
        if isinstance(current, SkipinjectWrapper):
            logger.debug("%s is already wrapped; leaving it", patch.path)
            return
        binding, function = _classify(parent, current)
        if function is None:
            logger.warning(
                "%s: target %s is not a function (%s); not patched", patch.who, patch.path, type(current).__name__
            )
            return
        if patch.instance_attribute is None:
            wrapper, patch.convention = _build_wrapper(patch, current, binding, function)
        elif binding == METHOD and convention_of(function)[0] is Convention.SYNC:

            def wrap_after(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                result = wrapped(*args, **kwargs)
                if instance is not None:
                    self._wrap_attribute(patch, instance)
                return result

            wrapper = SkipinjectWrapper(current, wrap_after)
        else:
            logger.warning(
                "%s: target %s is not a plain method (%s); its attribute %s cannot be wrapped",
                patch.who,
                patch.path,
                binding,
                patch.instance_attribute,
            )
            return
        own = _own(parent, attribute)
        setattr(parent, attribute, wrapper)
        patch.undo.append((parent, attribute, own, str(patch.path), "patched"))
        patch.applied = True
        convention = patch.convention.value if patch.convention else "?"
        logger.debug("patched %s (%s, %s) for %s", patch.path, binding, convention, patch.owner)
        if patch.overrides and binding == METHOD and isinstance(parent, type):
            self._follow_subclasses(patch, parent)

    def _follow_subclasses(self, patch: _Patch, base: Any) -> None:
        """Patch the overrides of ``patch``'s method in every subclass of ``base``, now and later."""
        pending: list[type] = list(base.__subclasses__())
        seen: set[type] = set()
        while pending:
            cls = pending.pop()
            if cls not in seen:
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
        name = patch.path.qualname.rpartition(".")[2]
        raw = vars(cls).get(name, _MISSING)
        if raw is _MISSING or isinstance(raw, SkipinjectWrapper) or not inspect.isfunction(raw):
            return
        path = TargetPath(cls.__module__, f"{cls.__qualname__}.{name}")
        try:
            setattr(cls, name, _build_wrapper(patch, raw, METHOD, raw, label=str(path))[0])
        except Exception as exc:  # a class that refuses the attribute must not break its definition
            logger.warning("%s: cannot patch the override %s: %s", patch.who, path, exc)
            return
        patch.undo.append((cls, name, raw, str(path), "patched"))
        logger.debug("patched the override %s of %s for %s", path, patch.path, patch.owner)

    def _wrap_attribute(self, patch: _Patch, instance: Any) -> None:
        """Wrap ``instance.<patch.instance_attribute>`` where it lives (after the method returned)."""
        *outer, name = (patch.instance_attribute or "").split(".")
        with self._lock:
            if not patch.applied:  # uninstrumented meanwhile
                return
            try:
                holder = functools.reduce(getattr, outer, instance)
                current = getattr(holder, name)
            except AttributeError:
                logger.debug("%s: %s has no attribute %s; not wrapped", patch.label, type(instance).__name__, name)
                return
            if isinstance(current, SkipinjectWrapper):
                return
            if not callable(current):
                logger.warning("%s: %s is not callable (%s); not wrapped", patch.who, patch.label, type(current))
                return
            own = _own(holder, name)
            wrapper, patch.convention = _build_wrapper(patch, current, FUNCTION, current, owner=weak_ref(instance))
            try:
                setattr(holder, name, wrapper)
            except (AttributeError, TypeError) as exc:
                logger.warning("%s: cannot wrap %s (%s)", patch.who, patch.label, exc)
                return
            patch.undo.append((holder, name, own, patch.label, "wrapped"))
        logger.debug("wrapped %s on a %s for %s", patch.label, type(holder).__name__, patch.owner)


def _classify(parent: Any, raw: Any) -> tuple[str, Any]:
    if isinstance(raw, (staticmethod, classmethod)):
        return (STATIC if isinstance(raw, staticmethod) else CLASS), raw.__func__
    if not callable(raw):
        return FUNCTION, None
    return (METHOD if isinstance(parent, type) else FUNCTION), raw


#: The injector of this process.
INJECTOR = Injector()
