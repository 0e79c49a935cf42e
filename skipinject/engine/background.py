"""Saving off the training step's critical path: a bounded queue (a full one makes the next miss wait) and one
writer thread per process doing the writes, fsync and checksums; reads of a project, ``fit`` returning and
interpreter exit wait for the pending saves (docs/benchmarks.md)."""

from __future__ import annotations

import atexit
import collections
import logging
import queue
import threading
from collections.abc import Callable, Hashable
from typing import Any

logger = logging.getLogger("skipinject")

#: Saves waiting or being written at once, per process.
MAX_PENDING = 2


class BackgroundWriter:
    """Runs save jobs in order in one daemon thread; ``flush`` waits for a key's (or every) job."""

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self._jobs: queue.Queue[tuple[Hashable, Callable[[], Any]]] = queue.Queue(maxsize=max_pending)
        self._pending: collections.Counter[Hashable] = collections.Counter()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, key: Hashable, job: Callable[[], Any]) -> None:
        with self._changed:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="skipinject-writer", daemon=True)
                self._thread.start()
            self._pending[key] += 1
        self._jobs.put((key, job))

    def flush(self, key: Hashable | None = None) -> None:
        """Wait for the jobs of ``key`` (``None``: all jobs)."""
        if self._thread is None or self._thread is threading.current_thread():
            return
        with self._changed:
            self._changed.wait_for(
                lambda: (self._pending[key] if key is not None else sum(self._pending.values())) == 0
            )

    def pending(self) -> int:
        with self._changed:
            return sum(self._pending.values())

    def _run(self) -> None:
        while True:
            key, job = self._jobs.get()
            try:
                job()
            except Exception:  # the job logs its own failures; nothing may kill the writer
                logger.exception("skipinject: a background save failed")
            finally:
                with self._changed:
                    self._pending[key] -= 1
                    if self._pending[key] <= 0:
                        del self._pending[key]
                    self._changed.notify_all()


WRITER = BackgroundWriter()
atexit.register(WRITER.flush)
