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
from skipinject.config.environment import ENV_CONFIG, ENV_DISABLE, ENV_LOG_LEVEL, ENV_RUN_REPORT
from skipinject.errors import ConfigError

if TYPE_CHECKING:
    from skipinject.engine import Engine
    from skipinject.plugin_manager import PluginSet

__all__ = [
    "ENV_CONFIG",
    "ENV_DISABLE",
    "ENV_LOG_LEVEL",
    "active",
    "configure_logging",
    "disabled",
    "export",
    "start",
    "started",
    "stop",
]

BOOTSTRAP_DIR = str(Path(__file__).resolve().parent / "_bootstrap")
RAY_SETUP_HOOK = "skipinject.bootstrap.ray_worker_setup"
ENV_CHAINED_HOOK = "SKIPINJECT_CHAINED_SETUP_HOOK"

logger = logging.getLogger("skipinject")

_lock = threading.Lock()
_engine: Engine | None = None
_started = False


#: Patched so that a job's ``runtime_env`` carries the configuration to workers on every node.
RAY_INIT = "ray:init"


def disabled() -> bool:
    """``SKIPINJECT_DISABLE``; an unreadable value counts as "on" after one error line (children)."""
    try:
        return env_vars.disabled()
    except ConfigError as exc:
        configure_logging()
        logger.error("%s; skipinject stays off in process %d", exc, os.getpid())
        return True


def started() -> bool:
    """Whether :func:`start` ran in this process (and :func:`stop` did not undo it)."""
    return _started


def active() -> bool:
    """Whether hooks of this process's configuration are installed here."""
    return _engine is not None


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
    """Remove every hook this process installed (tests, or a program that wants out): the roles'
    targets and the ``ray.init`` patch, so a later :func:`start` hands on its own configuration."""
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


def hand_on_from_env() -> None:
    """Only patch ``ray.init`` (a process that imported ray but no target package yet), so a job it
    starts hands the configuration on; the rest starts when a target package is imported."""
    text = os.environ.get(ENV_CONFIG)
    if not text or disabled():
        return
    configure_logging()
    try:
        _patch_ray_init(Config.from_json(text))
    except Exception as exc:
        logger.error("not active in process %d: %s: %s", os.getpid(), type(exc).__name__, exc)


def ray_worker_setup() -> None:
    """Ray's ``worker_process_setup_hook``: start in workers that did not get our sitecustomize.

    Workers on nodes whose raylet was started without skipinject's environment (every node of a
    cluster started before the run, every other node of any cluster) get ``SKIPINJECT_CONFIG``
    from the job's ``runtime_env`` only. Here they start skipinject, hand it on to the Python
    processes they start (this node's bootstrap directory first on ``PYTHONPATH``), then run
    the user's own setup hook if the job had one (``SKIPINJECT_CHAINED_SETUP_HOOK``).
    """
    if start_from_env() is not None:
        export_bootstrap_path()
    chained = os.environ.get(ENV_CHAINED_HOOK)
    if chained:
        from importlib import import_module

        module, _, attr = chained.rpartition(".")
        getattr(import_module(module), attr)()


def export_bootstrap_path(env: MutableMapping[str, str] | None = None) -> None:
    """Put this installation's bootstrap directory first on ``PYTHONPATH`` (if not there)."""
    target: Any = os.environ if env is None else env
    paths = [p for p in target.get("PYTHONPATH", "").split(os.pathsep) if p]
    if BOOTSTRAP_DIR not in paths:
        target["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *paths])


def export(config: Config, env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Put ``config`` and the bootstrap directory into ``env`` (default: this process's)."""
    target: MutableMapping[str, str] = os.environ if env is None else env
    target[ENV_CONFIG] = config.to_json()
    export_bootstrap_path(target)
    return target


def _patch_ray_init(config: Config) -> None:
    from skipinject.injector import INJECTOR

    INJECTOR.instrument(RAY_INIT, _RayInitInterceptor(config), owner="skipinject/processes")


def _chain_setup_hooks(user_hook: Any) -> Any:
    """A callable setup hook that starts skipinject, then runs the user's callable hook.

    Ray pickles it by value (cloudpickle) and runs it in every worker of the job; it needs a
    ``__name__``, which a closure has.
    """

    def skipinject_then_user_setup_hook() -> Any:
        ray_worker_setup()
        return user_hook()

    return skipinject_then_user_setup_hook


class _RayInitInterceptor:
    """Adds our config to the job's ``runtime_env`` so workers on every node start skipinject.

    Works whatever the program connects to (a new local cluster, ``address=...``, ``"auto"``,
    ``RAY_ADDRESS``): the job's ``runtime_env`` applies to all its workers on all nodes. The
    ``runtime_env`` may be a dict or a ``RuntimeEnv`` (its type is kept), or come in a
    ``job_config``; a setup hook of the user's is chained after ours, never dropped. After
    ``ray.init`` returns, a cluster of several nodes with a node-local cache gets one warning.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.config_json = config.to_json()

    def amend(self, runtime_env: Any) -> Any:
        """A copy of ``runtime_env`` (dict or ``RuntimeEnv``, maybe ``None``) with our variable and hook."""
        import copy

        amended = copy.copy(runtime_env) if runtime_env else {}
        env_vars = dict(amended.get("env_vars") or {})
        env_vars.setdefault(ENV_CONFIG, self.config_json)
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
        elif callable(user_hook):
            amended["worker_process_setup_hook"] = _chain_setup_hooks(user_hook)
        amended["env_vars"] = env_vars
        return amended

    def sync(self, call: Any, proceed: Any) -> Any:
        kwargs = call.kwargs
        job_config = kwargs.get("job_config")
        if kwargs.get("runtime_env") is None and getattr(job_config, "runtime_env", None):
            import copy

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
    import json

    text = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not text:
        return False
    try:
        runtime_env = json.loads(text).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return False
    env_vars = runtime_env.get("env_vars") or {}
    return bool(runtime_env.get("worker_process_setup_hook") or env_vars.get("__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"))
