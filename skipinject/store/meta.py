"""A step's ``meta.json`` as one typed value, checked once (docs/cache-format.md): :class:`StepMeta`
(still a mapping for role-specific keys) and its parts and file records, every name checked safe
before a path is built from it. Nothing else walks the JSON."""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import skipinject.store.format as fmt
from skipinject.errors import CacheError, CorruptCacheError
from skipinject.store.checksums import CHECKSUM_ALGOS


@dataclass(frozen=True)
class DataFile:
    """One data file of a part as ``meta.json`` records it (``spec``: size, checksum, encoding...)."""

    kind: str  # tensors | objects
    name: str
    spec: Mapping[str, Any]

    @property
    def size(self) -> int:
        return self.spec.get("size") or 0  # checked when parsed: a bounded int or absent

    @property
    def encoded(self) -> bool:
        return "encoding" in self.spec

    @property
    def decoded(self) -> int:
        """Bytes it takes decoded (its stored size unless compressed)."""
        return (self.spec.get("decoded_size") or 0) if self.encoded else self.size


@dataclass(frozen=True)
class Part:
    """One part of a step: its directory (``""``: the step directory itself), rows and files."""

    dir: str
    rows: int | None
    files: tuple[DataFile, ...]

    def at(self, step_dir: Path, name: str) -> Path:
        return step_dir / self.dir / name if self.dir else step_dir / name


#: Every key of ``meta.json`` the core writes and reads (docs/cache-format.md); a role's own keys may be beside them.
#: Only this module (and :mod:`~skipinject.store.writer`, which commits the record) names them.
CORE_KEYS = (
    "format",
    "format_version",
    "meta_checksum",
    "role",
    "step",
    "context",
    "checksum_algo",
    "parts",
    "rows",
    "writer",
    "node",
    "created",
    "plugin",
    "inputs",
    "calls",
    "call_inputs",
    "generation_s",
    "row_keys",
    "rows_per_input",
    "generated_at",
    "generation_settings",
)


class StepMeta(dict[str, Any]):
    """A ``meta.json`` (``shown``: where it was read, for messages): checked when the store read it, as its
    writer claims it when :func:`~skipinject.store.read_record` did. Its typed properties are the schema: each
    gives a value of its type or None (absent, or of another type: what a damaged record claims is not shown)."""

    def __init__(self, raw: Mapping[str, Any], shown: Path) -> None:
        super().__init__(raw)
        self.shown = shown

    @staticmethod
    def build(
        *,
        inputs: Any,
        calls: int | None = 1,
        call_inputs: Sequence[Any] | None = None,
        generation_s: float = 0.0,
        row_keys: Sequence[Any] | None = None,
        rows_per_input: Sequence[Any] | None = None,
        generated_at: int | None = None,
        settings: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A role's part of ``meta.json`` as the recorder and ``match`` commit it (:class:`~skipinject.store.StepWriter`
        adds the store's): ``extra`` (the role's ``record_meta``) first, then ``inputs`` and ``calls``;
        ``generation_s`` when positive, ``call_inputs`` for more than one call, ``row_keys`` with
        ``rows_per_input`` when given, ``generated_at`` for a rows record of ``action=match``, ``settings``: the
        run settings a role's rows depend on (its ``match_settings``) (``calls=None``: no count, as an imported
        step records none)."""
        meta: dict[str, Any] = {**(extra or {}), "inputs": inputs}
        if calls is not None:
            meta["calls"] = calls
        if generation_s > 0:
            meta["generation_s"] = round(generation_s, 6)
        if calls is not None and calls > 1 and call_inputs is not None:
            meta["call_inputs"] = list(call_inputs)
        if row_keys is not None:
            meta["row_keys"] = list(row_keys)
            meta["rows_per_input"] = list(rows_per_input or ())
        if generated_at is not None:
            meta["generated_at"] = generated_at
        if settings is not None:
            meta["generation_settings"] = dict(settings)
        return meta

    @property
    def role(self) -> str | None:
        value = self.get("role")
        return value if isinstance(value, str) else None

    @property
    def context(self) -> dict[str, Any] | None:
        """The trainer's metadata the step was recorded under (None: absent or not a mapping)."""
        value = self.get("context")
        return value if isinstance(value, dict) else None

    @property
    def rows(self) -> int | None:
        value = self.get("rows")
        return value if type(value) is int else None

    @property
    def created(self) -> str | None:
        value = self.get("created")
        return value if isinstance(value, str) else None

    @property
    def writer(self) -> dict[str, str]:
        """The writer's versions (``{}``: none recorded)."""
        writer = self.get("writer")
        return {str(k): str(v) for k, v in writer.items()} if isinstance(writer, dict) else {}

    @property
    def part_count(self) -> int:
        """How many parts it lists (not checked: :attr:`parts` checks them)."""
        parts = self.get("parts")
        return len(parts) if isinstance(parts, list) else 0

    @property
    def call_count(self) -> int | None:
        """``calls`` when it is an int, else None."""
        value = self.get("calls")
        return value if type(value) is int else None

    #: Values as written, whatever they are (the store checks its own; a reader checks the rest).
    ours = property(lambda self: self.get("format") == fmt.FORMAT)  # skipinject's format marker
    step = property(lambda self: self.get("step"))
    plugin = property(lambda self: self.get("plugin"))  # the plugin that wrote it, None: none
    checksum_algo = property(lambda self: self.get("checksum_algo"))
    inputs = property(lambda self: self.get("inputs"))  # the first call's input fingerprints
    calls = property(lambda self: self.get("calls", 1))  # how many calls the step holds
    generation_s = property(lambda self: self.get("generation_s"))  # the target's time for the step
    row_keys = property(lambda self: self.get("row_keys"))
    rows_per_input = property(lambda self: self.get("rows_per_input"))
    generation_settings = property(lambda self: self.get("generation_settings"))  # ``match_settings``' values
    generated = property(lambda self: "generated_at" in self)  # a rows record of ``action=match``

    def as_written(self, **between: Any) -> dict[str, Any]:
        """``cache show``'s fields, as written: role, step, rows, part directories, ``between``, context, created
        and writer."""
        fields = {key: self.get(key) for key in ("role", "step", "rows")}
        fields["parts"] = [p.get("dir") for p in self.get("parts", [])]
        return {**fields, **between, **{key: self.get(key) for key in ("context", "created", "writer")}}

    def written(self, key: str, default: Any = None) -> Any:
        """A key as written, whatever it is (a role's own ``record_meta`` keys; the store's checks)."""
        return self.get(key, default)

    def inputs_per_call(self, calls: int) -> list[Any]:
        """Each of ``calls`` calls' input fingerprints: ``call_inputs`` when it lists that many, else ``inputs``
        for the first call and None for the others (one-call steps keep theirs in ``inputs``)."""
        per_call = self.get("call_inputs")
        if isinstance(per_call, list) and len(per_call) == calls:
            return list(per_call)
        return [self.get("inputs")] + [None] * (calls - 1)

    def input_lists(self) -> list[Any]:
        """Every call's input fingerprints as written: ``call_inputs`` if it is a list, else ``[inputs]``."""
        per_call = self.get("call_inputs")
        return per_call if isinstance(per_call, list) else [self.get("inputs")]

    @property
    def directory(self) -> Path:
        return self.shown.parent

    @functools.cached_property
    def parts(self) -> tuple[Part, ...]:
        """Every part, every name checked to be safe (CorruptCacheError otherwise); parsed once."""
        parts = self.get("parts")
        if not isinstance(parts, list) or not parts:
            raise CorruptCacheError(f"{self.directory}: meta.json names no parts")
        if len(parts) > fmt.MAX_PARTS:
            raise CorruptCacheError(f"{self.directory}: meta.json lists {len(parts)} parts, more than {fmt.MAX_PARTS}")
        out = tuple(_part(self.directory, part) for part in parts)
        dirs = [part.dir for part in out]
        if len(set(dirs)) != len(dirs):
            raise CorruptCacheError(f"{self.directory}: meta.json names a part directory twice; not read")
        return out

    def files(self) -> list[tuple[Part, DataFile]]:
        return [(part, file) for part in self.parts for file in part.files]

    def named(self) -> set[str]:
        """``part/name`` of every data file it names (``/name`` in the step directory itself)."""
        return {f"{part.dir}/{file.name}" for part, file in self.files()}

    @property
    def stored_size(self) -> int:
        return sum(file.size for _, file in self.files())

    @property
    def expansion(self) -> int:
        """Bytes its compressed files gain when decoded (0: none compressed)."""
        return sum(file.decoded - file.size for _, file in self.files())

    @property
    def compressed(self) -> bool:
        return all(file.encoded for _, file in self.files())

    def check_budget(self) -> None:
        """Refuse (CorruptCacheError) a step whose files decode to more than its parts' or the process's budget."""
        from skipinject.store.hit_memory import memory_budget

        context = self.context
        total = 0
        for part in self.parts:
            decoded = sum(file.decoded for file in part.files)
            budget = part_budget(part.rows, context if context is not None else {})
            if decoded > budget and budget < memory_budget():
                raise CorruptCacheError(
                    f"{self.directory}: part {part.dir!r} declares {decoded} decoded bytes, more than its "
                    f"{part.rows} rows may take ({budget}); not read"
                )
            total += decoded
        if total > memory_budget():
            raise CorruptCacheError(
                f"{self.directory}: declares {total} decoded bytes, more than this process may spend on a step "
                f"({memory_budget()}); not read"
            )


def checked(
    meta: Any, path: Path, step: int, role: str, context: Mapping[str, Any], siblings: Collection[str] = ()
) -> StepMeta:
    """``meta`` (``meta.json`` parsed from ``path``) checked as step ``step`` of ``role`` (or of one of its
    ``siblings``) recorded under ``context``: format, version, self-checksum, role, step, context, rows and
    checksum algorithm (CorruptCacheError naming what is wrong)."""
    if not isinstance(meta, dict) or meta.get("format") != fmt.FORMAT:
        raise CorruptCacheError(f"{path}: not a skipinject cache (no format marker)")
    try:
        if meta.get("format_version") not in fmt.READABLE_VERSIONS:
            raise CorruptCacheError(
                f"{path}: written in format version {short(meta.get('format_version'))}, "
                f"this skipinject reads versions {', '.join(map(str, fmt.READABLE_VERSIONS))}"
            )
        if meta.get("meta_checksum") != fmt.meta_digest(meta):
            raise CorruptCacheError(f"{path}: meta.json was edited or damaged (its checksum does not match)")
        if meta.get("role") != role and meta.get("role") not in siblings:
            raise CorruptCacheError(f"{path}: written by role {short(meta.get('role'))}, not {role!r}")
        if meta.get("step") != step:
            raise CorruptCacheError(f"{path}: records step {short(meta.get('step'))}, but lies in step {step}")
        written = meta.get("context", {})
        if not isinstance(written, dict):
            raise CorruptCacheError(f"{path}: meta.json is malformed (context {short(written)} is not a mapping)")
        if written != context:
            raise CorruptCacheError(
                f"{path}: written for other trainer metadata {short(written)}, this run is {context!r}"
            )
        rows = meta.get("rows")
        if rows is not None and (type(rows) is not int or not 0 <= rows <= fmt.MAX_ROWS):
            raise CorruptCacheError(f"{path}: meta.json is malformed (rows {short(rows)} is no row count)")
        if meta.get("checksum_algo") not in CHECKSUM_ALGOS:
            raise CorruptCacheError(
                f"{path}: meta.json is malformed (unknown checksum algorithm {short(meta.get('checksum_algo'))})"
            )
    except CacheError:
        raise
    except Exception as exc:
        raise CorruptCacheError(f"{path}: meta.json is malformed ({type(exc).__name__}: {exc})") from exc
    return StepMeta(meta, path)


def part_budget(rows: int | None, context: Mapping[str, Any]) -> int:
    """The most bytes one part of ``rows`` rows may take decoded and rebuilt: per row, the declared width times
    :data:`~skipinject.store.format.MAX_BYTES_PER_TOKEN` (at least ``MIN_ROW_BYTES``), plus ``PART_SLACK``,
    at most the memory budget."""
    from skipinject.store.hit_memory import memory_budget

    budget = memory_budget()
    if rows is None:
        return budget
    widths = [context.get("prompt_length"), context.get("response_length")]
    if all(type(w) is int and 0 <= w <= fmt.MAX_WIDTH for w in widths):
        per_row = max(sum(int(w) for w in widths if w is not None) * fmt.MAX_BYTES_PER_TOKEN, fmt.MIN_ROW_BYTES)
    else:
        per_row = fmt.MAX_ROW_BYTES
    return min(budget, rows * per_row + fmt.PART_SLACK)


def _part(directory: Path, part: Any) -> Part:
    if not isinstance(part, Mapping):
        raise CorruptCacheError(f"{directory}: meta.json is malformed (part {short(part)} is not a record)")
    sub = part.get("dir", "")
    if not isinstance(sub, str) or (sub and not fmt.SAFE_NAME.match(sub)) or sub in (".", ".."):
        raise CorruptCacheError(f"{directory}: meta.json names an unsafe part directory {short(sub)}")
    files = part.get("files")
    if not isinstance(files, dict) or set(files) != {"tensors", "objects"}:
        raise CorruptCacheError(f"{directory}: meta.json part {sub!r} does not name its files")
    out: list[DataFile] = []
    for kind, spec in files.items():
        name = spec.get("name") if isinstance(spec, dict) else None
        if not isinstance(name, str) or not fmt.SAFE_NAME.match(name) or ".." in name or name == fmt.META_NAME:
            raise CorruptCacheError(f"{directory}: meta.json names an unsafe file {short(name)}")
        for key in ("size", "decoded_size"):
            value = spec.get(key)
            if value is not None and (type(value) is not int or not 0 <= value <= fmt.MAX_FILE_BYTES):
                raise CorruptCacheError(f"{directory}: meta.json records no file size ({key} {short(value, 40)})")
        if any(name == other.name for other in out):
            raise CorruptCacheError(f"{directory}: meta.json names the file {name!r} twice in part {sub!r}")
        out.append(DataFile(kind, name, spec))
    rows = part.get("rows")
    if rows is not None and (type(rows) is not int or not 0 <= rows <= fmt.MAX_ROWS):
        raise CorruptCacheError(f"{directory}: meta.json part {sub!r} records no row count ({short(rows, 40)})")
    return Part(sub, rows, tuple(out))


def short(value: Any, limit: int = 200) -> str:
    """``repr`` of a value from a cache, cut to one short line."""
    try:
        text = repr(value)
    except Exception:  # a RecursionError on a value nested past the limit
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."
