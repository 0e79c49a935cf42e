"""Patching targets by dotted path when their module is imported (wrapt post-import hooks): once (our
wrapper is left alone), reversibly (exactly what was there is put back), keeping the calling convention:
sync, ``async def``, or a *trampoline* (sync over an ``async def``, looking at its caller's frame, like
verl's ``auto_await``). A missing target is logged, never raised. A module-level function is replaced
wherever it is bound: in every module of the watched packages that imported the same function object,
under any name. ``overrides`` follows subclasses' overrides, existing and future (``True``: all of them;
a callable: each one it accepts, the others refused with one line); an *attribute target* wraps
``instance.<attribute>`` each time the method at ``path`` returns (callables bound per instance).

Wrappers pickle as a reference that the loading process resolves again (its own wrapper, or the original
where skipinject is not active), and the subclass hook holds nothing but the base class: a class Ray
pickles by value (a ``__main__`` task runner, an actor class) never carries the injector with it."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import importlib
import inspect
import logging
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any, Protocol, SupportsIndex, cast

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


#: Which subclass overrides of a method target are followed: ``True`` (all), or a check of the subclass
#: returning ``None`` (follow it) or why it is refused.
OverrideCheck = Callable[[type], "str | None"]


class SkipinjectWrapper(_FunctionWrapper):
    """Our wrapper type: how we never wrap a target twice. Pickled (``__reduce_ex__``, and through
    cloudpickle's function reducer, see :data:`PICKLERS`) as a reference the loading process resolves."""

    #: ``(target key, binding, label)``: what a loading process wraps again (:func:`_adopt`).
    _self_skipinject: tuple[str, str, str]

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        home = _home_of(self)
        if home is not None:
            return _resolve_home, home
        key, binding, label = getattr(self, "_self_skipinject", ("", FUNCTION, ""))
        return _adopt, (self.__wrapped__, key, binding, label)

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__reduce_ex__(2)


def _home_of(wrapper: Any) -> tuple[str, str] | None:
    """``(module, qualname)`` where ``wrapper`` is found by name in an importable module, else ``None``."""
    module_name, qualname = getattr(wrapper, "__module__", None), getattr(wrapper, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str) or module_name in ("__main__", "__mp_main__"):
        return None
    module = sys.modules.get(module_name)
    if module is None or "<locals>" in qualname:
        return None
    try:
        found = _lookup(module, qualname)
    except Exception:
        return None
    return (module_name, qualname) if found is wrapper else None


def _lookup(module: Any, qualname: str) -> Any:
    *outer, name = qualname.split(".")
    return inspect.getattr_static(functools.reduce(getattr, outer, module), name)


def _resolve_home(module_name: str, qualname: str) -> Any:
    """Unpickling a wrapper found by name: what that name holds in this process (its wrapper or the original)."""
    return _lookup(importlib.import_module(module_name), qualname)


def _adopt(raw: Any, key: str, binding: str, label: str) -> Any:
    """Unpickling a wrapper of a class pickled by value: wrapped again by this process's injector, if the
    target is instrumented here, else the original."""
    return INJECTOR.adopt(raw, key, binding, label)


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
    overrides: bool | OverrideCheck = False  # also patch subclasses' own overrides (methods only)
    instance_attribute: str | None = None  # attribute targets: the dotted attribute
    convention: Convention | None = None
    applied: bool = False
    #: What to put back on uninstrument, oldest first: ``(holder, name, what holder.__dict__ had, what, done)``.
    undo: list[tuple[Any, str, Any, str, str]] = field(default_factory=list)
    #: A module-level function: ``(original, wrapper)``, looked for by identity in the watched packages.
    alias: tuple[Any, Any] | None = None

    @property
    def key(self) -> str:
        return target_key(str(self.path), self.instance_attribute)

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
    calls are reported with. A wrapper left anywhere after :meth:`Injector.uninstrument` calls the original."""
    convention, inner = convention_of(function)
    interceptor = patch.interceptor
    label = label or patch.label
    passes = getattr(interceptor, "passes", None)
    # A bound method wrapped on an instance (attribute targets): a trampoline's coroutine needs its self.
    bound_self = getattr(function, "__self__", None) if owner is not None else None
    # Followed overrides: an override calling super() reaches the base's wrapper, which then passes.
    guarded = bool(patch.overrides) and binding == METHOD

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        reported = instance if owner is None else owner()
        # every generation call pays this path: nothing else is done
        if not patch.applied or (passes is not None and passes(reported, args, kwargs)):
            return wrapped(*args, **kwargs)
        call = Call(label, function, reported, args, kwargs)
        if convention is Convention.ASYNC:
            return interceptor.run_async(call, _proceed(wrapped, args, kwargs))
        if convention is Convention.TRAMPOLINE and _awaiting_caller(sys._getframe(1)):
            receiver = (instance, binding) if bound_self is None else (bound_self, METHOD)
            target = _bind(inner, *receiver)
            return interceptor.run_async(call, _proceed(target, args, kwargs))
        proceed = _proceed(wrapped, args, kwargs)
        if guarded:
            return _guarded(patch, reported, proceed, lambda: interceptor.sync(call, proceed))
        return interceptor.sync(call, proceed)

    built = SkipinjectWrapper(raw, wrapper)
    built._self_skipinject = (patch.key, binding, label)
    return built, convention


_running = threading.local()


def _guarded(patch: _Patch, instance: Any, proceed: Callable[[], Any], run: Callable[[], Any]) -> Any:
    """``run()``, unless this thread is already inside ``patch`` for ``instance`` (an override's super() call):
    then the original only (``proceed()``)."""
    active: set[tuple[int, int]] = _running.__dict__.setdefault("active", set())
    mark = (id(patch), id(instance))
    if mark in active:
        return proceed()
    active.add(mark)
    try:
        return run()
    finally:
        active.discard(mark)


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
        #: Patches applied after their module was imported, with the modules there were then (only those can
        #: have bound the original: later imports take the wrapper).
        self._patched_late: list[tuple[str, list[str]]] = []

    def instrument(
        self,
        path: str,
        interceptor: Interceptor,
        *,
        owner: str = "",
        attribute: str | None = None,
        overrides: bool | OverrideCheck = False,
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
                self._patched_late.append((key, list(sys.modules)))  # see say_earlier_names
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
                for token in [t for t, (inj, b) in _FOLLOWERS.items() if inj is self and b is base]:
                    del _FOLLOWERS[token]
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
            if patch.alias is not None:  # modules imported since, that took the wrapper from a patched one
                raw, wrapper = patch.alias
                for module, name in _bindings(_watched(patch, raw), wrapper):
                    setattr(module, name, raw)

    def adopt(self, raw: Any, key: str, binding: str, label: str) -> Any:
        """``raw`` (an original loaded from a pickle) wrapped for the instrumented target ``key``, else ``raw``."""
        with self._lock:
            patch = self._patches.get(key)
            if patch is not None and not patch.applied and patch.path.module not in sys.modules:
                with contextlib.suppress(Exception):  # importing it applies the patch
                    importlib.import_module(patch.path.module)
            if patch is None or not patch.applied or patch.instance_attribute is not None:
                return raw
            function = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
            return _build_wrapper(patch, raw, binding, function, label=label)[0]

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
            for key, modules in late:
                patch = self._patches.get(key)
                if patch is not None:
                    self._say_earlier_names(patch, modules, said)

    def _say_earlier_names(self, patch: _Patch, modules: list[str], said: set[int]) -> None:
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
            for name in modules
            if name != patch.path.module
            for attribute, value in list(getattr(sys.modules.get(name), "__dict__", {}).items())
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
                "%s: target %s does not exist in this install (module %s has no %s); this target will not act",
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
            wrapper._self_skipinject = (patch.key, binding, patch.label)
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
        if binding == FUNCTION and isinstance(parent, ModuleType) and patch.instance_attribute is None:
            self._follow_aliases(patch, current, wrapper)
        patch.applied = True
        convention = patch.convention.value if patch.convention else "?"
        logger.debug("patched %s (%s, %s) for %s", patch.path, binding, convention, patch.owner)
        if patch.overrides and binding == METHOD and isinstance(parent, type):
            self._follow_subclasses(patch, parent)
        if patch.owner != PICKLING_OWNER:
            _teach_picklers()

    def _follow_aliases(self, patch: _Patch, raw: Any, wrapper: Any) -> None:
        """Replace ``raw`` by ``wrapper`` in every module of the watched packages that bound it, under any name.

        Modules imported later take the wrapper from a patched module (an import copies the binding)."""
        patch.alias = (raw, wrapper)
        for module, name in _bindings(_watched(patch, raw), raw):
            setattr(module, name, wrapper)
            patch.undo.append((module, name, raw, f"{module.__name__}:{name}", "patched"))
            logger.debug("patched %s:%s, bound to %s, for %s", module.__name__, name, patch.path, patch.owner)

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
        token = object()  # names this hook in _FOLLOWERS; the hook itself holds nothing of the injector
        _FOLLOWERS[token] = (self, base)
        ours: Any = classmethod(_subclass_hook(base, None if own is _MISSING else own, token))
        type.__setattr__(base, "__init_subclass__", ours)
        self._subclass_hooks[base] = (own, ours, [patch])

    def _new_subclass(self, base: type, cls: type) -> None:
        with self._lock:
            hook = self._subclass_hooks.get(base)
            for each in list(hook[2] if hook else ()):
                self._patch_override(each, cls)

    def _patch_override(self, patch: _Patch, cls: type) -> None:
        name = patch.path.qualname.rpartition(".")[2]
        raw = vars(cls).get(name, _MISSING)
        if raw is _MISSING or isinstance(raw, SkipinjectWrapper) or not inspect.isfunction(raw):
            return
        path = TargetPath(cls.__module__, f"{cls.__qualname__}.{name}")
        reason = _refusal(patch, cls)
        try:
            if reason is None:
                setattr(cls, name, _build_wrapper(patch, raw, METHOD, raw, label=str(path))[0])
            else:
                setattr(cls, name, _refusing_wrapper(patch, raw, cls, path, reason))
        except Exception as exc:  # a class that refuses the attribute must not break its definition
            logger.warning("%s: cannot patch the override %s: %s", patch.who, path, exc)
            return
        patch.undo.append((cls, name, raw, str(path), "patched"))
        done = "patched" if reason is None else "refused"
        logger.debug("%s the override %s of %s for %s", done, path, patch.path, patch.owner)

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


def _refusal(patch: _Patch, cls: type) -> str | None:
    """Why ``patch`` does not follow ``cls``'s override (its role's check), or ``None``: it is followed."""
    if patch.overrides is True or not callable(patch.overrides):
        return None
    try:
        return patch.overrides(cls)
    except Exception as exc:  # a role's check must not break a class definition
        return f"its override check failed ({type(exc).__name__}: {exc})"


def _refusing_wrapper(patch: _Patch, raw: Any, cls: type, path: TargetPath, reason: str) -> SkipinjectWrapper:
    """The refused override, as it is, saying once (at its first call: its class is in use) why the role
    does not act on it."""
    said: list[bool] = []

    def refusing(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not said and patch.applied:
            said.append(True)
            logger.warning(
                "%s: %s overrides the target %s and is refused: %s; this role does not act on %s",
                patch.who,
                path,
                patch.path,
                reason,
                cls.__name__,
            )
        return wrapped(*args, **kwargs)

    wrapper = SkipinjectWrapper(raw, refusing)
    wrapper._self_skipinject = ("", METHOD, str(path))  # unpickled: the override as it is
    return wrapper


#: Subclass hooks by their token: ``(injector, base)``; a hook loaded from a pickle finds nothing here.
_FOLLOWERS: dict[object, tuple[Injector, type]] = {}


def _subclass_hook(base: type, own: Any, token: object) -> Callable[..., None]:
    """The ``__init_subclass__`` that follows ``base``'s subclasses: its closure is the base class, what
    ``base.__dict__`` had and a token, all picklable, so a class Ray pickles by value stays picklable."""

    def __init_subclass__(cls: Any, /, **kwargs: Any) -> None:
        if own is None:
            super(cast(Any, base), cls).__init_subclass__(**kwargs)
        else:
            own.__get__(None, cls)(**kwargs)
        _on_new_subclass(token, cls)

    return __init_subclass__


def _on_new_subclass(token: object, cls: type) -> None:
    follower = _FOLLOWERS.get(token)
    if follower is not None:
        follower[0]._new_subclass(follower[1], cls)


def _watched(patch: _Patch, raw: Any) -> set[str]:
    """The top-level packages searched for other bindings of a function: the target's and the function's own."""
    tops = {patch.path.module.partition(".")[0], str(getattr(raw, "__module__", "") or "").partition(".")[0]}
    return tops - {"", "__main__", "__mp_main__"}


def _bindings(tops: set[str], value: Any) -> list[tuple[ModuleType, str]]:
    """Every ``(module, name)`` of the packages ``tops`` binding ``value`` (by identity)."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if module_name.partition(".")[0] not in tops or not isinstance(module, ModuleType):
            continue
        found += [(module, name) for name, each in list(vars(module).items()) if each is value]
    return found


#: cloudpickle's function reducer, in Ray and standalone: a wrapper passes for a function there (its
#: ``__class__`` is the wrapped one's), so it is taught to ask the wrapper's ``__reduce_ex__``.
PICKLERS = ("ray.cloudpickle.cloudpickle:Pickler._function_reduce", "cloudpickle.cloudpickle:Pickler._function_reduce")
PICKLING_OWNER = "skipinject/pickling"


class _ReduceWrappers:
    """cloudpickle's ``_function_reduce(obj)``: a skipinject wrapper reduces itself, and so does one bound by
    attribute access (``Class.method``, kept by Ray's actor-method tracing wrappers); other objects as before."""

    def passes(self, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return not (args and (type(args[0]) is SkipinjectWrapper or _bound_ours(args[0])))

    def sync(self, call: Call, proceed: Callable[[], Any]) -> Any:
        obj = call.args[0]
        if type(obj) is SkipinjectWrapper:
            return obj.__reduce_ex__(getattr(call.instance, "proto", 2))
        return _rebind, (obj._self_parent, obj._self_instance, obj._self_owner)

    def run_async(self, call: Call, proceed: Callable[[], Awaitable[Any]]) -> Awaitable[Any]:  # pragma: no cover
        raise TypeError("cloudpickle's function reducer is not async")


def _bound_ours(obj: Any) -> bool:
    return type(obj) is wrapt.BoundFunctionWrapper and type(obj._self_parent) is SkipinjectWrapper


def _rebind(parent: Any, instance: Any, owner: Any) -> Any:
    """Unpickling a bound wrapper: its parent (this process's wrapper, or the original) bound again."""
    return parent.__get__(instance, owner)


def _teach_picklers() -> None:
    """Once per process (and again after an ``uninstrument_all``): cloudpickle reduces our wrappers."""
    for path in PICKLERS:
        if path not in INJECTOR._patches:
            INJECTOR.instrument(path, _ReduceWrappers(), owner=PICKLING_OWNER)


def _classify(parent: Any, raw: Any) -> tuple[str, Any]:
    if isinstance(raw, (staticmethod, classmethod)):
        return (STATIC if isinstance(raw, staticmethod) else CLASS), raw.__func__
    if not callable(raw):
        return FUNCTION, None
    return (METHOD if isinstance(parent, type) else FUNCTION), raw


#: The injector of this process.
INJECTOR = Injector()
