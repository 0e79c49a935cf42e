"""A tiny tqdm-style progress bar on stderr, drawn only on a terminal and only for work that lasts."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from skipinject.cache_tool.quote import shown
from skipinject.cache_tool.render import human_size


class Progress:
    """``with Progress(total, "verify") as bar: bar.update(n)``; silent unless stderr is a TTY.

    Nothing is drawn during the first ``delay`` seconds, so quick commands print no bar at all.
    """

    def __init__(self, total: int, label: str, *, unit: str = "B", stream: TextIO | None = None, delay: float = 1.0):
        self.total = max(0, int(total))
        self.label = label
        self.unit = unit
        self.stream = stream or sys.stderr
        self.delay = delay
        self.done = 0
        self.started = time.monotonic()
        self._drawn = False
        self._last = 0.0
        try:
            self.enabled = bool(self.stream.isatty())
        except (AttributeError, ValueError):
            self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _fmt(self, value: float) -> str:
        return human_size(int(value)) if self.unit == "B" else str(int(value))

    def update(self, amount: int = 1, note: str = "") -> None:
        self.done += amount
        if not self.enabled:
            return
        now = time.monotonic()
        elapsed = now - self.started
        if elapsed < self.delay or (now - self._last < 0.1 and self.done < self.total):
            return
        self._last = now
        fraction = min(1.0, self.done / self.total) if self.total else 1.0
        width = 24
        filled = int(fraction * width)
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 and self.total else 0.0
        line = (
            f"\r{self.label}: {fraction * 100:3.0f}%|{'█' * filled}{' ' * (width - filled)}| "
            f"{self._fmt(self.done)}/{self._fmt(self.total)} [{elapsed:.0f}s<{eta:.0f}s, {self._fmt(rate)}/s] "
            f"{shown(note)}"
        )
        self.stream.write(line[:160].ljust(100))
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
            self._drawn = False
