"""Finding steps under a dump directory and classifying them, without loading any tensor.

Every byte under a cache directory is treated as hostile: the walk never follows a symlink, never
opens anything but a regular file (a FIFO would block), reads ``meta.json`` bounded, and turns
whatever it cannot make sense of into a ``damaged`` item with one line saying why.

The store reads one role's steps when the role and the trainer context are known (the engine's
case). Here neither is: :func:`open_step` reads a ``meta.json`` bounded, takes role and context
from it, and hands the step to the store's own :class:`~skipinject.store.StepStore` (``read_meta``,
``verified``, ``load``), so there is still one reader.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from skipinject.errors import CorruptCacheError
from skipinject.store import StepStore
from skipinject.store.compression import expansion
from skipinject.store.files import read_small
from skipinject.store.format import FORMAT, MAX_META_BYTES, META_NAME, PART_NAME, STEP_NAME, is_ours

LAYOUT_RE = re.compile(r"^GBS(-?[0-9]+)_N(-?[0-9]+)_in(-?[0-9]+)_out(-?[0-9]+)$")
#: A step directory's name: the store's rule (decimal, no leading zeros), anchored for ``match``.
STEP_RE = re.compile(rf"^(?:{STEP_NAME.pattern})$")
GENSTEP_RE = re.compile(r"^genstep_([0-9]{1,18})$")  # verl < 0.9 (verl/utils/rollout_skip.py)
V0_FILE = "gen_batch.dp"  # verl's pickled DataProto of a rollout step (V0 trainer, fully async)
V0_INPUT_FILE = "new_batch.dp"  # verl < 0.9 also pickled the input batch beside it
V1_FILE = "tq_batch.pt"  # verl's torch.save payload of one TransferQueue mini-batch: {step}/{k}/
MAX_DEPTH = 8


def read_bounded(path: Path, limit: int = MAX_META_BYTES) -> bytes:
    """A small regular file's bytes, by the store's own bounded reader (:func:`read_small`)."""
    return read_small(path, limit)


def lstat_regular(path: Path) -> os.stat_result | None:
    """``lstat`` of ``path`` if it is a regular file (not a link), else ``None``."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info if stat.S_ISREG(info.st_mode) else None


def _entries(directory: Path) -> list[os.DirEntry[str]]:
    with os.scandir(directory) as found:
        return list(found)


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _is_file(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file(follow_symlinks=False)
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
    state: str  # complete | partial | foreign | damaged
    kind: str = "skipinject"  # skipinject | verl-v0 | verl-v1 | verl-0.8
    rows: int | None = None
    size: int = 0
    parts: int = 0
    created: str | None = None
    writer: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)  # regular files that make up this item
    mtime: float = 0.0  # newest modification time of those files
    meta: dict[str, Any] | None = field(default=None, repr=False)
    decoded: int | None = None  # its size once compressed files are decoded (None: as stored)

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
            "writer": dict(self.writer),
            "problems": list(self.problems),
        }


def _where(step_dir: Path) -> tuple[str, str, str | None]:
    """(project, layout, role directory or None) from the names above a step directory."""
    for ancestor in step_dir.parents:
        if LAYOUT_RE.match(ancestor.name):
            role_dir = step_dir.parent.name if step_dir.parent != ancestor else None
            return ancestor.parent.name, ancestor.name, role_dir
    return step_dir.parent.name, "-", None


def classify(step_dir: Path) -> list[Item]:
    """The items of one step directory (none, one, or ours beside verl's). Never raises."""
    project, layout, role_dir = _where(step_dir)
    try:
        return _classify(step_dir, project, layout, role_dir)
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


def _classify(step_dir: Path, project: str, layout: str, role_dir: str | None) -> list[Item]:
    items: list[Item] = []
    genstep = GENSTEP_RE.match(step_dir.name)
    step = int(genstep.group(1)) if genstep else int(step_dir.name)
    entries = _entries(step_dir)
    files = {e.name: e for e in entries if _is_file(e)}
    subdirs = sorted((e for e in entries if _is_dir(e) and PART_NAME.fullmatch(e.name)), key=lambda e: int(e.name))
    sub_files: dict[str, dict[str, os.DirEntry[str]]] = {}
    for sub in subdirs:
        try:
            sub_files[sub.name] = {e.name: e for e in _entries(Path(sub.path)) if _is_file(e)}
        except OSError:
            sub_files[sub.name] = {}

    # verl's own pickles (never loaded here; only their presence and size).
    foreign: Item | None = None
    if V0_FILE in files:
        kind = "verl-0.8" if genstep else "verl-v0"
        names = [V0_FILE] + ([V0_INPUT_FILE] if V0_INPUT_FILE in files else [])
        paths = [step_dir / name for name in names]
        foreign = Item(step_dir, project, layout, role_dir or "rollout", step, "foreign", kind=kind, files=paths)
        foreign.parts = 1
    v1_parts = []
    for index in range(len(subdirs)):
        if str(index) in sub_files and V1_FILE in sub_files[str(index)]:
            v1_parts.append(step_dir / str(index) / V1_FILE)
        else:
            break
    if v1_parts and foreign is None:
        foreign = Item(step_dir, project, layout, role_dir or "rollout_tq", step, "foreign", kind="verl-v1")
        foreign.files = v1_parts
        foreign.parts = len(v1_parts)
    if foreign is not None:
        _measure(foreign)
        _upstream_rows(foreign)
        items.append(foreign)

    ours_data = [step_dir / n for n in files if is_ours(n)]
    for sub_name, sub_entries in sub_files.items():
        ours_data += [step_dir / sub_name / n for n in sub_entries if is_ours(n)]
    meta_entry = files.get(META_NAME)
    if meta_entry is None and META_NAME in {e.name for e in entries}:
        problem = f"{step_dir}/meta.json: not a regular file"
        items.append(Item(step_dir, project, layout, role_dir or "-", step, "damaged", problems=[problem]))
        return items
    if genstep:
        return items  # verl < 0.9 wrote its own meta.json here; skipinject never writes genstep_ dirs
    if meta_entry is not None:
        item = _our_step(step_dir, project, layout, role_dir, step, foreign is not None)
        if item is not None and item.state == "damaged":
            item.rows, item.size, item.mtime = None, 0, 0.0  # what a damaged meta.json claims is not shown
            item.files = [step_dir / META_NAME, *ours_data]
            _measure(item)
        if item is not None:
            items.append(item)
            return items
    if ours_data:
        item = Item(step_dir, project, layout, role_dir or "-", step, "partial", files=ours_data)
        item.problems.append(f"{step_dir}: data files but no meta.json (a save was interrupted, or is running)")
        _measure(item)
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


def _measure(item: Item) -> None:
    kept = []
    for path in item.files:
        info = lstat_regular(path)
        if info is None:
            continue
        kept.append(path)
        item.size += info.st_size
        item.mtime = max(item.mtime, info.st_mtime)
    item.files = kept


def _upstream_rows(item: Item) -> None:
    """verl 0.9 writes ``num_trajectories`` beside each ``tq_batch.pt``: rows without unpickling."""
    if item.kind != "verl-v1":
        return
    total = 0
    for path in item.files:
        try:
            record = json.loads(read_bounded(path.parent / META_NAME, 1 << 16))
            total += int(record["num_trajectories"])
        except Exception:
            return
    item.rows = total


def load_meta_json(path: Path) -> dict[str, Any] | None:
    """A step's ``meta.json`` as JSON if it carries skipinject's format marker, else ``None``.

    Raises :class:`CorruptCacheError` when it cannot be read or parsed.
    """
    try:
        raw = read_small(path)
        meta = json.loads(raw)
    except CorruptCacheError:
        raise
    except (OSError, ValueError, RecursionError) as exc:
        raise CorruptCacheError(f"{path}: unreadable meta.json ({exc})") from exc
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


def open_step(step_dir: Path) -> tuple[StepStore, dict[str, Any]]:
    """The store holding ``step_dir`` (role and context from its own ``meta.json``) and the checked meta.

    Built on the store's reader: the meta is checked by :meth:`StepStore.read_meta`, after a bounded
    read here made sure ``meta.json`` is a small regular file. Raises CorruptCacheError, or
    FileNotFoundError when the step holds no skipinject ``meta.json``.
    """
    if not STEP_RE.match(step_dir.name):
        raise CorruptCacheError(f"{step_dir}: not a step directory (its name is not a step number)")
    role, context = step_identity(load_meta_json(step_dir / META_NAME), step_dir)
    store = StepStore(step_dir.parent, role, context)
    checked = store.read_meta(int(step_dir.name))
    return store, checked


def named_files(store: StepStore, step: int, meta: dict[str, Any]) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every data file ``meta.json`` names, with its record (the store's own reading of parts)."""
    yield from store.named_files(step, meta)


def precheck(store: StepStore, step: int, meta: dict[str, Any]) -> list[tuple[Path, int]]:
    """Every named file is a regular file (no link, FIFO) of its recorded size; before the store opens it."""
    out = []
    for path, spec in named_files(store, step, meta):
        if path.parent != store.step_dir(step) and os.path.islink(path.parent):
            raise CorruptCacheError(f"{path.parent}: part directory is a symbolic link")
        try:
            info = os.lstat(path)
        except FileNotFoundError as exc:
            raise CorruptCacheError(f"{path}: missing (named by meta.json)") from exc
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCacheError(f"{path}: not a regular file (link, FIFO or device)")
        if info.st_size != spec.get("size"):
            raise CorruptCacheError(f"{path}: {info.st_size} bytes, meta.json says {spec.get('size')} (truncated?)")
        out.append((path, info.st_size))
    return out


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
    item.meta = raw
    if isinstance(raw.get("role"), str):
        item.role = raw["role"]
    item.created = raw.get("created") if isinstance(raw.get("created"), str) else None
    writer = raw.get("writer")
    item.writer = {str(k): str(v) for k, v in writer.items()} if isinstance(writer, dict) else {}
    item.rows = raw.get("rows") if type(raw.get("rows")) is int else None
    item.parts = len(raw["parts"]) if isinstance(raw.get("parts"), list) else 0
    try:
        store, meta = open_step(step_dir)
        item.meta = meta
        sized = precheck(store, step, meta)
        item.files += [path for path, _ in sized]
    except (CorruptCacheError, OSError, ValueError, TypeError, AttributeError) as exc:
        item.state = "damaged"
        item.problems.append(str(exc) if isinstance(exc, CorruptCacheError) else f"{step_dir}: {exc}")
    _measure(item)
    if item.state != "damaged" and item.meta is not None and expansion(item.meta):
        item.decoded = item.size + expansion(item.meta)
    return item


# ---------------------------------------------------------------- walking


def _looks_like_step(directory: Path, entries: list[os.DirEntry[str]]) -> bool:
    if not (STEP_RE.match(directory.name) or GENSTEP_RE.match(directory.name)):
        return False
    for entry in entries:
        if entry.name in (META_NAME, V0_FILE, V0_INPUT_FILE) or is_ours(entry.name):
            return True
        if PART_NAME.fullmatch(entry.name) and _is_dir(entry):
            return True
    return False


def step_dirs(root: Path, problems: list[str] | None = None) -> Iterator[Path]:
    """Step directories at or under ``root``; never follows a link, never leaves ``root``."""
    stack = [(root, 0)]
    while stack:
        directory, depth = stack.pop()
        try:
            entries = _entries(directory)
        except OSError as exc:
            if problems is not None:
                problems.append(f"{directory}: cannot list it ({type(exc).__name__}: {exc})")
            continue
        if _looks_like_step(directory, entries):
            yield directory
            continue
        if depth >= MAX_DEPTH:
            continue
        children = sorted((e for e in entries if _is_dir(e)), key=lambda e: e.name, reverse=True)
        stack.extend((Path(e.path), depth + 1) for e in children)


def scan(root: Path, problems: list[str] | None = None) -> list[Item]:
    """Every item under ``root``, in a stable order (project, layout, role, step)."""
    items = [item for directory in step_dirs(root, problems) for item in classify(directory)]
    items.sort(key=lambda i: (i.project, i.layout, i.role, i.step if i.step is not None else -1, i.kind))
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
