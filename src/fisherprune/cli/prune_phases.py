"""How long each phase of ``fisherprune prune`` took, said on stderr as it ends, the
fine-tune's progress every tenth of its steps, and progress bars only on a terminal.

The phases follow one another (``PhaseClock.lap`` times what ran since the previous lap), so
their seconds add up to the whole run's: ``report.json``'s ``seconds`` and ``phase_seconds``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import TextIO

from torch import Tensor

__all__ = ["FinetuneProgress", "PhaseClock", "bars_on_terminal_only"]

_WHO = "fisherprune prune:"


class PhaseClock:
    """Seconds per phase of one run, from the clock's creation on.

    Args:
        stream: where each phase's line goes (None: ``sys.stderr`` at the time of writing).
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self.start = time.perf_counter()
        self._last = self.start
        self.seconds: dict[str, float] = {}  # phase -> wall seconds, in the order run

    @property
    def total(self) -> float:
        """Wall seconds from the clock's creation to the last lap."""
        return self._last - self.start

    def lap(self, phase: str, detail: str = "", parts: dict[str, float] | None = None) -> None:
        """Count the seconds since the previous lap (or the start) to ``phase`` (added to what
        it had) and write ``fisherprune prune: <phase> <detail> (<s> s)`` to the stream.

        ``parts``: sub-phases of it already timed (``PruneResult.phase_seconds``): they are
        counted under their own names, and the rest of the lap under ``phase``.
        """
        now = time.perf_counter()
        took, self._last = now - self._last, now
        rest = took - sum((parts or {}).values())
        for name, seconds in {**(parts or {}), phase: rest}.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        shown = "".join(f", {n} {s:.1f} s" for n, s in (parts or {}).items())
        self.say(f"{_WHO} {phase}{' ' + detail if detail else ''} ({took:.1f} s{shown})")

    def say(self, line: str) -> None:
        """Write ``line`` to the stream, flushed."""
        stream = self.stream or sys.stderr
        stream.write(line + "\n")
        stream.flush()


class FinetuneProgress:
    """A ``finetune`` step callback that writes the step, its loss, the time spent and an
    estimate of the time left every tenth of ``steps`` (and at the last step).

    Reads the loss (a device sync) only on the steps it writes.
    """

    def __init__(self, steps: int, clock: PhaseClock) -> None:
        self.steps = steps
        self.every = max(1, steps // 10)
        self.clock = clock
        self.start = time.perf_counter()

    def __call__(self, step: int, loss: Tensor) -> None:
        """After step ``step`` (1-based) with loss ``loss``: write a line when it is due."""
        if step % self.every and step != self.steps:
            return
        spent = time.perf_counter() - self.start
        left = spent / step * (self.steps - step)
        self.clock.say(
            f"{_WHO} fine-tuning step {step}/{self.steps}, loss {float(loss):.4f}, "
            f"{spent:.1f} s, about {left:.0f} s left"
        )


@contextlib.contextmanager
def bars_on_terminal_only() -> Iterator[bool]:
    """Yield whether progress bars may be drawn: stderr is a terminal. When it is not (a log
    file, a pipe), Hugging Face's own bars (loading and saving weights) are switched off
    inside the block and back on after it if they were on."""
    try:  # imported here: transformers takes a second to import, and only `prune` needs it
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - optional
        hf_logging = None
    terminal = sys.stderr.isatty()
    switch = hf_logging is not None and not terminal and hf_logging.is_progress_bar_enabled()
    if switch:
        hf_logging.disable_progress_bar()
    try:
        yield terminal
    finally:
        if switch:
            hf_logging.enable_progress_bar()
