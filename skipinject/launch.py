"""Installing skipinject in this process and every process it starts: the runner's way, and
:func:`enable` for launchers and notebooks that call verl from Python (``run_ppo(config)``).

Both resolve the settings once (the chosen plugins, ``skip.<role>.<key>`` checked as on the command
line), say what cannot work, export the resolved configuration for child processes (the
``SKIPINJECT_CONFIG`` variable and the bootstrap directory on ``PYTHONPATH``, see
:mod:`skipinject.bootstrap`) and start the hooks here.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skipinject.errors import ConfigError

if TYPE_CHECKING:
    from skipinject.config import Config
    from skipinject.plugin_manager import PluginSet

__all__ = ["enable", "install", "resolve"]

logger = logging.getLogger("skipinject")
_HINT = "; see `python -m skipinject --list`"


def resolve(
    overrides: Iterable[tuple[str, str]],
    *,
    plugins: str | None = None,
    plugins_given_as: str = "--plugins",
    settings_file: str | None = None,
    settings: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[PluginSet, Config]:
    """The chosen plugins (``plugins``, else ``VERL_SKIP_PLUGINS``) and the validated settings: a settings
    file, then ``settings`` (``{role: {key: value}}``), then ``overrides`` (``("skip.rollout.enable",
    "True")`` pairs), each layer over the one before."""
    from skipinject.config import Config, apply_overrides, apply_settings, load_file
    from skipinject.config.environment import ENV_PLUGINS
    from skipinject.plugin_manager import load_plugins

    if plugins is not None:
        loaded = load_plugins(plugins, given_as=plugins_given_as)
    else:
        loaded = load_plugins(os.environ.get(ENV_PLUGINS) or "")
    config = Config()
    if settings_file is not None:
        config = apply_settings(config, load_file(settings_file), loaded.roles, hint=_HINT)
    if settings is not None:
        config = apply_settings(config, settings, loaded.roles, hint=_HINT)
    config = apply_overrides(config, overrides, loaded.roles, hint=_HINT)
    owners = sorted({loaded.plugin_of(name).name for name in config.enabled_roles})
    config = Config(
        plugins=",".join(owners),
        plugin_sources=loaded.sources_of(owners),
        roles=config.roles,
        triggers=_triggers(loaded, config.enabled_roles),
    )
    if config.enabled_roles:
        config.to_json()  # refuses, in one line, what cannot reach the run's other processes
    return loaded, config


def install(config: Config, plugins: PluginSet) -> bool:
    """Say what cannot work, hand the configuration on to every process this one starts, and start the
    hooks here. Raises :class:`ConfigError` for a setting that must stop the run; ``True``: active."""
    from skipinject import bootstrap
    from skipinject.report import start as run_start

    bootstrap.configure_logging()
    off = bootstrap.disabled()
    problems = run_start.check_settings(config, disabled=off)  # said once the settings are known to start
    if not config.enabled_roles or off:
        run_start.say(problems)
        return False
    from skipinject.report import summary
    from skipinject.verl.stack import warn_if_untested

    warn_if_untested()
    acting = [name for name in config.enabled_roles if config.role(name).steps]
    end = summary.begin(acting) if acting else None  # before the engine: its exit flush runs before the summary
    try:
        bootstrap.export(config)
        _export_plugin_paths(plugins, config)
        engine = bootstrap.start(config, plugins)
    except BaseException:
        if end is not None:
            end.cancel()  # the program does not start: there is no run to sum up
        raise
    run_start.say(problems)
    if engine is None:
        if end is not None:
            end.cancel()
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
    """Install skipinject in this process and every process it starts, exactly as ``python -m skipinject``
    does, for a program that calls verl from Python::

        import skipinject
        skipinject.enable("skip.rollout_tq.enable=True", "skip.rollout_tq.steps=[1-8]",
                          "skip.rollout_tq.dump_dir=/data/skip")
        run_ppo(config, task_runner_class=TaskRunnerV1)

    ``overrides`` are ``skip.<role>.<key>=<value>`` items as on the command line; ``settings`` the same as a
    mapping, ``{"rollout": {"enable": True, "steps": "1-8"}}`` (also under a top-level ``"skip"`` key);
    ``settings_file`` a YAML file as ``--skip-config``; ``plugins`` a selection as ``--plugins``. Call it
    before verl is imported and before Ray starts (the workers Ray starts inherit it). A wrong setting
    raises :class:`~skipinject.ConfigError` (one line naming the key). Returns whether skipinject is active;
    a second call changes nothing (one warning).
    """
    from skipinject import bootstrap
    from skipinject.config import environment
    from skipinject.config.overrides import split_overrides

    if bootstrap.started():
        bootstrap.configure_logging()
        logger.warning("skipinject.enable: skipinject is already installed in this process; the call changes nothing")
        return bootstrap.active()
    environment.check()
    parsed, rest = split_overrides(list(overrides))
    if rest:
        raise ConfigError(f"{rest[0]}: expected skip.<role>.<key>=<value>")
    if settings is not None and set(settings) == {"skip"}:
        settings = settings["skip"]
    loaded, config = resolve(
        parsed,
        plugins=plugins,
        plugins_given_as="plugins=",
        settings_file=None if settings_file is None else str(settings_file),
        settings=settings,
    )
    return install(config, loaded)


def _triggers(plugins: PluginSet, enabled: list[str]) -> tuple[str, ...]:
    """Top-level packages holding the enabled roles' targets and clocks (and verl's SkipManager guard)."""
    from skipinject.verl.builtin_guard import BUILTIN_SKIP_INIT

    paths = [BUILTIN_SKIP_INIT] if any(plugins.roles[name].builtin for name in enabled) else []
    for name in enabled:
        role = plugins.roles[name]
        paths += [target.path for target in role.targets] + list(role.clocks)
    return tuple(sorted({path.split(":")[0].split(".")[0] for path in paths}))


def _export_plugin_paths(plugins: PluginSet, config: Config) -> None:
    """Plugins given as ``module[:attr]`` paths must import in children too (Ray workers start
    elsewhere than the current directory): append their directories to ``PYTHONPATH``."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for plugin in plugins.plugins:
        if plugin.name not in config.plugin_sources or plugin.distribution is not None:
            continue
        top = sys.modules.get(plugin.source.split(":")[0].split(".")[0])
        location = getattr(top, "__file__", None)
        if location is None:
            continue
        base = Path(location).resolve().parent
        if Path(location).name == "__init__.py":
            base = base.parent
        if str(base) not in paths:
            paths.append(str(base))
    if paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(paths)
