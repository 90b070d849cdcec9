"""Where a run's metrics go besides ``metrics.jsonl``: ``--log tensorboard``.

A sink receives every metrics entry as ``MetricsLog.record`` writes it (``dense``, ``eval``,
``prune``, ``final``) and is closed at the end of the run. ``SINKS`` maps a ``--log`` name to
its class; TensorBoard needs the ``tensorboard`` package (``pip install
'fisherprune[tensorboard]'``), asked for only when ``--log tensorboard`` is given.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

try:
    from torch.utils.tensorboard import SummaryWriter
except ImportError:  # tensorboard is an optional extra
    SummaryWriter = None

__all__ = ["SINKS", "MetricsSink", "TensorBoardSink", "open_sinks"]


class MetricsSink(Protocol):
    """Receives the run's metrics entries."""

    def record(self, entry: dict[str, Any]) -> None:
        """Take one metrics entry (it has ``step`` and ``kind``)."""

    def close(self) -> None:
        """Flush and release what the sink holds."""


class TensorBoardSink:
    """Writes every number of every entry as a scalar ``<kind>/<key>`` at the entry's step
    into TensorBoard event files under ``log_dir`` (``tensorboard --logdir SAVE_DIR/tb``).

    Raises (on construction):
        ImportError: tensorboard is not installed (the message says how to install it).
    """

    def __init__(self, log_dir: Path) -> None:
        if SummaryWriter is None:
            raise ImportError(
                "--log tensorboard needs the tensorboard package: pip install "
                "'fisherprune[tensorboard]' (or pip install tensorboard)"
            )
        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def record(self, entry: dict[str, Any]) -> None:
        """Add a scalar for each numeric value of ``entry`` (``kept`` per group included)."""
        step, kind = int(entry["step"]), entry["kind"]
        for key, value in entry.items():
            if key in ("step", "kind", "channel"):
                continue
            if isinstance(value, dict):
                for name, v in value.items():
                    self.writer.add_scalar(f"{kind}/{key}/{name}", v, step)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        """Flush the event file and close the writer."""
        self.writer.close()


#: ``--log`` name -> the sink it opens, given the run's save directory
SINKS: dict[str, Callable[[Path], MetricsSink]] = {
    "tensorboard": lambda save_dir: TensorBoardSink(save_dir / "tb"),
}


def open_sinks(names: list[str], save_dir: Path) -> list[MetricsSink]:
    """Open the sinks named by ``--log`` (``jsonl`` is always on and needs no sink).

    Raises:
        ValueError: an unknown name.
        ImportError: a sink's package is missing.
    """
    bad = [n for n in names if n not in SINKS and n != "jsonl"]
    if bad:
        raise ValueError(f"unknown --log {bad}; use jsonl or {', '.join(SINKS)}")
    return [SINKS[n](save_dir) for n in dict.fromkeys(names) if n != "jsonl"]
