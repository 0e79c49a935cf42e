"""The resolved configuration of a run, and how it travels to every process of the run.

The runner validates once and exports :meth:`Config.to_json` in ``SKIPINJECT_CONFIG``; children
(local ones through the environment, Ray workers on any node through the job's ``runtime_env``)
read it back with :meth:`Config.from_json`. Steps travel as ranges; a long text is compressed,
and a configuration that still does not fit in one environment variable is refused by the runner
before the program starts (Linux refuses to start a process with a longer variable).
"""

from __future__ import annotations

import base64
import enum
import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from skipinject.config.schema import ROLE_KEYS, RoleConfig
from skipinject.config.steps import StepSet
from skipinject.errors import ConfigError

#: Largest serialised configuration handed to children. Linux caps one environment string at
#: 128 KiB (MAX_ARG_STRLEN) and all of them together at a fraction of ARG_MAX; stay well inside.
MAX_SERIALISED_BYTES = 64 << 10
#: Largest configuration text before compression: the writer refuses more, so a reader refuses a
#: variable that expands further after decompressing at most this much (a zip bomb costs no more).
MAX_EXPANDED_BYTES = 512 << 10
_COMPRESS_ABOVE = 4 << 10
_COMPRESSED = "z1:"
SERIAL_VERSION = 2


@dataclass(frozen=True)
class Config:
    """Which plugins load and each role's settings."""

    #: Plugins to load, as a ``VERL_SKIP_PLUGINS`` selection (``None``: every installed plugin).
    plugins: str | None = None
    #: Where the chosen plugins come from (name -> ``module[:attr]``), so children import them
    #: directly instead of scanning every installed distribution's entry points.
    plugin_sources: Mapping[str, str] = field(default_factory=dict)
    roles: Mapping[str, RoleConfig] = field(default_factory=dict)
    #: Top-level packages whose first import starts skipinject in a child process (lazy start-up).
    triggers: tuple[str, ...] = ()

    def role(self, name: str) -> RoleConfig:
        return self.roles.get(name, RoleConfig())

    @property
    def enabled_roles(self) -> list[str]:
        return [name for name, cfg in self.roles.items() if cfg.enable]

    def to_json(self) -> str:
        """Compact text for an environment variable; raises :class:`ConfigError` when it cannot fit."""
        roles = {}
        for name, cfg in self.roles.items():
            roles[name] = {f.name: _plain_value(getattr(cfg, f.name)) for f in fields(cfg)}
        body = {
            "version": SERIAL_VERSION,
            "plugins": self.plugins,
            "sources": dict(self.plugin_sources),
            "triggers": list(self.triggers),
        }
        text = json.dumps({**body, "roles": roles}, sort_keys=True, separators=(",", ":"))
        expanded = len(text)
        if _COMPRESS_ABOVE < expanded <= MAX_EXPANDED_BYTES:
            text = _COMPRESSED + base64.b85encode(zlib.compress(text.encode(), 9)).decode()
        if expanded > MAX_EXPANDED_BYTES or len(text) > MAX_SERIALISED_BYTES:
            longest = max(self.roles, key=lambda n: len(self.roles[n].steps.spans))
            raise ConfigError(
                f"skip.{longest}.steps: {len(self.roles[longest].steps.spans)} separate steps or ranges are too many "
                f"to hand to the processes of the run ({len(text)} bytes of settings, at most {MAX_SERIALISED_BYTES}); "
                "write them as ranges like 1-128"
            )
        return text

    @classmethod
    def from_json(cls, text: str) -> Config:
        """Read :meth:`to_json` back; anything else is a :class:`ConfigError` naming the problem."""
        try:
            if len(text) > MAX_SERIALISED_BYTES * 2:
                raise ValueError(f"{len(text)} bytes is longer than any configuration skipinject writes")
            if text.startswith(_COMPRESSED):
                decompressor = zlib.decompressobj()
                raw = decompressor.decompress(base64.b85decode(text[len(_COMPRESSED) :]), MAX_EXPANDED_BYTES + 1)
                if decompressor.unconsumed_tail or len(raw) > MAX_EXPANDED_BYTES:
                    limit = MAX_EXPANDED_BYTES
                    raise ValueError(
                        f"compressed configuration expands beyond {limit} bytes, more than skipinject writes"
                    )
                text = raw.decode()
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("version") != SERIAL_VERSION:
                version = data.get("version") if isinstance(data, dict) else None
                raise ConfigError(f"serialised config has version {version!r}, expected {SERIAL_VERSION}")
            sources = data.get("sources") or {}
            if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
                raise ValueError("plugin sources are not a mapping of names to module paths")
            plugins = data.get("plugins")
            if plugins is not None and not isinstance(plugins, str):
                raise ValueError("plugins is not a string")
            roles_data = data["roles"]
            if not isinstance(roles_data, dict):
                raise ValueError("roles is not a mapping")
            triggers = data.get("triggers") or []
            if not isinstance(triggers, list) or not all(isinstance(t, str) and t.isidentifier() for t in triggers):
                raise ValueError("triggers is not a list of package names")
            roles = {str(name): _serialised_role(str(name), values) for name, values in roles_data.items()}
            return cls(plugins=plugins, plugin_sources=sources, roles=roles, triggers=tuple(triggers))
        except ConfigError as exc:
            raise ConfigError(f"cannot read the serialised skipinject config: {exc}") from exc
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, zlib.error) as exc:
            raise ConfigError(f"cannot read the serialised skipinject config: {type(exc).__name__}: {exc}") from exc


def _plain_value(value: Any) -> Any:
    """A setting as JSON: steps as ranges, enums by value, the rest as they are."""
    if isinstance(value, StepSet):
        return value.format()
    if isinstance(value, enum.Enum):
        return value.value
    return value


def _serialised_role(name: str, values: Any) -> RoleConfig:
    """A role as :meth:`Config.to_json` wrote it, checked strictly without OmegaConf (children start fast):
    every key of :class:`RoleConfig`, each by its declared check."""
    if not isinstance(values, dict) or set(values) != set(ROLE_KEYS):
        raise ValueError(f"role {name!r} does not have exactly the keys {', '.join(ROLE_KEYS)}")
    if not isinstance(values["steps"], str):
        raise ValueError(f"skip.{name}.steps is not a step list")
    try:
        return RoleConfig(**{**values, "steps": StepSet.parse(values["steps"], f"skip.{name}.steps")})
    except ValueError as exc:  # RoleConfig's checks name the key
        raise ValueError(f"skip.{name}.{exc}") from None
