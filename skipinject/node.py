"""Which node this process runs on, for the record a saved step keeps of its writer.

Apart from :mod:`skipinject.cluster` so that the store's writer can import it without importing the
store back. Ray is asked only when the program has already imported it.
"""

from __future__ import annotations

import socket
import sys
from typing import Any


def _ray() -> Any | None:
    """The Ray module if the program imported it and is connected, else ``None`` (never imports Ray)."""
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            return ray
    except Exception:
        return None
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
