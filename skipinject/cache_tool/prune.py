"""``prune`` and ``rm``: remove skipinject's steps and leftovers of interrupted saves (never verl's pickles).

What the options choose is checked step by step (never a save still running, never through a link),
then removed by the step's store (:meth:`~skipinject.store.StepStore.remove`).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from skipinject.cache_tool.common import (
    FOUND,
    CommandError,
    default_dump_dir,
    emit_json,
    human_size,
    mutable_root,
    say,
    shorten,
    shown,
)
from skipinject.cache_tool.scan import STEP_RE, Item, scan
from skipinject.cache_tool.verify import damage
from skipinject.errors import CacheError
from skipinject.store import META_NAME, StepMeta, StoredFile, local_kind, remove_leftovers

_AGE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_SIZE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)(?:i?b)?$")
#: Sizes beyond this (8 EiB) name no store: refused, not overflowed.
MAX_SIZE = float(1 << 63)
#: A data file written this recently may belong to a save still running: never touched.
MIN_AGE = 600.0


def parse_age(text: str) -> float:
    match = _AGE.match(text.strip().lower())
    if not match:
        raise CommandError(f"bad age {text!r}: use a number with s, m, h, d or w (e.g. 7d, 12h)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_size(text: str) -> int:
    """``500G`` -> bytes (K, M, G, T, P: powers of 1024; a plain number is bytes)."""
    match = _SIZE.match(text.strip().lower())
    if not match:
        raise CommandError(f"bad size {shorten(shown(text), 60)!r}: use a number with K, M, G or T (e.g. 500G, 10M)")
    size = float(match.group(1)) * 1024 ** "_kmgtp".index(match.group(2) or "_")
    if not size < MAX_SIZE:  # a 400-digit number is inf as a float
        raise CommandError(f"bad size {shorten(shown(text), 60)!r}: more than any store holds (at most 8 EiB)")
    return int(size)


def cmd_prune(
    dump_dir: Path | str | None,
    *,
    keep_last: int | None,
    older_than: float | str | None,
    partial: bool,
    damaged: bool,
    dry_run: bool,
    as_json: bool,
    max_size: int | str | None = None,
    by: str = "created",
    now: float | None = None,
) -> int:
    """``max_size`` and ``older_than`` as given on the command line (``500G``, ``7d``) or in bytes and seconds."""
    root = dump_dir or default_dump_dir()
    max_size = parse_size(max_size) if isinstance(max_size, str) else max_size
    older_than = parse_age(older_than) if isinstance(older_than, str) else older_than
    if keep_last is None and older_than is None and max_size is None and not partial and not damaged:
        raise CommandError(
            "nothing to prune: give --keep-last N, --max-size SIZE, --older-than AGE, --partial or --damaged"
        )
    if keep_last is not None and keep_last < 0:
        raise CommandError("--keep-last must be 0 or more")
    if isinstance(root, Path):
        mutable_root(root, "prune")
    now = time.time() if now is None else now
    problems: list[str] = []
    items = scan(root, problems)
    if problems and not items:  # an unlistable root (a denied listing) removes nothing: not "removed 0"
        raise CommandError(f"unreadable: {problems[0]}; nothing removed")
    for problem in problems:
        say(f"unreadable: {problem}", err=True)
    criteria: dict[str, Any] = {"keep_last": keep_last, "older_than": older_than, "max_size": max_size, "by": by}
    chosen = select(items, partial=partial, damaged=damaged, now=now, **criteria)
    outcome = act(root, items, chosen, partial=partial, dry_run=dry_run, now=now)
    render("prune", outcome, dry_run, as_json, dump_dir=str(root))
    return 0


def cmd_rm(steps: Sequence[Path | str], *, dry_run: bool, as_json: bool, now: float | None = None) -> int:
    """Remove the named steps through :func:`act` (the same checks and removal as ``prune``)."""
    now = time.time() if now is None else now
    outcome: dict[str, Any] = {"removed": [], "skipped": [], "leftovers": None, "files": 0, "bytes": 0}
    items, named, wrong = [], set(), []
    for path in steps:  # every name checked before anything is removed; a step named twice counts once
        try:
            item = _named_step(path)
        except CommandError as exc:
            wrong.append(str(exc))
            continue
        if str(item.path) not in named:
            named.add(str(item.path))
            items.append(item)
    if wrong:
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise CommandError(f"{wrong[0]}{more}; nothing removed")
    for item in items:
        done = act(item.path.parent, [item], [(item, "named")], partial=False, dry_run=dry_run, now=now)
        for key in ("removed", "skipped", "files", "bytes"):
            outcome[key] += done[key]
    render("rm", outcome, dry_run, as_json)
    return FOUND if outcome["skipped"] else 0


def _named_step(path: Path | str) -> Item:
    """The skipinject step at ``path`` (a local step directory or a step's URL); CommandError otherwise."""
    if isinstance(path, Path):
        path = Path(os.path.abspath(path))  # ``2`` and ``./2`` name one step
    name = path.name if isinstance(path, Path) else path.rstrip("/").rpartition("/")[2]
    if not STEP_RE.match(name):  # ``rm /`` walks nothing: only a directory named by a number is a step
        raise CommandError(f"{shown(path)}: no skipinject step there (a step directory is named by its number)")
    if isinstance(path, Path):
        mutable_root(path.parent, "rm")
        if local_kind(path) == "link":  # its target is never walked
            raise CommandError(f"{path}: a symbolic link, not a step directory; skipinject never removes through one")
    # the step directory alone (a remote step: listed from its parent), never what lies below it
    where, depth = (path, 0) if isinstance(path, Path) else (path.rstrip("/").rpartition("/")[0], 1)
    found = [item for item in scan(where, [], max_depth=depth) if str(item.path) == str(path).rstrip("/")]
    ours = [item for item in found if item.kind == "skipinject"]
    if ours:
        return ours[0]
    if found:
        raise CommandError(f"{path}: verl's own cache ({found[0].kind}); skipinject never removes it")
    raise CommandError(f"{path}: no skipinject step there")


def select(
    items: Sequence[Item],
    *,
    keep_last: int | None,
    older_than: float | None,
    partial: bool,
    damaged: bool,
    now: float,
    max_size: int | None = None,
    by: str = "created",
) -> list[tuple[Item, str]]:
    """The items the options choose, each with the reason."""
    chosen: list[tuple[Item, str]] = []
    ours = [item for item in items if item.kind == "skipinject"]
    for item in (item for item in ours if damaged and item.state == "complete"):
        problems = damage(item)  # verify's question: every byte checked
        if problems:
            item.state, item.problems = "damaged", problems
    by_role: dict[tuple[str, str, str, Path], list[Item]] = {}
    for item in (item for item in ours if item.state == "complete"):
        by_role.setdefault((item.project, item.layout, item.role, item.path.parent), []).append(item)
    for members in by_role.values() if keep_last is not None or older_than is not None else ():
        members.sort(key=lambda i: i.step or 0)
        kept = {id(item) for item in members[len(members) - keep_last :]} if keep_last else set()
        for item in members:
            used = item.last_used if by == "served" else item.created_time
            if id(item) in kept or (older_than is not None and now - used < older_than):
                continue
            why = f"{'unused' if by == 'served' else 'older'} for longer than --older-than"
            chosen.append((item, why if keep_last is None else "beyond --keep-last"))
    if max_size is not None:
        taken = {id(item) for item, _ in chosen}
        rest = [item for members in by_role.values() for item in members if id(item) not in taken]
        total = sum(item.size for item in rest)
        for item in sorted(rest, key=lambda i: i.last_used):
            if total <= max_size:
                break
            total -= item.size
            chosen.append((item, "least recently served beyond --max-size"))
    for item in ours:
        if (partial and item.state == "partial") or (damaged and item.state == "damaged"):
            chosen.append((item, "interrupted save" if item.state == "partial" else "damaged"))
    return chosen


def act(
    root: Path | str, items: Sequence[Item], chosen: list[tuple[Item, str]], *, partial: bool, dry_run: bool, now: float
) -> dict[str, Any]:
    """Remove (or, ``dry_run``, count) what is chosen and safe to remove now; the ``--json`` fields."""
    outcome: dict[str, Any] = {"removed": [], "skipped": [], "leftovers": None, "files": 0, "bytes": 0}
    leftovers: list[Any] | None = None
    if partial and isinstance(root, Path):  # abandoned files of our saves, by the store's rule
        stores = {item.path.parent: item.store() for item in items if item.kind == "skipinject"}
        leftovers = [found for _, store in sorted(stores.items()) for found in store.leftovers(now)]
    abandoned = {leftover.path for leftover in leftovers or ()}
    for item, reason in chosen:
        problem = _unsafe(item, root, now)
        if problem is None and item.state == "partial" and leftovers is not None and not set(item.files) <= abandoned:
            problem = "a save may still be writing it (its writer is alive, or it changed in the last 10 minutes)"
        if problem:
            outcome["skipped"].append({"path": str(item.path), "reason": problem})
            continue
        if dry_run:
            ours = _our_files(item)
            count, size = len(ours), sum(found.size for found in ours)
        else:  # locally from descriptors opened once from ``root``: a step swapped for a link removes nothing
            try:
                only = _named(item) if item.state == "partial" else None
                count, size = item.store(root if isinstance(root, Path) else None).remove(int(item.path.name), only)
            except (CacheError, OSError, ValueError) as exc:  # e.g. a read-only file system, an immutable directory
                why = f"{exc.strerror} ({exc.filename})" if isinstance(exc, OSError) and exc.strerror else exc
                count, size, problem = 0, 0, f"not removed: {why}"
        outcome["files"] += count
        outcome["bytes"] += size
        if problem:
            outcome["skipped"].append({"path": str(item.path), "reason": problem})
            continue
        outcome["removed"].append(
            {"path": str(item.path), "role": item.role, "step": item.step, "reason": reason, "size": size}
        )
    if leftovers is not None:
        gone = {Path(entry["path"]) for entry in outcome["removed"]}
        rest = [leftover for leftover in leftovers if not gone & set(leftover.path.parents)]
        count, size = (len(rest), sum(left.size for left in rest)) if dry_run else remove_leftovers(rest)
        outcome["leftovers"] = {"files": count, "bytes": size}
        outcome["files"] += count
        outcome["bytes"] += size
    return outcome


def _named(item: Item) -> set[str]:
    """``part/name`` of the files that make up ``item`` (``/name`` in the step directory itself)."""
    if item.state != "partial" and isinstance(item.meta, StepMeta):
        with contextlib.suppress(CacheError):  # a damaged step's parts may not parse: its files, as listed
            return item.meta.named() | {f"/{META_NAME}"}
    return {f"/{p.name}" if p.parent == item.path else f"{p.parent.name}/{p.name}" for p in item.files}


def _our_files(item: Item) -> list[StoredFile]:
    """The files of ``item`` that removing it deletes, as its store lists them (:meth:`StepStore.removal`)."""
    return item.store().removal(int(item.path.name), _named(item) if item.state == "partial" else None)


def _unsafe(item: Item, root: Path | str, now: float) -> str | None:
    """Why ``item`` must not be touched now, or None: it cannot be listed (a link, gone), or a file
    of it that is not part of its commit (or any, for an interrupted save) changed too recently."""
    if item.step is None or item.kind != "skipinject":
        return "not a skipinject step"
    try:
        ours = _our_files(item)
    except (CacheError, OSError) as exc:
        return f"cannot list it ({exc})"
    named = _named(item)
    for found in ours:
        if found.usage:
            continue  # a hit's record, not a save
        if now - found.mtime < MIN_AGE and (f"{found.part}/{found.name}" not in named or item.state != "complete"):
            return f"a save may still be writing it ({found.name} changed {now - found.mtime:.0f} s ago)"
    return None


def render(command: str, outcome: dict[str, Any], dry_run: bool, as_json: bool, **head: str) -> None:
    """``head``: the ``--json`` fields before the outcome's."""
    if as_json:
        emit_json(command, {**head, "dry_run": dry_run, **outcome})
        return
    verb = "would remove" if dry_run else "removed"
    for entry in outcome["removed"]:
        say(f"{verb} {entry['path']} ({entry['reason']}, {human_size(entry['size'])})")
    for entry in outcome["skipped"]:
        say(f"kept {entry['path']}: {entry['reason']}")
    leftovers = outcome["leftovers"]
    if leftovers is not None and leftovers["files"]:
        say(f"{verb} {leftovers['files']} leftover file(s) of interrupted saves ({human_size(leftovers['bytes'])})")
    say(f"{verb} {len(outcome['removed'])} step(s), {outcome['files']} file(s), {human_size(outcome['bytes'])}")
