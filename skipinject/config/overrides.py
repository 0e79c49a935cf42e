"""Reading ``skip.*`` settings: Hydra-style overrides (OmegaConf's dotlist grammar) and a ``--skip-config``
YAML file. YAML is first read as events (:func:`check_yaml`) and refused at an anchor or alias, or past
:data:`MAX_DEPTH` levels or :data:`MAX_NODES` values, so aliases never expand and a refusal costs little.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from skipinject.config.schema import Config, role_config
from skipinject.errors import ConfigError, did_you_mean

_OVERRIDE = re.compile(r"^\+{0,2}skip\.(?P<rest>.*)$", re.DOTALL)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: A settings file larger than this is not a settings file.
MAX_FILE_BYTES = 1 << 20


def split_overrides(argv: Sequence[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Separate ``[+|++]skip.<...>=value`` items from the rest of a program's arguments."""
    ours: list[tuple[str, str]] = []
    rest: list[str] = []
    for arg in argv:
        match = _OVERRIDE.match(arg)
        if match is None and arg.startswith("~skip."):  # Hydra's deletion: a skip.* key has no value to delete
            raise ConfigError(f"{arg}: removing a setting is not supported; leave it out to keep its default")
        if match is None:
            rest.append(arg)
            continue
        key, sep, value = match.group("rest").partition("=")
        if not sep:
            raise ConfigError(f"skip.{key}: expected skip.<role>.<key>=<value>")
        ours.append((f"skip.{key}", value))
    return ours, rest


def parse_overrides(
    overrides: Iterable[tuple[str, str]],
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, str]]]:
    """``[("skip.rollout.enable", "True")]`` -> ``{"rollout": {"enable": True}}`` (OmegaConf's values),
    and what was typed for each key (for error messages; ``steps`` are read from that text)."""
    from omegaconf import OmegaConf

    roles: dict[str, dict[str, Any]] = {}
    texts: dict[str, dict[str, str]] = {}
    for dotted, raw in overrides:
        parts = dotted.split(".")
        if len(parts) != 3 or not all(_NAME.match(p) for p in parts[1:]):
            raise ConfigError(f"{dotted}={raw}: expected skip.<role>.<key>=<value>")
        _, role, key = parts
        texts.setdefault(role, {})[key] = raw
        if key != "steps":
            check_yaml(raw, f"{dotted}={raw}")
        try:
            if key == "steps":  # read as text by StepSet (ranges stay ranges); interpolations resolve as in YAML
                value: Any = raw.strip()
                if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                    value = value[1:-1]
                if "${" in value:
                    value = OmegaConf.create({"v": value})["v"]
            else:
                parsed = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]), resolve=True)
                value = cast("dict[str, Any]", parsed)["v"]
        except Exception as exc:  # OmegaConf's grammar errors, and YAML's underneath
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"{dotted}={raw}: cannot parse the value ({reason})") from exc
        roles.setdefault(role, {})[key] = value
    return roles, texts


def load_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """The ``skip:`` mapping (``{role: {key: value}}``) of a YAML settings file, read bounded (a FIFO never
    blocks) and checked by :func:`check_yaml` before OmegaConf parses it."""
    from omegaconf import OmegaConf

    text = _read_settings(Path(path), f"--skip-config {path}")
    check_yaml(text, f"--skip-config {path}", "cannot read it")
    try:
        loaded = OmegaConf.to_container(OmegaConf.create(text), resolve=True)
    except Exception as exc:  # OmegaConf's errors, YAML's underneath
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(f"--skip-config {path}: cannot read it ({reason[:300]})") from exc
    if not isinstance(loaded, Mapping) or set(loaded) != {"skip"} or not isinstance(loaded["skip"], Mapping):
        raise ConfigError(f"--skip-config {path}: expected one top-level mapping `skip:` of roles")
    roles: dict[str, dict[str, Any]] = {}
    for role, values in loaded["skip"].items():
        if not isinstance(role, str) or not _NAME.match(role):
            shown = role if isinstance(role, str) and role.isprintable() else repr(role)
            raise ConfigError(f"--skip-config {path}: skip.{shown}: not a role name")
        if not isinstance(values, Mapping):
            raise ConfigError(f"skip.{role}: expected a mapping of keys to values, got {type(values).__name__}")
        roles[role] = {str(k): v for k, v in values.items()}
    return roles


def _read_settings(where: Path, shown: str) -> str:
    """A settings file's text: a regular file (checked on the opened descriptor), bounded, UTF-8."""
    import os
    import stat

    try:
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(f"{shown}: no such file") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise ConfigError(f"{shown}: cannot open it ({getattr(exc, 'strerror', None) or exc})") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            from skipinject.store import file_kind

            raise ConfigError(f"{shown}: {file_kind(mode)}, not a settings file")
        data = os.read(fd, MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{shown}: cannot read it ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{shown}: larger than {MAX_FILE_BYTES} bytes; not a settings file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{shown}: not UTF-8 text (byte {exc.start})") from exc


def apply_settings(
    base: Config,
    layer: Mapping[str, Mapping[str, Any]],
    known_roles: Iterable[str],
    *,
    hint: str | Callable[[str], str] = "",
    texts: Mapping[str, Mapping[str, str]] | None = None,
) -> Config:
    """``base`` with ``{role: {key: value}}`` merged in key by key; unknown roles or keys are errors (``hint``, or
    ``hint(role)``, ends the line of an unknown role)."""
    if not isinstance(layer, Mapping):
        raise ConfigError(f"settings: a mapping of roles to their settings, not {type(layer).__name__}{hint}")
    known = set(known_roles)
    roles = dict(base.roles)
    for role, values in layer.items():
        if role not in known:
            listed = ", ".join(sorted(known)) or "none"
            first, more = next(iter(values), "enable"), hint(role) if callable(hint) else hint
            raise ConfigError(
                f"skip.{role}.{first}: unknown role {role!r} (loaded roles: {listed}{more}){did_you_mean(role, known)}"
            )
        roles[role] = role_config(role, values, roles.get(role), texts=(texts or {}).get(role))
    return Config(plugins=base.plugins, plugin_sources=base.plugin_sources, roles=roles)


def apply_overrides(
    base: Config,
    overrides: Iterable[tuple[str, str]],
    known_roles: Iterable[str],
    *,
    hint: str | Callable[[str], str] = "",
) -> Config:
    """``base`` with parsed ``skip.<role>.<key>=value`` pairs applied (see :func:`apply_settings`)."""
    layer, texts = parse_overrides(overrides)
    return apply_settings(base, layer, known_roles, hint=hint, texts=texts)


#: Nesting and values a settings document may have (``skip: role: key: [steps]``; ranges keep lists short).
MAX_DEPTH = 16
MAX_NODES = 10_000


def check_yaml(text: str, where: str, failure: str = "cannot parse the value") -> None:
    """Refuse (one line naming ``where`` and the key being read) YAML with anchors or aliases, nested over
    :data:`MAX_DEPTH` deep or over :data:`MAX_NODES` values; a syntax error is ``{where}: {failure} (YAML: ...)``."""
    import yaml  # type: ignore[import-untyped]

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    open_: list[list[Any]] = []  # per open collection: [is a mapping, nodes read in it, the key being read]
    nodes = 0

    def at() -> str:
        named = [key for is_mapping, _, key in open_ if is_mapping and key is not None]
        return f"{where}: {'.'.join(named)}" if named else where

    try:
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.AliasEvent):
                raise ConfigError(f"{at()}: YAML aliases (*{event.anchor}) are not accepted in settings")
            if isinstance(event, yaml.CollectionEndEvent):
                open_.pop()
            if not isinstance(event, yaml.NodeEvent):
                continue
            if event.anchor is not None:
                raise ConfigError(f"{at()}: YAML anchors (&{event.anchor}) are not accepted in settings")
            nodes += 1
            if nodes > MAX_NODES:
                raise ConfigError(
                    f"{at()}: more than {MAX_NODES} YAML values; not a settings file "
                    "(write long step lists as ranges like 1-128)"
                )
            if open_ and open_[-1][0]:  # in a mapping: keys and values take turns
                if open_[-1][1] % 2 == 0 and isinstance(event, yaml.ScalarEvent):
                    open_[-1][2] = str(event.value)[:100]
                open_[-1][1] += 1
            if isinstance(event, yaml.CollectionStartEvent):
                if len(open_) >= MAX_DEPTH:
                    raise ConfigError(f"{at()}: YAML nested more than {MAX_DEPTH} levels deep")
                open_.append([isinstance(event, yaml.MappingStartEvent), 0, None])
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())[:200]
        raise ConfigError(f"{where}: {failure} (YAML: {problem})") from None
