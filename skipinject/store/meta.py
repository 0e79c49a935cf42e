"""A step's ``meta.json`` as one typed value, checked once (docs/cache-format.md): :class:`StepMeta`
(still a mapping for role-specific keys) and its parts and file records, every name checked safe
before a path is built from it. Nothing else walks the JSON."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import skipinject.store.format as fmt
from skipinject.errors import CorruptCacheError


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


class StepMeta(dict[str, Any]):
    """A checked ``meta.json`` (``shown``: where it was read, for messages)."""

    def __init__(self, raw: Mapping[str, Any], shown: Path) -> None:
        super().__init__(raw)
        self.shown = shown

    @property
    def directory(self) -> Path:
        return self.shown.parent

    @functools.cached_property
    def parts(self) -> tuple[Part, ...]:
        """Every part, every name checked to be safe (CorruptCacheError otherwise); parsed once."""
        parts = self.get("parts")
        if not isinstance(parts, list) or not parts:
            raise CorruptCacheError(f"{self.directory}: meta.json names no parts")
        return tuple(_part(self.directory, part) for part in parts)

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

        context = self.get("context")
        total = 0
        for part in self.parts:
            decoded = sum(file.decoded for file in part.files)
            budget = part_budget(part.rows, context if isinstance(context, Mapping) else {})
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


def step_meta(meta: Mapping[str, Any], step_dir: Path) -> StepMeta:
    """``meta`` as a :class:`StepMeta` (itself if it is one)."""
    return meta if isinstance(meta, StepMeta) else StepMeta(meta, step_dir / fmt.META_NAME)


def _part(directory: Path, part: Any) -> Part:
    if not isinstance(part, Mapping):
        raise CorruptCacheError(f"{directory}: meta.json is malformed (part {short(part)} is not a record)")
    sub = part.get("dir", "")
    if not isinstance(sub, str) or (sub and not fmt.SAFE_NAME.match(sub)) or sub in (".", ".."):
        raise CorruptCacheError(f"{directory}: meta.json names an unsafe part directory {short(sub)}")
    files = part.get("files")
    if not isinstance(files, dict) or set(files) != {"tensors", "objects"}:
        raise CorruptCacheError(f"{directory}: meta.json part {sub!r} does not name its files")
    out = []
    for kind, spec in files.items():
        name = spec.get("name") if isinstance(spec, dict) else None
        if not isinstance(name, str) or not fmt.SAFE_NAME.match(name) or ".." in name or name == fmt.META_NAME:
            raise CorruptCacheError(f"{directory}: meta.json names an unsafe file {short(name)}")
        for key in ("size", "decoded_size"):
            value = spec.get(key)
            if value is not None and (type(value) is not int or not 0 <= value <= fmt.MAX_FILE_BYTES):
                raise CorruptCacheError(f"{directory}: meta.json records no file size ({key} {short(value, 40)})")
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
