"""``cpu_store``: a checkpoint engine that moves weights between processes through a Ray actor.

The asynchronous trainers (V1 ``separate_async``, fully async) keep the rollout in
other processes than the trainer, so they sync weights through a checkpoint engine.
The ones verl ships need CUDA libraries (nccl, nixl, ...) or, like ``naive``, one
shared process. Here the trainer's master rank puts a CPU state dict into a named
:class:`WeightStore` actor under a new version number; each rollout-side engine
waits for a version newer than the last one it served and yields its tensors.

Every engine keeps a handle on the store for its whole life: a named actor with no
live handle can be garbage-collected between two syncs, after which the rollout
would wait forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from .rollout import collect_state_dict

logger = logging.getLogger(__name__)

BACKEND_NAME = "cpu_store"
STORE_ACTOR_NAME = "verl_cpu_shim_weight_store"


class WeightStore:
    """Ray actor holding the newest published state dict and its version."""

    def __init__(self) -> None:
        self.version = 0
        self.global_steps: int | None = None
        self.state: dict[str, torch.Tensor] = {}

    def put(self, state: dict[str, torch.Tensor], global_steps: int | None) -> int:
        self.state = state
        self.global_steps = global_steps
        self.version += 1
        return self.version

    def latest_version(self) -> int:
        return self.version

    def get(self) -> tuple[int, int | None, dict[str, torch.Tensor]]:
        return self.version, self.global_steps, self.state


def _store() -> ray.actor.ActorHandle:
    return (
        ray.remote(WeightStore)
        .options(name=STORE_ACTOR_NAME, get_if_exists=True, num_cpus=0, max_concurrency=4)
        .remote()
    )


@CheckpointEngineRegistry.register(BACKEND_NAME)
class CPUStoreCheckpointEngine(CheckpointEngine):
    """Checkpoint engine for trainer and rollout in different processes of one Ray cluster."""

    def __init__(self, bucket_size: int = 0, is_master: bool = False, poll_seconds: float = 0.05, **_: Any) -> None:
        self.is_master = is_master
        self.poll_seconds = poll_seconds
        self._seen_version = 0
        self._store = _store()

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    def finalize(self) -> None:
        return None

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Publish the weights (master rank); other ranks only drain the stream's collectives."""
        start = time.monotonic()
        state = await collect_state_dict(weights)
        if self.is_master:
            version = await self._store.put.remote(state, global_steps)
            logger.info("cpu_store: published version %d (step %s, %d tensors)", version, global_steps, len(state))
        return {"timing_s/cpu_store_send": time.monotonic() - start}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Wait for a version newer than the last one received, then yield its tensors."""
        while await self._store.latest_version.remote() <= self._seen_version:
            await asyncio.sleep(self.poll_seconds)
        version, _, state = await self._store.get.remote()
        self._seen_version = version
        for name, tensor in state.items():
            yield name, tensor
