"""Reading the next chosen step ahead (``skip.<role>.read_ahead``), so that its hit waits for (almost) nothing.

Once a step's first call has returned, the next committed step the settings allow is verified and loaded
(read, checksummed, decompressed, tensors rebuilt) in a daemon thread; the hit then only decodes. Its
plan uses the entry if the step's ``meta.json`` is still the one verified, else (and after a failed
read-ahead) verifies the step as without read-ahead. One step at a time per role; its entry (one batch
of hit memory) is let go when used, when the run moves past its step or ends (never waiting for a hung read).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from skipinject.store import StepEntry, StepStore

logger = logging.getLogger("skipinject")

#: Committed-or-not checks a read-ahead makes among the allowed steps found after the current one
#: (steps of other roles sharing the directory, interrupted saves) before it gives up.
CANDIDATES = 8


@dataclass
class _Reading:
    """One step being read ahead, from its search on (``found``: its ``step`` is known)."""

    store: StepStore
    after: int
    thread: threading.Thread | None = None
    found: threading.Event = field(default_factory=threading.Event)
    step: int | None = None
    entry: StepEntry | None = None
    dropped: bool = False


class ReadAhead:
    """A role's step read ahead: at most one at a time (thread-safe)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._lock = threading.Lock()
        self._reading: _Reading | None = None

    def start(self, store: StepStore, after: int, allows: Callable[[int], bool]) -> None:
        """Read the next step after ``after`` that ``allows`` takes and ``store`` holds, in the background
        (a read of a later step of the same store under way is kept)."""
        with self._lock:
            reading = self._reading
            if reading is not None:
                done_before = reading.found.is_set() and (reading.step is None or reading.step <= after)
                if reading.store is store and not done_before:
                    return
                self._drop(reading)
            reading = _Reading(store, after)
            reading.thread = threading.Thread(
                target=self._read, args=(reading, allows), name=f"skipinject-read-ahead-{self.role}", daemon=True
            )
            try:
                reading.thread.start()
            except RuntimeError:  # no thread to be had: the step is read at its plan
                return
            self._reading = reading

    def _read(self, reading: _Reading, allows: Callable[[int], bool]) -> None:
        store = reading.store
        try:
            numbers = store.step_numbers_on_disk()
            later = (step for step in numbers[bisect.bisect_right(numbers, reading.after) :] if allows(step))
            step = next((s for _, s in zip(range(CANDIDATES), later, strict=False) if store.is_committed(s)), None)
            with self._lock:
                reading.step = step
            reading.found.set()
            if step is None or reading.dropped:
                return
            logger.debug("%s step %d: reading step %d ahead from %s", self.role, reading.after, step, store.location)
            entry = store.verified(step)
            try:
                entry.loaded.extend(store.load(entry))  # tensors rebuilt too: the hit only decodes them
            except BaseException:
                entry.release()
                raise
        except Exception:  # the step's plan verifies it again and reports what is wrong, once
            return
        finally:
            reading.found.set()
        with self._lock:
            if reading.dropped:
                entry.release()
            else:
                reading.entry = entry

    def take(self, store: StepStore, step: int) -> tuple[StepEntry, float] | None:
        """The entry of ``step`` read ahead if still current in ``store``, and the seconds waited for it;
        None: verify as without read-ahead. A read of an earlier step is let go, a later one kept."""
        started = time.perf_counter()
        reading = self._reading
        if reading is None or reading.store is not store:
            return None
        reading.found.wait()
        if reading.step is not None and reading.step > step:
            return None
        with self._lock:
            if self._reading is not reading:
                return None
            self._reading = None
            if reading.step != step:
                self._drop(reading)
                return None
        assert reading.thread is not None
        reading.thread.join()
        with self._lock:
            entry, reading.entry, reading.dropped = reading.entry, None, True
        if entry is None:
            return None
        try:
            current = store.read_meta(step) == entry.meta
        except Exception:
            current = False
        if not current:
            entry.release()
            return None
        return entry, time.perf_counter() - started

    def moved_to(self, step: int) -> None:
        """The run is at ``step``: a step read ahead below it will not be used."""
        reading = self._reading
        if reading is not None and reading.step is not None and reading.step < step:
            self.close(reading)

    def close(self, only: _Reading | None = None) -> None:
        """Let go of the step read ahead (``only``: if it is that one), not waiting for its thread."""
        with self._lock:
            reading = self._reading
            if reading is not None and (only is None or reading is only):
                self._drop(reading)

    def wait(self) -> None:
        """Block until the step being read ahead is read (tests and benchmarks)."""
        reading = self._reading
        if reading is not None and reading.thread is not None:
            reading.thread.join()

    def _drop(self, reading: _Reading) -> None:
        """Let ``reading`` go (under the lock): its entry now, or when its thread is done."""
        reading.dropped = True
        entry, reading.entry = reading.entry, None
        if self._reading is reading:
            self._reading = None
        if entry is not None:
            entry.release()
