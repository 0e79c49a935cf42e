"""Never silent: a role enabled at chosen steps whose target no process called at a chosen step by the end of
its first chosen step (or of the run) gets one line naming the role, the step, the trainer class and the likely
cause; the summary lists it, and ``action=strict`` makes it an error.

A step ends when the trainer logs its training metrics (verl's ``Tracking.log`` with ``training/global_step``;
the fully async trainer logs once per parameter sync, for the steps since its last log). The trainer's process
judges; a role called in another process (the fully async Rollouter) counts through the run's process records
(:func:`skipinject.report.tally.run_records`)."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from skipinject.config import StepSet
from skipinject.errors import NeverCalledError
from skipinject.report.tally import TALLY, MetricsInterceptor, called_roles, run_records

logger = logging.getLogger("skipinject")

#: The key of a trainer's per-step training metrics holding the step they belong to.
STEP_METRIC = "training/global_step"
#: How many frames above ``Tracking.log`` are searched for the trainer that logs.
MAX_FRAMES = 8
#: Chosen steps a log's span is searched for at most (a span is a few steps).
MAX_SPAN = 4096


@dataclass(frozen=True)
class Watched:
    """An enabled role with chosen steps, as this check needs it."""

    name: str
    steps: StepSet
    #: The role's targets for the installed verl that act (``package.module:Qualified.name``).
    targets: tuple[str, ...]
    strict: bool = False
    #: The role's ``check(run_config)``: why it cannot act in a run (its first cause when it says one).
    check: Callable[[Any], str | None] | None = None

    @property
    def first(self) -> int:
        return self.steps.spans[0][0]

    @property
    def called_name(self) -> str:
        """``extract_reward`` or ``AgentLoopManager.generate_sequences`` (several: joined with ``or``)."""
        return " or ".join(dict.fromkeys(path.partition(":")[2] for path in self.targets)) or self.name


class Silence:
    """The roles of this process to judge, each once; what the trainer's logs say has ended."""

    def __init__(self, watched: Iterable[Watched]) -> None:
        self.watched = {w.name: w for w in watched if w.steps.spans}
        self.judged: set[str] = set()
        self.last_logged: int | None = None
        self._lock = threading.Lock()

    def step_logged(self, step: int, trainer: Any) -> None:
        """The trainer logged step ``step``'s training metrics: the steps since its previous log ended."""
        with self._lock:
            previous, self.last_logged = self.last_logged, step
        if previous is not None and previous < step:
            low = previous + 1
        else:
            span = getattr(trainer, "trigger_parameter_sync_step", 1)  # the fully async trainer's cycle
            low = step - (span if type(span) is int and 0 < span <= MAX_SPAN else 1) + 1
        due = []
        for watched in self._pending():
            ended = next((s for s in range(max(low, step - MAX_SPAN), step + 1) if s in watched.steps), None)
            if ended is not None:
                due.append((watched, f"step {ended} ended"))
        self._judge(due, trainer)

    def run_ended(self, trainer: Any) -> None:
        """The trainer's ``fit`` returned: the roles whose first chosen step it reached are judged."""
        if self.last_logged is None:
            return  # not the process whose trainer logs its steps (the fully async Rollouter)
        steps = getattr(trainer, "global_steps", None)
        last = max(self.last_logged, steps - 1 if type(steps) is int else 0)
        try:
            self._judge([(w, "the run ended") for w in self._pending() if w.first <= last], trainer)
        except NeverCalledError:
            raise
        except Exception as exc:  # a check must never break the trainer's end
            logger.debug("never-called check failed: %s: %s", type(exc).__name__, exc)

    def _pending(self) -> list[Watched]:
        with self._lock:
            return [w for name, w in self.watched.items() if name not in self.judged]

    def _judge(self, due: Sequence[tuple[Watched, str]], trainer: Any) -> None:
        with self._lock:
            due = [(w, when) for w, when in due if w.name not in self.judged]
            self.judged.update(w.name for w, _ in due)
        due = [(w, when) for w, when in due if w.name not in TALLY.called]
        if not due:
            return
        try:
            elsewhere = called_roles(run_records())  # the role may be called in another process
        except Exception:
            elsewhere = set()
        for watched, when in due:
            if watched.name in elsewhere:
                continue
            line = f"skip.{watched.name}: {when} and {watched.called_name} was never called: " + likely_cause(
                watched, trainer
            )
            logger.warning("%s", line)
            TALLY.note_silent(watched.name, line)
            if watched.strict:
                raise NeverCalledError(f"{line} (skip.{watched.name}.action=strict)")

    def logged(self, call: Any) -> None:
        """A ``Tracking.log`` call: a training step's metrics end that step (anything else is not a step's end)."""
        data = call.kwargs.get("data", call.args[0] if call.args else None)
        step = logged_step(data.get(STEP_METRIC) if isinstance(data, Mapping) else None)
        if step is None or not self.watched:
            return
        self.step_logged(step, logging_trainer(sys._getframe(1)))


def logged_step(value: Any) -> int | None:
    """A logged ``training/global_step`` as an int: an integer, a numpy one, or a whole float (the fully async
    trainer's aggregated metrics)."""
    if isinstance(value, bool):
        return None
    with contextlib.suppress(TypeError, ValueError, OverflowError):
        number = float(value)
        if number.is_integer() and 0 <= number < 1 << 62:
            return int(number)
    return None


class StepEnd:
    """verl's ``Tracking.log``: the trainer's metrics get this process's running totals, and a training step's
    log is that step's end (:meth:`Silence.logged`)."""

    def __init__(self, silence: Silence, metrics: MetricsInterceptor | None = None) -> None:
        self.silence = silence
        self.metrics = metrics or MetricsInterceptor()

    def sync(self, call: Any, proceed: Any) -> Any:
        result = self.metrics.sync(call, proceed)
        try:
            self.silence.logged(call)
        except NeverCalledError:
            raise
        except Exception as exc:  # a check must never break the trainer's log
            logger.debug("never-called check failed: %s: %s", type(exc).__name__, exc)
        return result

    async def run_async(self, call: Any, proceed: Any) -> Any:  # pragma: no cover - Tracking.log is sync
        return self.sync(call, proceed)


def logging_trainer(frame: Any) -> Any:
    """The trainer whose method called ``Tracking.log``: the nearest caller's ``self`` with ``global_steps``."""
    from skipinject.clock import CLOCK

    for _ in range(MAX_FRAMES):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if candidate is not None and type(getattr(candidate, "global_steps", None)) is int:
            return candidate
        frame = frame.f_back
    return CLOCK.instance


def likely_cause(watched: Watched, trainer: Any) -> str:
    """Why ``trainer`` did not call the role's targets, as far as can be seen from here."""
    from skipinject.verl.compat import is_run_config

    name = type(trainer).__name__ if trainer is not None else "the trainer"
    config = getattr(trainer, "config", None)
    with contextlib.suppress(Exception):
        reason = watched.check(config) if watched.check is not None and is_run_config(config) else None
        if reason:
            return f"{name}: {reason}"
    found = bypass_of(watched, type(trainer))
    if found:
        return f"{name} {found}"
    return (
        f"{name} did not call {' or '.join(watched.targets)} at a chosen step (a trainer or a setting that does not "
        "reach it; docs/verl-versions.md lists which trainer reaches which role)"
    )


def bypass_of(watched: Watched, trainer: type) -> str | None:
    """How the trainer class does not reach the role's targets, if its modules or methods show it."""
    for target in watched.targets:
        with contextlib.suppress(Exception):
            found = _bound_elsewhere(target, trainer) or _overridden(target, trainer)
            if found:
                return found
    return None


def trainers_of(modules: Iterable[Any]) -> list[type]:
    """The trainer classes (a class with a ``fit``) that entry modules hold, as the program's main imports them."""
    found: dict[type, None] = {}
    for module in modules:
        for value in list(vars(module).values()) if module is not None else ():
            if isinstance(value, type) and callable(getattr(value, "fit", None)):
                found[value] = None
    return list(found)


def _bound_elsewhere(target: str, trainer: type) -> str | None:
    """The trainer's modules calling the target's function under a name skipinject did not patch."""
    from skipinject.injector import SkipinjectWrapper

    module_name, _, qualname = target.partition(":")
    defining = sys.modules.get(module_name)
    patched = getattr(defining, qualname, None) if "." not in qualname else None
    original = getattr(patched, "__wrapped__", None) if isinstance(patched, SkipinjectWrapper) else None
    if original is None:
        return None
    for klass in trainer.__mro__:
        module = sys.modules.get(klass.__module__)
        if module is None or module is defining:
            continue
        for bound, value in vars(module).items():
            if value is original:
                where = f"{module.__name__}.{bound}"
                function = f"{original.__module__}.{original.__qualname__}"
                return f"calls {function} as {where}, not through {target}, the name the role patches"
    return None


def _overridden(target: str, trainer: type) -> str | None:
    """The trainer's own class overriding a method target (a subclass's ``_add_batch_to_generate``)."""
    module_name, _, qualname = target.partition(":")
    owner_name, _, method = qualname.rpartition(".")
    owner = sys.modules.get(module_name)
    for part in owner_name.split(".") if owner_name else ():
        owner = getattr(owner, part, None)
    if not isinstance(owner, type) or not issubclass(trainer, owner):
        return None
    from skipinject.injector import SkipinjectWrapper

    for klass in trainer.__mro__:
        if klass is owner or isinstance(vars(klass).get(method), SkipinjectWrapper):
            return None  # the target itself, or an override skipinject follows
        if method in vars(klass):
            return f"overrides {method} in {klass.__module__}.{klass.__qualname__}, so {target} is not called"
    return None


def watched_roles(slots: Iterable[Any], installed: Callable[[Any], bool]) -> list[Watched]:
    """A :class:`Watched` per role (its runtime or slot) with chosen steps; ``installed(target)``: the target is
    for this verl."""
    from skipinject.config import Action

    found = []
    for runtime in slots:
        settings, role = runtime.settings, runtime.role
        if not settings.enable or not settings.steps.spans:
            continue
        acting = [t for t in role.targets if installed(t) and not t.every_step] or [
            t for t in role.targets if installed(t)
        ]
        targets = tuple(t.label for t in acting)
        found.append(Watched(role.name, settings.steps, targets, settings.action is Action.strict, role.check))
    return found


def entry_lines(config: Any, roles: Mapping[str, Any], modules: Iterable[Any]) -> list[str]:
    """At the run's start: each enabled role with chosen steps that a trainer class the entry modules hold does
    not reach (a module of its binding the target's function under a name not patched, an override)."""
    from skipinject.verl.compat import verl_version, version_matches

    installed = verl_version()
    trainers = trainers_of(modules)
    lines = []
    for name in config.enabled_roles:
        settings, role = config.role(name), roles.get(name)
        if role is None or not settings.steps.spans:
            continue
        targets = [t for t in role.targets if version_matches(t.verl, installed) and not t.every_step]
        watched = Watched(name, settings.steps, tuple(t.label for t in targets))
        for trainer in trainers:
            found = bypass_of(watched, trainer)
            if found:
                lines.append(f"skip.{name} may not act in this run: {trainer.__name__} {found}")
                break
    return lines
