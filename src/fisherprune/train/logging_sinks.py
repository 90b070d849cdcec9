"""Where a run's metrics go besides ``metrics.jsonl``: ``--log tensorboard``.

A sink receives every metrics entry as ``MetricsLog.record`` writes it (``dense``, ``eval``,
``prune``, ``final``) and is closed at the end of the run. ``SINKS`` maps a ``--log`` name to
the module and class of its sink, imported only when a run asks for it: TensorBoard
(``fisherprune.train.tensorboard_sink``) needs the ``tensorboard`` package (``pip install
'fisherprune[tensorboard]'``), and importing it costs every command that does not log there
about a second of start-up.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol

__all__ = ["SINKS", "MetricsSink", "open_sinks"]


class MetricsSink(Protocol):
    """Receives the run's metrics entries."""

    def record(self, entry: dict[str, Any]) -> None:
        """Take one metrics entry (it has ``step`` and ``kind``)."""

    def close(self) -> None:
        """Flush and release what the sink holds."""


#: ``--log`` name -> ``(module, class, sub-folder of the save directory it writes to)``
SINKS: dict[str, tuple[str, str, str]] = {
    "tensorboard": ("fisherprune.train.tensorboard_sink", "TensorBoardSink", "tb"),
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
    sinks: list[MetricsSink] = []
    for name in dict.fromkeys(names):
        if name != "jsonl":
            module, cls, folder = SINKS[name]
            sinks.append(getattr(importlib.import_module(module), cls)(save_dir / folder))
    return sinks
