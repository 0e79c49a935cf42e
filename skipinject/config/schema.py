"""The ``skip.<role>.*`` schema: one structured OmegaConf node per role, validated key by key.

OmegaConf converts and checks the values (``True``/``yes``/``1`` for booleans, enum names for
``action`` and ``on_mismatch``, unknown keys refused); skipinject turns its errors into one line
naming the key and the value, and reads ``steps`` itself (ranges stay ranges).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from skipinject.config.steps import StepSet
from skipinject.errors import ConfigError

DEFAULT_DUMP_DIR = "~/.verl/rollout_dump"


class Action(str, enum.Enum):
    """What a chosen step does (``skip.<role>.action``)."""

    cache = "cache"  # own step cached -> load it, else run and save
    repeat = "repeat"  # exact step, else the largest cached below, else the smallest above
    strict = "strict"  # like cache, but a missing or unusable cache stops the run

    def __str__(self) -> str:
        return self.value


class MismatchPolicy(str, enum.Enum):
    """What a hit generated from other inputs than this call's does (``skip.<role>.on_mismatch``)."""

    warn = "warn"
    regenerate = "regenerate"
    fail = "fail"

    def __str__(self) -> str:
        return self.value


@dataclass
class RoleSchema:
    """The keys of ``skip.<role>`` and their defaults, as OmegaConf validates them.

    The first four are upstream's, with upstream's defaults.
    """

    enable: bool = False
    dump_dir: str = DEFAULT_DUMP_DIR
    steps: Any = field(default_factory=list)
    action: Action = Action.cache
    #: Load verl's own pickled caches (``gen_batch.dp``, ``tq_batch.pt``): they run code when loaded.
    trust_upstream: bool = False
    on_mismatch: MismatchPolicy = MismatchPolicy.warn
    #: Load from cache directories other users can write to or own (ssh's StrictModes, switched off).
    trust_dir_permissions: bool = False


ROLE_KEYS = tuple(f.name for f in fields(RoleSchema))
_BOOL_KEYS = {f.name for f in fields(RoleSchema) if f.type in ("bool", bool)}


@dataclass(frozen=True)
class RoleConfig:
    """The validated settings of one role in this run."""

    enable: bool = False
    dump_dir: str = DEFAULT_DUMP_DIR
    steps: StepSet = field(default_factory=StepSet)
    action: Action = Action.cache
    trust_upstream: bool = False
    on_mismatch: MismatchPolicy = MismatchPolicy.warn
    trust_dir_permissions: bool = False

    def __post_init__(self) -> None:
        # Accept plain values from code (``steps=(1, 2)``, ``action="repeat"``), as the schema would.
        if not isinstance(self.steps, StepSet):
            object.__setattr__(self, "steps", StepSet.from_value(list(self.steps), "steps"))
        object.__setattr__(self, "action", Action(self.action))
        object.__setattr__(self, "on_mismatch", MismatchPolicy(self.on_mismatch))

    def allows(self, step: int | None) -> bool:
        """The role may act on ``step`` (enabled and the step chosen)."""
        return self.enable and step is not None and step in self.steps


def role_config(
    role: str, values: Mapping[str, Any], base: RoleConfig | None = None, *, texts: Mapping[str, str] | None = None
) -> RoleConfig:
    """Validate plain values (from the command line, YAML or JSON) for ``skip.<role>``; errors name the key.

    ``texts``: what the user typed for each key, quoted in error messages instead of the parsed value.
    """
    if not isinstance(values, Mapping):
        raise ConfigError(f"skip.{role}: expected a mapping of keys to values, got {type(values).__name__}")
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = base or RoleConfig()
    node = OmegaConf.structured(RoleSchema)
    changes: dict[str, Any] = {}
    for raw_key, value in values.items():
        key = str(raw_key)
        dotted = f"skip.{role}.{key}"
        if key not in ROLE_KEYS:
            raise ConfigError(f"{dotted}: unknown key {key!r} (known: {', '.join(ROLE_KEYS)})")
        shown = (texts or {}).get(key)
        if key == "steps":
            changes[key] = StepSet.from_value(_plain(value), dotted)
            continue
        shown = shown if shown is not None else _show(value)
        try:
            node[key] = value
            converted = node[key]
            if key == "dump_dir" and converted is None:
                raise ValueError("no directory")
        except (OmegaConfBaseException, ValueError, TypeError) as exc:
            raise ConfigError(f"{dotted}={shown}: {_expected(key)}") from exc
        if key == "dump_dir" and (not converted.strip() or "\x00" in converted):
            raise ConfigError(f"{dotted}={shown}: expected a directory path")
        if key == "dump_dir" and "://" in converted:
            from skipinject.cluster import is_remote

            if is_remote(converted):
                from skipinject.store.remote import check_url

                check_url(converted, dotted)
        changes[key] = converted
    return replace(cfg, **changes)


def _plain(value: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _expected(key: str) -> str:
    if key in _BOOL_KEYS:
        return "expected true or false"
    if key == "action":
        return f"unknown action (choose one of {', '.join(a.value for a in Action)})"
    if key == "on_mismatch":
        return f"expected one of {', '.join(p.value for p in MismatchPolicy)}"
    if key == "dump_dir":
        return "expected a directory path"
    return "invalid value"
