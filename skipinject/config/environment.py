"""The environment variables skipinject reads (:data:`VARIABLES`), each validated like a command-line key:
the runner exits 2 with one line naming a bad one; a child process logs it and uses the default.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

from skipinject.errors import ConfigError

ENV_CONFIG = "SKIPINJECT_CONFIG"
ENV_DISABLE = "SKIPINJECT_DISABLE"
ENV_LOG_LEVEL = "SKIPINJECT_LOG_LEVEL"
ENV_PLUGINS = "VERL_SKIP_PLUGINS"
ENV_DEBUG = "SKIPINJECT_DEBUG"
ENV_SUMMARY = "SKIPINJECT_SUMMARY"
ENV_RUN_REPORT = "SKIPINJECT_RUN_REPORT"

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

#: Every environment variable skipinject reads, and what it does (the runner's ``--help`` lists them).
VARIABLES = {
    ENV_PLUGINS: "plugins to load, as --plugins (unset: every installed one)",
    ENV_DISABLE: "1/true/yes/on: skipinject off everywhere (default: on)",
    ENV_LOG_LEVEL: "DEBUG, INFO (default), WARNING, ERROR or CRITICAL",
    ENV_DEBUG: "1: `skipinject cache` shows a traceback of an internal error",
    ENV_SUMMARY: "a file: the run's summary is also written there, as JSON",
    ENV_CONFIG: "set by the runner: the checked settings, for the run's processes",
    ENV_RUN_REPORT: "set by the runner: where the run's processes write their counts for the summary",
    "SKIPINJECT_CHAINED_SETUP_HOOK": "set by skipinject: the job's own Ray worker setup hook, run next",
    "PYTHONPATH": "extended by the runner: its start-up hook, plugins given as paths",
    "RAY_JOB_CONFIG_JSON_ENV_VAR": "Ray's: whether a submitted job has its own worker setup hook",
}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={_show(raw)}: expected 1 or 0 (true/false, yes/no, on/off)")


#: ``SKIPINJECT_DISABLE`` and ``SKIPINJECT_DEBUG`` as booleans (``environ``: ``os.environ`` unless given).
disabled = functools.partial(_flag, ENV_DISABLE)
debug = functools.partial(_flag, ENV_DEBUG)


def log_level(environ: Mapping[str, str] | None = None) -> str:
    """``SKIPINJECT_LOG_LEVEL`` as a :mod:`logging` level name (default ``INFO``)."""
    raw = (os.environ if environ is None else environ).get(ENV_LOG_LEVEL, "")
    value = raw.strip().upper() or "INFO"
    if value == "WARN":
        value = "WARNING"
    if value not in LOG_LEVELS:
        raise ConfigError(f"{ENV_LOG_LEVEL}={_show(raw)}: expected one of {', '.join(LOG_LEVELS)}")
    return value


def check(environ: Mapping[str, str] | None = None) -> None:
    """Validate every variable the runner reads before the program starts (raises ConfigError)."""
    disabled(environ)
    debug(environ)
    log_level(environ)


def _show(raw: str) -> str:
    return repr(raw if len(raw) <= 100 else raw[:100] + "...")
