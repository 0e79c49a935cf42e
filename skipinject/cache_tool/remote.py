"""``skipinject cache ls|verify`` on a remote store's URL (``s3://bucket/dir``...).

One recursive listing of the URL gives every object's name and size; steps are the directories
holding our ``meta.json`` (committed) or only our data files (partial). ``meta.json`` is read in
one bounded request and checked by :class:`~skipinject.store.remote.RemoteStepStore`, which also
verifies every file for ``verify`` — the same reader the training run uses. Nothing is written.
"""

from __future__ import annotations

from typing import Any

from skipinject.cache_tool.scan import Item, open_step
from skipinject.errors import CorruptCacheError
from skipinject.store import StepStore
from skipinject.store.format import DATA_NAME, META_NAME, PART_NAME, STEP_NAME
from skipinject.store.meta import StepMeta
from skipinject.store.remote import FsspecFiles, RemotePath, open_remote
from skipinject.store.usage import USAGE_NAME
from skipinject.verl.layout import layout_values


def _where(parts: list[str]) -> tuple[str, str, str | None]:
    """(project, layout, role directory or None) from the names between the root and a step."""
    for index in range(len(parts) - 1, -1, -1):
        if layout_values(parts[index]) is not None:
            role_dir = parts[index + 1] if index + 1 < len(parts) else None
            return (parts[index - 1] if index else "-"), parts[index], role_dir
    return (parts[-1] if parts else "-"), "-", None


def _step_of(relative: list[str], committed: set[tuple[str, ...]]) -> tuple[str, ...] | None:
    """The step directory (as name parts) a data file belongs to, or None."""
    folder = tuple(relative[:-1])
    if not folder:
        return None
    if folder in committed:
        return folder
    if len(folder) > 1 and folder[:-1] in committed and PART_NAME.fullmatch(folder[-1]):
        return folder[:-1]
    if len(folder) > 1 and PART_NAME.fullmatch(folder[-1]) and STEP_NAME.fullmatch(folder[-2]):
        return folder[:-1]
    return folder if STEP_NAME.fullmatch(folder[-1]) else None


def scan_remote(url: str, problems: list[str]) -> list[Item]:
    """Every step under ``url``: committed (``meta.json`` read and checked), damaged or partial."""
    fs, root = open_remote(url)
    try:
        listing: dict[str, Any] = fs.find(root.path, detail=True)
    except FileNotFoundError:
        return []
    prefix = root.path.rstrip("/") + "/"
    sizes: dict[tuple[str, ...], int] = {}
    for name, info in listing.items():
        if str(name).startswith(prefix):
            sizes[tuple(str(name)[len(prefix) :].split("/"))] = int(info.get("size") or 0)
    committed = {rel[:-1] for rel in sizes if rel[-1] == META_NAME and len(rel) > 1 and STEP_NAME.fullmatch(rel[-2])}
    members: dict[tuple[str, ...], list[tuple[str, ...]]] = {step: [] for step in committed}
    for rel in sizes:
        if DATA_NAME.fullmatch(rel[-1]):
            step = _step_of(list(rel), committed)
            if step is not None:
                members.setdefault(step, []).append(rel)
    items = []
    for step_parts in sorted(members, key=lambda s: (s[:-1], int(s[-1]))):
        project, layout, role_dir = _where(list(step_parts[:-1]))
        location = _location(root, step_parts)
        files = members[step_parts]
        item = Item(location, project, layout, role_dir or "-", int(step_parts[-1]), "partial")
        item.files = [_location(root, rel) for rel in files]
        item.size = sum(sizes[rel] for rel in files)
        if step_parts in committed:
            meta_key = (*step_parts, META_NAME)
            item.size += sizes[meta_key]
            _read_commit(item, fs, location, (*step_parts, USAGE_NAME) in sizes)
        else:
            item.problems.append(f"{location}: data files but no meta.json (a save was interrupted, or is running)")
        items.append(item)
    return items


def _location(root: RemotePath, parts: tuple[str, ...]) -> Any:
    for piece in parts:
        root = root / piece
    return root


def _read_commit(item: Item, fs: Any, location: RemotePath, used: bool) -> None:
    """Fill ``item`` from its ``meta.json`` (checked by the store's reader) or mark it damaged."""
    try:
        store, meta = open_remote_step(fs, location)
        item.note_usage(store.usage(int(location.name)) if used else None)
    except (CorruptCacheError, OSError) as exc:
        item.state, item.problems = "damaged", [str(exc)]
        return
    except Exception as exc:  # whatever a forged meta.json provokes is a damaged step, never a traceback
        item.state, item.problems = "damaged", [f"{location}/meta.json: {type(exc).__name__}: {exc}"]
        return
    item.state = "complete"
    item.describe(meta)


def open_remote_step(fs: Any, location: RemotePath) -> tuple[StepStore, StepMeta]:
    """:func:`~skipinject.cache_tool.scan.open_step` of a step in the fsspec filesystem ``fs``."""
    return open_step(location, FsspecFiles(fs))  # type: ignore[arg-type]
