"""What a training run keeps as it goes: ``RunState`` (saved in every checkpoint, restored by
``--resume`` through ``resume_state``) and ``MetricsLog`` (the entries of ``metrics.jsonl``)."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from fisherprune._errors import first_line
from fisherprune.pruner import PruningOptimizer
from fisherprune.train.checkpoint import set_rng_state
from fisherprune.train.logging_sinks import MetricsSink

__all__ = ["MetricsLog", "RunState", "resume_state"]


@dataclass
class RunState:
    """Where a run stands. A checkpoint stores it as the plain dict of ``as_dict``."""

    step: int = 0  # optimizer steps taken
    dense: dict[str, Any] | None = None  # the dense model's metrics entry, once measured
    finished_at: int | None = None  # the step at which fine-tuning began (target reached)
    metrics: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl so far

    def as_dict(self) -> dict[str, Any]:
        """A deep copy in the checkpoint's layout: ``step``, ``dense``, ``finished_at`` and
        ``metrics`` (``dense`` stays the same object as its entry in ``metrics``)."""
        return copy.deepcopy(
            {
                "step": self.step,
                "dense": self.dense,
                "finished_at": self.finished_at,
                "metrics": self.metrics,
            }
        )

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> RunState:
        """The state saved by ``as_dict``; takes ``state``'s objects without copying them.

        Raises:
            KeyError: one of the four keys is missing.
        """
        return cls(
            step=state["step"],
            dense=state["dense"],
            finished_at=state["finished_at"],
            metrics=state["metrics"],
        )


class MetricsLog:
    """The run's metrics entries, kept in ``entries`` and, when ``write``, in the JSON-lines
    file ``path`` (one entry a line, in the order recorded).

    Args:
        path: the file (``metrics.jsonl``).
        entries: the list to append to, normally ``RunState.metrics``; it is not copied.
        write: False on ranks other than 0 under torchrun: keep the entries, write nothing.
        sinks: where each new entry also goes when writing (``--log tensorboard``).
    """

    def __init__(
        self,
        path: Path,
        entries: list[dict[str, Any]],
        write: bool,
        sinks: Sequence[MetricsSink] = (),
    ) -> None:
        self.path = path
        self.entries = entries
        self.write = write
        self.sinks = list(sinks) if write else []

    def restart(self) -> None:
        """Replace the file with the entries so far: none for a new run, a resumed run's from
        its checkpoint (anything recorded after that checkpoint is dropped)."""
        if self.write:
            self.path.write_text("".join(json.dumps(m) + "\n" for m in self.entries))

    def record(self, entry: dict[str, Any]) -> None:
        """Append ``entry`` to ``entries`` and, when writing, as a line to the file and to
        every sink."""
        self.entries.append(entry)
        if self.write:
            with self.path.open("a") as f:
                f.write(json.dumps(entry) + "\n")
        for sink in self.sinks:
            sink.record(entry)

    def close(self) -> None:
        """Close the sinks (the file is closed after every entry)."""
        for sink in self.sinks:
            sink.close()


def resume_state(
    saved: dict[str, Any], path: Path, model: nn.Module, popt: PruningOptimizer
) -> RunState:
    """Load the checkpoint ``saved`` (read from ``path``) into ``model``, ``popt`` and the
    RNGs, and return its run state.

    A checkpoint written after the model was shrunk (``popt.awaiting_shrink`` afterwards)
    holds the shrunk model's weights: only the masks are restored here (into ``model``'s
    masks, through ``popt``), and ``saved["model"]`` loads once the model is shrunk again
    (``phases.restore_shrunk``).

    Raises:
        ValueError: the checkpoint was written for another model or other settings.
    """
    try:
        popt.load_state_dict(saved["pruner"])
        if not popt.awaiting_shrink:
            model.load_state_dict(saved["model"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise ValueError(
            f"cannot resume from {path}: it was written for a different model or settings "
            f"({first_line(e, with_type=False)}); use another --save_dir or the original "
            "settings"
        ) from None
    set_rng_state(saved["rng"])
    return RunState.from_dict(saved["state"])
