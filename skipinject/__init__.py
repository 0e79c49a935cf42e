"""skipinject: skip and replay verl rollouts on any verl install, without editing verl.

Plugin authors need only what this module exports::

    from skipinject import Role, StepSource, Target, hookimpl
"""

from skipinject._version import __version__
from skipinject.errors import (
    CacheError,
    CacheMissError,
    CodecError,
    ConfigError,
    CorruptCacheError,
    PluginError,
    PromptMismatchError,
    SkipInjectError,
    TargetError,
    UntrustedCacheError,
)
from skipinject.hookspecs import hookimpl
from skipinject.roles import Call, HitInfo, Role, StepSource, Target, UpstreamFormat

__all__ = [
    "CacheError",
    "CacheMissError",
    "Call",
    "CodecError",
    "ConfigError",
    "CorruptCacheError",
    "HitInfo",
    "PluginError",
    "PromptMismatchError",
    "Role",
    "SkipInjectError",
    "StepSource",
    "Target",
    "TargetError",
    "UntrustedCacheError",
    "UpstreamFormat",
    "__version__",
    "hookimpl",
]
