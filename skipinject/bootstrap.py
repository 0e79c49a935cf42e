"""Installing skipinject in this process and every process it starts (the runner, :func:`enable`).

:func:`install` exports the checked settings in ``SKIPINJECT_CONFIG`` and puts ``_bootstrap`` (a
``sitecustomize``) first on ``PYTHONPATH``; ``ray.init`` is patched to carry both to workers on other nodes.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skipinject.config import Config
from skipinject.config import environment as env_vars
from skipinject.config.environment import ENV_CONFIG, ENV_PLUGINS, ENV_RUN_REPORT
from skipinject.errors import ConfigError
from skipinject.text import MAX_LINE, one_line

if TYPE_CHECKING:
    from skipinject.engine import Engine
    from skipinject.plugin_manager import PluginSet

BOOTSTRAP_DIR = str(Path(__file__).resolve().parent / "_bootstrap")
RAY_SETUP_HOOK = "skipinject.bootstrap.ray_worker_setup"
ENV_CHAINED_HOOK = "SKIPINJECT_CHAINED_SETUP_HOOK"
RAY_INIT = "ray:init"
_HINT = "; see `python -m skipinject --list`"

logger = logging.getLogger("skipinject")

_lock = threading.Lock()
_engine: Engine | None = None
_started = False
_refused: str | None = None  # the SKIPINJECT_CONFIG this process could not start from


def resolve(
    overrides: Iterable[tuple[str, str]],
    *,
    plugins: str | None = None,
    plugins_given_as: str = "--plugins",
    settings_file: str | None = None,
    settings: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[PluginSet, Config]:
    """The chosen plugins and the validated settings: file, then ``settings``, then ``overrides``."""
    from skipinject.config.overrides import apply_overrides, apply_settings, load_file
    from skipinject.plugin_manager import load_plugins

    given_as = ENV_PLUGINS if plugins is None else plugins_given_as
    loaded = load_plugins(plugins, given_as)

    def hint(role: str) -> str:  # an unknown role: where it would come from
        from skipinject.plugin_manager import installed_entry_points, role_origin

        return _HINT + role_origin(role, loaded, installed_entry_points(), given_as)

    config = Config()
    for layer in ({} if settings_file is None else load_file(settings_file), {} if settings is None else settings):
        config = apply_settings(config, layer, loaded.roles, hint=hint)
    config = apply_overrides(config, overrides, loaded.roles, hint=hint)
    owners = sorted({loaded.plugin_of(name).name for name in config.enabled_roles})
    config = Config(
        plugins=",".join(owners),
        plugin_sources={p.name: p.source for p in loaded.plugins if p.name in owners},
        roles=config.roles,
        triggers=_triggers(loaded, config.enabled_roles),
    )
    if config.enabled_roles:
        config.to_json()  # refuses, in one line, what cannot reach the run's other processes
    return loaded, config


def install(config: Config, plugins: PluginSet) -> bool:
    """Say what cannot work, hand ``config`` on to child processes, start the hooks here; ``True``: active."""
    from skipinject.report import start as run_start

    configure_logging()
    off = disabled()
    problems = run_start.check_settings(config, disabled=off)  # said once the settings are known to start
    if not config.enabled_roles or off:
        run_start.say(problems)
        return False
    from skipinject.report import tally
    from skipinject.verl.stack import warn_if_untested

    warn_if_untested()
    acting = [name for name in config.enabled_roles if config.role(name).steps]
    end = tally.begin(acting) if acting else None  # before the engine: its exit flush runs before the summary
    engine = None
    try:
        os.environ[ENV_CONFIG] = config.to_json()
        _on_pythonpath([BOOTSTRAP_DIR], first=True)
        _on_pythonpath(_plugin_dirs(plugins, config))
        engine = start(config, plugins)
    finally:
        if engine is None and end is not None:
            end.cancel()  # no run to sum up
    run_start.say(problems)
    if engine is None:
        return False
    engine.check_targets()
    run_start.watch(config, plugins.roles, end)
    return True


def enable(
    *overrides: str,
    settings: Mapping[str, Mapping[str, Any]] | None = None,
    settings_file: str | os.PathLike[str] | None = None,
    plugins: str | None = None,
) -> bool:
    """Install skipinject as ``python -m skipinject`` does, from Python, before verl is imported; ``settings``
    are ``{"rollout": {"enable": True}}`` (also under ``"skip"``). Whether it is active; a second call does nothing."""
    from skipinject.config.overrides import split_overrides

    _check_arguments(overrides, settings, settings_file, plugins)
    if _started:
        configure_logging()
        logger.warning("skipinject.enable: skipinject is already installed in this process; the call changes nothing")
        return _engine is not None
    env_vars.check()
    parsed, rest = split_overrides(list(overrides))
    if rest:
        raise ConfigError(f"{rest[0]}: expected skip.<role>.<key>=<value>")
    if settings is not None and set(settings) == {"skip"}:
        settings = settings["skip"]
    settings_file = None if settings_file is None else str(settings_file)
    loaded, config = resolve(
        parsed, plugins=plugins, plugins_given_as="plugins=", settings_file=settings_file, settings=settings
    )
    return install(config, loaded)


def _check_arguments(overrides: tuple[Any, ...], settings: Any, settings_file: Any, plugins: Any) -> None:
    """:func:`enable`'s arguments of the wrong type, refused in one line before anything is read."""
    checks: tuple[tuple[str, Any, type | tuple[type, ...], str], ...] = (
        ("settings", settings, Mapping, "a mapping of roles to keys"),
        ("settings_file", settings_file, (str, os.PathLike), "a file path"),
        ("plugins", plugins, str, "a comma list like 'rollout'"),
        *(("override", item, str, "'skip.<role>.<key>=<value>'") for item in overrides),
    )
    for name, value, kinds, expected in checks:
        if value is not None and not isinstance(value, kinds):
            raise ConfigError(f"skipinject.enable: {name}={one_line(repr(value), 120)}: expected {expected}")


def _triggers(plugins: PluginSet, enabled: list[str]) -> tuple[str, ...]:
    """Top-level packages holding the enabled roles' targets and clocks (and verl's SkipManager guard)."""
    from skipinject.verl.builtin_guard import BUILTIN_SKIP_INIT

    paths = [BUILTIN_SKIP_INIT] if any(plugins.roles[name].builtin for name in enabled) else []
    for name in enabled:
        role = plugins.roles[name]
        paths += [target.path for target in role.targets] + list(role.clocks)
    return tuple(sorted({path.split(":")[0].split(".")[0] for path in paths}))


def _plugin_dirs(plugins: PluginSet, config: Config) -> list[str]:
    """Where plugins given as ``module[:attr]`` paths import from (children start elsewhere, Ray workers too)."""
    dirs = []
    for plugin in plugins.plugins:
        if plugin.name in config.plugin_sources and plugin.distribution is None:
            location = getattr(sys.modules.get(plugin.source.split(":")[0].split(".")[0]), "__file__", None)
            if location is not None:
                base = Path(location).resolve().parent
                dirs.append(str(base.parent if Path(location).name == "__init__.py" else base))
    return dirs


def _on_pythonpath(dirs: list[str], *, first: bool = False) -> None:
    """Add ``dirs`` to ``PYTHONPATH`` (at the end, or ``first``) where not there yet."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    new = [d for d in dict.fromkeys(dirs) if d not in paths]
    if new:
        os.environ["PYTHONPATH"] = os.pathsep.join([*new, *paths] if first else [*paths, *new])


def disabled() -> bool:
    """``SKIPINJECT_DISABLE``; an unreadable value counts as "on" after one error line (children)."""
    try:
        return env_vars.disabled()
    except ConfigError as exc:
        configure_logging()
        logger.error("%s; skipinject stays off in process %d", exc, os.getpid())
        return True


def _one_line_record(record: logging.LogRecord) -> bool:
    """Each line of a run is one bounded line whatever names from a cache it quotes (a recorded path, a
    settings key): control characters escaped, cut at :data:`~skipinject.errors.MAX_LINE`."""
    message = record.getMessage()
    if not message.isprintable() or len(message) > MAX_LINE:
        record.msg, record.args = one_line(message), None
    return True


def bound_log_lines() -> None:
    """Every line of the ``skipinject`` logger one bounded line (:func:`_one_line_record`), whoever handles it."""
    if _one_line_record not in logger.filters:
        logger.addFilter(_one_line_record)


def configure_logging() -> None:
    """A plain stderr handler for the ``skipinject`` logger, unless the program gave it one; its lines bounded."""
    bound_log_lines()
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("skipinject %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.setLevel(env_vars.log_level())
    except ConfigError as exc:
        logger.setLevel(logging.INFO)
        logger.error("%s; logging at INFO", exc)


def start(config: Config, plugins: PluginSet | None = None) -> Engine | None:
    """Install the hooks of ``config``'s enabled roles in this process (once)."""
    global _engine, _started
    with _lock:
        if _started or disabled():
            return _engine
        _started = True
        if not config.enabled_roles:
            return None
        from skipinject.engine import Engine

        if plugins is None:
            from skipinject.plugin_manager import load_plugins, load_sources

            sources = config.plugin_sources
            plugins = load_sources(sources) if sources else load_plugins(config.plugins or "")
        roles = {role.name: (role, plugin.name) for plugin in plugins.plugins for role in plugin.roles}
        engine = Engine(config, roles)
        engine.start()
        _engine = engine
        _patch_ray_init(config)
        return engine


def stop() -> None:
    """Remove every hook this process installed, so a later :func:`start` hands on its own configuration."""
    global _engine, _started
    from skipinject.injector import INJECTOR

    with _lock:
        if _engine is not None:
            _engine.stop()
        INJECTOR.uninstrument(RAY_INIT)
        run_start = sys.modules.get("skipinject.report.start")
        if run_start is not None:
            run_start.unwatch()
        _engine = None
        _started = False


def start_from_env(hand_on_only: bool = False) -> Engine | None:
    """Start from ``SKIPINJECT_CONFIG`` (errors logged); ``hand_on_only``: only patch ``ray.init``."""
    global _refused
    text = os.environ.get(ENV_CONFIG)
    if not text or text == _refused or disabled():  # refused: said once (at ray's import), not again at verl's
        return None
    configure_logging()
    try:
        if hand_on_only:
            _patch_ray_init(Config.from_json(text))
            return None
        return start(Config.from_json(text))
    except Exception as exc:
        _refused = text
        logger.error("not active in process %d: %s: %s", os.getpid(), type(exc).__name__, exc)
        return None


def ray_worker_setup() -> None:
    """Ray's ``worker_process_setup_hook`` (workers on other nodes): start, hand on, run the job's own hook."""
    if start_from_env() is not None:
        _on_pythonpath([BOOTSTRAP_DIR], first=True)
    chained = os.environ.get(ENV_CHAINED_HOOK)
    if chained:
        from importlib import import_module

        module, _, attr = chained.rpartition(".")
        getattr(import_module(module), attr)()


def _patch_ray_init(config: Config) -> None:
    from skipinject.injector import INJECTOR

    INJECTOR.instrument(RAY_INIT, _RayInitInterceptor(config), owner="skipinject/processes")


class _RayInitInterceptor:
    """Adds our config and setup hook (the user's chained after it) to the job's ``runtime_env``, so workers
    on every node start skipinject; then warns once if several nodes share no cache."""

    def __init__(self, config: Config) -> None:
        self.config = config  # written for the workers at ``ray.init`` (most processes never call it)

    def amend(self, runtime_env: Any) -> Any:
        """A copy of ``runtime_env`` (dict, ``RuntimeEnv`` or ``None``) with our variable and hook."""
        amended = copy.copy(runtime_env) if runtime_env else {}
        env_vars = dict(amended.get("env_vars") or {})
        env_vars.setdefault(ENV_CONFIG, self.config.to_json())
        if os.environ.get(ENV_RUN_REPORT):  # the driver's: where this node's processes write their counts
            env_vars.setdefault(ENV_RUN_REPORT, os.environ[ENV_RUN_REPORT])
        user_hook = amended.get("worker_process_setup_hook")
        if _job_setup_hook_injected():
            pass  # `ray job submit` set a hook for the job: a second one would make ray.init fail
        elif not user_hook or user_hook == RAY_SETUP_HOOK:
            amended["worker_process_setup_hook"] = RAY_SETUP_HOOK
        elif isinstance(user_hook, str):
            env_vars.setdefault(ENV_CHAINED_HOOK, user_hook)
            amended["worker_process_setup_hook"] = RAY_SETUP_HOOK
        elif callable(user_hook):  # Ray pickles it by value

            def skipinject_then_user_setup_hook() -> Any:
                ray_worker_setup()
                return user_hook()

            amended["worker_process_setup_hook"] = skipinject_then_user_setup_hook
        amended["env_vars"] = env_vars
        return amended

    def sync(self, call: Any, proceed: Any) -> Any:
        kwargs = call.kwargs
        job_config = kwargs.get("job_config")
        if kwargs.get("runtime_env") is None and getattr(job_config, "runtime_env", None):
            job_config = copy.copy(job_config)  # the user's JobConfig is left as it was
            job_config.set_runtime_env(self.amend(job_config.runtime_env))
            kwargs["job_config"] = job_config
        else:
            kwargs["runtime_env"] = self.amend(kwargs.get("runtime_env"))
        run_start = sys.modules.get("skipinject.report.start")
        if run_start is not None:  # the driver: its start lines, if verl's config was not seen first
            run_start.at_ray_init()
        result = proceed()
        self.check_cluster()
        return result

    def check_cluster(self) -> None:
        """Warn (once) when the cluster has several nodes and a role's cache is node-local."""
        try:
            from skipinject import cluster

            nodes = cluster.ray_alive_nodes()
            if nodes > 1:
                cluster.warn_if_cache_not_shared(cluster.enabled_role_settings(self.config), nodes)
        except Exception as exc:  # a check must never break the program's ray.init
            logger.debug("cluster check failed: %s: %s", type(exc).__name__, exc)

    async def run_async(self, call: Any, proceed: Any) -> Any:  # pragma: no cover - ray.init is sync
        return self.sync(call, proceed)


def _job_setup_hook_injected() -> bool:
    """Whether ``ray job submit`` already gave this job a ``worker_process_setup_hook``."""
    text = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not text:
        return False
    try:
        runtime_env = json.loads(text).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return False
    env_vars = runtime_env.get("env_vars") or {}
    return bool(runtime_env.get("worker_process_setup_hook") or env_vars.get("__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"))
