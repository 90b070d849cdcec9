"""Pruning: scores, the one-channel prune step and PruningOptimizer."""

from fisherprune.pruner.optimizer import PruningOptimizer, resolve_target
from fisherprune.pruner.prune import PruneEvent, prune
from fisherprune.pruner.scoring import score, score_all
from fisherprune.settings import check_flops_weight

__all__ = [
    "PruneEvent",
    "PruningOptimizer",
    "check_flops_weight",
    "prune",
    "resolve_target",
    "score",
    "score_all",
]
