"""What a role is: plain data a plugin returns. The engine does the rest.

A role names the target(s) it patches, where each call's training step comes from, how a
call is handled (its *phase*), and how its result is saved and loaded (its *codec*).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from skipinject.clock import CLOCK
from skipinject.errors import TargetError
from skipinject.verl.compat import STEP_KEY, default_bypass

if TYPE_CHECKING:
    from pathlib import Path

    from skipinject.config import RoleConfig
    from skipinject.store import Payload, StepEntry, StepStore


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
        ident = r"[A-Za-z_][A-Za-z0-9_]*"
        import re

        if (
            not sep
            or not re.fullmatch(rf"{ident}(\.{ident})*", module)
            or not re.fullmatch(rf"{ident}(\.{ident})*", qualname)
        ):
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
        if name in params:
            index = params.index(name)
            if index < len(self.args):
                return self.args[index]
        return None

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
        from skipinject.verl.compat import run_config_of

        return run_config_of(self)

    @property
    def batch(self) -> Any:
        """The first argument: by verl convention the batch (``prompts``, ``data``)."""
        if self.args:
            return self.args[0]
        return next(iter(self.kwargs.values()), None)


@dataclass(frozen=True)
class StepSource:
    """Where a call's step comes from; sources are tried in order, the first integer wins."""

    kind: str
    name: str = ""
    extractor: Callable[[Call], int | None] | None = None
    fallbacks: tuple[StepSource, ...] = ()

    @classmethod
    def meta(cls, key: str = STEP_KEY) -> StepSource:
        """``batch.meta_info[key]`` of the call's batch argument."""
        return cls("meta", key)

    @classmethod
    def argument(cls, name: str) -> StepSource:
        """A named argument of the call."""
        return cls("argument", name)

    @classmethod
    def attribute(cls, name: str) -> StepSource:
        """An attribute of the bound instance (``self.global_steps``)."""
        return cls("attribute", name)

    @classmethod
    def clock(cls, name: str = STEP_KEY) -> StepSource:
        """An attribute of the trainer captured by the role's ``clock`` targets."""
        return cls("clock", name)

    @classmethod
    def per_call(cls, extractor: Callable[[Call], int | None]) -> StepSource:
        """Any function of the call (e.g. parse a sample id)."""
        return cls("extractor", getattr(extractor, "__name__", "extractor"), extractor)

    def or_else(self, *others: StepSource) -> StepSource:
        return StepSource(self.kind, self.name, self.extractor, self.fallbacks + others)

    def resolve(self, call: Call) -> int | None:
        for source in (self, *self.fallbacks):
            value = source._resolve_one(call)
            if value is not None:
                return value
        return None

    def _resolve_one(self, call: Call) -> int | None:
        value: Any
        if self.kind == "meta":
            meta = getattr(call.batch, "meta_info", None)
            value = meta.get(self.name) if isinstance(meta, Mapping) else None
        elif self.kind == "argument":
            value = call.argument(self.name)
        elif self.kind == "attribute":
            value = getattr(call.instance, self.name, None)
        elif self.kind == "clock":
            value = getattr(CLOCK.instance, self.name, None)
        elif self.kind == "extractor" and self.extractor is not None:
            value = self.extractor(call)
        else:
            value = None
        if value is None or isinstance(value, bool):
            return None
        try:
            return int(value)
        except (TypeError, ValueError):
            return None

    def describe(self) -> str:
        parts = [f"{s.kind}:{s.name}" for s in (self, *self.fallbacks)]
        return " or ".join(parts)


@runtime_checkable
class Codec(Protocol):
    """How a role's result becomes a :class:`~skipinject.store.Payload` (plain tensors + JSON-safe
    objects) and back. ``decode`` raises :class:`~skipinject.errors.CodecError` when a cache does not
    fit the call (the target then runs). Roles that save several parts per step also need
    :class:`MergingCodec`'s ``merge``."""

    def encode(self, result: Any) -> Payload: ...

    def decode(self, payload: Payload, call: Call) -> Any: ...


@runtime_checkable
class MergingCodec(Codec, Protocol):
    """A codec whose results of several parts of one step make one result again."""

    def merge(self, results: Sequence[Any]) -> Any: ...


@runtime_checkable
class RowCodec(Codec, Protocol):
    """A codec whose results are rows that can be served one by one (``action=match``, plugin API 1.2).

    A call has input rows (prompts) and its result ``r`` output rows per input row (``r = 1`` when
    the inputs were repeated before the target ran, ``n`` when the target repeats them), input row
    ``i``'s outputs being rows ``i*r .. i*r+r-1``. The engine keys each input row (:attr:`Role.row_key`),
    serves the rows cached before, calls the target once with only the others (:meth:`with_rows`) and
    merges the pieces back (:meth:`merge_rows`); a role whose codec is no ``RowCodec`` refuses
    ``action=match`` at start."""

    def input_rows(self, call: Call) -> int:
        """The number of input rows of ``call``."""

    def result_rows(self, result: Any) -> int:
        """The number of output rows of a result."""

    def with_rows(self, call: Call, rows: Sequence[int]) -> tuple[tuple[Any, ...], dict[str, Any], int]:
        """``call``'s arguments with only input rows ``rows`` (in that order), padded as the target
        needs (e.g. to a multiple of its workers, by repeating rows): ``(args, kwargs, padding rows)``."""

    def select_rows(self, result: Any, rows: Sequence[int]) -> Any:
        """A result holding output rows ``rows`` of ``result``, in that order."""

    def merge_rows(self, pieces: Sequence[Any], order: Sequence[int], call: Call) -> Any:
        """One result of ``call``: the rows of ``pieces`` (concatenated) taken in ``order``, exactly
        like the target's own result (the call's own per-row inputs, e.g. ids, in place of the
        recorded ones; the first piece's metadata)."""


class StepWriting(Protocol):
    """One step being written: parts first, then one atomic commit (or abort)."""

    def add_part(self, payload: Payload, part: str = "") -> None: ...

    def commit(self, meta: Mapping[str, Any]) -> Path: ...

    def abort(self) -> None: ...


class StepCache(Protocol):
    """One role's cached steps under one project directory, as phases see them."""

    @property
    def project_dir(self) -> Path: ...

    def step_dir(self, step: int) -> Path: ...

    def begin(self, step: int) -> StepWriting: ...

    def load(self, entry: StepEntry) -> list[Payload]: ...

    def is_committed(self, step: int) -> bool: ...


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
        """Whether there is something to serve (a verified entry or a trusted upstream file)."""
        return self.entry is not None or self.upstream_file is not None

    @property
    def source(self) -> Path | None:
        """Where the served data is: the entry's directory or the upstream file."""
        return self.entry.directory if self.entry is not None else self.upstream_file


@dataclass
class Loaded:
    """A planned step loaded with the engine's policy (see :meth:`PhaseContext.load`).

    ``results``: one per recorded part (call or mini-batch), decoded by the role's codec; for a
    trusted upstream file, the one object its :class:`UpstreamFormat` loaded. ``value``: what the
    phase's ``prepare`` made of them (``None`` without one)."""

    plan: Plan
    results: list[Any]
    value: Any = None
    seconds: float = 0.0


class PhaseContext(Protocol):
    """What a phase may use of its role in this process (the engine provides it)."""

    @property
    def name(self) -> str: ...

    @property
    def settings(self) -> RoleConfig: ...

    @property
    def codec(self) -> Codec: ...

    def once(self, key: Any, level: int, message: str, *args: Any) -> None:
        """Log ``message`` the first time ``key`` is seen in this process."""

    def store_for(self, call: Call) -> StepCache:
        """The cache of the run ``call`` belongs to."""

    def plan(self, call: Call, step: int) -> Plan:
        """Find the verified entry to serve for ``step`` (by the role's action), or say why there is none;
        logs the decision; raises :class:`~skipinject.errors.CacheMissError` for ``action=strict``."""

    def load(self, call: Call, step: int, prepare: Callable[[Loaded], Any] | None = None) -> Loaded | None:
        """Plan ``step`` and load what serves it, with the engine's policy (plugin API 1.1).

        ``None`` when nothing serves it (the miss is logged) or it cannot be loaded (one warning): the
        phase then runs the target. ``action=strict`` raises instead (:class:`~skipinject.errors.CacheMissError`
        or :class:`~skipinject.errors.CorruptCacheError`). ``prepare`` turns the decoded results into what
        the phase serves (:attr:`Loaded.value`) under the same policy: a cache that does not fit the
        call cannot serve it either."""

    def served(self, call: Call, step: int) -> bool | None:
        """Whether this run serves ``step`` from the cache (decided by :meth:`load` or :meth:`record`
        at the step), ``None`` before a call decided it (plugin API 1.3)."""

    def notes(self, call: Call, step: int) -> dict[str, Any]:
        """What this run's phases noted about ``step``: a dict kept with the step until the run moves
        past it (e.g. the prompts a submit and its refills drew; plugin API 1.3)."""

    def record(self, call: Call, step: int, result: Any) -> int | None:
        """Save ``result`` as ``step``'s next part ``k`` (in ``{step}/{k}/``); returns ``k``, or ``None``
        when this run does not record the step (it was served or is cached already, its directory is
        unusable, a part failed: reported once). Encoded and copied now, written in the background
        (plugin API 1.3).

        The step is cached only once :meth:`commit` is called: a step the run moves past before
        that (a call of the role at another step, the end of the run) is dropped with one warning."""

    def commit(
        self, call: Call, step: int, meta: Mapping[str, Any] | None = None, *, unit: str = "rows", note: str = ""
    ) -> None:
        """Commit the parts :meth:`record` saved of ``step``, after their writes, with ``meta`` in its
        ``meta.json`` (after the fields :attr:`Role.record_meta` gave for the first part); its save
        line counts the rows as ``unit`` and ends with ``note`` (plugin API 1.3)."""

    def in_background(self, store: StepCache, job: Callable[[], None]) -> None:
        """Run ``job`` (a write to ``store``) after the store's earlier jobs, off the training thread.

        Jobs of one store run in order; :meth:`plan` waits for the store's pending ones, the end of
        the run (the role's clock returning) for all; only a few wait at once (the next call blocks).
        Without a clock the job runs at once. ``job`` must log its own failures and may only use data
        nothing else changes (e.g. :meth:`~skipinject.store.Payload.private_copy` of an encoded result).
        """


class Phase(Protocol):
    """How one target's calls are handled once the engine decided the step may skip.

    The default treats one call as one unit: serve it from the cache or run it and save the result.
    Roles whose work spans several calls (rollout_tq's submit and sample) bring their own. ``run``
    serves sync calls, ``run_async`` awaiting ones; ``proceed()`` calls the original target
    (``run_async``'s returns an awaitable), ``proceed(*args, **kwargs)`` calls it with other
    arguments (plugin API 1.2).
    """

    def run(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any: ...

    async def run_async(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any: ...


@dataclass(frozen=True)
class Target:
    """A function or method to patch, with the phase handling its calls.

    ``verl`` is a version specifier (``">=0.9"``): the target is only patched in verls it matches.
    ``every_step`` hands the phase every call of an enabled role, whatever its step.

    ``attribute`` (dotted, e.g. ``"actor_rollout_wg.generate_sequences"``) is for callables bound
    per instance, which a patch of their class never sees: ``path`` is then a method that runs
    unchanged, and each time it returns, the callable at ``instance.<attribute>`` is wrapped on the
    object holding it. Those calls are the target's calls (convention kept, the phase and bypass as
    for any target), with :attr:`Call.instance` = the instance whose method returned (the trainer).
    """

    path: str
    phase: Phase | None = None
    verl: str | None = None
    #: The phase sees every call while the role is enabled, not only calls at ``skip.<role>.steps``
    #: (e.g. to switch off a prefetch that would go around the role). Validation calls still bypass.
    every_step: bool = False
    #: The instance attribute (dotted) wrapped each time the method ``path`` returns, or ``None``.
    attribute: str | None = None

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
    #: The served step's ``meta.json`` (empty for verl's own files): what :attr:`Role.record_meta` added
    #: when it was recorded, so that ``on_hit`` can tell whether this run would compute it alike.
    meta: Mapping[str, Any] = field(default_factory=dict)
    #: The role's settings in this run (``None`` when not known).
    settings: RoleConfig | None = None


@dataclass(frozen=True)
class MatchInfo:
    """What the engine did for one call with ``action=match``, handed to :attr:`Role.on_match`.

    ``sources``: the cached records rows were served from (``"step 3"``, ``"rows 2"``), with how many;
    ``served``: per source, the merged result's output rows it served; ``source_meta``: per source, its
    ``meta.json`` (see :attr:`HitInfo.meta`)."""

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
    """verl's own cache file for a role: found, reported, and loaded only when trusted.

    ``directory``: the step's directory in the project directory, as a ``str.format`` pattern of
    ``step`` (verl >= 0.9: ``"{step}"``; verl < 0.9's RolloutSkip: ``"genstep_{step:06d}"``).
    ``file_name``: the file in it; ``"0/name"`` means one ``name`` per part directory ``0/ 1/ ...``.

    The rest tells ``skipinject cache`` what it needs without loading anything (it never unpickles
    outside ``import --trust``): ``label`` names the kind in its listings (``verl-v0``); ``inputs_file``
    is the input batch written beside it (verl < 0.9: ``new_batch.dp``), listed with it and the source
    of an imported step's input fingerprint; ``required`` are files upstream needs beside it to load
    the step (``verify`` reports them missing); ``rows_key`` is the key of the JSON ``meta.json`` beside
    each file that counts its rows; ``step_key`` the key of the JSON ``meta.json`` in the step's directory
    holding the training step, when the directory is named otherwise. ``claims``: when several roles
    declare one file, whether a loaded value is this role's (``import`` gives a value to the first
    role that claims it, else to the role declaring the file without ``claims``, which listings name).
    """

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
        """The step's directory name, or None for the default ``{step}``."""
        return None if self.directory == "{step}" else self.directory.format(step=step)


@dataclass(frozen=True)
class Role:
    """One cacheable stage of training, as a plugin declares it."""

    name: str
    targets: Sequence[Target]
    step: StepSource
    codec: Codec | None = None
    #: Methods whose instance is the trainer: entering them sets the clock and the run config.
    clocks: Sequence[str] = ()
    #: Name of verl's own SkipManager role this replaces (turned off there when this one is on).
    builtin: str | None = None
    #: Called once with the run's verl config; returns a reason why the role cannot fire, or None.
    check: Callable[[Any], str | None] | None = None
    bypass: Callable[[Call], bool] = default_bypass
    #: Per-row digests of the call's inputs; a hit whose digests differ is reported (``on_mismatch``).
    fingerprint: Callable[[Call], Sequence[str] | None] | None = None
    #: Adjusts a result served from the cache (e.g. replace the old run's timing with hit metrics).
    on_hit: Callable[[Any, Call, HitInfo], Any] | None = None
    #: Fields added to the ``meta.json`` of a step (or rows record) this call's result is saved in: what
    #: else decided the result besides its inputs (e.g. the reward that scored a rollout). JSON-safe
    #: values; the first call's fields of a step are kept. Served back as :attr:`HitInfo.meta`.
    record_meta: Callable[[Call], Mapping[str, Any] | None] | None = None
    #: Adjusts a freshly computed result (e.g. mark the miss in the metrics).
    on_miss: Callable[[Any, Call], Any] | None = None
    #: Per input row, a digest of everything of the call deciding its result (``action=match``, plugin
    #: API 1.2): e.g. the prompt's tokens and non-tensor inputs. The engine adds the run settings
    #: ``match_settings`` names and the row's occurrence among equal rows; ``None``: ``fingerprint``.
    row_key: Callable[[Call], Sequence[str] | None] | None = None
    #: Run-config keys (dotted) whose values decide a row's result (model, sampling, lengths): rows
    #: recorded under other values never match.
    match_settings: Sequence[str] = ()
    #: Adjusts a result merged from cached and fresh rows (``action=match``), e.g. metrics.
    on_match: Callable[[Any, Call, MatchInfo], Any] | None = None
    #: Sub-directory of the project directory holding this role's steps; ``None``: the role's name,
    #: ``""``: the project directory itself (upstream's layout, used by the rollout roles).
    cache_subdir: str | None = None
    #: Upstream's cache files for this role, if any (``gen_batch.dp``), and how to read them once trusted;
    #: one format or several (e.g. verl 0.9's layout and the older ``genstep_*`` one), tried in order.
    upstream: UpstreamFormat | Sequence[UpstreamFormat] | None = None
    description: str = ""

    @property
    def upstream_formats(self) -> tuple[UpstreamFormat, ...]:
        if self.upstream is None:
            return ()
        return (self.upstream,) if isinstance(self.upstream, UpstreamFormat) else tuple(self.upstream)

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise TargetError(f"role name {self.name!r} must be an identifier")
        for clock in self.clocks:
            TargetPath.parse(clock)
