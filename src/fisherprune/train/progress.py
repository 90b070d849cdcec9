"""What the user sees while training: a progress bar on a terminal, plain lines otherwise.

The bar is tqdm's when tqdm is installed (``pip install 'fisherprune[progress]'``); without it,
a one-line bar drawn here, so that the core install needs nothing beyond torch and numpy.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

try:
    from tqdm import tqdm
except ImportError:  # tqdm is an optional extra
    tqdm = None

__all__ = ["Progress"]


class Progress:
    """``update(step, text)`` advances the bar; ``line(text)`` prints a line above it.

    mode: ``"bar"``, ``"plain"`` (only ``line`` output, for logs and pipes),
    ``"none"``, or ``"auto"`` (bar when ``stream`` is a terminal, else plain).
    ``total`` (the step cap) may be set until the first ``update``.
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
        self._bar: tqdm | None = None  # tqdm's bar, opened by the first update
        self._last = 0.0
        self._drawn = False

    def update(self, step: int, text: str) -> None:
        """Show ``step`` of ``total`` and ``text`` on the bar (nothing unless mode is bar)."""
        if self.mode != "bar":
            return
        if tqdm is not None:
            if self._bar is None:
                self._bar = tqdm(
                    total=self.total, initial=step - 1, file=self.stream, unit="step",
                    dynamic_ncols=True, mininterval=0.1,
                )  # fmt: skip
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        self._draw(step, text)

    def _draw(self, step: int, text: str) -> None:
        """The bar without tqdm: redraw one line, at most ten times a second."""
        now = time.monotonic()
        if now - self._last < 0.1:
            return
        self._last = now
        if self.total:
            frac = min(1.0, step / self.total)
            head = f"[{'#' * int(frac * 24):<24}] {step}/{self.total}"
        else:
            head = f"step {step}"
        self.stream.write(f"\r{head} {text}"[:120].ljust(120))
        self.stream.flush()
        self._drawn = True

    def line(self, text: str) -> None:
        """Print ``text`` on its own line, above the bar."""
        if self.mode == "none":
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
            return
        if self._drawn:
            self.stream.write("\r" + " " * 120 + "\r")
            self._drawn = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar (the next output starts on a new line)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
