"""Output: aligned tables, human sizes and ages, and the JSON documents of ``--json``.

Every human-readable line goes out through :func:`say` (and every table cell through the same
:func:`~skipinject.cache_tool.quote.shown`), so no name or value from a cache reaches a terminal raw.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from skipinject.cache_tool.quote import shown

#: Version of every ``--json`` document (``"schema": "skipinject.cache.<command>/<SCHEMA_VERSION>"``).
SCHEMA_VERSION = 1


def schema(command: str) -> str:
    return f"skipinject.cache.{command}/{SCHEMA_VERSION}"


def human_size(size: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_number(value: float | None) -> str:
    if value is None:
        return "-"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[str] = ()) -> str:
    """An aligned plain-text table; columns named in ``right`` are right-aligned."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else shown(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = []
        for i, cell in enumerate(row):
            last = i == len(row) - 1
            if headers[i] in right:
                parts.append(cell.rjust(widths[i]))
            else:
                parts.append(cell if last else cell.ljust(widths[i]))
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines) + "\n"


def say(text: object = "", *, err: bool = False) -> None:
    """Print one line to stdout (or stderr), escaped whole by :func:`shown`: a newline or an escape
    sequence in a name inside it is shown, never obeyed. Tables are printed by :func:`show_table`."""
    print(shown(text), file=sys.stderr if err else sys.stdout)


def show_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[str] = ()) -> None:
    """Print :func:`table` (its cells escaped one by one, so the columns stay aligned)."""
    print(table(headers, rows, right), end="")


def emit_json(document: Mapping[str, Any], out: TextIO | None = None) -> None:
    out = out or sys.stdout
    json.dump(document, out, indent=1, sort_keys=False, default=str)
    out.write("\n")


def shorten(text: str, width: int = 100) -> str:
    """``text`` cut to ``width`` characters (escaped when printed, by :func:`say`)."""
    return text if len(text) <= width else text[: width - 1] + "…"
