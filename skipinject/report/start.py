"""The start of a run, in the driver: the settings that cannot work, then a line per role (:func:`role_line`) once
verl's ``run_ppo`` gets its config (or, at ``ray.init``, one a caller holds), so the layout is the trainer's."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from skipinject.config import Action, Config, RoleConfig, StepSet
from skipinject.config.environment import ENV_DISABLE
from skipinject.errors import ConfigError

if TYPE_CHECKING:
    from skipinject.report.tally import RunEnd
    from skipinject.roles import Call, Role
    from skipinject.store import StepStore

logger = logging.getLogger("skipinject")
Lines = list[tuple[int, str]]

#: Where verl gets the run's composed config before it starts Ray.
RUN_ENTRY = "verl.trainer.main_ppo:run_ppo"
RAY_SHUTDOWN = "ray:shutdown"
#: Chosen steps a start line counts one by one at most (more are counted by their ranges).
MAX_COUNTED = 100_000
NO_STEPS = (
    "skip.{0}.enable=true but skip.{0}.steps is empty: the role acts at no step "
    "(give skip.{0}.steps=[1,2] or a range like 1-64)"
)
NOT_ENABLED = "skip.{0}.steps={1} is given but skip.{0}.enable is false: the role is off (add skip.{0}.enable=true)"
#: How many frames above ``ray.init`` are searched for the run's config.
MAX_FRAMES = 12


def setting_problems(config: Config, *, disabled: bool) -> Lines:
    """``(level, line)`` for each setting that cannot do what it says."""
    named = [name for name, settings in config.roles.items() if settings.enable or settings.steps]
    if disabled and named:
        more = f" and {len(named) - 1} more role(s)" if len(named) > 1 else ""
        line = f"skipinject is off ({ENV_DISABLE} is set): skip.{named[0]}{more} will not act in this run"
        return [(logging.WARNING, line)]
    return [
        (logging.WARNING, (NO_STEPS if settings.enable else NOT_ENABLED).format(name, _steps_text(settings.steps)))
        for name, settings in config.roles.items()
        if bool(settings.enable) != bool(settings.steps)
    ]


def dump_dir_problem(name: str, settings: RoleConfig) -> str | None:
    """Why a local ``dump_dir`` cannot hold this role's cache; ``None`` when usable or remote (checked later)."""
    where = f"skip.{name}.dump_dir={settings.dump_dir}"
    try:
        root, saves = settings.root, settings.save
        if root.path is None:
            return None
        existing = root.path
        while not os.path.lexists(existing) and existing.parent != existing:
            existing = existing.parent
        if not existing.is_dir():
            return f"{where}: {existing} is not a directory: nothing can be cached there"
        with contextlib.suppress(FileNotFoundError):
            root.backend(trust_permissions=settings.trust_dir_permissions).check_trust([root.path], name)
        if existing != root.path and not saves:
            return None  # nothing to read yet, and nothing will be written
        doing = "created" if existing != root.path else "written" if saves else "read"
        refused = read_only(existing) if saves else None
        if refused is None and not os.access(existing, (os.W_OK if saves else os.R_OK) | os.X_OK):
            refused = "permission denied"
        if refused is None and saves and existing != root.path:  # the run would create its dump_dir there
            refused = cannot_create_in(existing)
        if refused is not None:
            return f"{where}: cannot be {doing} ({existing}: {refused}): nothing can be cached there"
    except Exception as exc:  # the trust rules' one-line reasons
        return f"{where}: {exc}"
    return None


def read_only(directory: Path) -> str | None:
    """``"read-only file system"`` when ``directory`` is on one, else ``None``."""
    with contextlib.suppress(OSError, AttributeError):
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return "read-only file system"
    return None


def cannot_create_in(directory: Path) -> str | None:
    """Why no directory can be made in ``directory`` where ``os.access`` lets root through (a virtual file system
    such as ``/proc``): one is made and removed again. ``None`` when it can."""
    try:
        made = tempfile.mkdtemp(prefix=".skipinject-probe-", dir=directory)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    with contextlib.suppress(OSError):
        os.rmdir(made)
    return None


#: Bounds :func:`run_directory_problem`'s look into a ``dump_dir``: entries read, at most.
MAX_ENTRIES_LOOKED_AT = 10_000


def run_directory_problem(name: str, settings: RoleConfig) -> str | None:
    """A local ``dump_dir`` that is itself a run's directory (``{experiment}_{project}``: it holds layouts such as
    ``GBS4_N2_in32_out16/``) or a layout's (it holds steps): the run would cache one or two levels below it, find
    none of what is there and generate every step again. ``None`` when it is neither (or cannot be read)."""
    from skipinject.store import META_NAME
    from skipinject.verl.layout import LAYOUT_RE

    try:
        root = settings.root.path
        if root is None or not root.is_dir():
            return None
        with os.scandir(root) as entries:
            for _, entry in zip(range(MAX_ENTRIES_LOOKED_AT), entries, strict=False):
                if not entry.is_dir(follow_symlinks=False):
                    continue
                if LAYOUT_RE.match(entry.name):
                    what, levels = f"{entry.name}/, a cache layout: it is a run's directory", 1
                elif entry.name.isdigit() and os.path.isfile(os.path.join(entry.path, META_NAME)):
                    what, levels = f"step {entry.name}/: it is a layout's directory", 2
                else:
                    continue
                parent = root.parents[levels - 1]
                return (
                    f"skip.{name}.dump_dir={settings.dump_dir} holds {what}, and this run caches in "
                    f"{root}/<experiment>_<project>/GBS…/, finding none of it; give skip.{name}.dump_dir={parent}"
                )
    except (OSError, ValueError, IndexError):
        return None
    return None


#: The dump_dirs whose problem the start lines of this process said (its engine does not say it again).
_said: set[str] = set()


def said_at_start(settings: RoleConfig) -> bool:
    """Whether this process said at start what is wrong with ``settings``' ``dump_dir``."""
    try:
        return str(settings.root) in _said
    except Exception:
        return False


def check_settings(config: Config, *, disabled: bool) -> Lines:
    """:func:`setting_problems` and each acting role's :func:`dump_dir_problem` or :func:`run_directory_problem`
    (an error under ``strict``)."""
    lines = setting_problems(config, disabled=disabled)
    for name in [] if disabled else config.enabled_roles:
        settings = config.role(name)
        problem = (
            (dump_dir_problem(name, settings) or run_directory_problem(name, settings)) if settings.steps else None
        )
        if problem is not None and settings.action is Action.strict:
            raise ConfigError(f"{problem} (skip.{name}.action=strict relies on the cache)")
        if problem is not None:
            lines.append((logging.WARNING, problem))
            with contextlib.suppress(Exception):
                _said.add(str(settings.root))
    return lines


def say(lines: Iterable[tuple[int, str]]) -> None:
    for level, line in lines:
        logger.log(level, "%s", line)


def role_line(name: str, settings: RoleConfig, where: str, counts: str) -> str:
    """``rollout: cache steps 1-64 in DIR: 40 cached, 24 to generate``."""
    steps = settings.steps
    one = len(steps.spans) == 1 and steps.spans[0][0] == steps.spans[0][1]
    return f"{name}: {settings.action} {'step' if one else 'steps'} {_steps_text(steps)} in {where}: {counts}"


def counts_phrase(settings: RoleConfig, store: StepStore, last: Any) -> str:
    """What the run will do with the chosen steps (up to ``last``), how many are cached (one listing, a stat each)."""
    steps, action = settings.steps, settings.action
    if type(last) is int and last > 0:
        steps = StepSet((lo, min(hi, last)) for lo, hi in steps.spans if lo <= last)
    listed = store.step_numbers_on_disk()
    committed = set(store.meta_versions(listed)) if listed else set()
    cached, on_disk = sum(step in steps for step in committed), len(committed)
    todo = max(len(steps) - cached, 0) if len(steps) <= MAX_COUNTED else None  # None: too many to count
    left = "the others" if todo is None else str(todo)
    if action is Action.match:
        phrase = f"{on_disk} step(s) cached in this layout; rows found there are served by prompt, the others generated"
    elif action is Action.repeat and todo != 0 and on_disk:
        phrase = f"{cached} cached, {left} served from the nearest of the {on_disk} cached step(s)"
    elif action is Action.strict:
        phrase = f"{cached} cached" + (f", {left} missing: the run stops at the first" if todo != 0 else "")
    elif action is Action.refresh:
        phrase = f"{cached} cached, all generated and saved again"
    else:
        phrase = f"{cached} cached, {left} to generate"
    return phrase + ("" if settings.save else "; read-only (save=false): nothing is saved")


def past_the_end(steps: StepSet, last: Any) -> str:
    """``"; steps 3-5 come after the run's last step (trainer.total_training_steps=2): never reached"``, or
    ``""`` when every chosen step is reached (or the run's config does not give its last step)."""
    if type(last) is not int or last <= 0:
        return ""
    beyond = StepSet((max(lo, last + 1), hi) for lo, hi in steps.spans if hi > last)
    if not beyond:
        return ""
    one = len(beyond.spans) == 1 and beyond.spans[0][0] == beyond.spans[0][1]
    after = f"{'step' if one else 'steps'} {_steps_text(beyond)} {'comes' if one else 'come'} after the run's last step"
    return f"; {after} (trainer.total_training_steps={last}): never reached"


def layout_lines(config: Config, roles: Mapping[str, Role], run_config: Any) -> Lines:
    """Each enabled role's start line for verl config ``run_config``, after its ``check`` or ``caveat``."""
    from skipinject.verl.compat import select

    lines: Lines = []
    last = select(run_config, "trainer.total_training_steps")
    for name in config.enabled_roles:
        settings, role = config.role(name), roles.get(name)
        if role is None or not settings.steps:
            continue
        reason = _ask(role.check, run_config)
        if reason:
            lines.append((logging.WARNING, f"skip.{name} is enabled but cannot act in this run: {reason}"))
        try:
            store = open_store(name, role, settings, run_config)
            problem = store.unusable()
            counts = f"unusable ({problem})" if problem else counts_phrase(settings, store, last)
            counts += past_the_end(settings.steps, last)
            level = logging.WARNING if problem else logging.INFO
            lines.append((level, role_line(name, settings, str(store.project_dir), counts)))
        except Exception as exc:
            counts = f"not counted ({type(exc).__name__}: {exc})"
            lines.append((logging.INFO, role_line(name, settings, f"{settings.root}/…", counts)))
        caveat = None if reason else _ask(role.caveat, run_config, settings)
        if caveat:
            lines.append((logging.WARNING, f"{name}: {caveat}"))
    return lines


def bypass_lines(config: Config, roles: Mapping[str, Role], modules: Iterable[Any]) -> Lines:
    """A line for each enabled role the trainer classes of the program's entry modules do not reach."""
    from skipinject.report.silence import entry_lines

    try:
        return [(logging.WARNING, line) for line in entry_lines(config, roles, modules)]
    except Exception:  # a start line must never break the program
        return []


def _ask(question: Callable[..., str | None] | None, *args: Any) -> str | None:
    """A role's ``check`` or ``caveat`` for this run: its reason, ``None`` when it has none or fails."""
    try:
        return question(*args) if question is not None else None
    except Exception:
        return None


def open_store(name: str, role: Role, settings: RoleConfig, run_config: Any) -> StepStore:
    """The store of this role's steps in a run with ``run_config``, opened for reading."""
    from skipinject.store import StepStore
    from skipinject.verl.layout import project_dir

    subdir = role.name if role.cache_subdir is None else role.cache_subdir
    project, context = project_dir(settings.root, run_config, subdir, before_trainer=True)
    trust = settings.trust_dir_permissions
    backend = settings.root.backend(trust_permissions=trust)
    return StepStore(project, name, context, trust_permissions=trust, dump_dir=settings.root.path, backend=backend)


class RunStart:
    """Says the role lines once, when the driver first hands verl its config (or starts Ray without)."""

    def __init__(self, config: Config, roles: Mapping[str, Role], end: RunEnd | None = None) -> None:
        self.config, self.roles, self.end = config, dict(roles), end
        self._once = threading.Lock()  # held from the first say on

    def say(self, lines: Callable[[], Lines]) -> None:
        if not self._once.acquire(blocking=False):
            return
        try:
            say(lines())
        except Exception as exc:  # a report must never break the program
            logger.debug("start lines failed: %s: %s", type(exc).__name__, exc)

    def sync(self, call: Call, proceed: Callable[[], Any]) -> Any:
        run_config = call.args[0] if call.args else call.kwargs.get("config")
        runner = call.kwargs.get("task_runner_class", call.args[1] if len(call.args) > 1 else None)
        entry = [sys.modules.get("__main__"), sys.modules.get(getattr(runner, "__module__", "") or "")]
        self.say(
            lambda: layout_lines(self.config, self.roles, run_config) + bypass_lines(self.config, self.roles, entry)
        )
        try:
            return proceed()
        finally:  # the trainer's fit returned (or failed): every process's counts are written
            if self.end is not None:
                self.end.say()

    async def run_async(self, call: Call, proceed: Callable[[], Any]) -> Any:  # pragma: no cover - run_ppo is sync
        return self.sync(call, proceed)

    def at_ray_init(self) -> None:
        """The role lines from the verl config a caller of ``ray.init`` holds (``run_ppo`` in ``__main__``, which
        no import hook sees), else without the layout."""
        run_config = _caller_run_config(sys._getframe(1))
        if run_config is not None:
            self.say(lambda: layout_lines(self.config, self.roles, run_config))
            return
        where, counts = "<experiment>_<project>/GBS…_N…_in…_out…", "the layout is the trainer's"
        roles = [(name, self.config.role(name)) for name in self.config.enabled_roles]
        self.say(lambda: [(logging.INFO, role_line(n, s, f"{s.root}/{where}", counts)) for n, s in roles if s.steps])


def _caller_run_config(frame: FrameType | None) -> Any:
    """The nearest caller's local ``config`` that is a verl run config, else a mapping with ``trainer``."""
    from skipinject.verl.compat import is_run_config

    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        local = frame.f_locals
        if is_run_config(local.get("config")):
            return local["config"]
        for value in local.values():
            with contextlib.suppress(Exception):  # a user's local (a dict, a DictConfig): never breaks ray.init
                if isinstance(value, Mapping) and isinstance(value.get("trainer"), Mapping):
                    return value
        frame = frame.f_back
    return None


_watch: RunStart | None = None


def watch(config: Config, roles: Mapping[str, Role], end: RunEnd | None = None) -> None:
    """In the driver: the role lines when verl gets its config, ``end``'s summary when ``run_ppo`` returns."""
    global _watch
    from skipinject.injector import INJECTOR

    if not any(config.role(name).steps for name in config.enabled_roles):
        return
    unwatch()
    _watch = RunStart(config, roles, end)
    INJECTOR.instrument(RUN_ENTRY, _watch, owner="skipinject/start")
    if end is not None:
        INJECTOR.instrument(RAY_SHUTDOWN, end, owner="skipinject/start")


def at_ray_init() -> None:
    """The driver starts Ray: the start lines, if verl's config was not seen first."""
    if _watch is not None:
        _watch.at_ray_init()


def unwatch() -> None:
    global _watch
    from skipinject.injector import INJECTOR

    INJECTOR.uninstrument(RUN_ENTRY)
    INJECTOR.uninstrument(RAY_SHUTDOWN)
    _watch = None


def _steps_text(steps: StepSet) -> str:
    return steps.format()[1:-1]
