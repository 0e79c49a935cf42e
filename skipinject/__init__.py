"""skipinject: skip and replay verl rollouts on any verl install, without editing verl.

The plugin API (:data:`API_VERSION`, docs/plugins.md) is ``__all__``, :mod:`skipinject.plugin_kit` and
:mod:`skipinject.testing`; every other module is internal. Names that need torch or verl are imported on
first use, so ``import skipinject`` stays cheap.
"""

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
    from skipinject.hookspecs import hookimpl
    from skipinject.payload import Payload
    from skipinject.report.tally import count_rescored
    from skipinject.store import StepEntry
    from skipinject.store import StepStore as StepCache
    from skipinject.store import StepWriter as StepWriting
    from skipinject.verl.codecs import DataProtoCodec, TensorDictCodec

#: Public names imported on first use: name -> defining module (``module:name`` for another name there).
_LAZY = {
    "Action": "skipinject.config",
    "DataProtoCodec": "skipinject.verl.codecs",
    "MismatchPolicy": "skipinject.config",
    "RescorePolicy": "skipinject.config",
    "Payload": "skipinject.payload",
    "RoleConfig": "skipinject.config",
    "StepCache": "skipinject.store:StepStore",
    "StepEntry": "skipinject.store",
    "StepWriting": "skipinject.store:StepWriter",
    "TensorDictCodec": "skipinject.verl.codecs",
    "TensorSink": "skipinject.codecs",
    "decode_tensor": "skipinject.codecs",
    "count_rescored": "skipinject.report.tally",
    "enable": "skipinject.bootstrap",
    "encode_tensor": "skipinject.codecs",
    "hookimpl": "skipinject.hookspecs",
    "from_jsonable": "skipinject.codecs",
    "to_jsonable": "skipinject.codecs",
}


def __getattr__(name: str) -> Any:
    module, _, attribute = _LAZY.get(name, "").partition(":")
    if not module:
        raise AttributeError(f"module 'skipinject' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), attribute or name)
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
