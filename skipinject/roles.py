"""What a role is: plain data a plugin returns (targets, step source, phase, codec); the engine does the rest."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from skipinject.clock import CLOCK
from skipinject.errors import TargetError
from skipinject.verl.compat import STEP_KEY, default_bypass, run_config_of

if TYPE_CHECKING:
    from pathlib import Path

    from skipinject.config import RoleConfig
    from skipinject.store import Payload, StepEntry, StepStore

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True)
class TargetPath:
    """``package.module:Qualified.name`` split into its module and attribute path."""

    module: str
    qualname: str

    @classmethod
    def parse(cls, text: str) -> TargetPath:
        if not isinstance(text, str):
            raise TargetError(f"target {text!r} is not a string of the form package.module:Qualified.name")
        module, sep, qualname = text.partition(":")
        if not sep or not _DOTTED.fullmatch(module) or not _DOTTED.fullmatch(qualname):
            raise TargetError(
                f"target {text!r} is not of the form package.module:Qualified.name "
                "(e.g. verl.experimental.agent_loop.agent_loop:AgentLoopManager.generate_sequences)"
            )
        return cls(module, qualname)

    def __str__(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclass
class Call:
    """One intercepted call: the bound instance (``None`` for functions) and its arguments."""

    target: str
    function: Callable[..., Any]
    instance: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def argument(self, name: str) -> Any:
        """The value of parameter ``name`` as the target received it, or ``None``."""
        if name in self.kwargs:
            return self.kwargs[name]
        try:
            params = [p for p in inspect.signature(self.function).parameters if p not in ("self", "cls")]
        except (TypeError, ValueError):
            return None
        index = params.index(name) if name in params else len(self.args)
        return self.args[index] if index < len(self.args) else None

    def with_batch(self, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments with its batch (see :attr:`batch`) replaced by ``batch``."""
        if self.args:
            return (batch, *self.args[1:]), dict(self.kwargs)
        kwargs = dict(self.kwargs)
        if kwargs:
            kwargs[next(iter(kwargs))] = batch
        return (), kwargs

    @property
    def run_config(self) -> Any:
        """The verl config of the run: the bound instance's, else the trainer clock's (or ``None``)."""
        return run_config_of(self)

    @property
    def batch(self) -> Any:
        """The first argument: by verl convention the batch (``prompts``, ``data``)."""
        return self.args[0] if self.args else next(iter(self.kwargs.values()), None)


@dataclass(frozen=True)
class StepSource:
    """Where a call's step comes from (docs/plugins.md); sources are tried in order, the first integer wins."""

    kind: str
    name: str = ""
    extractor: Callable[[Call], int | None] | None = None
    fallbacks: tuple[StepSource, ...] = ()

    @classmethod
    def meta(cls, key: str = STEP_KEY) -> StepSource:
        return cls("meta", key)

    @classmethod
    def argument(cls, name: str) -> StepSource:
        return cls("argument", name)

    @classmethod
    def attribute(cls, name: str) -> StepSource:
        return cls("attribute", name)

    @classmethod
    def clock(cls, name: str = STEP_KEY) -> StepSource:
        return cls("clock", name)

    @classmethod
    def per_call(cls, extractor: Callable[[Call], int | None]) -> StepSource:
        return cls("extractor", getattr(extractor, "__name__", "extractor"), extractor)

    def or_else(self, *others: StepSource) -> StepSource:
        return StepSource(self.kind, self.name, self.extractor, self.fallbacks + others)

    def resolve(self, call: Call) -> int | None:
        for source in (self, *self.fallbacks):
            value = source._value(call)
            if value is not None and not isinstance(value, bool):
                try:
                    return int(value)
                except (TypeError, ValueError):
                    pass
        return None

    def _value(self, call: Call) -> Any:
        if self.kind == "meta":
            meta = getattr(call.batch, "meta_info", None)
            return meta.get(self.name) if isinstance(meta, Mapping) else None
        if self.kind == "argument":
            return call.argument(self.name)
        if self.kind in ("attribute", "clock"):
            return getattr(call.instance if self.kind == "attribute" else CLOCK.instance, self.name, None)
        return self.extractor(call) if self.kind == "extractor" and self.extractor is not None else None

    def describe(self) -> str:
        return " or ".join(f"{s.kind}:{s.name}" for s in (self, *self.fallbacks))


@runtime_checkable
class Codec(Protocol):
    """A role's result to a :class:`~skipinject.store.Payload` and back; ``decode`` raises
    :class:`~skipinject.errors.CodecError` when a cache does not fit the call (the target then runs)."""

    def encode(self, result: Any) -> Payload: ...

    def decode(self, payload: Payload, call: Call) -> Any: ...


@runtime_checkable
class MergingCodec(Codec, Protocol):
    """A codec whose results of several parts of one step make one result again."""

    def merge(self, results: Sequence[Any]) -> Any: ...


@runtime_checkable
class RowCodec(Codec, Protocol):
    """A codec whose results are rows served one by one (``action=match``; each method: docs/plugins.md)."""

    def input_rows(self, call: Call) -> int: ...

    def result_rows(self, result: Any) -> int: ...

    def with_rows(self, call: Call, rows: Sequence[int]) -> tuple[tuple[Any, ...], dict[str, Any], int]: ...

    def select_rows(self, result: Any, rows: Sequence[int]) -> Any: ...

    def merge_rows(self, pieces: Sequence[Any], order: Sequence[int], call: Call) -> Any: ...


@dataclass
class Plan:
    """What the engine decided for one call: the entry to serve (or trusted upstream file), and why."""

    store: StepStore
    step: int
    entry: StepEntry | None = None
    upstream_file: Path | None = None
    upstream_format: UpstreamFormat | None = None
    reason: str = ""
    #: verl's own cache of the step, found but not loaded (``trust_upstream`` is false).
    untrusted_upstream: Path | None = None
    #: Whether a fresh result may be saved (not into a step directory another user controls).
    saves: bool = True

    @property
    def served_step(self) -> int:
        return self.entry.step if self.entry else self.step

    @property
    def serves(self) -> bool:
        return self.entry is not None or self.upstream_file is not None

    @property
    def source(self) -> Path | None:
        return self.entry.directory if self.entry is not None else self.upstream_file


@dataclass
class Loaded:
    """A planned step loaded (:meth:`PhaseContext.load`): one decoded result per recorded part (an upstream
    file: its one object), and ``value``, what the phase's ``prepare`` made of them."""

    plan: Plan
    results: list[Any]
    value: Any = None
    seconds: float = 0.0


class PhaseContext(Protocol):
    """What a phase may use of its role in this process (the engine provides it; each method: docs/phases.md)."""

    @property
    def name(self) -> str: ...

    @property
    def settings(self) -> RoleConfig: ...

    @property
    def codec(self) -> Codec: ...

    def once(self, key: Any, level: int, message: str, *args: Any) -> None: ...

    def store_for(self, call: Call) -> StepStore: ...

    def plan(self, call: Call, step: int) -> Plan: ...

    def load(self, call: Call, step: int, prepare: Callable[[Loaded], Any] | None = None) -> Loaded | None: ...

    def served(self, call: Call, step: int) -> bool | None: ...

    def notes(self, call: Call, step: int) -> dict[str, Any]: ...

    def record(self, call: Call, step: int, result: Any) -> int | None: ...

    def commit(
        self, call: Call, step: int, meta: Mapping[str, Any] | None = None, *, unit: str = "rows", note: str = ""
    ) -> None: ...

    def in_background(self, store: StepStore, job: Callable[[], None]) -> None: ...

    def row_keys(self, call: Call, digests: Sequence[str]) -> list[str]: ...

    def match_rows(self, call: Call, keys: list[str], group: int = 1) -> Any: ...

    def record_rows(self, call: Call, step: int, result: Any, keys: Sequence[str]) -> None: ...


class Phase(Protocol):
    """How one target's calls are handled once the step may skip (docs/phases.md); ``proceed()`` calls the
    original target, ``proceed(*args, **kwargs)`` with other arguments."""

    def run(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any: ...

    async def run_async(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any: ...


@dataclass(frozen=True)
class Target:
    """A function or method to patch, with the phase handling its calls (fields: docs/plugins.md);
    ``every_step``: the phase sees every call of an enabled role; ``before(call)``: called in this process
    right before the original runs (whatever the engine decided, validation included), never for a call
    served from the cache -- what must be ready when the target really runs (plugin API 1.6); ``overrides``
    (methods): subclasses' overrides are followed (``True``, or the check returns ``None``) or refused with
    the reason it returns."""

    path: str
    phase: Phase | None = None
    verl: str | None = None
    every_step: bool = False
    attribute: str | None = None
    before: Callable[[Call], None] | None = None
    overrides: bool | Callable[[type], str | None] = False

    def __post_init__(self) -> None:
        TargetPath.parse(self.path)
        if self.attribute is not None:
            TargetPath.parse(f"{self.path}.{self.attribute}")

    @property
    def label(self) -> str:
        """``path``, or ``path->attribute`` for attribute targets (as logs and ``--list`` name it)."""
        return f"{self.path}->{self.attribute}" if self.attribute else self.path


@dataclass(frozen=True)
class HitInfo:
    """What the engine knows about a cache hit, handed to :attr:`Role.on_hit`."""

    requested_step: int
    served_step: int
    load_seconds: float
    mismatched_rows: int = 0
    compared_rows: int = 0
    directory: str = ""
    #: The served step's ``meta.json`` (empty for verl's own files), with what :attr:`Role.record_meta` added.
    meta: Mapping[str, Any] = field(default_factory=dict)
    settings: RoleConfig | None = None


@dataclass(frozen=True)
class MatchInfo:
    """What ``action=match`` did for one call, handed to :attr:`Role.on_match`: per cached source
    (``"step 3"``), the rows it served and its ``meta.json``."""

    step: int
    served_rows: int
    generated_rows: int
    sources: Mapping[str, int]
    seconds: float
    served: Mapping[str, Sequence[int]] = field(default_factory=dict)
    source_meta: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    settings: RoleConfig | None = None


@dataclass(frozen=True)
class UpstreamFormat:
    """verl's own cache file for a role: found, reported, and loaded only when trusted. ``directory``: a
    pattern of ``step`` (``"genstep_{step:06d}"``); ``file_name`` in it (``"0/name"``: one per part).
    For ``skipinject cache``, which never unpickles it: ``label``, ``inputs_file`` beside it, files
    ``required`` to load it, ``rows_key``/``step_key`` of its ``meta.json``, and ``claims``: whether a
    loaded value is this role's when several roles declare one file."""

    file_name: str
    load: Callable[[Any], Any]
    directory: str = "{step}"
    label: str = "upstream"
    inputs_file: str | None = None
    required: tuple[str, ...] = ()
    rows_key: str | None = None
    step_key: str | None = None
    claims: Callable[[Any], bool] | None = None

    def directory_of(self, step: int) -> str | None:
        """The step's directory name (None: the default ``{step}``)."""
        return None if self.directory == "{step}" else self.directory.format(step=step)


@dataclass(frozen=True)
class Role:
    """One cacheable stage of training, as a plugin declares it (each field: docs/plugins.md)."""

    name: str
    targets: Sequence[Target]
    step: StepSource
    codec: Codec | None = None
    clocks: Sequence[str] = ()
    #: Name of verl's own SkipManager role this replaces (turned off there when this one is on).
    builtin: str | None = None
    check: Callable[[Any], str | None] | None = None
    caveat: Callable[[Any, RoleConfig], str | None] | None = None
    bypass: Callable[[Call], bool] = default_bypass
    fingerprint: Callable[[Call], Sequence[str] | None] | None = None
    on_hit: Callable[[Any, Call, HitInfo], Any] | None = None
    #: JSON-safe fields for the ``meta.json`` of the step this call is saved in (served as ``HitInfo.meta``).
    record_meta: Callable[[Call], Mapping[str, Any] | None] | None = None
    on_miss: Callable[[Any, Call], Any] | None = None
    #: ``action=match`` (``row_key`` ``None``: ``fingerprint``).
    row_key: Callable[[Call], Sequence[str] | None] | None = None
    match_settings: Sequence[str] = ()
    match_reads: Sequence[str] = ()
    on_match: Callable[[Any, Call, MatchInfo], Any] | None = None
    #: ``None``: the role's name, ``""``: steps directly in the project directory.
    cache_subdir: str | None = None
    #: verl's own cache files for this role (one format or several, tried in order).
    upstream: UpstreamFormat | Sequence[UpstreamFormat] | None = None
    description: str = ""

    @property
    def upstream_formats(self) -> tuple[UpstreamFormat, ...]:
        if self.upstream is None:
            return ()
        return (self.upstream,) if isinstance(self.upstream, UpstreamFormat) else tuple(self.upstream)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise TargetError(f"role name {self.name!r} must be an identifier")
        for field_name, kind in (("targets", Target), ("clocks", str)):
            value = getattr(self, field_name)
            if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, kind) for v in value):
                raise TargetError(f"role {self.name!r}: {field_name} must be a list of {kind.__name__}, not {value!r}")
        if not isinstance(self.step, StepSource):
            raise TargetError(f"role {self.name!r}: step must be a StepSource, not {self.step!r}")
        if self.codec is not None and not isinstance(self.codec, Codec):
            raise TargetError(f"role {self.name!r}: codec {self.codec!r} has no encode(result), decode(payload, call)")
        for clock in self.clocks:
            TargetPath.parse(clock)
