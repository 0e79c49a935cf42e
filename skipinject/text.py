"""Text for people, shared by the run's report and the cache tool: how a line quotes a name that may come from
a cache (:func:`shown`, :func:`one_line`: escaped, on one line) and how it says a size (:func:`human_size`).
Imports nothing of skipinject."""

from __future__ import annotations


def _escape(char: str) -> str:
    if char == "\x1b":
        return "\\e"
    if 0xDC80 <= ord(char) <= 0xDCFF:  # an undecodable byte of a file name (surrogateescape)
        return f"\\x{ord(char) - 0xDC00:02x}"
    return char.encode("unicode_escape").decode("ascii")  # \\, \n, \t, \r, \xNN, \uNNNN, \UNNNNNNNN


def shown(value: object) -> str:
    """``value`` as one safe line of text: nothing in it can control a terminal or start a new line."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if c == " " or (c.isprintable() and c != "\\") else _escape(c) for c in text)


#: Characters of one log line of a run, at most: a name from a cache (a settings key, a path) is bounded by it.
MAX_LINE = 2000


def one_line(text: str, width: int = MAX_LINE) -> str:
    """``text`` (our own words around names that may come from a cache) as one bounded line: control
    characters escaped (a backslash kept as it is, so quoted values stay readable), cut at ``width``."""
    if not text.isprintable():
        text = "".join(c if c == " " or c.isprintable() else _escape(c) for c in text)
    if len(text) > width:
        text = f"{text[: width - 40]}… ({len(text):,} characters)"
    return text


def human_size(size: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
