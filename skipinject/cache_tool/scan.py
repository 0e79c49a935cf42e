"""Finding and classifying the steps under a dump directory or a remote store's URL, no tensor loaded.

One walk through the store's backend for both; what it cannot make sense of is a ``damaged`` item
with one line saying why.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import Any

from skipinject.cache_tool.common import existing_dir
from skipinject.cache_tool.plugins import InstalledRoles, Upstream
from skipinject.errors import CorruptCacheError, UntrustedCacheError
from skipinject.store import (
    MAX_DEPTH,
    META_NAME,
    ROWS_DIR,
    STEP_NAME,
    Backend,
    StepMeta,
    StepStore,
    StoredFile,
    backend_for,
    is_ours,
    list_step,
    local_kind,
    location_for,
    read_json,
    read_record,
    unresolved_problem,
    walk,
)
from skipinject.verl.layout import DEFAULT_PROJECT, layout_values

#: A step directory's name: the store's rule (decimal, no leading zeros), anchored for ``match``.
STEP_RE = re.compile(rf"^(?:{STEP_NAME.pattern})$")
PARTIAL = "data files but no meta.json (a save was interrupted, or is running)"


def has_meta(step_dir: Path) -> bool:
    return local_kind(step_dir / META_NAME, follow=True) is not None


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
    meta: StepMeta | None = field(default=None, repr=False)
    upstream: Upstream | None = field(default=None, repr=False)  # the declaration of a foreign item
    decoded: int | None = None  # its size once compressed files are decoded (None: as stored)
    hits: int = 0  # times served, by its usage record
    served: float | None = None  # when last served (unix time), None: never (or no record)
    backend: Backend = field(default_factory=lambda: backend_for(None), repr=False)

    @property
    def created_time(self) -> float:
        """``meta.json``'s ``created``, else its files' time."""
        for layout in ("%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S") if self.created else ():
            with contextlib.suppress(ValueError):
                return datetime.strptime(str(self.created)[:24], layout).timestamp()
        return self.mtime

    @property
    def last_used(self) -> float:
        """When it was last served, else when it was written: what ``prune --max-size`` goes by."""
        return self.served if self.served is not None else self.created_time

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

    def store(self, root: Path | None = None) -> StepStore:
        """The store holding this step, for upkeep that needs no role context; ``root`` anchors removals."""
        return StepStore(self.path.parent, self.role, {}, dump_dir=root, backend=self.backend)


def _where(names: Sequence[str]) -> tuple[str, str, str | None]:
    """(project, layout, the step's parent or None when that is the layout) from the names above a step."""
    for index in range(len(names) - 1, -1, -1):
        if layout_values(names[index]) is not None:
            return (names[index - 1] if index else "-"), names[index], names[-1] if index + 1 < len(names) else None
    if len(names) > 1 and names[-2] == DEFAULT_PROJECT:  # {dump_dir}/skipinject_default/{role}/{step}
        return DEFAULT_PROJECT, "-", names[-1]
    return (names[-1] if names else "-"), "-", None


def classify(
    step_dir: Path, upstreams: Sequence[Upstream] = (), backend: Backend | None = None, root: Path | None = None
) -> list[Item]:
    """The items of one step directory (none, one, or ours beside verl's), its trust checked from ``root``
    down (as a run checks its dump directory's). Never raises."""
    backend = backend or backend_for(None)
    project, layout, role_dir = _where(PurePosixPath(str(step_dir.parent)).parts)  # a RemotePath too
    ours_dir = STEP_RE.match(step_dir.name) is not None
    step = int(step_dir.name) if ours_dir else None

    def new(state: str, files: list[Path], problem: str | None = None) -> Item:
        found = Item(step_dir, project, layout, role_dir or "-", step, state, files=files, backend=backend)
        found.problems += [problem] if problem else []
        return found

    try:
        listing = list_step(backend, step_dir)  # the store's listing: no link followed, part directories too
        listed = {step_dir / f.part / f.name: f for f in listing if f.kind == "file"}
        items = []
        foreign = _foreign(step_dir, listed, upstreams)
        if foreign is not None:  # verl's own pickles: only their presence and size
            foreign.project, foreign.layout, foreign.role = project, layout, role_dir or foreign.role
            items.append(foreign)
            step = step if ours_dir else foreign.step
        ours_data = [path for path in listed if is_ours(path.name)]
        meta_path = step_dir / META_NAME
        ours = None
        if meta_path not in listed and any(not f.part and f.name == META_NAME for f in listing):
            ours = new("damaged", [], f"{meta_path}: not a regular file")
        elif ours_dir and meta_path in listed:
            ours = _our_step(new("complete", [meta_path]), layout, foreign is not None, root)
            if ours is not None and ours.state == "damaged":
                ours.rows, ours.files = None, [meta_path, *ours_data]  # what a damaged meta.json claims is not shown
        if ours is None and ours_dir and ours_data:
            ours = new("partial", ours_data, f"{step_dir}: {PARTIAL}")
        elif ours is None and ours_dir and meta_path in listed and foreign is None:
            ours = new("damaged", [], f"{meta_path}: not a skipinject commit record (no format marker)")
        items += [ours] if ours is not None else []
        for found in items:  # size and time of its regular files
            found.files = [path for path in found.files if path in listed]
            found.size = sum(listed[path].size for path in found.files)
            found.mtime = max((listed[path].mtime for path in found.files), default=0.0)
            if found.state != "damaged" and isinstance(found.meta, StepMeta) and found.meta.expansion:
                found.decoded = found.size + found.meta.expansion
        return items
    except Exception as exc:  # a weird tree is reported, never a traceback
        return [new("damaged", [], f"{step_dir}: cannot read it ({type(exc).__name__}: {exc})")]


def _foreign(step_dir: Path, listed: Mapping[Path, StoredFile], upstreams: Sequence[Upstream]) -> Item | None:
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
            item = Item(step_dir, "", "", upstream.role, int(found.group(1)), "foreign", upstream.format.label)
            item.files, item.upstream, item.parts = paths, upstream, len(paths) if upstream.per_part else 1
            key = upstream.format.rows_key  # rows without unpickling, where verl writes them beside each file
            with contextlib.suppress(Exception):
                item.rows = None if key is None else sum(int(read_json(p.parent / META_NAME)[key]) for p in paths)
            return item
    return None


def _our_step(item: Item, layout: str, beside_foreign: bool, root: Path | None = None) -> Item | None:
    """``item`` as its ``meta.json`` describes it (each value only of the right type), its files checked by
    size; None when it is not ours. ``meta.json`` is read once."""
    try:
        meta = read_record(item.path, item.backend)
    except CorruptCacheError as exc:
        item.state, item.problems = "damaged", [str(exc)]
        return None if beside_foreign else item  # beside verl's pickle: verl's own meta.json
    if meta is None:
        return None  # not ours: verl's (beside its pickles) or unknown (reported by the caller)
    item.meta, item.created, item.writer = meta, meta.created, meta.writer
    item.role = meta.role if meta.role is not None else item.role
    item.rows, item.parts = meta.rows, meta.part_count
    if item.path.parent.name == ROWS_DIR and meta.generated:
        item.layout = f"{layout}/{ROWS_DIR}"  # rows records of action=match, numbered on their own
    try:
        store, item.meta = StepStore.at(item.path, item.backend, root, meta)
        item.files += [path for path, _ in store.precheck(int(item.path.name), item.meta)]
        usage = store.usage(int(item.path.name))
        if usage is not None:
            item.hits, item.served = usage.hits, usage.last_served
    except UntrustedCacheError as exc:  # intact perhaps, but in a tree another user controls
        item.state, item.problems = "untrusted", [str(exc)]
    except (CorruptCacheError, OSError, ValueError, TypeError, AttributeError) as exc:
        item.state = "damaged"
        item.problems = [str(exc) if isinstance(exc, CorruptCacheError) else f"{item.path}: {exc}"]
    return item


def step_dirs(
    backend: Backend, root: Path, problems: list[str], upstreams: Sequence[Upstream], max_depth: int = MAX_DEPTH
) -> Iterator[Path]:
    """Step directories at or under ``root`` (:func:`skipinject.store.walk`), verl's own by ``upstreams``."""

    def foreign(name: str) -> set[str] | None:
        formats = [u for u in upstreams if u.directory.match(name)]
        if not formats:
            return None
        known = {u.base_name for u in formats if not u.per_part}
        return known | {u.format.inputs_file for u in formats if u.format.inputs_file is not None}

    return walk(backend, root, problems, foreign, max_depth)


def scan(
    root: Path | str, problems: list[str] | None = None, roles: InstalledRoles | None = None, max_depth: int = MAX_DEPTH
) -> list[Item]:
    """Every item under a local directory or a remote store's URL (at most ``max_depth`` levels below it), by
    project, layout, role and step."""
    problems = [] if problems is None else problems
    if isinstance(root, str):  # verl's pickles are never looked for in an object store
        backend, where, upstreams = backend_for(root), location_for(root), []
        if backend.stat(where) is None:
            return []
    else:
        backend, where = backend_for(None), existing_dir(root)
        upstreams = (roles or InstalledRoles()).upstreams()
    found = step_dirs(backend, where, problems, upstreams, max_depth)
    local = where if backend.checks_owners else None  # directories others could write: as a run sees them
    items = [item for directory in found for item in classify(directory, upstreams, backend, local)]
    items.sort(key=lambda i: (i.project, i.layout, i.role, i.step if i.step is not None else -1, i.kind))
    redirect = unresolved_problem(root) if isinstance(root, Path) else None
    for item in items if redirect is not None else ():  # as a run sees such a dump_dir: not loaded
        if item.state == "complete":
            item.state = "untrusted"
            item.problems.append(f"{redirect}: another user could redirect it; a run neither loads nor saves there")
    return items
