"""``ls``: projects, layouts, roles and steps, with size, age, writer and state (``meta.json`` only)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from skipinject.cache_tool.common import OK, scan_any, writer_text
from skipinject.cache_tool.render import emit_json, human_size, say, schema, show_table
from skipinject.cache_tool.scan import Item, step_ranges

#: ``--sort`` keys: largest first, least recently served (or created) first, by step.
SORTS = ("size", "served", "created", "step")
STATES = ("complete", "partial", "damaged", "untrusted", "foreign")


def cmd_ls(
    root: Path | str,
    *,
    as_json: bool,
    per_step: bool,
    default: bool,
    sort: str = "step",
    roles: Sequence[str] = (),
    states: Sequence[str] = (),
) -> int:
    if default and isinstance(root, Path) and not root.exists():
        if as_json:
            emit_json({"schema": schema("ls"), "dump_dir": str(root), "steps": [], "groups": [], "problems": []})
        else:
            say(f"nothing cached in {root} (it does not exist)")
        return OK
    problems: list[str] = []
    items = [
        item
        for item in scan_any(root, problems)
        if (not roles or item.role in roles) and (not states or item.state in states)
    ]  # select
    items = sorted(items, key=_ORDER[sort])  # stable: the scan's order within equal keys
    groups = group(items)  # act
    if as_json:
        emit_json(
            {
                "schema": schema("ls"),
                "dump_dir": str(root),
                "steps": [item.record() for item in items],
                "groups": groups,
                "problems": problems,
            }
        )
    else:
        render(root, items, groups, problems, per_step=per_step)
    return OK


# ---------------------------------------------------------------- act

_ORDER: dict[str, Callable[[Item], Any]] = {
    "size": lambda item: -item.size,
    "served": lambda item: (item.served is not None, item.served or 0.0, item.created_time),
    "created": lambda item: item.created_time,
    "step": lambda item: (item.project, item.layout, item.role, -1 if item.step is None else item.step, item.kind),
}


def served_text(item: Item) -> str:
    if item.kind != "skipinject" or item.state != "complete":
        return "-"
    return "never" if item.served is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(item.served))


def when(created: str | None, mtime: float) -> str:
    if created:
        return created[:16].replace("T", " ")
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(mtime)) if mtime else "-"


def _span(first: str, last: str) -> str:
    """``2026-11-30 14:25 .. 14:33`` (the date once when both are on the same day)."""
    if first == last:
        return first
    return f"{first} .. {last[11:]}" if first[:10] == last[:10] else f"{first} .. {last}"


def group(items: Sequence[Item]) -> list[dict[str, Any]]:
    """Items of one project, layout, role, state and writer, with their steps as ranges."""
    grouped: dict[tuple[Any, ...], list[Item]] = {}
    for item in items:
        written_by = writer_text(item.writer) if item.kind == "skipinject" else f"{item.kind} (pickle)"
        key = (item.project, item.layout, item.role, item.state, written_by)
        grouped.setdefault(key, []).append(item)
    out = []
    for (project, layout, role, state, written_by), members in grouped.items():
        whens = sorted(when(i.created, i.mtime) for i in members)
        rows = [i.rows for i in members]
        served = [i for i in members if i.served is not None]
        latest = max(served, key=lambda i: i.served or 0.0) if served else members[0]
        out.append(
            {
                "project": project,
                "layout": layout,
                "role": role,
                "state": state,
                "steps": step_ranges([i.step for i in members if i.step is not None]),
                "count": len(members),
                "rows": sum(r for r in rows if r is not None) if any(r is not None for r in rows) else None,
                "size": sum(i.size for i in members),
                "created": _span(whens[0], whens[-1]),
                "last_served": served_text(latest),
                "hits": sum(i.hits for i in members),
                "written_by": written_by,
            }
        )
    return out


# ---------------------------------------------------------------- render


def render(
    root: Path | str, items: Sequence[Item], groups: Sequence[dict[str, Any]], problems: list[str], *, per_step: bool
) -> None:
    if not items:
        say(f"nothing cached in {root}")
    elif per_step:
        rows = [
            [
                i.project,
                i.layout,
                i.role,
                i.step,
                i.parts,
                i.rows,
                human_size(i.size) + ("" if i.decoded is None else f" ({human_size(i.decoded)} decoded)"),
                when(i.created, i.mtime),
                served_text(i),
                i.hits,
                writer_text(i.writer) if i.kind == "skipinject" else i.kind,
                i.state,
            ]
            for i in items
        ]
        heads: tuple[str, ...] = (
            "PROJECT",
            "LAYOUT",
            "ROLE",
            "STEP",
            "PARTS",
            "ROWS",
            "SIZE",
            "CREATED",
            "LAST SERVED",
            "HITS",
            "WRITTEN BY",
            "STATE",
        )
        show_table(heads, rows, right=("STEP", "PARTS", "ROWS", "SIZE", "HITS"))
    else:
        rows = [
            [
                g["project"],
                g["layout"],
                g["role"],
                g["steps"],
                g["rows"],
                human_size(g["size"]),
                g["created"] or "-",
                g["last_served"],
                g["hits"],
                g["written_by"],
                g["state"],
            ]
            for g in groups
        ]
        heads = (
            "PROJECT",
            "LAYOUT",
            "ROLE",
            "STEPS",
            "ROWS",
            "SIZE",
            "CREATED",
            "LAST SERVED",
            "HITS",
            "WRITTEN BY",
            "STATE",
        )
        show_table(heads, rows, right=("ROWS", "SIZE", "HITS"))
    if items:
        total = sum(i.size for i in items)
        decoded = sum(i.size if i.decoded is None else i.decoded for i in items)
        unpacked = "" if decoded == total else f" ({human_size(decoded)} decoded)"
        hits = sum(i.hits for i in items)
        say(f"{len(items)} step(s), {human_size(total)}{unpacked}, {hits} hit(s) in {root}")
    for item in items:
        if item.state in ("damaged", "untrusted"):
            for problem in item.problems:
                say(f"{item.state}: {problem}", err=True)
    for problem in problems:
        say(f"unreadable: {problem}", err=True)
