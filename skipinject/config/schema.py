"""The ``skip.<role>.*`` schema (:class:`RoleConfig`: each key, its default and its check) and a run's
:class:`Config`, which travels to child processes as :meth:`Config.to_json` in ``SKIPINJECT_CONFIG``."""

from __future__ import annotations

import base64
import enum
import functools
import json
import os
import zlib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, make_dataclass, replace
from typing import TYPE_CHECKING, Any

from skipinject.config.steps import StepSet
from skipinject.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    from skipinject.dump_root import DumpRoot

DEFAULT_DUMP_DIR = "~/.verl/rollout_dump"
#: Longest ``dump_dir`` accepted: Linux's PATH_MAX (a longer path cannot be opened anyway).
MAX_PATH_CHARS = 4096
#: Most batches ``reuse_hit_memory`` may keep (:data:`skipinject.store.hit_memory.MAX_SLOTS`).
MAX_HIT_MEMORY = 16


class _Choice(str, enum.Enum):
    def __str__(self) -> str:
        return str(self.value)


class Action(_Choice):
    """What a chosen step does (``skip.<role>.action``)."""

    cache = "cache"  # own step cached -> load it, else run and save
    repeat = "repeat"  # exact step, else the largest cached below, else the smallest above
    strict = "strict"  # like cache, but a missing or unusable cache stops the run
    match = "match"  # rows served by their inputs from any cached step, only the others generated
    refresh = "refresh"  # generate and save again, replacing what is cached (never served)


class MismatchPolicy(_Choice):
    """What a hit generated from other inputs than this call's does (``skip.<role>.on_mismatch``)."""

    warn = "warn"
    regenerate = "regenerate"
    fail = "fail"


class RescorePolicy(_Choice):
    """Whether a served result is scored again by this run's code (``skip.<role>.rescore``): the rollout
    roles' rewards, which verl >= 0.7 computes inside the rollout."""

    auto = "auto"  # when what scored it differs from this run's (or is unknown)
    always = "always"
    never = "never"


class WeightSyncPolicy(_Choice):
    """Whether the trainer's weight sync into the rollout engine waits while the coming generation is served
    (``skip.<role>.defer_weight_sync``): carried out, once, before anything needs the engine again."""

    auto = "auto"  # deferred where the role's trainer allows it exactly (colocated, sync generation)
    never = "never"  # every sync carried out when verl makes it


_BOOLEAN = "expected true or false"


def _setting(default: Any, expected: str = _BOOLEAN, check: Callable[[Any], None] | None = None) -> Any:
    """A field of :class:`RoleConfig`, typed as its default; ``check`` raises ``ValueError`` with the reason."""
    return field(default=default, metadata={"expected": expected, "check": check})


class InvalidSetting(ValueError):
    """A value :class:`RoleConfig` refuses: ``key=value: reason``."""

    def __init__(self, key: str, value: Any, reason: str) -> None:
        super().__init__(f"{key}={_show(repr(value))}: {reason}")
        self.key = key
        self.reason = reason


def _directory_path(value: Any) -> None:
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise ValueError("expected a directory path")
    if len(value) > MAX_PATH_CHARS:
        raise ValueError(f"{len(value)} characters, longer than any path ({MAX_PATH_CHARS}); expected a directory path")


_COMPRESSIONS = "expected auto, none, zstd or zstd-1 .. zstd-22"


def _compression(value: Any) -> None:
    if value == "auto":  # the default: no import at start-up
        return
    from skipinject.payload import COMPRESSION_VALUE

    if not isinstance(value, str) or not COMPRESSION_VALUE.fullmatch(value):
        raise ValueError(_COMPRESSIONS)


_BATCHES = f"expected a number of batches, 0 .. {MAX_HIT_MEMORY}"


def _batches(value: Any) -> None:
    if type(value) is not int or not 0 <= value <= MAX_HIT_MEMORY:
        raise ValueError(_BATCHES)


@dataclass(frozen=True)
class RoleConfig:
    """The validated settings of one role: every ``skip.<role>`` key, once, with its check and message (the
    schema, the transport and the runner's help come from here). The first four are upstream's keys."""

    enable: bool = _setting(False)
    dump_dir: str = _setting(DEFAULT_DUMP_DIR, "expected a directory path", _directory_path)
    steps: StepSet = _setting(StepSet(), "expected a list of steps (e.g. [1,2,3] or 1-128)")  # noqa: RUF009
    action: Action = _setting(Action.cache, f"unknown action (choose one of {', '.join(Action)})")  # noqa: RUF009
    #: Load verl's own pickled caches (``gen_batch.dp``, ``tq_batch.pt``): they run code when loaded.
    trust_upstream: bool = _setting(False)
    on_mismatch: MismatchPolicy = _setting(MismatchPolicy.warn, f"expected one of {', '.join(MismatchPolicy)}")  # noqa: RUF009
    #: Load from cache directories other users can write to or own (ssh's StrictModes, switched off).
    trust_dir_permissions: bool = _setting(False)
    compression: str = _setting("auto", _COMPRESSIONS, _compression)
    reuse_hit_memory: int = _setting(2, _BATCHES, _batches)
    read_ahead: bool = _setting(True)
    rescore: RescorePolicy = _setting(RescorePolicy.auto, f"expected one of {', '.join(RescorePolicy)}")  # noqa: RUF009
    save: bool = _setting(True)
    defer_weight_sync: WeightSyncPolicy = _setting(  # noqa: RUF009
        WeightSyncPolicy.auto, f"expected one of {', '.join(WeightSyncPolicy)}"
    )

    def __post_init__(self) -> None:
        # Plain values from code (``steps=(1, 2)``, ``action="repeat"``) taken as the schema would, then checked.
        if not isinstance(self.steps, StepSet):
            object.__setattr__(self, "steps", StepSet.from_value(list(self.steps), "steps"))
        for f in fields(self):
            value, kind = getattr(self, f.name), type(f.default)
            try:
                if issubclass(kind, enum.Enum):
                    object.__setattr__(self, f.name, kind(value))
                elif kind is bool and type(value) is not bool:
                    raise ValueError(_BOOLEAN)
                elif f.metadata["check"] is not None:
                    f.metadata["check"](value)
            except ValueError as exc:
                reason = f.metadata["expected"] if issubclass(kind, enum.Enum) else str(exc)
                raise InvalidSetting(f.name, value, reason) from None

    @functools.cached_property
    def root(self) -> DumpRoot:
        """``dump_dir`` parsed, once: the root the engine opens this role's stores under."""
        from skipinject.dump_root import DumpRoot  # at the first call (a child only reads its settings)

        return DumpRoot.parse(self.dump_dir)

    def allows(self, step: int | None) -> bool:
        """The role may act on ``step`` (enabled and the step chosen)."""
        return self.enable and step is not None and step in self.steps


_FIELDS = {f.name: f for f in fields(RoleConfig)}
ROLE_KEYS = tuple(_FIELDS)


@functools.cache
def role_schema() -> Any:
    """The keys of ``skip.<role>`` and their defaults as OmegaConf validates them (the runner's
    only, made at first use): :class:`RoleConfig`'s, but ``steps``, read by skipinject itself (ranges stay ranges)."""
    return make_dataclass(
        "RoleSchema",
        [
            (f.name, Any, field(default_factory=list)) if f.name == "steps" else (f.name, type(f.default), f.default)
            for f in fields(RoleConfig)
        ],
    )


def choices(key: str) -> tuple[str, ...]:
    """The values an enum key takes (``action``: cache, repeat, strict), else ``()``."""
    default = _FIELDS[key].default
    return tuple(member.value for member in type(default)) if isinstance(default, enum.Enum) else ()


def role_config(
    role: str, values: Mapping[str, Any], base: RoleConfig | None = None, *, texts: Mapping[str, str] | None = None
) -> RoleConfig:
    """Validate plain values for ``skip.<role>``; errors name the key and quote ``texts`` (what was typed)."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"skip.{role}: expected a mapping of keys to values, got {type(values).__name__}")
    from omegaconf import Container, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    node = OmegaConf.structured(role_schema())
    changes: dict[str, Any] = {}
    shown: dict[str, str] = {}
    for raw_key, value in values.items():
        key = str(raw_key)
        dotted = f"skip.{role}.{_show(key)}"
        if key not in ROLE_KEYS:
            raise ConfigError(
                f"{dotted}: unknown key {key!r} (known: {', '.join(ROLE_KEYS)}){did_you_mean(key, ROLE_KEYS)}"
            )
        if key == "steps":  # read by StepSet itself (ranges stay ranges); its errors name the key
            plain = OmegaConf.to_container(value, resolve=True) if isinstance(value, Container) else value
            changes[key] = StepSet.from_value(plain, dotted)
            continue
        shown[key] = _show((texts or {}).get(key, value))
        try:
            _plain_enough(key, value)
            node[key] = value  # OmegaConf converts to the key's type: True/yes/1, enum names
        except (OmegaConfBaseException, ValueError, TypeError) as exc:  # not of the key's type
            reason = _FIELDS[key].metadata["expected"] + did_you_mean(value, choices(key))
            raise ConfigError(f"{dotted}={shown[key]}: {reason}") from exc
        changes[key] = node[key]
    try:
        config = replace(base or RoleConfig(), **changes)
    except InvalidSetting as exc:  # of the key's type, but not a value the key takes
        raise ConfigError(f"skip.{role}.{exc.key}={shown[exc.key]}: {exc.reason}") from None
    if "dump_dir" in changes:  # a URL's protocol: imports fsspec, so only for what a user gave
        try:
            root = config.root
        except ConfigError as exc:
            raise ConfigError(f"skip.{role}.dump_dir={shown['dump_dir']}: {exc}") from None
        root.check(f"skip.{role}.dump_dir")
    return config


def _plain_enough(key: str, value: Any) -> None:
    """Refuse what OmegaConf would coerce silently: any number as a boolean (``enable=2``), any object's
    ``str()`` as a path (``dump_dir=object()``). ``0``/``1`` and OmegaConf's words stay booleans, and a
    number typed on the command line stays a directory's name."""
    kind = type(_FIELDS[key].default)
    if kind is bool and not (isinstance(value, (bool, str)) or (type(value) is int and value in (0, 1))):
        raise ValueError(_BOOLEAN)
    if kind is str and not isinstance(value, (str, os.PathLike)) and type(value) is not int:
        raise ValueError(_FIELDS[key].metadata["expected"])


def _show(value: Any) -> str:
    text = value if isinstance(value, str) and value.isprintable() else repr(value)  # one line, no escapes
    return text if len(text) <= 200 else text[:200] + "..."


#: Largest serialised configuration handed to children, well inside Linux's 128 KiB MAX_ARG_STRLEN.
MAX_SERIALISED_BYTES = 64 << 10
#: Largest text before compression: written at most, so a reader stops decompressing there (zip bombs).
MAX_EXPANDED_BYTES = 512 << 10
_COMPRESS_ABOVE = 4 << 10
_COMPRESSED = "z1:"
SERIAL_VERSION = 2


@dataclass(frozen=True)
class Config:
    """Which plugins load and each role's settings."""

    #: Plugins to load, as a ``VERL_SKIP_PLUGINS`` selection (``None``: every installed plugin).
    plugins: str | None = None
    #: Where the chosen plugins come from (name -> ``module[:attr]``): children import them without a scan.
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
        from skipinject.dump_root import anchored

        roles = {
            name: asdict(cfg) | {"steps": cfg.steps.format(), "dump_dir": anchored(cfg.dump_dir)}
            for name, cfg in self.roles.items()
        }
        body = {
            "version": SERIAL_VERSION,
            "plugins": self.plugins,
            "sources": dict(self.plugin_sources),
            "triggers": list(self.triggers),
            "roles": roles,  # the enums are ``str``s: JSON writes their values
        }
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
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
        """Read :meth:`to_json` back; anything else is a :class:`ConfigError`."""
        try:
            if len(text) > MAX_SERIALISED_BYTES * 2:
                raise ValueError(f"{len(text)} bytes is longer than any configuration skipinject writes")
            if text.startswith(_COMPRESSED):
                raw = zlib.decompressobj().decompress(
                    base64.b85decode(text[len(_COMPRESSED) :]), MAX_EXPANDED_BYTES + 1
                )
                if len(raw) > MAX_EXPANDED_BYTES:  # stopped one byte past the limit: a zip bomb stops there too
                    limit = MAX_EXPANDED_BYTES
                    raise ValueError(
                        f"compressed configuration expands beyond {limit} bytes, more than skipinject writes"
                    )
                text = raw.decode()
            data = json.loads(text)
            version = data.get("version") if isinstance(data, dict) else None
            if version != SERIAL_VERSION:
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


def _serialised_role(name: str, values: Any) -> RoleConfig:
    """A role as :meth:`Config.to_json` wrote it, checked strictly without OmegaConf (children start fast)."""
    if not isinstance(values, dict) or set(values) != set(ROLE_KEYS):
        raise ValueError(f"role {name!r} does not have exactly the keys {', '.join(ROLE_KEYS)}")
    if not isinstance(values["steps"], str):
        raise ValueError(f"skip.{name}.steps is not a step list")
    try:
        return RoleConfig(**{**values, "steps": StepSet.parse(values["steps"], f"skip.{name}.steps")})
    except ValueError as exc:  # RoleConfig's checks name the key
        raise ValueError(f"skip.{name}.{exc}") from None
