"""Finding steps under a dump directory or a remote store's URL and classifying them, no tensor loaded.

Every byte under a cache is hostile: the walk goes through the store's backends (no link followed,
only regular files opened, ``meta.json`` read bounded) and turns what it cannot make sense of into a
``damaged`` item with one line saying why. verl's own caches are what the installed plugins declare
(:class:`~skipinject.roles.UpstreamFormat`). A step's role and context come from its ``meta.json``;
:func:`open_step` then hands it to the store's own :class:`~skipinject.store.StepStore`, the one reader.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from skipinject.cache_tool.common import existing_dir
from skipinject.cache_tool.plugins import InstalledRoles, Upstream
from skipinject.errors import CorruptCacheError, UntrustedCacheError
from skipinject.store import StepStore
from skipinject.store.backend import Backend
from skipinject.store.files import parse_json, unresolved_problem
from skipinject.store.format import (
    DATA_NAME,
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
from skipinject.store.remote import FsspecFiles, RemotePath, open_remote
from skipinject.store.step_store import StoredFile, list_step
from skipinject.store.usage import USAGE_NAME, Usage
from skipinject.verl.layout import layout_values

#: A step directory's name: the store's rule (decimal, no leading zeros), anchored for ``match``.
STEP_RE = re.compile(rf"^(?:{STEP_NAME.pattern})$")
MAX_DEPTH = 8
PARTIAL = "data files but no meta.json (a save was interrupted, or is running)"


def read_json(path: Path, backend: Backend | None = None) -> Any:
    """A small JSON file (a ``meta.json``, ours or verl's) read and parsed with the training run's
    bounds; CorruptCacheError for anything wrong."""
    files = backend or LocalFiles()
    data = files.read_bytes(path, MAX_META_BYTES)
    return parse_json(data, path, what="meta.json", max_depth=MAX_META_DEPTH)


def load_meta_json(path: Path) -> dict[str, Any] | None:
    """A step's ``meta.json`` if it carries skipinject's format marker, else None."""
    meta = read_json(path)
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def has_meta(step_dir: Path) -> bool:
    """Whether a local step directory holds a ``meta.json`` (any, followed if a link)."""
    return LocalFiles().stat(step_dir / META_NAME, follow=True) is not None


@dataclass
class Item:
    """One cached step of one kind: skipinject's format, or verl's own pickles beside or instead."""

    path: Path  # the step directory (a RemotePath in a remote store)
    project: str
    layout: str
    role: str
    step: int | None
    state: str  # complete | partial | foreign | damaged | untrusted
    kind: str = "skipinject"  # or the label of verl's format (verl-v0 | verl-v1 | verl-0.8)
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
    hits: int = 0  # times served, by its usage record
    served: float | None = None  # when last served (unix time), None: never (or no record)

    @property
    def created_time(self) -> float:
        """When it was written (``meta.json``'s ``created``, else its files' time)."""
        for layout in ("%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S") if self.created else ():
            with contextlib.suppress(ValueError):
                return datetime.strptime(str(self.created)[:24], layout).timestamp()
        return self.mtime

    @property
    def last_used(self) -> float:
        """When it was last served, else when it was written: what ``prune --max-size`` goes by."""
        return self.served if self.served is not None else self.created_time

    def note_usage(self, usage: Usage | None) -> None:
        if usage is not None:
            self.hits, self.served = usage.hits, usage.last_served

    def describe(self, meta: dict[str, Any]) -> None:
        """What ``meta.json`` says (role, creation, writer, rows, parts), each only when of the right type."""
        self.meta = meta
        if isinstance(meta.get("role"), str):
            self.role = meta["role"]
        self.created = meta.get("created") if isinstance(meta.get("created"), str) else None
        writer = meta.get("writer")
        self.writer = {str(k): str(v) for k, v in writer.items()} if isinstance(writer, dict) else {}
        self.rows = meta.get("rows") if type(meta.get("rows")) is int else None
        self.parts = len(meta["parts"]) if isinstance(meta.get("parts"), list) else 0

    def record(self) -> dict[str, Any]:
        """The stable JSON form (docs/cache-tool.md)."""
        served = None if self.served is None else time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.served))
        return {
            "path": str(self.path),
            **{name: getattr(self, name) for name in ("project", "layout", "role", "step", "state", "kind", "rows")},
            "size": self.size,
            "decoded": self.size if self.decoded is None else self.decoded,
            "parts": self.parts,
            "created": self.created,
            "last_served": served,
            "hits": self.hits,
            "writer": dict(self.writer),
            "problems": list(self.problems),
        }


def _where(names: Sequence[str], nearest: bool = False) -> tuple[str, str, str | None]:
    """(project, layout, role directory or None) from the names above a step directory; the role
    directory is the one below the layout, or (``nearest``) the step's parent."""
    for index in range(len(names) - 1, -1, -1):
        if layout_values(names[index]) is not None:
            role_dir = names[-1 if nearest else index + 1] if index + 1 < len(names) else None
            return (names[index - 1] if index else "-"), names[index], role_dir
    return (names[-1] if names else "-"), "-", None


def classify(step_dir: Path, upstreams: Sequence[Upstream] = ()) -> list[Item]:
    """The items of one step directory (none, one, or ours beside verl's). Never raises."""
    project, layout, role_dir = _where(step_dir.parent.parts, nearest=True)
    try:
        return _classify(step_dir, project, layout, role_dir, upstreams)
    except Exception as exc:  # a weird tree is reported, never a traceback
        step = int(step_dir.name) if STEP_RE.match(step_dir.name) else None
        problem = f"{step_dir}: cannot read it ({type(exc).__name__}: {exc})"
        return [Item(step_dir, project, layout, role_dir or "-", step, "damaged", problems=[problem])]


def _foreign(
    step_dir: Path, where: tuple[str, str, str | None], listed: Mapping[Path, StoredFile], upstreams: Sequence[Upstream]
) -> Item | None:
    """verl's own cache in ``step_dir`` by the first declaration it matches (never loaded here)."""
    for upstream in reversed(upstreams):  # the role taking every value of a file (no ``claims``) names it
        found = upstream.directory.match(step_dir.name)
        if found is None:
            continue
        paths: list[Path] = []
        if upstream.per_part:
            while step_dir / str(len(paths)) / upstream.base_name in listed:
                paths.append(step_dir / str(len(paths)) / upstream.base_name)
        elif step_dir / upstream.base_name in listed:
            inputs = upstream.format.inputs_file
            paths = [step_dir / name for name in (upstream.base_name, inputs) if name and step_dir / name in listed]
        if paths:
            item = Item(step_dir, where[0], where[1], where[2] or upstream.role, int(found.group(1)), "foreign")
            item.kind, item.files, item.upstream = upstream.format.label, paths, upstream
            item.parts = len(paths) if upstream.per_part else 1
            return item
    return None


def _classify(
    step_dir: Path, project: str, layout: str, role_dir: str | None, upstreams: Sequence[Upstream]
) -> list[Item]:
    items: list[Item] = []
    listing = list_step(LocalFiles(), step_dir)  # the store's listing: no link followed, part directories too
    listed = {step_dir / f.part / f.name: f for f in listing if f.kind == "file"}
    foreign = _foreign(step_dir, (project, layout, role_dir), listed, upstreams)
    if foreign is not None:  # verl's own pickles: only their presence and size
        _measure(foreign, listed)
        _upstream_rows(foreign)
        items.append(foreign)
    ours_dir = STEP_RE.match(step_dir.name) is not None
    step = int(step_dir.name) if ours_dir else (foreign.step if foreign is not None else None)
    ours_data = [path for path in listed if is_ours(path.name)]
    meta_path = step_dir / META_NAME
    if meta_path not in listed and any(not f.part and f.name == META_NAME for f in listing):
        problem = f"{meta_path}: not a regular file"
        return [*items, Item(step_dir, project, layout, role_dir or "-", step, "damaged", problems=[problem])]
    if not ours_dir or step is None:
        return items  # verl's own directory (genstep_*, with its own meta.json): skipinject never writes it
    if meta_path in listed:
        item = _our_step(step_dir, project, layout, role_dir, step, foreign is not None)
        if item is not None and item.state == "damaged":
            item.rows = None  # what a damaged meta.json claims is not shown
            item.files = [meta_path, *ours_data]
        if item is not None:
            _measure(item, listed)
            if item.state != "damaged" and isinstance(item.meta, StepMeta) and item.meta.expansion:
                item.decoded = item.size + item.meta.expansion
            return [*items, item]
    if ours_data:
        item = Item(step_dir, project, layout, role_dir or "-", step, "partial", files=ours_data)
        item.problems.append(f"{step_dir}: {PARTIAL}")
        _measure(item, listed)
        items.append(item)
    elif meta_path in listed and foreign is None:
        problem = f"{meta_path}: not a skipinject commit record (no format marker)"
        items.append(Item(step_dir, project, layout, role_dir or "-", step, "damaged", problems=[problem]))
    return items


def _measure(item: Item, listed: Mapping[Path, StoredFile]) -> None:
    """Size and newest time of the item's files, as the step's listing found them (regular files only)."""
    item.files = [path for path in item.files if path in listed]
    item.size = sum(listed[path].size for path in item.files)
    item.mtime = max((listed[path].mtime for path in item.files), default=0.0)


def _upstream_rows(item: Item) -> None:
    """Rows without unpickling, where verl writes them in a ``meta.json`` beside each file."""
    key = item.upstream.format.rows_key if item.upstream is not None else None
    with contextlib.suppress(Exception):
        if key is not None:
            item.rows = sum(int(read_json(path.parent / META_NAME)[key]) for path in item.files)


def open_step(step_dir: Path, backend: Backend | None = None) -> tuple[StepStore, StepMeta]:
    """The store holding ``step_dir`` (role and context from its own ``meta.json``, local or in the
    ``backend``) and its meta, checked whole by :meth:`StepStore.read_meta`. Raises CorruptCacheError,
    or FileNotFoundError when the step holds no skipinject ``meta.json``."""
    if not STEP_RE.match(step_dir.name):
        raise CorruptCacheError(f"{step_dir}: not a step directory (its name is not a step number)")
    raw = read_json(step_dir / META_NAME, backend)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CorruptCacheError(f"{step_dir}/meta.json: not a skipinject commit record (no format marker)")
    role, context = raw.get("role"), raw.get("context", {})
    if not isinstance(role, str) or not isinstance(context, dict):
        raise CorruptCacheError(
            f"{step_dir}/meta.json: malformed (role {role!r:.80}, context {type(context).__name__})"
        )
    store = StepStore(step_dir.parent, role, context, backend=backend)
    return store, store.read_meta(int(step_dir.name))


def _our_step(
    step_dir: Path, project: str, layout: str, role_dir: str | None, step: int, beside_foreign: bool
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
        item.files += [path for path, _ in store.precheck(step, meta)]
        item.note_usage(store.usage(step))
    except UntrustedCacheError as exc:  # intact perhaps, but in a tree another user controls
        item.state = "untrusted"
        item.problems.append(str(exc))
    except (CorruptCacheError, OSError, ValueError, TypeError, AttributeError) as exc:
        item.state = "damaged"
        item.problems.append(str(exc) if isinstance(exc, CorruptCacheError) else f"{step_dir}: {exc}")
    return item


def step_dirs(root: Path, problems: list[str] | None = None, upstreams: Sequence[Upstream] = ()) -> Iterator[Path]:
    """Step directories at or under ``root``; never follows a link below it, never leaves it."""
    files = LocalFiles()
    stack = [(root, 0)]
    while stack:
        directory, depth = stack.pop()
        try:
            names = files.names(directory, follow=True)
            subdirs = set(files.names(directory, directories=True))
        except OSError as exc:
            if problems is not None:
                problems.append(f"{directory}: cannot list it ({type(exc).__name__}: {exc})")
            continue
        formats = [u for u in upstreams if u.directory.match(directory.name)]
        known = {META_NAME} | {u.base_name for u in formats if not u.per_part}
        known |= {u.format.inputs_file for u in formats if u.format.inputs_file is not None}
        if (STEP_RE.match(directory.name) or formats) and any(
            name in known or is_ours(name) or (PART_NAME.fullmatch(name) and name in subdirs) for name in names
        ):
            yield directory
            continue
        if problems is not None:  # a step that is a link is never followed, and said
            for name in sorted(n for n in names if STEP_RE.match(n) and n not in subdirs):
                if (files.stat(directory / name) or ("",))[0] == "link":
                    problems.append(f"{directory / name}: a symbolic link, not followed")
        if depth < MAX_DEPTH:
            stack.extend((directory / name, depth + 1) for name in sorted(subdirs, reverse=True))


def scan(root: Path, problems: list[str] | None = None, roles: InstalledRoles | None = None) -> list[Item]:
    """Every item under ``root``, in a stable order (project, layout, role, step). ``roles``: the
    plugins whose declarations name verl's own caches (default: as a run would load them)."""
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


def scan_any(root: Path | str, problems: list[str]) -> list[Item]:
    """Items of a local directory (which must exist) or of a remote store's URL."""
    return scan_remote(root, problems) if isinstance(root, str) else scan(existing_dir(root), problems)


def item_store(item: Item, root: Path | None = None) -> StepStore:
    """The store holding ``item``'s step (local, or the object store of its URL), for upkeep that needs
    no role context (usage record, files, removal); ``root`` anchors local removals."""
    if isinstance(item.path, Path):
        return StepStore(item.path.parent, item.role, {}, dump_dir=root)
    return StepStore(item.path.parent, item.role, {}, backend=FsspecFiles(open_remote(str(item.path))[0]))


def step_ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3,5"``."""
    runs: list[list[int]] = []
    for value in sorted(set(steps)):
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# ---------------------------------------------------------------- remote stores


def _step_of(folder: tuple[str, ...], committed: set[tuple[str, ...]]) -> tuple[str, ...] | None:
    """The step directory (as name parts) a data file in ``folder`` belongs to, or None."""
    if not folder or folder in committed:
        return folder or None
    in_part = len(folder) > 1 and PART_NAME.fullmatch(folder[-1])
    if in_part and (folder[:-1] in committed or STEP_NAME.fullmatch(folder[-2])):
        return folder[:-1]
    return folder if STEP_NAME.fullmatch(folder[-1]) else None


def scan_remote(url: str, problems: list[str]) -> list[Item]:
    """Every step under ``url`` from one recursive listing: committed (``meta.json`` read and
    checked by the store's reader), damaged or partial. Nothing is written."""
    fs, root = open_remote(url)
    try:
        listing: dict[str, Any] = fs.find(root.path, detail=True)
    except FileNotFoundError:
        return []
    prefix = root.path.rstrip("/") + "/"
    sizes = {
        tuple(str(name)[len(prefix) :].split("/")): int(info.get("size") or 0)
        for name, info in listing.items()
        if str(name).startswith(prefix)
    }
    committed = {rel[:-1] for rel in sizes if rel[-1] == META_NAME and len(rel) > 1 and STEP_NAME.fullmatch(rel[-2])}
    members: dict[tuple[str, ...], list[tuple[str, ...]]] = {step: [] for step in committed}
    for rel in sizes:
        step = _step_of(rel[:-1], committed) if DATA_NAME.fullmatch(rel[-1]) else None
        if step is not None:
            members.setdefault(step, []).append(rel)
    items = []
    for step_parts in sorted(members, key=lambda s: (s[:-1], int(s[-1]))):
        project, layout, role_dir = _where(step_parts[:-1])
        location = _location(root, step_parts)
        item = Item(location, project, layout, role_dir or "-", int(step_parts[-1]), "partial")
        item.files = [_location(root, rel) for rel in members[step_parts]]
        item.size = sum(sizes[rel] for rel in members[step_parts])
        if step_parts in committed:
            meta_key = (*step_parts, META_NAME)
            item.size += sizes[meta_key]
            _read_commit(item, FsspecFiles(fs), (*step_parts, USAGE_NAME) in sizes)
        else:
            item.problems.append(f"{location}: {PARTIAL}")
        items.append(item)
    return items


def _location(root: RemotePath, parts: tuple[str, ...]) -> Any:
    return functools.reduce(operator.truediv, parts, root)


def _read_commit(item: Item, backend: FsspecFiles, used: bool) -> None:
    """Fill ``item`` from its ``meta.json`` (checked by the store's reader) or mark it damaged."""
    try:
        store, meta = open_step(item.path, backend)
        item.note_usage(store.usage(int(item.path.name)) if used else None)
    except (CorruptCacheError, OSError) as exc:
        item.state, item.problems = "damaged", [str(exc)]
        return
    except Exception as exc:  # whatever a forged meta.json provokes is a damaged step, never a traceback
        item.state, item.problems = "damaged", [f"{item.path}/meta.json: {type(exc).__name__}: {exc}"]
        return
    item.state = "complete"
    item.describe(meta)
