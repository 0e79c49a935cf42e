"""Memory hits decode into, kept from one hit to the next (``skip.<role>.reuse_hit_memory``, docs/compression.md):
fresh memory's page faults are most of a compressed hit on a VM. A slot is lent again only when its :class:`Claim`
and every array lent from it (weak references) are gone; reused memory is not zeroed, so it must be written in full."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    from numpy.typing import NDArray

    #: A buffer a hit decodes into: a file or anonymous mapping, bytes read from a store, or lent memory.
    Decoded: TypeAlias = mmap.mmap | bytearray | NDArray[np.uint8]

#: Slots kept by default: the batch training still holds while the next hit loads, and one to decode into.
DEFAULT_SLOTS = 2
#: Most slots a setting may ask for (:data:`skipinject.config.schema.MAX_HIT_MEMORY`).
MAX_SLOTS = 16
#: A new buffer is this much larger than asked (1/16), so the next hit's slightly larger file still fits.
_HEADROOM = 16


_USABLE: list[int] = []


def memory_budget() -> int:
    """The most one step may take decoded and rebuilt: half the memory this process may use (physical,
    cgroup or ``RLIMIT_AS``). A step declaring more is refused before anything is allocated."""
    if not _USABLE:
        limits = []
        with contextlib.suppress(AttributeError, OSError, ValueError):
            limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        with contextlib.suppress(ImportError, OSError, ValueError):
            import resource

            soft = resource.getrlimit(resource.RLIMIT_AS)[0]
            if soft != resource.RLIM_INFINITY:
                limits.append(soft)
        with contextlib.suppress(OSError), open("/sys/fs/cgroup/memory.max", "rb") as handle:
            text = handle.read(64).strip()
            if text.isdigit():
                limits.append(int(text))
        _USABLE.append(min(limits) if limits else 32 << 30)
    return _USABLE[0] // 2


@dataclass(eq=False)
class _Buffer:
    mapping: mmap.mmap | bytearray
    lent: weakref.ref[Any] | None = None  # the array lent from it, while alive

    def busy(self) -> bool:
        return self.lent is not None and self.lent() is not None


@dataclass(eq=False)
class _Slot:
    buffers: list[_Buffer] = field(default_factory=list)
    claim: weakref.ref[Claim] | None = None

    def busy(self) -> bool:
        claimed = self.claim is not None and self.claim() is not None
        return claimed or any(buffer.busy() for buffer in self.buffers)


class HitMemory:
    """The pool of one role's hits (thread-safe: hits may come from background threads)."""

    def __init__(self, slots: int = DEFAULT_SLOTS, max_bytes: int | None = None) -> None:
        if not 0 <= slots <= MAX_SLOTS:
            raise ValueError(f"hit memory slots must be 0 .. {MAX_SLOTS}, got {slots}")
        self.slots = slots
        self.max_bytes = memory_budget() // 2 if max_bytes is None else max_bytes
        self._pool: list[_Slot] = []
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._held()

    def _held(self) -> int:
        return sum(len(buffer.mapping) for slot in self._pool for buffer in slot.buffers)

    def clear(self) -> None:
        """Let go of every buffer no tensor views (the rest go when their tensors do)."""
        with self._lock:
            for buffer in (buffer for slot in self._pool if not slot.busy() for buffer in slot.buffers):
                close(buffer.mapping)
            self._pool = [slot for slot in self._pool if slot.busy()]


class Claim:
    """One hit's hold on the pool: one slot, lent to no other hit while this claim or its arrays live."""

    def __init__(self, memory: HitMemory | None) -> None:
        self._memory = memory
        self._slot: _Slot | None = None
        self._tried = False
        self._grown: list[_Buffer] = []  # buffers the pool allocated for this hit

    def take(self, size: int) -> tuple[Decoded, bool]:
        """A writable buffer of exactly ``size`` bytes, and whether it holds zeros (else it must be written first)."""
        memory = self._memory
        if memory is not None and size:
            with memory._lock:
                lent = self._lend(memory, size)
            if lent is not None:
                return lent
        return anonymous(size), True

    def _lend(self, memory: HitMemory, size: int) -> tuple[Decoded, bool] | None:
        """From this claim's slot (a free or new one, claimed on first use); None: all busy, or past the bound."""
        import numpy as np

        if not self._tried:
            self._tried = True
            self._slot = next((slot for slot in memory._pool if not slot.busy()), None)
            if self._slot is None and len(memory._pool) < memory.slots:
                self._slot = _Slot()
                memory._pool.append(self._slot)
            if self._slot is not None:
                self._slot.claim = weakref.ref(self)
        slot = self._slot
        if slot is None or slot.claim is None or slot.claim() is not self:
            return None
        free = [buffer for buffer in slot.buffers if not buffer.busy()]
        fits = [buffer for buffer in free if len(buffer.mapping) >= size]
        if fits:
            chosen, zeroed = min(fits, key=lambda buffer: len(buffer.mapping)), False
        else:
            for small in free:  # outgrown: let it go rather than keep memory no hit uses
                slot.buffers.remove(small)
                close(small.mapping)
            capacity = size + size // _HEADROOM
            capacity += -capacity % mmap.PAGESIZE
            if memory._held() + capacity > memory.max_bytes:
                return None
            chosen, zeroed = _Buffer(anonymous(capacity)), True
            slot.buffers.append(chosen)
            self._grown.append(chosen)
        array = np.frombuffer(chosen.mapping, dtype=np.uint8, count=size)
        chosen.lent = weakref.ref(array)
        return array, zeroed

    def refuse(self) -> None:
        """The step was refused: what the pool allocated for it is not kept for later hits."""
        memory, slot = self._memory, self._slot
        if memory is not None and slot is not None:
            with memory._lock:
                slot.buffers = [buffer for buffer in slot.buffers if buffer not in self._grown]
                if slot.claim is not None and slot.claim() is self:
                    slot.claim = None
                if not slot.buffers and slot in memory._pool:
                    memory._pool.remove(slot)
        self._grown = []

    def buffer(self, size: int) -> Decoded:
        """:meth:`take` for bytes that are written in full before they are read (a decompressed file)."""
        return self.take(size)[0]


#: Fresh memory for every buffer (no pool).
FRESH = Claim(None)


def anonymous(size: int) -> mmap.mmap | bytearray:
    """A buffer costing memory only as it is filled: an anonymous private mapping (no huge pages: on a VM
    a fresh 2 MiB page costs ~4x its 4 KiB pages)."""
    if not size:
        return bytearray()
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    return mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)


def close(buffer: object) -> None:
    """Unmap a buffer now (a mapping an export still views is left to its last holder)."""
    with contextlib.suppress(BufferError):
        getattr(buffer, "close", lambda: None)()
