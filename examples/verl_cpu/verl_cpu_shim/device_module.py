"""A CPU stand-in for verl's torch device module (``torch.cuda``-style calls on ``torch.cpu``).

Shared by the ``cpu`` platform (verl >= 0.9) and the device patches of older verls
(:mod:`verl_cpu_shim.legacy`). Imports nothing from verl.
"""

from __future__ import annotations

import os
from typing import Any

import torch


class _CPUDeviceModule:
    """``torch.cpu`` plus the ``torch.cuda``-style calls verl makes on its device module.

    ``get_device_name()`` returns ``"CPU"``, the key verl's flops counter knows.
    Attributes not defined here come from :mod:`torch.cpu`.
    """

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "CPU"

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        return None

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed


cpu_device_module = _CPUDeviceModule()
