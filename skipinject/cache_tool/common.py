"""What every command shares: exit statuses, the one-line usage error, path checks, and output.

Every line for people goes through :func:`shown`: names and ``meta.json`` values are hostile input.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from skipinject.store import local_kind, unresolved_problem
from skipinject.text import human_size as human_size
from skipinject.text import shown as shown

OK, FOUND, USAGE = 0, 1, 2
#: Version of every ``--json`` document (``"schema": "skipinject.cache.<command>/<SCHEMA_VERSION>"``).
SCHEMA_VERSION = 1


class CommandError(Exception):
    """A one-line error for the user (bad path, bad option); exit status 2."""


def default_dump_dir() -> Path:
    from skipinject.config import DEFAULT_DUMP_DIR

    return Path(DEFAULT_DUMP_DIR).expanduser()


def existing_dir(path: Path) -> Path:
    found = local_kind(path, follow=True)
    if found is None:
        raise CommandError(f"{path}: no such directory")
    if found != "directory":
        raise CommandError(f"{path}: not a directory")
    return path


def mutable_root(path: Path, command: str) -> Path:
    """``path``, refused when another user could redirect it (checked as given: a swapped link leads a removal)."""
    problem = unresolved_problem(path)
    if problem is not None:
        raise CommandError(
            f"{problem}: another user could redirect `cache {command}`; nothing changed. "
            "Give a path only you control (e.g. the resolved directory, if you trust it)"
        )
    return existing_dir(path)


def writer_text(writer: object) -> str:
    """``meta.json``'s ``writer`` record in a few words (``-``: none, or no record)."""
    found = writer if isinstance(writer, dict) else {}
    parts = [f"{name} {found[name]}" for name in ("skipinject", "verl", "torch") if name in found]
    return ", ".join(parts) or "-"


# ---------------------------------------------------------------- escaping


def _escape_record(record: logging.LogRecord) -> bool:
    record.msg, record.args = shown(record.getMessage()), None
    return True


@contextlib.contextmanager
def escaped_logs() -> Iterator[None]:
    """While the tool runs, the ``skipinject`` logger's lines go through :func:`shown` too: first, so that a
    run's own line filter (``bootstrap.bound_log_lines``, escaping control characters only) finds them safe
    and does not escape them twice."""
    logger = logging.getLogger("skipinject")
    if _escape_record not in logger.filters:
        logger.filters.insert(0, _escape_record)
    try:
        yield
    finally:
        logger.removeFilter(_escape_record)


# ---------------------------------------------------------------- output


def human_number(value: float | None) -> str:
    if value is None:
        return "-"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


def shorten(text: str, width: int = 100) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def say(text: object = "", *, err: bool = False) -> None:
    """Print one line to stdout (or stderr), escaped whole by :func:`shown`."""
    print(shown(text), file=sys.stderr if err else sys.stdout)


def show_table(headers: str | Sequence[str], rows: Sequence[Sequence[Any]], right: str | Sequence[str] = ()) -> None:
    """An aligned table, each cell escaped; ``right``: right-aligned columns (a string: ``|``-separated)."""
    heads = headers.split("|") if isinstance(headers, str) else list(headers)
    aligned = set(right.split("|") if isinstance(right, str) else right)
    cells = [heads] + [["-" if c is None else shown(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(heads))]
    for row in cells:
        parts = [
            cell.rjust(widths[i]) if heads[i] in aligned else cell if i == len(row) - 1 else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        print("  ".join(parts).rstrip())


def emit_json(command: str, document: Mapping[str, Any]) -> None:
    """``command``'s ``--json`` document, its schema first (``skipinject.cache.<command>/<SCHEMA_VERSION>``)."""
    json.dump({"schema": f"skipinject.cache.{command}/{SCHEMA_VERSION}", **document}, sys.stdout, indent=1, default=str)
    print()


def output(command: str, as_json: bool, document: Mapping[str, Any], render: Callable[[], None]) -> None:
    """``--json``: ``command``'s document; else the lines ``render`` says."""
    if as_json:
        emit_json(command, document)
    else:
        render()


class Progress(contextlib.AbstractContextManager["Progress"]):
    """A bar on stderr, drawn only on a terminal and after ``delay`` seconds (quick commands print none)."""

    def __init__(self, total: int, label: str, *, unit: str = "B", stream: TextIO | None = None, delay: float = 1.0):
        self.total, self.label, self.unit, self.delay = max(0, int(total)), label, unit, delay
        self.stream = stream or sys.stderr
        self.done, self.started, self._last, self._drawn, self.enabled = 0, time.monotonic(), 0.0, False, False
        with contextlib.suppress(AttributeError, ValueError):
            self.enabled = bool(self.stream.isatty())

    def __exit__(self, *exc: object) -> None:
        if self._drawn:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()

    def update(self, amount: int = 1, note: str = "") -> None:
        self.done += amount
        now = time.monotonic()
        elapsed = now - self.started
        if not self.enabled or elapsed < self.delay or (now - self._last < 0.1 and self.done < self.total):
            return
        self._last, self._drawn = now, True
        fraction = min(1.0, self.done / self.total) if self.total else 1.0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 and self.total else 0.0
        done, total, speed = (
            human_size(int(v)) if self.unit == "B" else str(int(v)) for v in (self.done, self.total, rate)
        )
        bar = "█" * int(fraction * 24)
        line = (
            f"\r{self.label}: {fraction * 100:3.0f}%|{bar:24}| {done}/{total} [{elapsed:.0f}s<{eta:.0f}s, {speed}/s] "
        )
        self.stream.write((line + shown(note))[:160].ljust(100))
        self.stream.flush()
