"""Starting skipinject in a process, and handing it on to the processes it starts.

The runner resolves and validates the configuration once, then exports it as JSON in
``SKIPINJECT_CONFIG`` and puts ``skipinject/_bootstrap`` (a ``sitecustomize``) first on
``PYTHONPATH``. Every Python child then starts skipinject before any user code. Ray workers on
this node inherit that environment; for workers on other nodes, ``ray.init`` is patched to add
the variable and a ``worker_process_setup_hook`` to the job's ``runtime_env``.

Set ``SKIPINJECT_DISABLE=1`` to turn everything off without changing the command line.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skipinject.config import Config
from skipinject.config import environment as env_vars
from skipinject.config.environment import ENV_CONFIG, ENV_DISABLE, ENV_LOG_LEVEL
from skipinject.errors import ConfigError

if TYPE_CHECKING:
    from skipinject.engine import Engine
    from skipinject.plugin_manager import PluginSet

__all__ = ["ENV_CONFIG", "ENV_DISABLE", "ENV_LOG_LEVEL", "configure_logging", "disabled", "export", "start", "stop"]

BOOTSTRAP_DIR = str(Path(__file__).resolve().parent / "_bootstrap")
RAY_SETUP_HOOK = "skipinject.bootstrap.ray_worker_setup"

logger = logging.getLogger("skipinject")

_lock = threading.Lock()
_engine: Engine | None = None
_started = False


def disabled() -> bool:
    """``SKIPINJECT_DISABLE``; an unreadable value counts as "on" after one error line (children)."""
    try:
        return env_vars.disabled()
    except ConfigError as exc:
        configure_logging()
        logger.error("%s; skipinject stays off in process %d", exc, os.getpid())
        return True


def configure_logging() -> None:
    """Give the ``skipinject`` logger a plain stderr handler unless the program configured one."""
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

            plugins = (
                load_sources(config.plugin_sources) if config.plugin_sources else load_plugins(config.plugins or "")
            )
        roles = {role.name: (role, plugin.name) for plugin in plugins.plugins for role in plugin.roles}
        engine = Engine(config, roles)
        engine.start()
        _engine = engine
        _patch_ray_init(config)
        return engine


def stop() -> None:
    """Remove every hook this process installed (tests, or a program that wants out)."""
    global _engine, _started
    with _lock:
        if _engine is not None:
            _engine.stop()
        _engine = None
        _started = False


def start_from_env() -> Engine | None:
    """Start from ``SKIPINJECT_CONFIG`` (children of the runner). Errors are logged, not raised."""
    text = os.environ.get(ENV_CONFIG)
    if not text or disabled():
        return None
    configure_logging()
    try:
        return start(Config.from_json(text))
    except Exception as exc:
        logger.error("not active in process %d: %s: %s", os.getpid(), type(exc).__name__, exc)
        return None


def ray_worker_setup() -> None:
    """Ray's ``worker_process_setup_hook``: start in workers that did not get our sitecustomize."""
    start_from_env()


def export(config: Config, env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Put ``config`` and the bootstrap directory into ``env`` (default: this process's)."""
    target: MutableMapping[str, str] = os.environ if env is None else env
    target[ENV_CONFIG] = config.to_json()
    paths = [p for p in target.get("PYTHONPATH", "").split(os.pathsep) if p]
    if BOOTSTRAP_DIR not in paths:
        target["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *paths])
    return target


def _patch_ray_init(config: Config) -> None:
    from skipinject.injector import INJECTOR

    INJECTOR.instrument("ray:init", _RayInitInterceptor(config.to_json()), owner="skipinject/processes")


class _RayInitInterceptor:
    """Adds our config to the job's ``runtime_env`` so workers on every node start skipinject."""

    def __init__(self, config_json: str) -> None:
        self.config_json = config_json

    def sync(self, call: Any, proceed: Any) -> Any:
        kwargs = call.kwargs
        runtime_env = kwargs.get("runtime_env")
        runtime_env = dict(runtime_env) if runtime_env else {}
        env = dict(runtime_env.get("env_vars") or {})
        env.setdefault(ENV_CONFIG, self.config_json)
        runtime_env["env_vars"] = env
        if not runtime_env.get("worker_process_setup_hook"):
            runtime_env["worker_process_setup_hook"] = RAY_SETUP_HOOK
        kwargs["runtime_env"] = runtime_env
        return proceed()

    async def run_async(self, call: Any, proceed: Any) -> Any:  # pragma: no cover - ray.init is sync
        return self.sync(call, proceed)
