"""Where a cache root's files are and how to go through them: the one place a :class:`Backend` is chosen for a
root (a local directory, or a remote store's URL), and the cache tool's walk down to the step directories."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import skipinject.store.format as fmt
from skipinject.errors import CorruptCacheError
from skipinject.store.backend import Backend as Backend

if TYPE_CHECKING:
    pass

__all__ = ["Backend", "backend_for", "local_kind", "location_for", "read_json", "walk"]

#: How deep the cache tool looks below a root for step directories.
MAX_DEPTH = 8


def backend_for(url: str | None, *, given: Path | None = None, trust_permissions: bool = False) -> Backend:
    """Where a root's files are moved: the remote store's fsspec filesystem for a ``url``, else local files
    (``given``: the local root as the user gave it, links unresolved, checked before a link could redirect it)."""
    if url is None:
        from skipinject.store.local import LocalFiles

        return LocalFiles(trust_permissions=trust_permissions, given_root=given)
    from skipinject.store.remote import FsspecFiles, open_remote

    return FsspecFiles(open_remote(url)[0])


def location_for(url: str) -> Path:
    """A remote store's URL as the store joins it: a :class:`~skipinject.store.remote.RemotePath`."""
    from skipinject.store.remote import open_remote

    return cast(Path, open_remote(url)[1])


def local_kind(path: Path, *, follow: bool = False) -> str | None:
    """What a local name is (``file``, ``directory``, ``link``, ``other``), None: nothing there."""
    from skipinject.store.local import LocalFiles

    return getattr(LocalFiles().stat(path, follow=follow), "kind", None)


def read_json(path: Path, backend: Backend | None = None) -> Any:
    """A small JSON file (a ``meta.json``, ours or verl's) parsed with the training run's bounds."""
    from skipinject.store.files import parse_json
    from skipinject.store.local import LocalFiles

    data = (backend or LocalFiles()).read_bytes(path, fmt.MAX_META_BYTES)
    return parse_json(data, path, what="meta.json", max_depth=fmt.MAX_META_DEPTH)


def walk(
    backend: Backend,
    root: Path,
    problems: list[str],
    foreign: Callable[[str], Collection[str] | None] = lambda name: None,
    max_depth: int = MAX_DEPTH,
) -> Iterator[Path]:
    """Step directories at or under ``root`` (at most ``max_depth`` levels below); never follows a link below
    it, never leaves it. A step directory is named as a step and holds ``meta.json``, our data files or a part
    directory, or is one ``foreign(name)`` gives the file names of (verl's own caches; None: not one)."""
    from skipinject.store.local import LocalFiles

    stack = [(root, 0)]
    while stack:
        directory, depth = stack.pop()
        try:
            if depth == 0 and isinstance(backend, LocalFiles):  # the root as given may be a link
                names = backend.names(directory, follow=True)
            else:
                names = backend.names(directory)
            kinds = {name: getattr(backend.stat(directory / name), "kind", None) for name in names}
        except (OSError, CorruptCacheError) as exc:  # e.g. another user's private directory in a shared one
            problems.append(f"{directory}: cannot list it ({type(exc).__name__}: {exc})")
            continue
        subdirs = {name for name, kind in kinds.items() if kind == "directory"}
        theirs = foreign(directory.name)
        known = {fmt.META_NAME, *(theirs or ())}
        if (fmt.STEP_NAME.fullmatch(directory.name) or theirs is not None) and any(
            name in known or fmt.is_ours(name) or (fmt.PART_NAME.fullmatch(name) and name in subdirs) for name in names
        ):
            yield directory
            continue
        for name in sorted(n for n in names if fmt.STEP_NAME.fullmatch(n) and kinds[n] == "link"):
            problems.append(f"{directory / name}: a symbolic link, not followed")
        if depth < max_depth:
            stack.extend((directory / name, depth + 1) for name in sorted(subdirs, reverse=True))
