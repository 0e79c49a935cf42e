"""Whether a cache directory is shared between the nodes of a Ray cluster, said once when it is not.

The process saving a step can land on any node; a ``dump_dir`` on a node-local file system holds each
node's steps only. Ray is asked only when the program already imported it (:mod:`skipinject.node`)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from skipinject.dump_root import DumpRoot
from skipinject.node import _ray
from skipinject.store import is_network_path

logger = logging.getLogger("skipinject")

_warned = threading.Lock()  # held once this process warned


def is_node_local(path: str | os.PathLike[str] | DumpRoot, mountinfo: str | None = None) -> bool:
    """``path`` (a cache root or its text) is known to be on this node only (no mount table: not known)."""
    root = path if isinstance(path, DumpRoot) else DumpRoot.parse(str(path))
    if root.path is None:
        return False
    return is_network_path(root.path, mountinfo) is False


def ray_alive_nodes() -> int:
    """How many nodes the connected Ray cluster has alive now; 0 when Ray is not connected."""
    ray = _ray()
    if ray is None:
        return 0
    try:
        return sum(1 for node in ray.nodes() if node.get("Alive"))
    except Exception:
        return 0


def node_local_dump_dirs(roles: Mapping[str, Any]) -> dict[str, str]:
    """``{role: dump_dir}`` of the given role settings whose ``dump_dir`` is node-local."""
    found = {}
    for name, settings in roles.items():
        root = getattr(settings, "root", None)
        root = root if isinstance(root, DumpRoot) else DumpRoot.parse(str(getattr(settings, "dump_dir", settings)))
        if is_node_local(root):
            found[name] = root.text
    return found


def warn_if_cache_not_shared(roles: Mapping[str, Any], nodes: int) -> bool:
    """Warn once per process when ``nodes`` > 1 and a role's ``dump_dir`` is node-local; whether it warned now."""
    if nodes <= 1:
        return False
    local = node_local_dump_dirs(roles)
    if not local or not _warned.acquire(blocking=False):
        return False
    logger.warning(
        "the Ray cluster has %d nodes, but the cache of %s is on a node-local file system: steps saved on one "
        "node are not found by a run whose trainer lands on another. Fix: %s",
        nodes,
        ", ".join(f"skip.{name} ({path})" for name, path in sorted(local.items())),
        "; ".join(
            f"set skip.{name}.dump_dir to a shared file system path or an object store URL (s3://bucket/dir)"
            for name in sorted(local)
        ),
    )
    return True


def _reset_warning() -> None:
    """Tests: forget that this process warned."""
    if _warned.locked():
        _warned.release()


def enabled_role_settings(config: Any) -> dict[str, Any]:
    """``{role: settings}`` of a :class:`skipinject.config.Config`'s enabled roles."""
    return {name: config.role(name) for name in config.enabled_roles}
