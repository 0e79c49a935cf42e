"""Device patches for verls without a platform registry (``verl.plugin``: verl >= 0.9 only).

verl 0.6 to 0.8 pick the device in :mod:`verl.utils.device` (cuda, else npu, else cpu) and ask it for
the torch device module, the collective backend and the Ray resource. On a CPU-only host the
device name is already ``"cpu"``, but the rest points at accelerators. This module, imported
through ``VERL_USE_EXTERNAL_MODULES`` right after ``verl.utils.device`` itself:

* replaces ``get_torch_device`` (a CPU stand-in with the ``torch.cuda``-style calls verl makes),
  ``get_nccl_backend`` (``gloo``) and ``get_resource_name`` (``GPU``: fake Ray GPUs) there and in
  the verl modules already holding them by name;
* makes ``torch.distributed.init_process_group`` take plain ``gloo`` for a backend string whose
  every entry is a CPU one (``"cpu:gloo,cpu:gloo"`` is what verl builds; torch rejects it);
* lets gloo's ``all_gather`` take the 0-d tensor verl 0.6's sync rollout gathers (NCCL accepts it);
* gives Ray fake GPUs (``$VERL_CPU_FAKE_GPUS``) when verl 0.4/0.5's ``main_ppo`` starts it without any;
* makes Ray placement groups asked for device ``cpu`` (``trainer.device=cpu``) reserve the fake
  ``GPU`` resource: verl names the bundle after the device, and Ray has no ``cpu`` resource;
* lets FSDP's ``EngineRegistry`` (0.7+) find the engine it registered for ``cuda`` under ``cpu``;
* loads model configs with ``sdpa`` where verl 0.4/0.5 hard-code ``flash_attention_2``;
* takes the unpad/pad helpers from ``verl.utils.npu_flash_attn_utils`` (plain torch + einops)
  instead of ``flash_attn``, which has no CPU build.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
from typing import Any

from .device_module import cpu_device_module

logger = logging.getLogger(__name__)

_PATCHED = "__verl_cpu_shim_patched__"


def _replace_everywhere(module_name: str, name: str, replacement: Any) -> None:
    module = importlib.import_module(module_name)
    original = getattr(module, name, None)
    setattr(module, name, replacement)
    if original is None:
        return
    for loaded_name, loaded in list(sys.modules.items()):
        if loaded_name.startswith("verl.") and getattr(loaded, name, None) is original:
            setattr(loaded, name, replacement)


def _patch_device() -> None:
    import verl.utils.device as device

    if getattr(device, _PATCHED, False):
        return
    _replace_everywhere("verl.utils.device", "get_torch_device", lambda: cpu_device_module)
    _replace_everywhere("verl.utils.device", "get_nccl_backend", lambda: "gloo")
    _replace_everywhere("verl.utils.device", "get_resource_name", lambda: "GPU")
    setattr(device, _PATCHED, True)


def _all_cpu(backend: Any) -> bool:
    if not isinstance(backend, str) or "," not in backend:
        return False
    entries = [part.strip() for part in backend.split(",") if part.strip()]
    return all(part.startswith("cpu:") for part in entries)


def _patch_process_group_init() -> None:
    import torch.distributed as dist

    original = dist.init_process_group
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if args and _all_cpu(args[0]):
            args = ("gloo", *args[1:])
        if _all_cpu(kwargs.get("backend")):
            kwargs["backend"] = "gloo"
        return original(*args, **kwargs)

    setattr(init_process_group, _PATCHED, True)
    dist.init_process_group = init_process_group


def _patch_all_gather() -> None:
    """verl 0.6's sync rollout gathers a 0-d timing tensor into 1-element tensors: NCCL accepts
    that, gloo does not (``invalid tensor size``). Give gloo the 1-element tensor it expects."""
    import torch.distributed as dist

    original = dist.all_gather
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def all_gather(tensor_list: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        zero_d = getattr(tensor, "dim", None) is not None and tensor.dim() == 0
        if zero_d and tensor_list and tuple(tensor_list[0].shape) == (1,):
            tensor = tensor.reshape(1)
        return original(tensor_list, tensor, *args, **kwargs)

    setattr(all_gather, _PATCHED, True)
    dist.all_gather = all_gather


def _patch_ray_init() -> None:
    """verl 0.4/0.5's ``main_ppo`` starts Ray without ``num_gpus``, and their resource pools need GPUs:
    add ``$VERL_CPU_FAKE_GPUS`` fake ones when the caller gives none (newer verls pass ``num_gpus``)."""
    import os

    import ray

    original = ray.init
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def init(*args: Any, **kwargs: Any) -> Any:
        fake = os.environ.get("VERL_CPU_FAKE_GPUS")
        if fake and "num_gpus" not in kwargs and not kwargs.get("address") and not args:
            kwargs["num_gpus"] = int(fake)
        return original(*args, **kwargs)

    setattr(init, _PATCHED, True)
    ray.init = init


def _patch_placement_groups() -> None:
    from verl.single_controller.ray.base import RayResourcePool

    original = RayResourcePool.get_placement_groups
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def get_placement_groups(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("device_name") == "cpu":
            kwargs["device_name"] = "cuda"  # verl maps "cuda" to the Ray resource "GPU"
        return original(self, *args, **kwargs)

    setattr(get_placement_groups, _PATCHED, True)
    RayResourcePool.get_placement_groups = get_placement_groups


def _patch_engine_registry() -> None:
    try:
        from verl.workers.engine.base import EngineRegistry
    except ImportError:  # verl 0.6 has no engine registry
        return
    if "get_engine_cls" not in EngineRegistry.__dict__:  # verl 0.5's registry: not used by its FSDP workers
        return
    original = EngineRegistry.__dict__["get_engine_cls"].__func__
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def get_engine_cls(cls: type, model_type: str, backend: str) -> Any:
        devices = cls._engines.get(model_type, {}).get(backend, {})
        if "cpu" not in devices and "cuda" in devices:
            devices["cpu"] = devices["cuda"]
        return original(cls, model_type, backend)

    setattr(get_engine_cls, _PATCHED, True)
    EngineRegistry.get_engine_cls = classmethod(get_engine_cls)


def _patch_attention_helpers() -> None:
    try:
        import verl.utils.attention_utils as attention
        from verl.utils import npu_flash_attn_utils as plain
    except ImportError:
        return
    helpers = (plain.index_first_axis, plain.pad_input, plain.rearrange, plain.unpad_input)
    if hasattr(attention, "_get_attention_functions"):
        attention._get_attention_functions = lambda: helpers
        attention._index_first_axis, attention._pad_input, attention._rearrange, attention._unpad_input = helpers


def _patch_flash_attention_default() -> None:
    """verl 0.4/0.5's FSDP workers load the model config with ``attn_implementation="flash_attention_2"``
    hard-coded (no override): without ``flash_attn`` (no CPU build), ask for ``sdpa`` instead."""
    if importlib.util.find_spec("flash_attn") is not None:
        return
    from transformers import AutoConfig

    original = AutoConfig.__dict__["from_pretrained"].__func__
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("attn_implementation") == "flash_attention_2":
            kwargs["attn_implementation"] = "sdpa"
        return original(cls, *args, **kwargs)

    setattr(from_pretrained, _PATCHED, True)
    AutoConfig.from_pretrained = classmethod(from_pretrained)  # type: ignore[method-assign,assignment]


def install_legacy() -> None:
    """Apply every patch (idempotent)."""
    _patch_device()
    _patch_process_group_init()
    _patch_all_gather()
    _patch_ray_init()
    _patch_placement_groups()
    _patch_engine_registry()
    _patch_attention_helpers()
    _patch_flash_attention_default()
    logger.debug("verl_cpu_shim: device patches for verl without verl.plugin installed")
