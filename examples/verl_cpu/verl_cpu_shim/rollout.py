"""An ``hf`` rollout backend: HF ``generate`` on CPU behind verl's server-mode interfaces.

verl 0.7 to 0.9 only runs rollouts through token-in/token-out *servers* (vLLM, SGLang,
TRT-LLM), none of which runs on CPU. Three pieces stand in for them:

* :class:`HFGenerationServer` -- the Ray actor that holds a HF causal LM and answers
  ``generate(prompt_ids, sampling_params, request_id)`` with a ``TokenOutput``, plus
  the control calls (sleep/wake-up/abort/resume/...) replicas and trainers make;
* :class:`HFReplica` -- the ``RolloutReplica`` that starts one such actor per replica
  (named ``hf_server_{replica}_{node}``);
* :class:`HFServerAdapter` -- the ``BaseRollout`` that lives in the trainer (hybrid
  engine) or ``CheckpointEngineWorker`` (standalone) process and pushes new weights
  into the server actor: a real weight sync, so rollouts follow the trained policy.

Set ``VERL_CPU_GEN_LOG=<file>`` to get one JSON line per generate request served and per weight sync
loaded (see :func:`log_event`; ``harness.generate_calls`` and ``harness.weight_syncs`` read them): each
names the weights it saw by ``global_steps`` (verl's weight version) and a digest of their values.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import ray
import torch
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput

from .genlog import log_event, prompt_digest

try:
    from verl.workers.rollout.utils import ensure_async_iterator
except ImportError:  # verl < 0.7

    async def ensure_async_iterator(iterable: Any) -> AsyncIterator[Any]:
        if hasattr(iterable, "__aiter__"):
            async for item in iterable:
                yield item
        else:
            for item in iterable:
                yield item


logger = logging.getLogger(__name__)

BACKEND_NAME = "hf"


def server_actor_name(replica_rank: int, node_rank: int = 0, suffix: str = "") -> str:
    """Ray name of a replica's server actor (the adapter finds it by this name)."""
    return f"{BACKEND_NAME}_server_{replica_rank}_{node_rank}{suffix}"


def _model_path(model_config: Any) -> str:
    local = getattr(model_config, "local_path", None)
    return str(local or model_config.path)


def _to_cpu_tensor(tensor: torch.Tensor) -> torch.Tensor:
    if hasattr(tensor, "full_tensor"):  # DTensor shard from FSDP2
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu", copy=True).contiguous()


async def collect_state_dict(weights: Iterable[Any] | AsyncIterator[Any]) -> dict[str, torch.Tensor]:
    """Drain a ``(name, tensor)`` stream (sync or async) into a CPU state dict."""
    state: dict[str, torch.Tensor] = {}
    async for name, tensor in ensure_async_iterator(weights):
        state[name] = _to_cpu_tensor(tensor)
    return state


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """A short digest of a state dict's names and values: equal weights, equal digests."""
    digest = hashlib.blake2b(digest_size=8)
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class HFGenerationServer:
    """Ray actor serving token-in/token-out generation with a HF causal LM on CPU."""

    def __init__(
        self,
        config: RolloutConfig,
        model_config: Any,
        rollout_mode: RolloutMode,
        replica_rank: int,
        node_rank: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.config: RolloutConfig = omega_conf_to_dataclass(config)
        self.rollout_mode = rollout_mode
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        path = _model_path(model_config)
        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.max_model_len = self.config.max_model_len or getattr(self.model.config, "max_position_embeddings", 2048)
        # Version of the weights being served; verl's V1 trainer does int() on it.
        self.global_steps = 0
        self.weight_version = 0
        # A digest of the weights last loaded ("pretrained" before any sync): which weights a generation saw.
        self.weight_digest = "pretrained"
        # torch generate is not re-entrant on one model: one request computes at a time.
        self._compute_lock = threading.Lock()
        self._admission = asyncio.Event()
        self._admission.set()
        self._rejecting = False
        log_event("server_start", replica=replica_rank)

    # -- generation -----------------------------------------------------------------

    def _max_new_tokens(self, n_prompt: int, sampling_params: dict[str, Any]) -> int:
        budget = sampling_params.pop("max_tokens", None) or sampling_params.pop("max_new_tokens", None)
        if budget is None:
            budget = min(
                self.config.response_length,
                self.config.prompt_length + self.config.response_length - n_prompt,
            )
        return max(1, min(int(budget), self.max_model_len - n_prompt))

    @torch.no_grad()
    def _generate_blocking(
        self, prompt_ids: list[int], sampling_params: dict[str, Any]
    ) -> tuple[list[int], list[float] | None]:
        want_logprobs = bool(sampling_params.pop("logprobs", False))
        max_new = self._max_new_tokens(len(prompt_ids), sampling_params)
        temperature = float(sampling_params.get("temperature", self.config.temperature) or 0.0)
        top_p = float(sampling_params.get("top_p", self.config.top_p))
        top_k = int(sampling_params.get("top_k", self.config.top_k))
        do_sample = temperature > 0
        gen_kwargs: dict[str, Any] = {
            "max_new_tokens": max_new,
            "do_sample": do_sample,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "return_dict_in_generate": True,
            "output_logits": want_logprobs,
        }
        if do_sample:
            gen_kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0)
        input_ids = torch.tensor([prompt_ids], dtype=torch.long)
        with self._compute_lock:
            out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **gen_kwargs)
        new_tokens = out.sequences[0, input_ids.shape[1] :].tolist()
        log_probs = None
        if want_logprobs:
            scale = temperature if do_sample else 1.0
            log_probs = [
                torch.log_softmax(step_logits[0].float() / scale, dim=-1)[token].item()
                for step_logits, token in zip(out.logits, new_tokens, strict=False)
            ]
        return new_tokens, log_probs

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        **_: Any,
    ) -> TokenOutput:
        """Generate one completion for ``prompt_ids`` (token ids in, token ids out)."""
        prompt_ids = [int(t) for t in prompt_ids]
        while not self._admission.is_set():
            if self._rejecting:
                return TokenOutput(
                    token_ids=[], stop_reason="aborted", extra_fields={"global_steps": self.global_steps}
                )
            await self._admission.wait()
        steps, version, digest = self.global_steps, self.weight_version, self.weight_digest
        tokens, log_probs = await asyncio.to_thread(self._generate_blocking, prompt_ids, dict(sampling_params))
        log_event(
            "generate",
            replica=self.replica_rank,
            n_sequences=1,
            n_prompt_tokens=len(prompt_ids),
            prompt=prompt_digest(prompt_ids),
            n_new_tokens=len(tokens),
            weight_version=version,
            weight_digest=digest,
            global_steps=steps,
        )
        return TokenOutput(
            token_ids=tokens,
            log_probs=log_probs,
            stop_reason="completed",
            num_preempted=0,
            extra_fields={"global_steps": steps},
        )

    # -- weights ----------------------------------------------------------------------

    def load_weights(self, state: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        """Copy ``state`` into the served model; returns how many tensors were loaded."""
        with self._compute_lock:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected:
            logger.warning("hf server ignored %d unexpected weights, e.g. %s", len(unexpected), unexpected[:3])
        self.weight_version += 1
        self.weight_digest = state_digest(state)
        if global_steps is not None:
            self.global_steps = global_steps
        log_event(
            "weight_sync",
            replica=self.replica_rank,
            n_tensors=len(state),
            weight_version=self.weight_version,
            weight_digest=self.weight_digest,
            global_steps=self.global_steps,
        )
        logger.info(
            "hf server %s loaded %d tensors (version %d, step %s, %d not sent)",
            self.replica_rank,
            len(state),
            self.weight_version,
            self.global_steps,
            len(missing),
        )
        return len(state)

    def weight_checksum(self) -> float:
        """Sum of all parameters: lets a test see that a weight sync changed the served model."""
        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.model.parameters()))

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # -- control calls made by replicas, managers and trainers ------------------------

    def get_server_address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), 0

    def get_rollout_config(self) -> RolloutConfig:
        return self.config

    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        while self._compute_lock.locked():
            await asyncio.sleep(0.01)

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        """Close admission; running requests finish (they are short), new ones wait or are rejected."""
        self._rejecting = reject_request
        self._admission.clear()
        await self.wait_for_requests_to_drain()
        return {"aborted_count": 0, "request_ids": []}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self) -> None:
        self._rejecting = False
        self._admission.set()

    resume_engine_generation = resume_generation
    open_submission_gate = resume_generation

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class HFReplica(RolloutReplica):
    """Rollout replica backed by one :class:`HFGenerationServer` actor (single node)."""

    if getattr(RolloutReplica.get_ray_class_with_init_args, "__isabstractmethod__", False):  # verl 0.6

        def get_ray_class_with_init_args(self) -> Any:
            """Standalone/colocated workers: not needed by the hf server (verl 0.6 declares it abstract)."""
            raise NotImplementedError("the hf rollout runs in hybrid mode only on this verl")

    async def launch_servers(self) -> None:
        # is_teacher_model / name_suffix exist from verl 0.8 on.
        if self.is_reward_model or getattr(self, "is_teacher_model", False):
            raise NotImplementedError("the hf rollout serves only the policy")
        name = server_actor_name(self.replica_rank, 0, getattr(self, "name_suffix", ""))
        server_cls = ray.remote(HFGenerationServer)
        concurrency = getattr(self, "max_concurrency", 1000)  # a replica property from verl 0.7 on
        server = server_cls.options(name=name, max_concurrency=concurrency, num_cpus=0).remote(
            config=self.config,
            model_config=self.model_config,
            rollout_mode=self.rollout_mode,
            replica_rank=self.replica_rank,
        )
        self.servers = [server]
        host, _ = await server.get_server_address.remote()
        self._server_handle = server
        # Only a key for verl's load balancer; nothing listens on it.
        self._server_address = f"{host}:{name}"


class HFServerAdapter(BaseRollout):
    """Trainer-side handle on a replica's server: forwards weight updates and sleep/wake calls.

    Built by verl in the hybrid-engine worker (``get_rollout_class``) and in each
    ``CheckpointEngineWorker`` of standalone replicas. Only the first rank of a replica
    talks to the server.
    """

    def __init__(
        self,
        config: RolloutConfig,
        model_config: HFModelConfig,
        device_mesh: Any = None,
        replica_rank: int = -1,
        **_: Any,
    ) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self.is_leader_rank = self.rollout_rank == 0
        self._server: ray.actor.ActorHandle | None = None

    def _server_handle(self) -> ray.actor.ActorHandle | None:
        if not self.is_leader_rank:
            return None
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        server = self._server_handle()
        if server is not None:
            await server.wake_up.remote(tags=tags)

    async def release(self) -> None:
        server = self._server_handle()
        if server is not None:
            await server.sleep.remote()

    async def update_weights(
        self,
        weights: Any,
        global_steps: int | None = None,
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> None:
        """Send the full ``(name, tensor)`` stream to the server as one CPU state dict."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"hf rollout takes named_tensors weights, not {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("hf rollout does not serve LoRA adapters")
        state = await collect_state_dict(weights)
        server = self._server_handle()
        if server is None:
            return
        start = time.monotonic()
        await server.load_weights.remote(state, global_steps)
        logger.info(
            "hf weight sync: %d tensors in %.2fs (step %s)",
            len(state),
            time.monotonic() - start,
            global_steps,
        )
