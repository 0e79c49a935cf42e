"""Exceptions of skipinject: each message says what is wrong and what to do about it (a name that may come from
a cache quoted by :func:`skipinject.text.shown` or :func:`skipinject.text.one_line`: escaped, on one line)."""

from __future__ import annotations

from collections.abc import Iterable


class SkipInjectError(Exception):
    """Base class of every error skipinject raises on purpose."""


def did_you_mean(word: object, known: Iterable[str]) -> str:
    """``"; did you mean 'rollout'?"`` for the closest of ``known`` to a mistyped ``word``, else ``""``."""
    import difflib

    close = difflib.get_close_matches(str(word), list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


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
