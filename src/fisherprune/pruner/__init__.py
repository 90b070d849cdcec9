"""Pruning: scores, the one-channel prune step and PruningOptimizer."""

from fisherprune.pruner.optimizer import PruningOptimizer, resolve_target
from fisherprune.pruner.prune import PruneEvent, prune
from fisherprune.pruner.scoring import check_flops_weight, score, score_all

__all__ = [
    "PruneEvent",
    "PruningOptimizer",
    "check_flops_weight",
    "prune",
    "resolve_target",
    "score",
    "score_all",
]
