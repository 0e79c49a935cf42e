"""An ``hf`` rollout for verl 0.6's sync (SPMD) mode: the worker's ``generate_sequences`` on CPU.

verl 0.6 builds its sync rollout from ``verl.workers.rollout.base._ROLLOUT_REGISTRY[(name, "sync")]``
(vLLM and SGLang only) inside each ``ActorRolloutRefWorker``, and drives it through
``rollout_mode()`` (``resume``, ``update_weights`` with the FSDP actor's weights, ``resume``) and
``trainer_mode()`` (``release``). :class:`HFSyncRollout` is the smallest stand-in for vLLM there: it
holds a HF copy of the model in the worker process, takes every weight sync (so generation follows
the trained policy), and generates with verl's own ``HFRollout`` generation code. Each call is
logged as ``generate`` events in ``$VERL_CPU_GEN_LOG``, one per sequence (like the server rollout).

verl 0.4 and 0.5 build their own ``HFRollout`` for ``rollout.name=hf``; :func:`log_hf_rollout`
only makes its calls show in the generation log there.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.hf_rollout import HFRollout

from .genlog import log_event

logger = logging.getLogger(__name__)


def _log_generated(output: Any, prompts: Any) -> None:
    rows = len(output)
    prompt_tokens = int(prompts.batch["attention_mask"].sum()) if "attention_mask" in prompts.batch.keys() else 0
    log_event(
        "generate",
        replica=0,
        n_sequences=rows,
        n_prompt_tokens=prompt_tokens,
        n_new_tokens=int(output.batch["responses"].numel()),
        weight_version=-1,
        global_steps=prompts.meta_info.get("global_steps"),
        validate=bool(prompts.meta_info.get("validate", False)),
        # False for REMAX's greedy baseline (the trainer's meta_info["do_sample"]=False).
        do_sample=bool(prompts.meta_info.get("do_sample", True)),
    )


class HFSyncRollout(HFRollout):
    """verl 0.6's sync rollout interface with HF ``generate`` on CPU: verl's own ``HFRollout``
    generation (``generate_sequences``), over a HF copy of the model that takes every weight sync."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None, **_: Any) -> None:
        from transformers import AutoModelForCausalLM

        # 0.6's HFRollout.__init__ calls BaseRollout.__init__ without the arguments 0.6 requires.
        BaseRollout.__init__(self, config, model_config, device_mesh)
        path = str(getattr(self.model_config, "local_path", None) or self.model_config.path)
        self.module = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        log_event("server_start", replica=0, mode="sync")

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(self, weights: Any, **kwargs: Any) -> None:
        from .rollout import collect_state_dict

        state = await collect_state_dict(weights)
        _, unexpected = self.module.load_state_dict(state, strict=False)
        if unexpected:
            logger.warning("hf sync rollout ignored %d unexpected weights, e.g. %s", len(unexpected), unexpected[:3])

    def generate_sequences(self, prompts: Any) -> Any:
        output = super().generate_sequences(prompts)
        _log_generated(output, prompts)
        return output


def log_hf_rollout(*, prompts_repeated: bool = False) -> None:
    """verl 0.4/0.5: log every ``HFRollout.generate_sequences`` call (verl's own rollout for ``hf``).

    ``prompts_repeated`` (verl 0.5): the trainer already repeats each prompt n times before it calls
    the worker group, yet 0.5's ``HFRollout`` still samples ``config.n`` sequences per row (n x n in
    all; the trainer's ``union`` then fails, a verl 0.5 bug of the ``hf`` rollout). Its calls then
    run with ``n = 1``, as verl 0.5's vLLM rollout does for repeated prompts.
    """
    original = HFRollout.generate_sequences
    if getattr(original, "__verl_cpu_shim_logged__", False):
        return
    original_init = HFRollout.__init__

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        log_event("server_start", replica=0, mode="sync")  # the generator exists: the log is wired

    HFRollout.__init__ = __init__  # type: ignore[method-assign]
    _sharding_manager_timing()

    @functools.wraps(original)
    def generate_sequences(self: Any, prompts: Any) -> Any:
        if prompts_repeated:
            output = _with_one_sample(self, lambda: original(self, prompts))
        else:
            output = original(self, prompts)
        _log_generated(output, prompts)
        return output

    generate_sequences.__verl_cpu_shim_logged__ = True  # type: ignore[attr-defined]
    HFRollout.generate_sequences = generate_sequences  # type: ignore[method-assign]


def _with_one_sample(rollout: Any, run: Any) -> Any:
    from omegaconf import open_dict

    config = rollout.config
    with open_dict(config):
        n = config.n
        config.n = 1
        try:
            return run()
        finally:
            config.n = n


def _sharding_manager_timing() -> None:
    """verl 0.4's worker reads ``rollout_sharding_manager.timing`` after generating, which its ``hf``
    rollout's ``BaseShardingManager`` lacks (a verl 0.4 bug of the ``hf`` path): an empty one."""
    from verl.workers.sharding_manager.base import BaseShardingManager

    if not hasattr(BaseShardingManager, "timing"):
        BaseShardingManager.timing = {}  # type: ignore[attr-defined]
