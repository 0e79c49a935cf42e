"""Register the shim's pieces with verl's own extension points (idempotent).

verl >= 0.9 has a platform registry (``verl.plugin.platform``): the shim registers a ``cpu``
platform there. Older verls (0.4 to 0.8) have none; :mod:`verl_cpu_shim.legacy` patches their
device helpers instead. The ``hf`` rollout and the ``cpu_store`` checkpoint engine register the
same way in every verl that has those registries (0.6 on); 0.4 and 0.5 build verl's own
``HFRollout`` for ``rollout.name=hf``.
"""

from __future__ import annotations

import importlib.util
import logging

logger = logging.getLogger(__name__)

_installed = False


def _load_hf_replica() -> type:
    from .rollout import HFReplica

    return HFReplica


def has_platform_registry() -> bool:
    """Whether this verl has ``verl.plugin.platform`` (0.9 and later)."""
    try:
        return importlib.util.find_spec("verl.plugin.platform") is not None
    except ModuleNotFoundError:
        return False


def plain_attention_helpers() -> None:
    """A 0.9-line tree without verl 0.9.1's pure-torch unpad/pad fallback (verl's neo tree, whose NeoProto
    worker bridge unpads every batch) imports them from ``flash_attn``, which has no CPU build: the plain
    helpers are taken there, as on the older verls (:mod:`verl_cpu_shim.legacy`)."""
    if importlib.util.find_spec("flash_attn") is not None:
        return
    import verl.utils.attention_utils as attention

    if hasattr(attention, "_fallback_unpad_input"):
        return
    from .legacy import _patch_attention_helpers

    _patch_attention_helpers()


def install() -> None:
    """Register the ``cpu`` platform (or patch the device helpers), gloo init, ``hf`` rollout, ``cpu_store``."""
    global _installed
    if _installed:
        return
    if has_platform_registry():
        from . import platform  # noqa: F401  (its decorator registers it)
        from .distributed import patch_process_group_init

        patch_process_group_init()
        plain_attention_helpers()
    else:
        from .legacy import install_legacy

        install_legacy()
    if importlib.util.find_spec("verl.workers.rollout.replica") is None:
        # verl 0.4/0.5: no rollout registries; ``rollout.name=hf`` builds verl's own HFRollout in
        # the worker (sync mode), whose calls only need to show in the generation log.
        from importlib.metadata import version

        from .sync_rollout import log_hf_rollout

        log_hf_rollout(prompts_repeated=not version("verl").startswith("0.4."))
        _installed = True
        logger.debug("verl_cpu_shim installed (verl without rollout registries)")
        return
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from .rollout import BACKEND_NAME

    if importlib.util.find_spec("verl.checkpoint_engine") is not None:
        from . import checkpoint  # noqa: F401  (its decorator registers it)
    rollout_base._ROLLOUT_REGISTRY[(BACKEND_NAME, "async")] = "verl_cpu_shim.rollout.HFServerAdapter"
    # verl 0.6's sync (worker-group) rollout mode builds its rollout from the same registry.
    rollout_base._ROLLOUT_REGISTRY[(BACKEND_NAME, "sync")] = "verl_cpu_shim.sync_rollout.HFSyncRollout"
    RolloutReplicaRegistry.register(BACKEND_NAME, _load_hf_replica)
    _installed = True
    logger.debug("verl_cpu_shim installed")
