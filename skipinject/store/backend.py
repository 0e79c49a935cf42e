"""Where a store's files live, apart from what they are: a :class:`Backend` moves bytes, nothing more (format,
checks, commit, claims and garbage are :class:`~skipinject.store.StepStore`'s, once for both backends)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, NamedTuple, Protocol, TypeVar

if TYPE_CHECKING:
    from skipinject.store.hit_memory import Decoded

T = TypeVar("T")


class Stat(NamedTuple):
    """What a backend tells of one name, never through a link."""

    kind: str  # "file", "directory", "link" or "other"
    size: int
    modified: float | None = None  # seconds since the epoch, when the store keeps it


class StepFiles(Protocol):
    """One step directory opened for reading. Every read is refused unless of a regular file of exactly
    ``size`` bytes, checked before a byte is read."""

    def read_meta(self) -> bytes:
        """``meta.json``'s bytes, bounded (FileNotFoundError, else CorruptCacheError)."""

    def read(
        self, sub: str, name: str, size: object, algo: str, *, into: Callable[[int], Decoded] | None = None
    ) -> tuple[Decoded | bytes, str]:
        """A data file of part ``sub`` and its checksum, in private memory (``into``: a buffer of a size)."""

    def stream(self, sub: str, name: str, size: object) -> AbstractContextManager[Iterator[bytes]]:
        """A data file's bytes in pieces as they arrive."""

    def close(self) -> None: ...


class Backend(Protocol):
    """Moves a store's bytes: :class:`~.local.LocalFiles` or :class:`~.remote.FsspecFiles`. A location is a ``Path``
    or a :class:`~.remote.RemotePath` standing in for one; ``prepare``, ``make_dir`` and ``check_trust`` are a
    file system's own."""

    #: Whether directory ownership and modes say who may write (else the store's access control does).
    checks_owners: bool

    def names(self, location: Path, *, directories: bool = False) -> list[str]:
        """Names under ``location`` (only sub-directories with ``directories``); FileNotFoundError."""

    def stat(self, location: Path) -> Stat | None: ...

    def versions(self, root: Path, locations: list[Path]) -> dict[Path, int]:
        """A number per existing file that changes when it is replaced; never raises."""

    def read_bytes(self, location: Path, limit: int) -> bytes:
        """A whole small file, at most ``limit`` bytes (more: CorruptCacheError); FileNotFoundError."""

    def open_step(self, directory: Path, role: str) -> StepFiles:
        """The step ``directory`` opened for reading (never through a link, trust-checked)."""

    def write(self, location: Path, produce: Callable[[BinaryIO], T], write_id: str | None = None) -> tuple[int, T]:
        """A file written whole from ``produce(handle)`` (a reader sees the old or the new one): its size and
        what ``produce`` returned."""

    def replace(self, location: Path, data: bytes, write_id: str) -> None:
        """Replace a small file in one step, durably (``meta.json``: the commit)."""

    def remove(self, location: Path, anchor: Path | None = None) -> None:
        """Remove a file or empty directory (locally walking down from ``anchor``); never raises."""

    def prepare(self, step_dir: Path, folder: Path) -> list[Path]:
        """Make ``folder`` (the step or a part directory) ready for files; returns what it created."""

    def make_dir(self, location: Path) -> bool | None:
        """Create ``location`` exclusively: whether this call did; None: no directories."""

    def check_trust(self, chain: list[Path], role: str) -> None:
        """Refuse (CorruptCacheError naming the fix) directories other users could write."""
