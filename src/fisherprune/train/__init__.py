"""Training: data loading, built-in models and the pruning trainer behind ``fisherprune train``.

    PruningTrainer    data -> trained, pruned, fine-tuned, exported model, with a report
    TrainConfig       every setting of a run, validated
    TrainResult       what a run produced (``result.json``)

Imports flow one way (trainer -> finish -> report -> result); the modules here import each other
directly, never this package.
"""

from fisherprune.train.config import TrainConfig
from fisherprune.train.result import TrainResult
from fisherprune.train.trainer import PruningTrainer

__all__ = ["PruningTrainer", "TrainConfig", "TrainResult"]
