"""``prune``: remove skipinject's steps and leftovers of interrupted saves (never verl's pickles).

Split into select (which steps the options choose), a safety check per step (never a save still
running, never through a link), the removal (one small function, :func:`remove_step`) and render.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from skipinject.cache_tool.common import OK, CommandError, mutable_root
from skipinject.cache_tool.render import emit_json, human_size, say, schema
from skipinject.cache_tool.scan import Item, scan
from skipinject.cache_tool.verify import damage
from skipinject.store.files import entries, regular_stat
from skipinject.store.format import META_NAME, is_ours, is_part_name

_AGE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
#: A data file written this recently may belong to a save still running: never touched.
MIN_AGE = 600.0


def parse_age(text: str) -> float:
    match = _AGE.match(text.strip().lower())
    if not match:
        raise CommandError(f"bad age {text!r}: use a number with s, m, h, d or w (e.g. 7d, 12h)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _created_ts(item: Item) -> float:
    if item.created:
        with contextlib.suppress(ValueError):
            return time.mktime(time.strptime(item.created[:19], "%Y-%m-%dT%H:%M:%S"))
    return item.mtime


def cmd_prune(
    root: Path,
    *,
    keep_last: int | None,
    older_than: float | None,
    partial: bool,
    damaged: bool,
    dry_run: bool,
    as_json: bool,
    now: float | None = None,
) -> int:
    if keep_last is None and older_than is None and not partial and not damaged:
        raise CommandError("nothing to prune: give --keep-last N, --older-than AGE, --partial or --damaged")
    if keep_last is not None and keep_last < 0:
        raise CommandError("--keep-last must be 0 or more")
    mutable_root(root, "prune")
    now = time.time() if now is None else now
    items = scan(root)
    chosen = select(items, keep_last=keep_last, older_than=older_than, partial=partial, damaged=damaged, now=now)
    outcome = act(root, items, chosen, partial=partial, dry_run=dry_run, now=now)
    if as_json:
        emit_json({"schema": schema("prune"), "dump_dir": str(root), "dry_run": dry_run, **outcome})
    else:
        render(outcome, dry_run=dry_run)
    return OK


# ---------------------------------------------------------------- select


def select(
    items: Sequence[Item],
    *,
    keep_last: int | None,
    older_than: float | None,
    partial: bool,
    damaged: bool,
    now: float,
) -> list[tuple[Item, str]]:
    """The items the options choose, each with the reason."""
    chosen: list[tuple[Item, str]] = []
    for item in items if damaged else ():
        if item.kind == "skipinject" and item.state == "complete":
            problems = damage(item)  # verify's question: every byte checked by the store
            if problems:
                item.state, item.problems = "damaged", problems
    by_role: dict[tuple[str, str, str, Path], list[Item]] = {}
    for item in items:
        if item.kind == "skipinject" and item.state == "complete":
            by_role.setdefault((item.project, item.layout, item.role, item.path.parent), []).append(item)
    if keep_last is not None or older_than is not None:
        for members in by_role.values():
            members.sort(key=lambda i: i.step or 0)
            keep = set()
            if keep_last is not None:
                keep = {id(i) for i in members[len(members) - keep_last :]} if keep_last else set()
            for item in members:
                if id(item) in keep:
                    continue
                if older_than is not None and now - _created_ts(item) < older_than:
                    continue
                chosen.append((item, "older than --older-than" if keep_last is None else "beyond --keep-last"))
    for item in items:
        if item.kind != "skipinject":
            continue
        if partial and item.state == "partial":
            chosen.append((item, "interrupted save"))
        if damaged and item.state == "damaged":
            chosen.append((item, "damaged"))
    return chosen


# ---------------------------------------------------------------- act


def act(
    root: Path, items: Sequence[Item], chosen: list[tuple[Item, str]], *, partial: bool, dry_run: bool, now: float
) -> dict[str, Any]:
    """Remove (or, ``dry_run``, count) what is chosen and safe to remove now; the ``--json`` fields."""
    root_real = root.resolve()
    removed: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    files_total = bytes_total = 0
    garbage_found = _leftovers(items, now) if partial else None
    for item, reason in chosen:
        problem = _unsafe(item, root_real, now)
        abandoned = garbage_found is None or set(item.files) <= garbage_found[1]
        if problem is None and item.state == "partial" and not abandoned:
            problem = "a save may still be writing it (its writer is alive, or it changed in the last 10 minutes)"
        if problem:
            skipped.append({"path": str(item.path), "reason": problem})
            continue
        count, size = (len(_our_files(item)), sum(_sizes(_our_files(item)))) if dry_run else remove_step(item, root)
        files_total += count
        bytes_total += size
        removed.append({"path": str(item.path), "role": item.role, "step": item.step, "reason": reason, "size": size})
    leftovers = None
    if garbage_found is not None:
        from skipinject.store import garbage

        gone = {Path(entry["path"]) for entry in removed}
        rest = [leftover for leftover in garbage_found[0] if not gone & set(leftover.path.parents)]
        counted = (len(rest), sum(leftover.size for leftover in rest))
        leftovers = counted if dry_run else garbage.remove_leftovers(rest)
        files_total += leftovers[0]
        bytes_total += leftovers[1]
    return {
        "removed": removed,
        "skipped": skipped,
        "leftovers": None if leftovers is None else {"files": leftovers[0], "bytes": leftovers[1]},
        "files": files_total,
        "bytes": bytes_total,
    }


def _our_files(item: Item) -> list[Path]:
    """The files of ``item`` to delete: skipinject's only (verl's pickles are never deleted)."""
    if item.state == "partial":
        return list(item.files)
    out = []
    directories = [item.path] + [
        item.path / e.name for e in entries(item.path) if e.is_dir(follow_symlinks=False) and is_part_name(e.name)
    ]
    for directory in directories:
        for entry in entries(directory):
            if is_ours(entry.name) and entry.is_file(follow_symlinks=False):
                out.append(directory / entry.name)
    meta = item.path / META_NAME
    if item.kind == "skipinject" and regular_stat(meta) is not None:
        out.append(meta)
    return out


def _sizes(paths: list[Path]) -> list[int]:
    return [info.st_size for info in (regular_stat(p) for p in paths) if info is not None]


def _unsafe(item: Item, root_real: Path, now: float) -> str | None:
    """Why ``item`` must not be touched now, or None."""
    try:
        real = item.path.resolve()
    except OSError as exc:
        return f"cannot resolve it ({exc})"
    if real != root_real and root_real not in real.parents:
        return "it lies outside the dump directory (reached through a link)"
    if item.path.is_symlink():
        return "it is a symbolic link"
    named = set(item.files)
    try:
        ours = _our_files(item)
    except OSError as exc:
        return f"cannot list it ({exc})"
    for path in ours:
        info = regular_stat(path)
        if info is None:
            continue
        if (path not in named or item.state != "complete") and now - info.st_mtime < MIN_AGE:
            return f"a save may still be writing it ({path.name} changed {now - info.st_mtime:.0f} s ago)"
    return None


def remove_step(item: Item, root: Path) -> tuple[int, int]:
    """Delete ``meta.json`` first (the step becomes absent at once), then its data files and empty dirs:
    relative to descriptors opened once from ``root`` (:mod:`skipinject.store.files`), so a step
    swapped for a link after the check removes nothing through it."""
    from skipinject.store.files import remove_step as remove_under

    if item.state == "partial":
        chosen = {p.relative_to(item.path).as_posix() for p in item.files}

        def wanted(part: str, name: str) -> bool:
            return (f"{part}/{name}" if part else name) in chosen

    else:

        def wanted(part: str, name: str) -> bool:
            return is_ours(name) or (not part and name == META_NAME and item.kind == "skipinject")

    try:
        return remove_under(root, item.path, wanted)
    except (OSError, ValueError):
        return 0, 0


def _leftovers(items: Sequence[Item], now: float) -> tuple[list[Any], set[Path]] | None:
    """Abandoned files of our saves (the store's rule, :mod:`skipinject.store.garbage`), or None without it."""
    try:
        from skipinject.store import garbage
    except ImportError:
        return None
    found: list[Any] = []
    for store_dir in sorted({item.path.parent for item in items if item.kind == "skipinject"}):
        found += garbage.find_leftovers(store_dir, now=now)
    return found, {leftover.path for leftover in found}


# ---------------------------------------------------------------- render


def render(outcome: dict[str, Any], *, dry_run: bool) -> None:
    verb = "would remove" if dry_run else "removed"
    for entry in outcome["removed"]:
        say(f"{verb} {entry['path']} ({entry['reason']}, {human_size(entry['size'])})")
    for entry in outcome["skipped"]:
        say(f"kept {entry['path']}: {entry['reason']}")
    leftovers = outcome["leftovers"]
    if leftovers is not None and leftovers["files"]:
        say(f"{verb} {leftovers['files']} leftover file(s) of interrupted saves ({human_size(leftovers['bytes'])})")
    say(f"{verb} {len(outcome['removed'])} step(s), {outcome['files']} file(s), {human_size(outcome['bytes'])}")
