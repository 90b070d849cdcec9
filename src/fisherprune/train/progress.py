"""What the user sees while training: a bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``update(step, text)`` redraws one line on a terminal; ``line(text)`` prints a line.

    mode: ``"bar"``, ``"plain"`` (only ``line`` output, for logs and pipes),
    ``"none"``, or ``"auto"`` (bar when ``stream`` is a terminal, else plain).
    """

    def __init__(
        self,
        total: int | None,
        mode: str = "auto",
        stream: TextIO | None = None,
        enabled: bool = True,
    ) -> None:
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "plain"
        self.mode = mode if enabled else "none"
        self.total = total
        self._last = 0.0
        self._drawn = False

    def update(self, step: int, text: str) -> None:
        if self.mode != "bar":
            return
        now = time.monotonic()
        if now - self._last < 0.1:
            return
        self._last = now
        if self.total:
            frac = min(1.0, step / self.total)
            bar = "#" * int(frac * 24)
            head = f"[{bar:<24}] {step}/{self.total}"
        else:
            head = f"step {step}"
        self.stream.write(f"\r{head} {text}"[:120].ljust(120))
        self.stream.flush()
        self._drawn = True

    def line(self, text: str) -> None:
        if self.mode == "none":
            return
        if self._drawn:
            self.stream.write("\r" + " " * 120 + "\r")
            self._drawn = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
