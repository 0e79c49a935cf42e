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
from pathlib import Path
from typing import Any

from skipinject.dump_root import LOCAL_SCHEMES, DumpRoot, is_remote, is_url, local_path_text
from skipinject.node import _ray, node_identity

logger = logging.getLogger("skipinject")

MOUNTINFO = "/proc/self/mountinfo"

#: File systems that several nodes mount (network, cluster, parallel file systems).
SHARED_FS_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "ncpfs",
        "afs",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "cephfs",
        "glusterfs",
        "ocfs2",
        "gfs2",
        "panfs",
        "pvfs2",
        "orangefs",
        "wekafs",
        "quobyte",
        "vastfs",
        "davfs",
        "9p.nfs",
    }
)
#: ``fuse.*`` mounts are mostly network clients (sshfs, s3fs, gcsfuse, juicefs, ...); these are not.
LOCAL_FUSE_TYPES = frozenset({"fuse.lxcfs", "fuse-overlayfs", "fuse.fuse-overlayfs", "fuse.portal", "fuse.gvfsd-fuse"})

_warn_lock = threading.Lock()
_warned = False


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo``."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1 : i + 4]) == 3 and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """``(mount point, file system type)`` of each line of a ``/proc/<pid>/mountinfo`` text."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        sep = fields.index("-")
        if sep + 1 >= len(fields):
            continue
        mounts.append((_unescape(fields[4]), fields[sep + 1]))
    return mounts


def _existing_ancestor(path: Path) -> Path:
    path = path.expanduser().absolute()
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate.resolve()
    return Path("/")


def fs_type(path: str | os.PathLike[str], mountinfo: str | None = None) -> str | None:
    """The type of the file system ``path`` is (or would be) on; ``None`` when it cannot be told.

    ``path`` need not exist yet: its nearest existing parent decides. The mount is the longest
    mount point that contains the resolved path (the last mounted wins on equal mount points).
    """
    if mountinfo is None:
        try:
            mountinfo = Path(MOUNTINFO).read_text()
        except OSError:
            return None
    target = _existing_ancestor(Path(path))
    best: tuple[int, str] | None = None
    for mount_point, kind in parse_mountinfo(mountinfo):
        mount = Path(mount_point)
        if target == mount or mount in target.parents:
            depth = len(mount.parts)
            if best is None or depth >= best[0]:
                best = (depth, kind)
    return None if best is None else best[1]


def is_shared_fs_type(kind: str) -> bool:
    kind = kind.lower()
    if kind in SHARED_FS_TYPES:
        return True
    return kind.startswith(("fuse.", "fuseblk.")) and kind not in LOCAL_FUSE_TYPES


def is_node_local(path: str | os.PathLike[str] | DumpRoot, mountinfo: str | None = None) -> bool:
    """True when ``path`` (a cache root, or its text) is known to be on this node only: not a URL,
    not on a network file system.

    Unknown (no ``/proc/self/mountinfo``, e.g. not Linux) counts as not node-local: skipinject
    only warns about what it knows.
    """
    root = path if isinstance(path, DumpRoot) else DumpRoot.parse(str(path))
    if root.path is None:
        return False
    kind = fs_type(root.path, mountinfo)
    if kind is None:
        return False
    return not is_shared_fs_type(kind)


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
