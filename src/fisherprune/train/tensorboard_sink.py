"""The TensorBoard metrics sink of ``--log tensorboard`` (see ``logging_sinks``): imported
only by a run that asks for it, since importing TensorBoard is slow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    from torch.utils.tensorboard import SummaryWriter
except ImportError:  # tensorboard is an optional extra
    SummaryWriter = None

__all__ = ["TensorBoardSink"]


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
