"""Where a store's files live, apart from what they are (joblib's store backends, vcrpy's persisters).

A :class:`Backend` moves bytes and knows nothing of the format beyond the names it is handed:

* ``names`` and ``stat`` (one name; ``versions``: many, from one listing where the store can);
* ``read_bytes``: a small file, bounded; ``open_step`` then :meth:`StepFiles.read_meta` /
  :meth:`StepFiles.read` / :meth:`StepFiles.stream`: the files of one step, sizes checked before a
  byte is read;
* ``write``: a file written whole under its final name; ``replace``: a small file replaced in one step
  (``meta.json``, last);
* ``remove``: one file or empty directory.

Three more are a file system's own and have no bytes-only form; each is a no-op in an object store:

* ``prepare`` / ``make_dir``: directories, created private to the user and never through a link;
  ``make_dir`` is the exclusive create a ``match`` rows record's number is claimed with;
* ``check_trust``: who may write a directory is its POSIX owner and mode (ssh's ``StrictModes``);
  the step and part directories are checked again on the descriptors they are read through,
  inside ``open_step``, so a directory swapped after the check is still refused.

Everything else is :class:`~skipinject.store.StepStore`'s, once for every backend: the format, the
``meta.json`` checks, checksums before decoding, the commit rule, claims of new record numbers
(:meth:`~skipinject.store.StepStore.claim`), garbage collection
(:func:`skipinject.store.garbage.collect_by_name`), decoding while a compressed file downloads.

:class:`~skipinject.store.local.LocalFiles` keeps every local guarantee (descriptor-relative
``O_NOFOLLOW`` opens, directory trust, fsync, atomic rename, copy-on-write mappings);
:class:`~skipinject.store.remote.FsspecFiles` the object-store ones (whole uploads, meta.json put
last, streamed bounded reads). :meth:`skipinject.dump_root.DumpRoot.backend` picks one from a
``dump_dir``, in one place.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import BinaryIO, NamedTuple, Protocol, TypeVar

T = TypeVar("T")

#: A location in a backend: a local path, or a :class:`~skipinject.store.remote.RemotePath` standing in
#: for one (it joins with ``/`` and has ``name``, ``parent`` and ``str``: all the store uses of a path).
Location = Path


class Stat(NamedTuple):
    """What a backend tells of one name, never through a link."""

    kind: str  # "file", "directory", "link" or "other"
    size: int
    modified: float | None = None  # seconds since the epoch, when the store keeps it


class StepFiles(Protocol):
    """One step directory opened for reading (closed by :meth:`close`)."""

    #: Whether :meth:`stream` hands a file over as it arrives (an object store's download), so that a
    #: compressed file is decoded while it comes instead of read whole first.
    streams: bool

    def read_meta(self) -> bytes:
        """``meta.json``'s bytes, at most :data:`~skipinject.store.format.MAX_META_BYTES` (+1 is refused).

        ``FileNotFoundError`` when there is none; any other failure is a CorruptCacheError."""

    def read(
        self, sub: str, name: str, size: object, algo: str, *, mapped: bool = False
    ) -> tuple[mmap.mmap | bytes | bytearray, str]:
        """A data file of part ``sub`` and its checksum (hashed as the bytes come): refused
        (CorruptCacheError) unless it is a regular file of exactly ``size`` bytes, checked before a
        byte is read. ``mapped``: the bytes may come back mapped copy-on-write (large files)."""

    def stream(self, sub: str, name: str, size: object) -> AbstractContextManager[Iterator[bytes]]:
        """A data file's bytes in pieces as they arrive, after the same size check as :meth:`read` (the
        caller counts and hashes them)."""

    def close(self) -> None: ...


class Backend(Protocol):
    """Moves a store's bytes (see the module doc for the few directory operations it also has)."""

    #: Whether directory ownership and modes say who may write (local files; an object store's
    #: own access control decides that instead).
    checks_owners: bool

    def names(self, location: Location, *, directories: bool = False) -> list[str]:
        """Names under ``location`` (only sub-directories with ``directories``); FileNotFoundError."""

    def stat(self, location: Location) -> Stat | None:
        """What ``location`` is, never through a link; None when there is none or it cannot be told."""

    def versions(self, root: Location, locations: list[Location]) -> dict[Location, int]:
        """A number per existing file that changes when it is replaced (``root``: where all lie, for
        one listing); never raises."""

    def read_bytes(self, location: Location, limit: int) -> bytes:
        """A whole small file, at most ``limit`` bytes (more: CorruptCacheError); FileNotFoundError."""

    def open_step(self, directory: Location, role: str) -> StepFiles:
        """The step ``directory`` opened for reading (never through a link, trust-checked)."""

    def write(self, location: Location, produce: Callable[[BinaryIO], T], write_id: str | None = None) -> tuple[int, T]:
        """Write a file whole under its final name, its bytes from ``produce(handle)`` (a local file
        through a temporary name, an object in one upload): its size and what ``produce`` returned.
        A reader sees the old file or the new one, never part of it."""

    def replace(self, location: Location, data: bytes, write_id: str) -> None:
        """Replace a small file with ``data`` in one step, durably (a step's ``meta.json``: the commit)."""

    def remove(self, location: Location, anchor: Location | None = None) -> None:
        """Remove a file (or an empty directory); best effort, never raises.

        ``anchor``: the store's root, from which a local backend walks down without following links."""

    def prepare(self, step_dir: Location, folder: Location) -> list[Location]:
        """Make ``folder`` (the step or a part directory) ready for files; returns what it created."""

    def make_dir(self, location: Location) -> bool | None:
        """Create the directory ``location`` if no one has: True when this call created it, False when
        it existed; None when the store has no directories (names are prefixes of objects)."""

    def check_trust(self, chain: list[Location], role: str) -> None:
        """Refuse (CorruptCacheError naming the fix) directories other users could write."""
