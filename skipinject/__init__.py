"""skipinject: skip and replay verl rollouts on any verl install, without editing verl. The plugin API
(:data:`API_VERSION`, docs/plugins.md) is ``__all__``, :mod:`skipinject.plugin_kit` and :mod:`skipinject.testing`;
every other module is internal."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from skipinject._version import API_VERSION, __version__
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
)
from skipinject.plugin_kit import (
    CodecHeader,
    attended_tokens,
    installed_verl_matches,
    row_digest,
    row_text,
    tensor_bytes,
)
from skipinject.roles import (
    Call,
    Codec,
    HitInfo,
    Loaded,
    MatchInfo,
    MergingCodec,
    Phase,
    PhaseContext,
    Plan,
    Role,
    RowCodec,
    StepSource,
    Target,
    UpstreamFormat,
)
from skipinject.verl.compat import default_bypass, run_config_of, select, verl_version, version_matches

if TYPE_CHECKING:
    from skipinject.codecs import TensorSink, decode_tensor, encode_tensor, from_jsonable, to_jsonable
    from skipinject.config import Action, MismatchPolicy, RescorePolicy, RoleConfig
    from skipinject.payload import Payload
    from skipinject.plugin_manager import hookimpl
    from skipinject.report.tally import count_rescored, count_weight_syncs
    from skipinject.store import StepEntry
    from skipinject.store import StepStore as StepCache
    from skipinject.store import StepWriter as StepWriting
    from skipinject.verl.codecs import DataProtoCodec, TensorDictCodec

#: Public names that need torch or verl, imported on first use (``import skipinject`` stays cheap), by defining
#: module; two are that module's other names.
_LAZY = {
    name: module
    for module, names in {
        "skipinject.bootstrap": ("enable",),
        "skipinject.codecs": ("TensorSink", "decode_tensor", "encode_tensor", "from_jsonable", "to_jsonable"),
        "skipinject.config": ("Action", "MismatchPolicy", "RescorePolicy", "RoleConfig"),
        "skipinject.payload": ("Payload",),
        "skipinject.plugin_manager": ("hookimpl",),
        "skipinject.report.tally": ("count_rescored", "count_weight_syncs"),
        "skipinject.store": ("StepCache", "StepEntry", "StepWriting"),
        "skipinject.verl.codecs": ("DataProtoCodec", "TensorDictCodec"),
    }.items()
    for name in names
}
_RENAMED = {"StepCache": "StepStore", "StepWriting": "StepWriter"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'skipinject' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), _RENAMED.get(name, name))
    globals()[name] = value
    return value


__all__ = [
    "API_VERSION",
    "Action",
    "CacheError",
    "CacheMissError",
    "Call",
    "Codec",
    "CodecError",
    "CodecHeader",
    "ConfigError",
    "CorruptCacheError",
    "DataProtoCodec",
    "HitInfo",
    "Loaded",
    "MatchInfo",
    "MergingCodec",
    "MismatchPolicy",
    "Payload",
    "Phase",
    "PhaseContext",
    "Plan",
    "PluginError",
    "PromptMismatchError",
    "RescorePolicy",
    "Role",
    "RoleConfig",
    "RowCodec",
    "SkipInjectError",
    "StepCache",
    "StepEntry",
    "StepSource",
    "StepWriting",
    "Target",
    "TargetError",
    "TensorDictCodec",
    "TensorSink",
    "UpstreamFormat",
    "__version__",
    "attended_tokens",
    "count_rescored",
    "count_weight_syncs",
    "decode_tensor",
    "default_bypass",
    "enable",
    "encode_tensor",
    "from_jsonable",
    "hookimpl",
    "installed_verl_matches",
    "row_digest",
    "row_text",
    "run_config_of",
    "select",
    "tensor_bytes",
    "to_jsonable",
    "verl_version",
    "version_matches",
]
