"""Reading the next chosen step ahead (``skip.<role>.read_ahead``), so that its hit waits for (almost) nothing.

A hit's cost is reading, checksumming and decoding the step: a compressed hit into fresh memory is
bounded by its page faults, an object store adds the download. In a training run the trainer
mostly waits while a step trains, and the chosen steps are known in advance; so once a step's
first call has returned, the next step the settings allow that is committed in the store is
verified and loaded (:meth:`~skipinject.store.StepStore.verified` and ``load``: read, checksummed,
decompressed, its tensors rebuilt) in a daemon thread, the way a DataLoader prefetches; the hit
then only decodes the loaded parts (the codec's part, cheap).

When that step's plan comes, the entry is used if the step's ``meta.json`` is still the one
verified (a step recorded anew names fresh data files; one removed has none): the plan waits for
the thread if it is still reading. Otherwise, and after a read-ahead that failed in any way
(damaged, untrusted, removed, unreadable), the plan verifies the step as without read-ahead and
reports what is wrong there, once: a read-ahead never logs a failure and never serves anything that
did not pass the same checks.

One step at a time per role. Its entry holds one batch's decoded buffers (from the role's hit
memory, or fresh memory when every slot is busy), let go when its plan uses it or when it will not
be used: the run moved past its step, the run ended (without waiting for a read that hangs: the
thread is a daemon, and lets its entry go when its read ends), or the step changed in the store.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from skipinject.store import StepStore
from skipinject.store.payload import StepEntry

logger = logging.getLogger("skipinject")

#: Committed-or-not checks a read-ahead makes among the allowed steps found after the current one
#: (steps of other roles sharing the directory, interrupted saves) before it gives up.
CANDIDATES = 8


@dataclass
class _Reading:
    """One step being read ahead, from the moment its search starts."""

    store: StepStore
    after: int
    thread: threading.Thread | None = None
    #: Set once the step to read is known (``step``; None: there is none).
    found: threading.Event = field(default_factory=threading.Event)
    step: int | None = None
    entry: StepEntry | None = None
    dropped: bool = False


def next_cached(store: StepStore, after: int, allows: Callable[[int], bool]) -> int | None:
    """The first step after ``after`` that ``allows`` takes and that is committed in ``store`` (one listing)."""
    numbers = store.step_numbers_on_disk()
    later = (step for step in numbers[bisect.bisect_right(numbers, after) :] if allows(step))
    for _, step in zip(range(CANDIDATES), later, strict=False):
        if store.is_committed(step):
            return step
    return None


class ReadAhead:
    """A role's step read ahead: at most one at a time (thread-safe)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._lock = threading.Lock()
        self._reading: _Reading | None = None

    def start(self, store: StepStore, after: int, allows: Callable[[int], bool]) -> None:
        """Read the next step after ``after`` that ``allows`` takes and ``store`` holds, in the background.

        A step already being read ahead of a later step in the same store is kept (one at a time)."""
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
            step = next_cached(store, reading.after, allows)
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
        """The entry of ``step`` read ahead, if it is still the step in ``store``, and the seconds this
        waited for it (the read's end, and a read of ``meta.json``); None: verify as without read-ahead.

        A step read ahead that the run has moved past is let go; one of a later step is kept."""
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
        if reading is None or reading.step is None or reading.step >= step:
            return
        with self._lock:
            if self._reading is reading:
                self._drop(reading)

    def close(self) -> None:
        """The run ended: let go of the step read ahead. Never waits for its thread (a read may hang on
        a stalled mount or download): a read still running lets its entry go itself when it ends."""
        with self._lock:
            reading = self._reading
            if reading is not None:
                self._drop(reading)

    def wait(self) -> None:
        """Block until the step being read ahead (if any) is read (tests and benchmarks)."""
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
