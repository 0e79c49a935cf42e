"""What the store holds for one part of a step, and a verified entry ready to load."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skipinject.store.hit_memory import FRESH, Claim

if TYPE_CHECKING:
    import torch

    from skipinject.store.hit_memory import Decoded


@dataclass
class Payload:
    """One part of a result: plain tensors plus JSON-safe values (see :mod:`skipinject.codecs`)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    rows: int | None = None

    def private_copy(self) -> Payload:
        """A copy with its own tensors and JSON tree: later in-place changes to the result cannot reach it.

        A miss saved in the background is copied first, so what is written is what training saw
        when the call returned, whatever training (or a transport's buffer reuse) does afterwards.
        """
        import json

        tensors = {name: tensor.detach().clone() for name, tensor in self.tensors.items()}
        objects = json.loads(json.dumps(self.objects, separators=(",", ":"), allow_nan=True))
        return Payload(tensors=tensors, objects=objects, rows=self.rows)


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
        """Drop what :meth:`StepStore.verified` read. Mappings are let go, never closed here: a tensor
        built by ``torch.frombuffer`` views one without holding a buffer export, so ``close`` would
        succeed under it and the tensor would read unmapped memory. A mapping is unmapped when its
        last holder (this entry or a loaded tensor) is gone."""
        self.mapped.clear()
        self.blobs.clear()
        self.loaded.clear()
