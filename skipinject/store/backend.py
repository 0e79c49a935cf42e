"""Where a store's files live, apart from what they are: a :class:`Backend` moves bytes.

``names``/``stat``/``versions`` list; ``read_bytes`` and ``open_step`` read, bounded and size-checked;
``write`` (a file whole), ``replace`` (``meta.json``, the commit) and ``remove`` change. ``prepare``,
``make_dir`` and ``check_trust`` are a file system's own (no-ops in an object store). Everything else
(format, checks, commit, claims, garbage) is :class:`~skipinject.store.StepStore`'s, once for both:
:class:`~skipinject.store.local.LocalFiles` and :class:`~skipinject.store.remote.FsspecFiles`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, NamedTuple, Protocol, TypeVar

if TYPE_CHECKING:
    from skipinject.store.hit_memory import Decoded

T = TypeVar("T")

#: A local path, or a :class:`~skipinject.store.remote.RemotePath` standing in for one.
Location = Path


class Stat(NamedTuple):
    """What a backend tells of one name, never through a link."""

    kind: str  # "file", "directory", "link" or "other"
    size: int
    modified: float | None = None  # seconds since the epoch, when the store keeps it


class StepFiles(Protocol):
    """One step directory opened for reading (closed by :meth:`close`)."""

    def read_meta(self) -> bytes:
        """``meta.json``'s bytes, bounded; FileNotFoundError when there is none, else CorruptCacheError."""

    def read(
        self, sub: str, name: str, size: object, algo: str, *, into: Callable[[int], Decoded] | None = None
    ) -> tuple[Decoded | bytes, str]:
        """A data file of part ``sub`` and its checksum, refused unless a regular file of exactly ``size`` bytes
        (checked before a byte is read), in private memory (``into``: a buffer of the given size)."""

    def stream(self, sub: str, name: str, size: object) -> AbstractContextManager[Iterator[bytes]]:
        """A data file's bytes in pieces as they arrive, after the same size check."""

    def close(self) -> None: ...


class Backend(Protocol):
    """Moves a store's bytes."""

    #: Whether directory ownership and modes say who may write (local files; an object store's
    #: own access control decides that instead).
    checks_owners: bool

    def names(self, location: Location, *, directories: bool = False) -> list[str]:
        """Names under ``location`` (only sub-directories with ``directories``); FileNotFoundError."""

    def stat(self, location: Location) -> Stat | None:
        """What ``location`` is, never through a link; None when there is none."""

    def versions(self, root: Location, locations: list[Location]) -> dict[Location, int]:
        """A number per existing file that changes when it is replaced; never raises."""

    def read_bytes(self, location: Location, limit: int) -> bytes:
        """A whole small file, at most ``limit`` bytes (more: CorruptCacheError); FileNotFoundError."""

    def open_step(self, directory: Location, role: str) -> StepFiles:
        """The step ``directory`` opened for reading (never through a link, trust-checked)."""

    def write(self, location: Location, produce: Callable[[BinaryIO], T], write_id: str | None = None) -> tuple[int, T]:
        """A file written whole under its final name from ``produce(handle)``: its size and what ``produce``
        returned. A reader sees the old file or the new one."""

    def replace(self, location: Location, data: bytes, write_id: str) -> None:
        """Replace a small file with ``data`` in one step, durably (``meta.json``: the commit)."""

    def remove(self, location: Location, anchor: Location | None = None) -> None:
        """Remove a file or empty directory (locally walking down from ``anchor``); never raises."""

    def prepare(self, step_dir: Location, folder: Location) -> list[Location]:
        """Make ``folder`` (the step or a part directory) ready for files; returns what it created."""

    def make_dir(self, location: Location) -> bool | None:
        """Create ``location`` exclusively: True if this call did, False if it existed, None: no directories."""

    def check_trust(self, chain: list[Location], role: str) -> None:
        """Refuse (CorruptCacheError naming the fix) directories other users could write."""
