"""Which node this process runs on, for a saved step's record of its writer (apart from
:mod:`skipinject.cluster`, which imports the store). Ray is asked only once the program imported it."""

from __future__ import annotations

import socket
import sys
from typing import Any


def _ray() -> Any | None:
    """The Ray module if the program imported it and is connected, else ``None`` (never imports Ray)."""
    ray = sys.modules.get("ray")
    try:
        return ray if ray is not None and ray.is_initialized() else None
    except Exception:
        return None


def node_identity() -> dict[str, str]:
    """Which node this process runs on: host name, and Ray's node id and IP when Ray is connected."""
    identity = {"hostname": socket.gethostname()}
    ray = _ray()
    if ray is not None:
        try:
            identity["ray_node_id"] = ray.get_runtime_context().get_node_id()
            identity["ray_node_ip"] = ray.util.get_node_ip_address()
        except Exception:
            pass
    return identity
