"""One escaping function for every name and value a cache holds, before it reaches a terminal.

Directory names, object names and ``meta.json`` values are hostile input: a newline forges a table
row, an escape sequence sets the terminal's title or clears the screen, a name that is not UTF-8
makes a strict UTF-8 stdout raise. Every human-readable line the cache tool prints (tables, one-line
errors, notes, logs) goes through :func:`shown`, as ``ls -b`` and git quote paths: printable text
stays as it is, a backslash is doubled, ``\\n`` ``\\t`` ``\\r`` and ``\\e`` are written so, any other
non-printable character as ``\\xHH`` / ``\\uHHHH`` / ``\\UHHHHHHHH``, and a byte that is not UTF-8
(a name decoded with ``surrogateescape``) as ``\\xHH`` of that byte. ``--json`` does not go through
it: JSON carries the exact values (see docs/cache-tool.md for non-UTF-8 names).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

_NAMED = {"\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\x1b": "\\e"}


def _escape(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # an undecodable byte of a file name (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def shown(value: object) -> str:
    """``value`` as one safe line of text: nothing in it can control a terminal or start a new line."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if c == " " or (c.isprintable() and c != "\\") else _escape(c) for c in text)


class EscapeLogRecords(logging.Filter):
    """Escapes every ``skipinject`` log line the tool emits (a warning naming a cache file included)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = shown(record.getMessage()), None
        return True


@contextlib.contextmanager
def escaped_logs() -> Iterator[None]:
    """While the tool runs, the ``skipinject`` logger's lines go through :func:`shown` too."""
    logger = logging.getLogger("skipinject")
    escaping = EscapeLogRecords()
    logger.addFilter(escaping)
    try:
        yield
    finally:
        logger.removeFilter(escaping)
