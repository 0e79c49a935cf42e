"""Register the shim's pieces with verl's own extension points (idempotent)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_installed = False


def _load_hf_replica() -> type:
    from .rollout import HFReplica

    return HFReplica


def install() -> None:
    """Register the ``cpu`` platform, gloo init, ``hf`` rollout and ``cpu_store`` engine."""
    global _installed
    if _installed:
        return
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from . import checkpoint, platform  # noqa: F401  (their decorators register them)
    from .distributed import patch_process_group_init
    from .rollout import BACKEND_NAME

    patch_process_group_init()
    rollout_base._ROLLOUT_REGISTRY[(BACKEND_NAME, "async")] = "verl_cpu_shim.rollout.HFServerAdapter"
    RolloutReplicaRegistry.register(BACKEND_NAME, _load_hf_replica)
    _installed = True
    logger.debug("verl_cpu_shim installed")
