"""The ``skip.<role>.<key>`` configuration: schema, transport, environment; the runner reads overrides and settings
files with :mod:`skipinject.config.overrides` (a child process reads only the configuration the runner exported)."""

from skipinject.config.schema import (
    DEFAULT_DUMP_DIR,
    MAX_SERIALISED_BYTES,
    ROLE_KEYS,
    Action,
    Config,
    MismatchPolicy,
    RescorePolicy,
    RoleConfig,
    WeightSyncPolicy,
    role_config,
)
from skipinject.config.steps import MAX_STEP, StepSet

__all__ = [
    "DEFAULT_DUMP_DIR",
    "MAX_SERIALISED_BYTES",
    "MAX_STEP",
    "ROLE_KEYS",
    "Action",
    "Config",
    "MismatchPolicy",
    "RescorePolicy",
    "RoleConfig",
    "StepSet",
    "WeightSyncPolicy",
    "role_config",
]
