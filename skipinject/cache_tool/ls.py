"""``ls``: projects, layouts, roles and steps, with size, age, writer and state (``meta.json`` only)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from skipinject.cache_tool.common import OK, default_dump_dir, human_size, output, say, show_table, writer_text
from skipinject.cache_tool.scan import Item, scan
from skipinject.store import local_kind

_ORDER: dict[str, Callable[[Item], Any]] = {  # ``--sort``
    "size": lambda item: -item.size,
    "served": lambda item: (item.served is not None, item.served or 0.0, item.created_time),
    "created": lambda item: item.created_time,
    "step": lambda item: (item.project, item.layout, item.role, -1 if item.step is None else item.step, item.kind),
}


def cmd_ls(
    dump_dir: Path | str | None, *, as_json: bool, steps: bool, sort: str, role: Sequence[str], state: Sequence[str]
) -> int:
    root = dump_dir or default_dump_dir()
    missing = dump_dir is None and local_kind(default_dump_dir(), follow=True) is None
    problems: list[str] = []
    found = [] if missing else scan(root, problems)
    items = [i for i in found if (not role or i.role in role) and (not state or i.state in state)]
    items.sort(key=_ORDER[sort])  # stable: the scan's order within equal keys
    groups = group(items)
    document = {"dump_dir": str(root), "steps": [i.record() for i in items], "groups": groups, "problems": problems}
    shown_root = f"{root} (it does not exist)" if missing else root
    output("ls", as_json, document, lambda: render(shown_root, items, groups, problems, per_step=steps))
    return OK


def served_text(item: Item) -> str:
    if item.kind != "skipinject" or item.state != "complete":
        return "-"
    return "never" if item.served is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(item.served))


def when(item: Item) -> str:
    if item.created:
        return item.created[:16].replace("T", " ")
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(item.mtime)) if item.mtime else "-"


def written_by(item: Item, pickle: str = "") -> str:
    return writer_text(item.writer) if item.kind == "skipinject" else f"{item.kind}{pickle}"


def step_ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3,5"``."""
    consecutive = itertools.groupby(enumerate(sorted(set(steps))), key=lambda pair: pair[1] - pair[0])
    runs = [[step for _, step in run] for _, run in consecutive]
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def group(items: Sequence[Item]) -> list[dict[str, Any]]:
    """Items of one project, layout, role, state and writer, with their steps as ranges."""
    grouped: dict[tuple[str, ...], list[Item]] = {}
    for item in items:
        key = (item.project, item.layout, item.role, item.state, written_by(item, " (pickle)"))
        grouped.setdefault(key, []).append(item)
    out = []
    for (project, layout, role, state, writer), members in grouped.items():
        whens = sorted(when(i) for i in members)
        first, last = whens[0], whens[-1]  # ``2026-11-30 14:25 .. 14:33``: the date once on one day
        span = first if first == last else f"{first} .. {last[11:] if first[:10] == last[:10] else last}"
        rows = [i.rows for i in members if i.rows is not None]
        served = [i for i in members if i.served is not None]
        out.append(
            {
                "project": project,
                "layout": layout,
                "role": role,
                "state": state,
                "steps": step_ranges([i.step for i in members if i.step is not None]),
                "count": len(members),
                "rows": sum(rows) if rows else None,
                "size": sum(i.size for i in members),
                "created": span,
                "last_served": served_text(max(served, key=lambda i: i.served or 0.0) if served else members[0]),
                "hits": sum(i.hits for i in members),
                "written_by": writer,
            }
        )
    return out


def render(
    root: Path | str, items: Sequence[Item], groups: Sequence[dict[str, Any]], problems: list[str], *, per_step: bool
) -> None:
    if not items:
        say(f"nothing cached in {root}")
    elif per_step:
        rows = []
        for i in items:
            size = human_size(i.size) + ("" if i.decoded is None else f" ({human_size(i.decoded)} decoded)")
            row = [i.project, i.layout, i.role, i.step, i.parts, i.rows, size, when(i), served_text(i), i.hits]
            rows.append([*row, written_by(i), i.state])
        heads = "PROJECT|LAYOUT|ROLE|STEP|PARTS|ROWS|SIZE|CREATED|LAST SERVED|HITS|WRITTEN BY|STATE"
        show_table(heads, rows, right="STEP|PARTS|ROWS|SIZE|HITS")
    else:
        keys = ("project", "layout", "role", "steps", "rows", "size", "created", "last_served", "hits", "written_by")
        rows = [[human_size(g[k]) if k == "size" else g[k] for k in keys] + [g["state"]] for g in groups]
        heads = "PROJECT|LAYOUT|ROLE|STEPS|ROWS|SIZE|CREATED|LAST SERVED|HITS|WRITTEN BY|STATE"
        show_table(heads, rows, right="ROWS|SIZE|HITS")
    if items:
        total = sum(i.size for i in items)
        decoded = sum(i.size if i.decoded is None else i.decoded for i in items)
        unpacked = "" if decoded == total else f" ({human_size(decoded)} decoded)"
        say(f"{len(items)} step(s), {human_size(total)}{unpacked}, {sum(i.hits for i in items)} hit(s) in {root}")
    for item in items:
        for problem in item.problems if item.state in ("damaged", "untrusted") else ():
            say(f"{item.state}: {problem}", err=True)
    for problem in problems:
        say(f"unreadable: {problem}", err=True)
