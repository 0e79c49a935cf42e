"""Which node this process is on, and whether a cache directory can be shared between nodes.

On a Ray cluster of several nodes the process that saves a step (verl's ``TaskRunner``) can land
on any node, and the next run may land on another one. A ``dump_dir`` on a node-local file
system (the default ``~/.verl/rollout_dump`` usually is) then holds each node's steps only: a
later run on another node misses them. This module finds that out and says so once.

Nothing here imports Ray: Ray is asked only when the program has already imported it (:mod:`skipinject.node`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from skipinject.dump_root import LOCAL_SCHEMES, DumpRoot, is_remote, is_url, local_path_text
from skipinject.node import _ray, node_identity
from skipinject.store.mounts import fs_type, is_network_path, is_shared_fs_type, parse_mountinfo

logger = logging.getLogger("skipinject")

_warn_lock = threading.Lock()
_warned = False


def is_node_local(path: str | os.PathLike[str] | DumpRoot, mountinfo: str | None = None) -> bool:
    """True when ``path`` (a cache root, or its text) is known to be on this node only: not a URL,
    not on a network file system.

    Unknown (no ``/proc/self/mountinfo``, e.g. not Linux) counts as not node-local: skipinject
    only warns about what it knows.
    """
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
        if not isinstance(root, DumpRoot):
            root = DumpRoot.parse(str(getattr(settings, "dump_dir", settings)))
        if is_node_local(root):
            found[name] = root.text
    return found


def warn_if_cache_not_shared(roles: Mapping[str, Any], nodes: int) -> bool:
    """Warn once per process when ``nodes`` > 1 and a role's ``dump_dir`` is node-local.

    ``roles`` maps role names to their settings (anything with a ``dump_dir``) or to the
    directory itself. Returns whether it warned (now).
    """
    global _warned
    if nodes <= 1:
        return False
    local = node_local_dump_dirs(roles)
    if not local:
        return False
    with _warn_lock:
        if _warned:
            return False
        _warned = True
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
    global _warned
    with _warn_lock:
        _warned = False


def enabled_role_settings(config: Any) -> dict[str, Any]:
    """``{role: settings}`` of a :class:`skipinject.config.Config`'s enabled roles."""
    names: Iterable[str] = config.enabled_roles
    return {name: config.role(name) for name in names}


__all__ = [
    "LOCAL_SCHEMES",
    "fs_type",
    "is_node_local",
    "is_remote",
    "is_shared_fs_type",
    "is_url",
    "local_path_text",
    "node_identity",
    "parse_mountinfo",
    "ray_alive_nodes",
    "warn_if_cache_not_shared",
]
