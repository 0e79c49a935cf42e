"""The ``skip.<role>.<key>`` configuration: schema, overrides, settings files, transport, environment."""

from skipinject.config.overrides import apply_overrides, apply_settings, load_file, parse_overrides, split_overrides
from skipinject.config.schema import (
    DEFAULT_DUMP_DIR,
    MAX_SERIALISED_BYTES,
    ROLE_KEYS,
    Action,
    Config,
    MismatchPolicy,
    RescorePolicy,
    RoleConfig,
    RoleSchema,
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
    "RoleSchema",
    "StepSet",
    "WeightSyncPolicy",
    "apply_overrides",
    "apply_settings",
    "load_file",
    "parse_overrides",
    "role_config",
    "split_overrides",
]
