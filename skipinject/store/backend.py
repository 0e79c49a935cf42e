"""Where a store's files live, apart from what they are (joblib's store backends, vcrpy's persisters).

:class:`~skipinject.store.StepStore` holds the format's logic once (which files a step has, the
meta.json checks, the commit rule, checksums before decoding); a :class:`Backend` only moves bytes:

* ``names``: names in a directory (step directories of a project, files of a step or part);
* ``open_step`` then :meth:`StepFiles.read_meta` / :meth:`StepFiles.read`: bounded reads of one step,
  sizes checked before a byte is read, checksums computed as the bytes come;
* ``write``: a file written whole under its final name (data files under fresh ones);
* ``commit``: ``meta.json`` replaced last, in one step;
* ``remove`` / ``collect``: a failed writer's files, and leftovers once abandoned.

:class:`~skipinject.store.local.LocalFiles` keeps every local guarantee (descriptor-relative
``O_NOFOLLOW`` opens, directory trust, fsync, atomic rename, copy-on-write mappings);
:class:`~skipinject.store.remote.FsspecFiles` the object-store ones (whole uploads, meta.json put
last, streamed bounded reads). :meth:`skipinject.dump_root.DumpRoot.backend` picks one from a
``dump_dir``, in one place.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol, TypeVar

if TYPE_CHECKING:
    pass

T = TypeVar("T")

#: A location in a backend: a local path, or a :class:`~skipinject.store.remote.RemotePath` standing in
#: for one (it joins with ``/`` and has ``name``, ``parent`` and ``str``: all the store uses of a path).
Location = Path


@dataclass(frozen=True)
class StoredFile:
    """A name in a step directory (``part``: ``""``) or one of its part directories, as listed:
    ``kind`` is file, directory, link or other (never followed); ``mtime`` in unix seconds."""

    part: str
    name: str
    kind: str
    size: int
    mtime: float


class StepFiles(Protocol):
    """One step directory opened for reading (closed by :meth:`close`)."""

    def read_meta(self) -> bytes:
        """``meta.json``'s bytes, at most :data:`~skipinject.store.format.MAX_META_BYTES` (+1 is refused).

        ``FileNotFoundError`` when there is none; any other failure is a CorruptCacheError."""

    def read(
        self, sub: str, name: str, size: object, kind: str, algo: str
    ) -> tuple[mmap.mmap | bytes | bytearray, str]:
        """A data file of part ``sub`` and its checksum: refused (CorruptCacheError) unless it is a
        regular file of exactly ``size`` bytes, checked before a byte is read; tensor files may come
        back mapped copy-on-write.

        A backend may also offer ``read_decoded(sub, name, spec, algo, make)``: a compressed file
        decoded as it is read, and the checksum of its stored bytes (an object store's, which
        decodes while the download streams); without it a compressed file is read whole, then decoded."""

    def close(self) -> None: ...


class Backend(Protocol):
    """Moves a store's bytes; knows nothing of the format beyond the names it is handed."""

    #: Whether directory ownership and modes say who may write (local files; an object store's
    #: own access control decides that instead).
    checks_owners: bool

    def check_trust(self, chain: list[Location], role: str) -> None:
        """Refuse (CorruptCacheError naming the fix) directories other users could write."""

    def names(self, location: Location, *, directories: bool = False) -> list[str]:
        """Names under ``location`` (only sub-directories with ``directories``); FileNotFoundError."""

    def list_part(self, step_dir: Location, sub: str) -> list[str]:
        """Names in part directory ``sub`` of a step (reached from the step, never through a link)."""

    def open_step(self, directory: Location, role: str) -> StepFiles:
        """The step ``directory`` opened for reading (never through a link, trust-checked)."""

    def is_regular(self, directory: Location, name: str) -> bool:
        """``name`` (one level of part directory allowed) is a regular file in a real, trusted step
        directory. Never raises."""

    def stat(self, location: Location) -> tuple[str, int] | None:
        """``(kind, size)`` of a name, never through a link (kind: file, directory, link or other);
        None when there is none or it cannot be told."""

    def step_files(self, step_dir: Location) -> list[StoredFile]:
        """Every name in a step directory and its part directories, none followed through a link;
        FileNotFoundError when there is no step, CorruptCacheError when it is a link or no directory."""

    def read_bytes(self, location: Location, limit: int) -> bytes:
        """A whole small file, at most ``limit`` bytes (more: CorruptCacheError); FileNotFoundError."""

    def versions(self, root: Location, locations: list[Location]) -> dict[Location, int]:
        """A number per existing file that changes when it is replaced (``root``: where all lie, for
        one listing); never raises."""

    def prepare(self, step_dir: Location, folder: Location) -> list[Location]:
        """Make ``folder`` (the step or a part directory) ready for files; returns what it created."""

    def write(self, location: Location, produce: Callable[[BinaryIO], T], write_id: str | None = None) -> tuple[int, T]:
        """Write a file whole under its final name, its bytes from ``produce(handle)`` (a local file
        through a temporary name, an object in one upload): its size and what ``produce`` returned.
        A reader sees the old file or the new one, never part of it."""

    def commit(self, step_dir: Location, meta: bytes, write_id: str) -> None:
        """Replace the step's ``meta.json`` with ``meta``, last and in one step."""

    def claim(self, project: Location, first: int, token: str) -> int:
        """The first step number from ``first`` on that no other writer holds, now held by this one
        (``token``: the writer's id): concurrent writers of new records never pick the same."""

    def release(self, project: Location, number: int, token: str) -> None:
        """What :meth:`claim` left that the committed record does not need; never raises."""

    def remove(self, location: Location, anchor: Location | None = None) -> None:
        """Remove a file (or an empty directory) a failed writer left; best effort, never raises.

        ``anchor``: the store's root, from which a local backend walks down without following links."""

    def remove_step(self, anchor: Location, step_dir: Location, wanted: Callable[[str, str], bool]) -> tuple[int, int]:
        """Remove the files of a step that ``wanted(part, name)`` selects (``part``: ``""`` for the step
        directory itself), ``meta.json`` first, then empty directories: (files, bytes) removed. A local
        backend reaches the step from ``anchor`` without following a link."""

    def collect(self, project: Location, step: int, named: set[str] | None) -> tuple[int, int]:
        """Remove leftovers of ``step`` (files no meta.json names, once abandoned; ``named``: those it names, None
        when it cannot be read); never raises."""
