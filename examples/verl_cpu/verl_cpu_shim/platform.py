"""A ``cpu`` verl platform: torch on CPU, gloo collectives, a fake Ray "GPU" resource.

verl asks its platform object for the device name, the torch device module, the
collective backend and the Ray resource that a worker reserves. On CPU:

* the device is ``"cpu"`` and ``current_device()`` returns the *string* ``"cpu"``
  (an int would make torch look for an accelerator with that index);
* the Ray resource stays ``"GPU"``, satisfied by ``ray_init.num_gpus`` fake GPUs,
  because verl's resource pools count GPUs;
* memory, profiler and NVTX calls are no-ops.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

from .device_module import cpu_device_module

PLATFORM_NAME = "cpu"


@PlatformRegistry.register(platform=PLATFORM_NAME)
class CPUPlatform(PlatformBase):
    """verl platform for CPU-only hosts (select with ``VERL_PLATFORM=cpu``)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> Any:
        return cpu_device_module

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:  # type: ignore[override]  # verl's hint says int; torch wants "cpu"
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> None:
        return None
