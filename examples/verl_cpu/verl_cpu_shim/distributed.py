"""Make verl's Ray process-group init use plain gloo on CPU.

``verl.utils.distributed.initialize_global_process_group_ray`` defaults its backend to
``"cpu:gloo,<device>:<collective>"``; with the ``cpu`` platform that is
``"cpu:gloo,cpu:gloo"``, which torch rejects (one device type named twice). The
wrapper passes ``"gloo"`` instead whenever every entry would be a CPU one.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_PATCHED_FLAG = "__verl_cpu_shim_patched__"
_TARGET = "initialize_global_process_group_ray"


def _cpu_only_backend(backend: str | None) -> str | None:
    """Return ``"gloo"`` for a missing or all-CPU backend string, else ``None``."""
    if backend is None:
        from verl.utils.device import get_device_name

        return "gloo" if get_device_name() == "cpu" else None
    entries = [part.strip() for part in backend.split(",") if part.strip()]
    if len(entries) > 1 and all(part.startswith("cpu:") for part in entries):
        return "gloo"
    return None


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second: int | None = None, backend: str | None = None) -> Any:
        return original(timeout_second=timeout_second, backend=_cpu_only_backend(backend) or backend)

    setattr(initialize_global_process_group_ray, _PATCHED_FLAG, True)
    return initialize_global_process_group_ray


def patch_process_group_init() -> None:
    """Patch the function in ``verl.utils.distributed`` and where it was already imported by name."""
    import verl.utils.distributed as dist_mod

    original = getattr(dist_mod, _TARGET)
    if getattr(original, _PATCHED_FLAG, False):
        return
    patched = _wrap(original)
    setattr(dist_mod, _TARGET, patched)
    for name, module in list(sys.modules.items()):
        if name.startswith("verl.") and getattr(module, _TARGET, None) is original:
            setattr(module, _TARGET, patched)
            logger.debug("patched %s.%s", name, _TARGET)
