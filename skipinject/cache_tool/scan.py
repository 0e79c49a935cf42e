"""Finding steps under a dump directory and classifying them, without loading any tensor.

Every byte under a cache directory is treated as hostile: the walk never follows a symlink, never
opens anything but a regular file (a FIFO would block), reads ``meta.json`` bounded, and turns
whatever it cannot make sense of into a ``damaged`` item with one line saying why.

verl's own caches are recognised by the installed plugins' declarations
(:class:`~skipinject.roles.UpstreamFormat`, through :class:`~skipinject.cache_tool.plugins.InstalledRoles`):
nothing here knows a role's name or verl's file names.

The store reads one role's steps when the role and the trainer context are known (the engine's
case). Here neither is: :func:`open_step` reads a ``meta.json`` bounded, takes role and context
from it, and hands the step to the store's own :class:`~skipinject.store.StepStore` (``read_meta``,
``verified``, ``load``), so there is still one reader.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypedDict

from skipinject.cache_tool.plugins import InstalledRoles, Upstream
from skipinject.errors import CorruptCacheError, UntrustedCacheError
from skipinject.store import StepStore
from skipinject.store.backend import Backend
from skipinject.store.files import entries as list_entries
from skipinject.store.files import parse_json, read_small, unresolved_problem
from skipinject.store.format import (
    FORMAT,
    MAX_META_BYTES,
    MAX_META_DEPTH,
    META_NAME,
    PART_NAME,
    ROWS_DIR,
    STEP_NAME,
    is_ours,
)
from skipinject.store.local import LocalFiles
from skipinject.store.meta import StepMeta
from skipinject.store.step_store import StoredFile, list_step
from skipinject.store.usage import Usage
from skipinject.verl.layout import layout_values

#: A step directory's name: the store's rule (decimal, no leading zeros), anchored for ``match``.
STEP_RE = re.compile(rf"^(?:{STEP_NAME.pattern})$")
MAX_DEPTH = 8


def iso_time(when: float) -> str:
    """A unix time as ``meta.json``'s ``created`` writes it (local time, with its offset)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(when))


def read_json(path: Path) -> Any:
    """A small JSON file (a ``meta.json``, ours or verl's) by the store's own bounded reader and parser:
    the same byte and nesting bounds as the training run; CorruptCacheError for anything wrong."""
    return parse_json(read_small(path), path, what="meta.json", max_depth=MAX_META_DEPTH)


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


# ---------------------------------------------------------------- items


class ItemRecord(TypedDict):
    """An :class:`Item`'s stable JSON form (docs/cache-tool.md)."""

    path: str
    project: str
    layout: str
    role: str
    step: int | None
    state: str
    kind: str
    rows: int | None
    size: int
    decoded: int
    parts: int
    created: str | None
    last_served: str | None
    hits: int
    writer: dict[str, str]
    problems: list[str]


@dataclass
class Item:
    """One cached step of one kind: skipinject's format, or verl's own pickles beside or instead."""

    path: Path  # the step directory
    project: str
    layout: str
    role: str
    step: int | None
    state: str  # complete | partial | foreign | damaged | untrusted
    kind: str = "skipinject"  # skipinject, or the label of verl's format (verl-v0 | verl-v1 | verl-0.8)
    rows: int | None = None
    size: int = 0
    parts: int = 0
    created: str | None = None
    writer: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)  # regular files that make up this item
    mtime: float = 0.0  # newest modification time of those files
    meta: dict[str, Any] | None = field(default=None, repr=False)
    upstream: Upstream | None = field(default=None, repr=False)  # the declaration of a foreign item
    decoded: int | None = None  # its size once compressed files are decoded (None: as stored)
    hits: int = 0  # times served, by its usage record (skipinject's steps)
    served: float | None = None  # when last served (unix time), None: never (or no record)

    @property
    def created_time(self) -> float:
        """When it was written (``meta.json``'s ``created``, else its files' time)."""
        if self.created:
            for layout in ("%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S"):
                with contextlib.suppress(ValueError):
                    return datetime.strptime(self.created[:24], layout).timestamp()
        return self.mtime

    @property
    def last_used(self) -> float:
        """When it was last served, else when it was written: what ``prune --max-size`` goes by."""
        return self.served if self.served is not None else self.created_time

    def note_usage(self, usage: Usage | None) -> None:
        if usage is not None:
            self.hits, self.served = usage.hits, usage.last_served

    def describe(self, meta: dict[str, Any]) -> None:
        """What a step's ``meta.json`` says of it (role, creation, writer, rows, parts), each shown
        only when it has the right type (a forged one is listed, never trusted)."""
        self.meta = meta
        if isinstance(meta.get("role"), str):
            self.role = meta["role"]
        self.created = meta.get("created") if isinstance(meta.get("created"), str) else None
        writer = meta.get("writer")
        self.writer = {str(k): str(v) for k, v in writer.items()} if isinstance(writer, dict) else {}
        self.rows = meta.get("rows") if type(meta.get("rows")) is int else None
        self.parts = len(meta["parts"]) if isinstance(meta.get("parts"), list) else 0

    def record(self) -> ItemRecord:
        """The stable JSON form (docs/cache-tool.md)."""
        return {
            "path": str(self.path),
            "project": self.project,
            "layout": self.layout,
            "role": self.role,
            "step": self.step,
            "state": self.state,
            "kind": self.kind,
            "rows": self.rows,
            "size": self.size,
            "decoded": self.size if self.decoded is None else self.decoded,
            "parts": self.parts,
            "created": self.created,
            "last_served": None if self.served is None else iso_time(self.served),
            "hits": self.hits,
            "writer": dict(self.writer),
            "problems": list(self.problems),
        }


def _where(step_dir: Path) -> tuple[str, str, str | None]:
    """(project, layout, role directory or None) from the names above a step directory."""
    for ancestor in step_dir.parents:
        if layout_values(ancestor.name) is not None:
            role_dir = step_dir.parent.name if step_dir.parent != ancestor else None
            return ancestor.parent.name, ancestor.name, role_dir
    return step_dir.parent.name, "-", None


def classify(step_dir: Path, upstreams: Sequence[Upstream] = ()) -> list[Item]:
    """The items of one step directory (none, one, or ours beside verl's). Never raises.

    ``upstreams``: verl's formats the installed plugins declare (:meth:`InstalledRoles.upstreams`)."""
    project, layout, role_dir = _where(step_dir)
    try:
        return _classify(step_dir, project, layout, role_dir, upstreams)
    except Exception as exc:  # a weird tree is reported, never a traceback
        step = int(step_dir.name) if STEP_RE.match(step_dir.name) else None
        return [
            Item(
                step_dir,
                project,
                layout,
                role_dir or "-",
                step,
                "damaged",
                problems=[f"{step_dir}: cannot read it ({type(exc).__name__}: {exc})"],
            )
        ]


def _foreign(
    step_dir: Path,
    where: tuple[str, str, str | None],
    files: Mapping[str, StoredFile],
    sub_files: Mapping[str, Mapping[str, StoredFile]],
    upstreams: Sequence[Upstream],
) -> Item | None:
    """verl's own cache in ``step_dir`` by the first declaration it matches (never loaded here)."""
    project, layout, role_dir = where
    for upstream in reversed(upstreams):  # the role taking every value of a file (no ``claims``) names it
        found = upstream.directory.match(step_dir.name)
        if found is None:
            continue
        paths = []
        if upstream.per_part:
            index = 0
            while upstream.base_name in sub_files.get(str(index), {}):
                paths.append(step_dir / str(index) / upstream.base_name)
                index += 1
        elif upstream.base_name in files:
            paths.append(step_dir / upstream.base_name)
            inputs = upstream.format.inputs_file
            if inputs is not None and inputs in files:
                paths.append(step_dir / inputs)
        if not paths:
            continue
        item = Item(
            step_dir,
            project,
            layout,
            role_dir or upstream.role,
            int(found.group(1)),
            "foreign",
            kind=upstream.format.label,
        )
        item.files, item.upstream = paths, upstream
        item.parts = len(paths) if upstream.per_part else 1
        return item
    return None


def _classify(
    step_dir: Path, project: str, layout: str, role_dir: str | None, upstreams: Sequence[Upstream]
) -> list[Item]:
    items: list[Item] = []
    listing = list_step(LocalFiles(), step_dir)  # the store's listing: no link followed, part directories too
    measured = {step_dir / f.part / f.name if f.part else step_dir / f.name: f for f in listing if f.kind == "file"}
    files = {f.name: f for f in listing if not f.part and f.kind == "file"}
    sub_files: dict[str, dict[str, StoredFile]] = {}
    for found in sorted((f for f in listing if f.part and f.kind == "file"), key=lambda f: int(f.part)):
        sub_files.setdefault(found.part, {})[found.name] = found

    # verl's own pickles (never loaded here; only their presence and size).
    foreign = _foreign(step_dir, (project, layout, role_dir), files, sub_files, upstreams)
    if foreign is not None:
        _measure(foreign, measured)
        _upstream_rows(foreign)
        items.append(foreign)
    ours_dir = STEP_RE.match(step_dir.name) is not None
    step = int(step_dir.name) if ours_dir else (foreign.step if foreign is not None else None)

    ours_data = [step_dir / n for n in files if is_ours(n)]
    for sub_name, sub_entries in sub_files.items():
        ours_data += [step_dir / sub_name / n for n in sub_entries if is_ours(n)]
    meta_entry = files.get(META_NAME)
    if meta_entry is None and any(not f.part and f.name == META_NAME for f in listing):
        problem = f"{step_dir}/meta.json: not a regular file"
        items.append(Item(step_dir, project, layout, role_dir or "-", step, "damaged", problems=[problem]))
        return items
    if not ours_dir or step is None:
        return items  # verl's own directory (genstep_*, with its own meta.json): skipinject never writes it
    if meta_entry is not None:
        item = _our_step(step_dir, project, layout, role_dir, step, foreign is not None, measured)
        if item is not None and item.state == "damaged":
            item.rows, item.size, item.mtime = None, 0, 0.0  # what a damaged meta.json claims is not shown
            item.files = [step_dir / META_NAME, *ours_data]
            _measure(item, measured)
        if item is not None:
            items.append(item)
            return items
    if ours_data:
        item = Item(step_dir, project, layout, role_dir or "-", step, "partial", files=ours_data)
        item.problems.append(f"{step_dir}: data files but no meta.json (a save was interrupted, or is running)")
        _measure(item, measured)
        items.append(item)
    elif meta_entry is not None and foreign is None:
        items.append(
            Item(
                step_dir,
                project,
                layout,
                role_dir or "-",
                step,
                "damaged",
                problems=[f"{step_dir}/meta.json: not a skipinject commit record (no format marker)"],
            )
        )
    return items


def _measure(item: Item, measured: Mapping[Path, StoredFile]) -> None:
    """Size and newest time of the item's files, as the step's listing found them (regular files only)."""
    kept = []
    for path in item.files:
        found = measured.get(path)
        if found is None:
            continue
        kept.append(path)
        item.size += found.size
        item.mtime = max(item.mtime, found.mtime)
    item.files = kept


def _upstream_rows(item: Item) -> None:
    """Rows without unpickling, where verl writes them in a ``meta.json`` beside each file."""
    key = item.upstream.format.rows_key if item.upstream is not None else None
    if key is None:
        return
    total = 0
    for path in item.files:
        try:
            total += int(read_json(path.parent / META_NAME)[key])
        except Exception:
            return
    item.rows = total


def load_meta_json(path: Path) -> dict[str, Any] | None:
    """A step's ``meta.json`` as JSON if it carries skipinject's format marker, else ``None``.

    Read and parsed by the store's reader with the training run's bounds (size, nesting, numbers);
    raises :class:`CorruptCacheError` when it cannot be read or parsed.
    """
    meta = read_json(path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return None
    return meta


def step_identity(meta: dict[str, Any] | None, step_dir: object) -> tuple[str, dict[str, Any]]:
    """The role and trainer context a step's ``meta.json`` claims (a store is opened with them, and
    then checks the whole file); CorruptCacheError when it is not ours or they are malformed."""
    if meta is None:
        raise CorruptCacheError(f"{step_dir}/meta.json: not a skipinject commit record (no format marker)")
    role, context = meta.get("role"), meta.get("context", {})
    if not isinstance(role, str) or not isinstance(context, dict):
        raise CorruptCacheError(
            f"{step_dir}/meta.json: malformed (role {role!r:.80}, context {type(context).__name__})"
        )
    return role, context


def open_step(step_dir: Path, backend: Backend | None = None) -> tuple[StepStore, StepMeta]:
    """The store holding ``step_dir`` (role and context from its own ``meta.json``) and the checked meta,
    local or in the ``backend`` (an object store).

    ``meta.json`` is read bounded by the backend (a small regular file; one request) and parsed with
    the training run's bounds; the store's :meth:`StepStore.read_meta` then checks it whole. Raises
    CorruptCacheError, or FileNotFoundError when the step holds no skipinject ``meta.json``.
    """
    if not STEP_RE.match(step_dir.name):
        raise CorruptCacheError(f"{step_dir}: not a step directory (its name is not a step number)")
    files = backend if backend is not None else LocalFiles()
    shown = step_dir / META_NAME
    raw = parse_json(files.read_bytes(shown, MAX_META_BYTES), shown, what="meta.json", max_depth=MAX_META_DEPTH)
    role, context = step_identity(raw if isinstance(raw, dict) and raw.get("format") == FORMAT else None, step_dir)
    store = StepStore(step_dir.parent, role, context, backend=backend)
    return store, store.read_meta(int(step_dir.name))


def precheck(store: StepStore, step: int, meta: dict[str, Any]) -> list[tuple[Path, int]]:
    """Every named file is a regular file (no link, FIFO) of its recorded size; before the store opens it."""
    return store.precheck(step, meta)


def _our_step(
    step_dir: Path,
    project: str,
    layout: str,
    role_dir: str | None,
    step: int,
    beside_foreign: bool,
    measured: Mapping[Path, StoredFile],
) -> Item | None:
    item = Item(step_dir, project, layout, role_dir or "-", step, "complete", files=[step_dir / META_NAME])
    try:
        raw = load_meta_json(step_dir / META_NAME)
    except CorruptCacheError as exc:
        if beside_foreign:
            return None  # verl's own meta.json beside its pickle
        item.state = "damaged"
        item.problems.append(str(exc))
        return item
    if raw is None:
        return None  # not ours: verl's (beside its pickles) or unknown (reported by the caller)
    item.describe(raw)
    if step_dir.parent.name == ROWS_DIR and "generated_at" in raw:
        item.layout = f"{layout}/{ROWS_DIR}"  # rows records of action=match, numbered on their own
    try:
        store, meta = open_step(step_dir)
        item.meta = meta
        sized = precheck(store, step, meta)
        item.files += [path for path, _ in sized]
        item.note_usage(store.usage(step))
    except UntrustedCacheError as exc:  # intact perhaps, but in a tree another user controls
        item.state = "untrusted"
        item.problems.append(str(exc))
    except (CorruptCacheError, OSError, ValueError, TypeError, AttributeError) as exc:
        item.state = "damaged"
        item.problems.append(str(exc) if isinstance(exc, CorruptCacheError) else f"{step_dir}: {exc}")
    _measure(item, measured)
    if item.state != "damaged" and isinstance(item.meta, StepMeta) and item.meta.expansion:
        item.decoded = item.size + item.meta.expansion
    return item


# ---------------------------------------------------------------- walking


def _looks_like_step(directory: Path, entries: list[os.DirEntry[str]], upstreams: Sequence[Upstream]) -> bool:
    formats = [u for u in upstreams if u.directory.match(directory.name)]
    if not STEP_RE.match(directory.name) and not formats:
        return False
    known = {META_NAME} | {u.base_name for u in formats if not u.per_part}
    known |= {u.format.inputs_file for u in formats if u.format.inputs_file is not None}
    for entry in entries:
        if entry.name in known or is_ours(entry.name):
            return True
        if PART_NAME.fullmatch(entry.name) and _is_dir(entry):
            return True
    return False


def step_dirs(root: Path, problems: list[str] | None = None, upstreams: Sequence[Upstream] = ()) -> Iterator[Path]:
    """Step directories at or under ``root``; never follows a link, never leaves ``root``."""
    stack = [(root, 0)]
    while stack:
        directory, depth = stack.pop()
        try:
            entries = list_entries(directory)
        except OSError as exc:
            if problems is not None:
                problems.append(f"{directory}: cannot list it ({type(exc).__name__}: {exc})")
            continue
        if _looks_like_step(directory, entries, upstreams):
            yield directory
            continue
        if depth >= MAX_DEPTH:
            continue
        children = sorted((e for e in entries if _is_dir(e)), key=lambda e: e.name, reverse=True)
        stack.extend((Path(e.path), depth + 1) for e in children)


def scan(root: Path, problems: list[str] | None = None, roles: InstalledRoles | None = None) -> list[Item]:
    """Every item under ``root``, in a stable order (project, layout, role, step).

    ``roles``: the installed plugins whose declarations name verl's own caches (default: as a run
    would load them)."""
    upstreams = (roles or InstalledRoles()).upstreams()
    items = [item for directory in step_dirs(root, problems, upstreams) for item in classify(directory, upstreams)]
    items.sort(key=lambda i: (i.project, i.layout, i.role, i.step if i.step is not None else -1, i.kind))
    redirect = unresolved_problem(root)
    if redirect is not None:  # as a run sees such a dump_dir: intact steps there are not loaded
        for item in items:
            if item.state == "complete":
                item.state = "untrusted"
                item.problems.append(f"{redirect}: another user could redirect it; a run neither loads nor saves there")
    return items


def step_ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3,5"``."""
    out: list[str] = []
    values = sorted(set(steps))
    start: int | None = None
    prev = 0  # read only once start is set
    for value in values:
        if start is None:
            start = prev = value
        elif value == prev + 1:
            prev = value
        else:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = prev = value
    if start is not None:
        out.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(out)
