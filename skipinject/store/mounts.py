"""Which file system a path is on, and whether its bytes cross a network: the one mount classifier,
asked by ``compression=auto`` and by :mod:`skipinject.cluster` (a cache several nodes see)."""

from __future__ import annotations

import os
import re
from pathlib import Path

MOUNTINFO = "/proc/self/mountinfo"

#: File systems that several nodes mount (network, cluster, parallel file systems).
_SHARED = "nfs nfs4 cifs smb3 smbfs ncpfs afs lustre gpfs beegfs ceph cephfs glusterfs ocfs2 gfs2 panfs pvfs2 orangefs"
SHARED_FS_TYPES = frozenset(f"{_SHARED} wekafs quobyte vastfs davfs 9p 9p.nfs".split())
#: ``fuse.*`` mounts are mostly network clients (sshfs, s3fs, gcsfuse, juicefs, ...); these are not.
LOCAL_FUSE_TYPES = frozenset({"fuse.lxcfs", "fuse-overlayfs", "fuse.fuse-overlayfs", "fuse.portal", "fuse.gvfsd-fuse"})


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo``."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """``(mount point, file system type)`` of each line of a ``/proc/<pid>/mountinfo`` text."""
    mounts = []
    for fields in map(str.split, text.splitlines()):
        if "-" in fields and len(fields) >= 5 and fields.index("-") + 1 < len(fields):
            mounts.append((_unescape(fields[4]), fields[fields.index("-") + 1]))
    return mounts


def fs_type(path: str | os.PathLike[str], mountinfo: str | None = None) -> str | None:
    """The file system type of the longest (last mounted) mount point over ``path``'s nearest existing parent."""
    if mountinfo is None:
        try:
            mountinfo = Path(MOUNTINFO).read_text()
        except OSError:
            return None
    given = Path(path).expanduser().absolute()
    target = next((at.resolve() for at in (given, *given.parents) if at.exists()), Path("/"))
    within = {target, *target.parents}
    mounts = [(len(Path(at).parts), kind) for at, kind in parse_mountinfo(mountinfo) if Path(at) in within]
    return max(reversed(mounts), key=lambda mount: mount[0])[1] if mounts else None


def is_network_path(path: str | os.PathLike[str], mountinfo: str | None = None) -> bool | None:
    """Whether ``path``'s file system crosses a network (several nodes mount it); None: no mount table."""
    kind = (fs_type(path, mountinfo) or "").lower()
    if not kind:
        return None
    return kind in SHARED_FS_TYPES or (kind.startswith(("fuse.", "fuseblk.")) and kind not in LOCAL_FUSE_TYPES)
