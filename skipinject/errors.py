"""Exceptions of skipinject: each message says what is wrong and what to do about it; and how a message or log
line quotes a name that may come from a cache (:func:`shown`, :func:`one_line`): escaped, on one line."""

from __future__ import annotations

from collections.abc import Iterable


class SkipInjectError(Exception):
    """Base class of every error skipinject raises on purpose."""


def did_you_mean(word: object, known: Iterable[str]) -> str:
    """``"; did you mean 'rollout'?"`` for the closest of ``known`` to a mistyped ``word``, else ``""``."""
    import difflib

    close = difflib.get_close_matches(str(word), list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


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


class UsageError(SkipInjectError):
    """A command line is wrong (an unknown option, a missing SCRIPT or module)."""


class ConfigError(SkipInjectError):
    """A ``skip.<role>.<key>=value`` override (or the serialised config) is invalid."""


class PluginError(SkipInjectError):
    """A plugin was asked for but cannot be found, imported or understood."""


class UnknownPluginError(PluginError, ConfigError):
    """A plugin selection (``VERL_SKIP_PLUGINS``, ``--plugins``, ``enable(plugins=...)``) names no plugin: a
    wrong setting like any other (``ConfigError``), and a plugin that cannot be found (``PluginError``)."""


class TargetError(SkipInjectError):
    """A target path is malformed (``package.module:Qualified.name`` expected)."""


class CacheError(SkipInjectError):
    """A cache entry cannot be used; the role falls back to running the target."""


class CorruptCacheError(CacheError):
    """A cache entry exists but fails verification (truncated, edited, other format or role)."""


class UntrustedCacheError(CorruptCacheError):
    """A cache lies where another user could have planted or redirected it: not ours to trust."""


class CacheMissError(CacheError):
    """``action=strict`` and the step has no usable cache."""


class PromptMismatchError(CacheError):
    """``on_mismatch=fail`` and a cached result belongs to other inputs than this call's."""


class CodecError(CacheError):
    """A value cannot be stored in (or read back from) the safe on-disk format."""


class NeverCalledError(SkipInjectError):
    """``action=strict`` and the role's target was never called by the end of its first chosen step."""
