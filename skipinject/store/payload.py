"""A verified cache entry, ready to load (what it loads: :class:`~skipinject.payload.Payload`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skipinject.payload import Payload
from skipinject.store.hit_memory import FRESH, Claim

if TYPE_CHECKING:
    from skipinject.store.hit_memory import Decoded


@dataclass(frozen=True)
class StepEntry:
    """A verified, loadable cache entry."""

    step: int
    directory: Path
    meta: Mapping[str, Any]
    #: Tensor files mapped (and checksummed) by :meth:`StepStore.verified`, reused by ``load``.
    mapped: dict[Path, Decoded] = field(default_factory=dict, compare=False, repr=False)
    #: Bytes of the other files, read (and checksummed) once by :meth:`StepStore.verified`.
    blobs: dict[Path, bytes] = field(default_factory=dict, compare=False, repr=False)
    #: Where a compressed step's decoded tensors go (:mod:`~skipinject.store.hit_memory`).
    memory: Claim = field(default=FRESH, compare=False, repr=False)
    #: Its parts already loaded (a step read ahead): the next :meth:`StepStore.load` hands them out.
    loaded: list[Payload] = field(default_factory=list, compare=False, repr=False)

    def release(self) -> None:
        """Drop what :meth:`StepStore.verified` read. Mappings are let go, never closed: a tensor viewing one holds
        no buffer export, so closing it would leave the tensor reading unmapped memory."""
        self.mapped.clear()
        self.blobs.clear()
        self.loaded.clear()
