"""A quiet progress indicator: a single self-overwriting line on a terminal, nothing otherwise,
so logs and CI output are not flooded.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``update(done)`` redraws at most 10 times a second, only when ``stream`` is a TTY."""

    def __init__(self, total: int, label: str = "", *, stream: TextIO | None = None, enabled: bool | None = None):
        self.total, self.label = max(total, 1), label
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty()) if enabled is None else enabled
        self._last = 0.0
        self._drawn = False

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and done < self.total:
            return
        self._last = now
        frac = min(done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        self.stream.write(f"\r{self.label} [{bar:<30}] {frac:4.0%}")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\r" + " " * (len(self.label) + 40) + "\r")
            self.stream.flush()
            self._drawn = False
