"""TrainResult: what a ``fisherprune train`` run produced, as written to ``result.json``.

Its own module so that everything that reads a result (the report, the run's finish, callers of
``PruningTrainer.run``) depends on this small type, never on the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fisherprune.export.latency_stats import LatencyComparison, latency_text

__all__ = ["TrainResult", "latency_fields"]


@dataclass
class TrainResult:
    """What a run produced. Costs are per example in the run's convention.

    ``latency`` holds CPU times of the dense and the pruned model at batch 1 and 64, timed
    side by side in rounds (``compare_latency``): for the eager modules, ``latency_fields``'
    keys with ``b1`` (and ``b64``), and the same keys prefixed ``served_`` for frozen
    TorchScript when the model could be traced; ``threads``, ``allocator``, ``device``,
    ``load``, ``cpus`` and ``conditions`` (all of them in words) say how they were timed. The
    field order is the key order of ``result.json``.
    """

    dense_metric: float
    final_metric: float
    metric_name: str  # "accuracy" (classification) or "mse" (regression)
    dense_cost: float
    final_cost: float
    dense_params: int
    final_params: int
    latency: dict[str, Any]
    steps: int
    prunes: int  # channels removed (more than prune events with round_to > 1)
    files: dict[str, str] = field(default_factory=dict)  # what was written: kind -> path
    dense_learned: bool | None = None  # False: the dense model was no better than trivial
    warnings: list[str] = field(default_factory=list)  # what the user must know about the run

    def latency_cells(self, prefix: str, batch: int) -> tuple[str, str, str] | None:
        """Dense and pruned latency (``0.512 ms ±3%``) and the speed-up (``SpeedUp.text``) of
        one form (``""`` eager, ``"served_"``) at one batch size; None if not timed."""
        lat, key = self.latency, f"{prefix}{{}}_b{batch}"
        if key.format("speedup") not in lat:
            return None
        dense, pruned = (
            latency_text(lat[key.format(m) + "_ms"] / 1e3, lat[key.format(m) + "_spread"])
            for m in ("dense", "pruned")
        )
        return dense, pruned, lat[key.format("speedup") + "_text"]


def latency_fields(comparison: LatencyComparison, prefix: str, batch: int) -> dict[str, Any]:
    """``TrainResult.latency``'s entries for a dense and a pruned model timed side by side at
    one batch size, each key ``<prefix><name>_b<batch>...``:

    ``dense_b1_ms``, ``pruned_b1_ms``: median milliseconds per call; ``dense_b1_spread``,
    ``pruned_b1_spread``: half the interquartile range over the median; ``speedup_b1``: the
    median of the rounds' paired ratios, ``speedup_b1_iqr`` their quartiles,
    ``speedup_b1_resolved`` whether that range excludes 1.0 and ``speedup_b1_text`` the ratio
    or, when unresolved, the spread that covers it (``SpeedUp``); ``blocks_b1_ms``: every
    timed block of each model, milliseconds per call, round by round.
    """
    speedup, models = comparison.speedup("dense", "pruned"), comparison.models
    fields: dict[str, Any] = {}
    for name in ("dense", "pruned"):
        fields[f"{prefix}{name}_b{batch}_ms"] = models[name].median * 1e3
        fields[f"{prefix}{name}_b{batch}_spread"] = models[name].spread
    key = f"{prefix}speedup_b{batch}"
    return {
        **fields,
        key: speedup.median,
        f"{key}_iqr": list(speedup.quartiles),
        f"{key}_resolved": speedup.resolved,
        f"{key}_text": speedup.text(),
        f"{prefix}blocks_b{batch}_ms": {
            name: [t * 1e3 for t in models[name].blocks] for name in ("dense", "pruned")
        },
    }
