"""The ``skip.<role>.<key>`` configuration: parsing, strict validation, serialisation.

Overrides are taken out of the program's argv by the runner (verl never sees them), validated
before the program starts, and handed to child processes as JSON in an environment variable.
"""

from __future__ import annotations

import itertools
import json
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from skipinject.errors import ConfigError

ACTIONS = ("cache", "repeat", "strict")
MISMATCH_POLICIES = ("warn", "regenerate", "fail")
DEFAULT_DUMP_DIR = "~/.verl/rollout_dump"
#: Largest step accepted (steps are held as a tuple; ``0-1000000`` is ~40 MB and ~0.1 s to build).
MAX_STEP = 1_000_000

_OVERRIDE = re.compile(r"^(?P<prefix>\+{0,2})skip\.(?P<rest>.*)$", re.DOTALL)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_STEP_ITEM = re.compile(r"([0-9]+)(?:\s*-\s*([0-9]+))?")


@dataclass(frozen=True)
class RoleConfig:
    """Settings of one role. The first four keys and their defaults are upstream's."""

    enable: bool = False
    dump_dir: str = DEFAULT_DUMP_DIR
    steps: tuple[int, ...] = ()
    action: str = "cache"
    #: Load upstream pickled caches (``gen_batch.dp``, ``tq_batch.pt``): they run code when loaded.
    trust_upstream: bool = False
    #: What to do when a cached result was produced from other inputs than this call's.
    on_mismatch: str = "warn"

    def allows(self, step: int | None) -> bool:
        return self.enable and step is not None and step in self._step_set

    @property
    def _step_set(self) -> frozenset[int]:
        cached = self.__dict__.get("_steps_frozen")
        if cached is None:
            cached = frozenset(self.steps)
            object.__setattr__(self, "_steps_frozen", cached)
        return cached


ROLE_KEYS = tuple(f.name for f in fields(RoleConfig))


@dataclass(frozen=True)
class Config:
    """The resolved configuration of a run: which plugins load and each role's settings."""

    plugins: str | None = None
    roles: Mapping[str, RoleConfig] = field(default_factory=dict)

    def role(self, name: str) -> RoleConfig:
        return self.roles.get(name, RoleConfig())

    @property
    def enabled_roles(self) -> list[str]:
        return [name for name, cfg in self.roles.items() if cfg.enable]

    def to_json(self) -> str:
        """Compact JSON (it travels in an environment variable: steps are written as ranges)."""
        roles = {
            name: {**{f.name: getattr(cfg, f.name) for f in fields(cfg)}, "steps": format_steps(cfg.steps)}
            for name, cfg in self.roles.items()
        }
        return json.dumps({"version": 1, "plugins": self.plugins, "roles": roles}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Config:
        try:
            data = json.loads(text)
            if data.get("version") != 1:
                raise ConfigError(f"serialised config has version {data.get('version')!r}, expected 1")
            roles = {name: role_config_from_mapping(name, values) for name, values in data["roles"].items()}
            return cls(plugins=data.get("plugins"), roles=roles)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"cannot read the serialised skipinject config: {exc}") from exc


def role_config_from_mapping(role: str, values: Mapping[str, Any]) -> RoleConfig:
    """Build a validated RoleConfig from plain values (YAML/JSON/OmegaConf), naming any bad key."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"skip.{role}: expected a mapping of keys to values, got {type(values).__name__}")
    cfg = RoleConfig()
    for key, value in values.items():
        cfg = _with_value(cfg, role, str(key), value)
    return cfg


def split_overrides(argv: Sequence[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Separate ``[+|++]skip.<...>=value`` items from the rest of a program's arguments."""
    ours: list[tuple[str, str]] = []
    rest: list[str] = []
    for arg in argv:
        match = _OVERRIDE.match(arg)
        if match is None:
            rest.append(arg)
            continue
        key, sep, value = match.group("rest").partition("=")
        if not sep:
            raise ConfigError(f"skip.{key}: expected skip.<role>.<key>=<value>")
        ours.append((f"skip.{key}", value))
    return ours, rest


def apply_overrides(
    base: Config, overrides: Iterable[tuple[str, str]], known_roles: Iterable[str], *, hint: str = ""
) -> Config:
    """Apply parsed ``skip.<role>.<key>=value`` pairs to ``base``; unknown roles or keys are errors."""
    known = set(known_roles)
    roles = dict(base.roles)
    for dotted, raw in overrides:
        parts = dotted.split(".")
        if len(parts) != 3 or not all(_NAME.match(p) for p in parts[1:]):
            raise ConfigError(f"{dotted}={raw}: expected skip.<role>.<key>=<value>")
        _, role, key = parts
        if role not in known:
            listed = ", ".join(sorted(known)) or "none"
            raise ConfigError(f"{dotted}: unknown role {role!r} (loaded roles: {listed}){hint}")
        roles[role] = _with_value(roles.get(role, RoleConfig()), role, key, parse_value(key, raw, dotted))
    return replace(base, roles=roles)


def parse_value(key: str, raw: str, dotted: str) -> Any:
    """Turn the text of an override into a typed value for ``key``."""
    text = _unquote(raw.strip())
    if key == "steps":
        return parse_steps(text, dotted)
    if key in ("enable", "trust_upstream"):
        lowered = text.lower()
        if lowered in ("true", "false"):
            return lowered == "true"
        raise ConfigError(f"{dotted}={raw}: expected true or false")
    return text


def parse_steps(text: str, dotted: str = "steps") -> tuple[int, ...]:
    """Parse ``[1,2,3]``, ``1-128``, ``[1-4,10]``, ``7`` or ``[]`` into sorted unique steps."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    elif "[" in body or "]" in body:
        raise ConfigError(f"{dotted}={text}: unbalanced brackets")
    spans: list[tuple[int, int]] = []
    for item in (piece.strip() for piece in body.split(",")):
        if not item:
            if body.strip():
                raise ConfigError(f"{dotted}={text}: empty item in the step list")
            continue
        match = _STEP_ITEM.fullmatch(item)
        if match is None:
            raise ConfigError(f"{dotted}={text}: {item!r} is not a step (integers >= 0 or ranges like 1-128)")
        low_text, high_text = (n.lstrip("0") or "0" for n in (match.group(1), match.group(2) or match.group(1)))
        for number in (low_text, high_text):
            if len(number) > len(str(MAX_STEP)) or int(number) > MAX_STEP:
                raise ConfigError(f"{dotted}={text}: step {number[:20]} is larger than {MAX_STEP}")
        low, high = int(low_text), int(high_text)
        if low > high:
            raise ConfigError(f"{dotted}={text}: range {item!r} goes backwards")
        spans.append((low, high))
    return _expand(spans)


def _expand(spans: Iterable[tuple[int, int]]) -> tuple[int, ...]:
    merged: list[list[int]] = []
    for low, high in sorted(spans):
        if merged and low <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], high)
        else:
            merged.append([low, high])
    return tuple(itertools.chain.from_iterable(range(low, high + 1) for low, high in merged))


def format_steps(steps: Iterable[int]) -> str:
    """The shortest text :func:`parse_steps` reads back as ``steps`` (``[1-4,10]``)."""
    ordered = steps if isinstance(steps, tuple) and _increasing(steps) else tuple(sorted(set(steps)))
    runs = []
    start, count = 0, len(ordered)
    while start < count:  # a run ends where ordered[j] - j changes (it never decreases): binary search
        low, high, base = start, count - 1, ordered[start] - start
        while low < high:
            middle = (low + high + 1) // 2
            if ordered[middle] - middle == base:
                low = middle
            else:
                high = middle - 1
        first, last = ordered[start], ordered[low]
        runs.append(str(first) if first == last else f"{first}-{last}")
        start = low + 1
    return "[" + ",".join(runs) + "]"


def _increasing(steps: tuple[int, ...]) -> bool:
    return all(map(operator.lt, steps, itertools.islice(steps, 1, None)))


def _with_value(cfg: RoleConfig, role: str, key: str, value: Any) -> RoleConfig:
    dotted = f"skip.{role}.{key}"
    if key not in ROLE_KEYS:
        raise ConfigError(f"{dotted}: unknown key {key!r} (known: {', '.join(ROLE_KEYS)})")
    if key in ("enable", "trust_upstream"):
        if not isinstance(value, bool):
            raise ConfigError(f"{dotted}={value!r}: expected true or false")
    elif key == "dump_dir":
        if not isinstance(value, str) or not value.strip() or "\x00" in value:
            raise ConfigError(f"{dotted}={value!r}: expected a directory path")
    elif key == "steps":
        value = _coerce_steps(value, dotted)
    elif key == "action":
        if value not in ACTIONS:
            raise ConfigError(f"{dotted}={value!r}: unknown action (choose one of {', '.join(ACTIONS)})")
    elif key == "on_mismatch" and value not in MISMATCH_POLICIES:
        raise ConfigError(f"{dotted}={value!r}: expected one of {', '.join(MISMATCH_POLICIES)}")
    return replace(cfg, **{key: value})


def _coerce_steps(value: Any, dotted: str) -> tuple[int, ...]:
    if isinstance(value, str):
        return parse_steps(value, dotted)
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, Sequence) or isinstance(value, (bytes, bytearray)):
        raise ConfigError(f"{dotted}={value!r}: expected a list of steps")
    steps: set[int] = set()
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0 or item > MAX_STEP:
            raise ConfigError(f"{dotted}={value!r}: {item!r} is not a step (integers 0..{MAX_STEP})")
        steps.add(item)
    return tuple(sorted(steps))


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text
