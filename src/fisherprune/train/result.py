"""TrainResult: what a ``fisherprune train`` run produced, as written to ``result.json``.

Its own module so that everything that reads a result (the report, the run's finish, callers of
``PruningTrainer.run``) depends on this small type, never on the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TrainResult"]


@dataclass
class TrainResult:
    """What a run produced. Costs are per example in the run's convention.

    ``latency`` holds CPU times of the dense and the pruned model at batch 1 and 64:
    ``dense_b1_ms``, ``pruned_b1_ms``, ``speedup_b1`` (and ``..._b64``) for the eager modules,
    and the same keys prefixed ``served_`` for frozen TorchScript when the model could be
    traced. The field order is the key order of ``result.json``.
    """

    dense_metric: float
    final_metric: float
    metric_name: str  # "accuracy" (classification) or "mse" (regression)
    dense_cost: float
    final_cost: float
    dense_params: int
    final_params: int
    latency: dict[str, float]
    steps: int
    prunes: int  # channels removed (more than prune events with round_to > 1)
    files: dict[str, str] = field(default_factory=dict)  # what was written: kind -> path
    dense_learned: bool | None = None  # False: the dense model was no better than trivial
    warnings: list[str] = field(default_factory=list)  # what the user must know about the run
