"""fisherprune: remove whole channels by their Fisher pruning signal weighed against their cost.

Public API (see docs/api.md):

    MaskLayer, find_masks             masks placed by hand
    update_pruning_signals            fold a batch's Fisher estimate into the signal EMA
    computational_cost, CostReport    cost per example and marginal cost per channel
    prune, PruneEvent                 zero the one channel with the lowest score
    PruningOptimizer                  SGD (or any optimizer) + signals + pruning schedule
"""

from fisherprune._version import __version__
from fisherprune.cost import CostModel, CostReport, computational_cost, register_cost_formula
from fisherprune.graph import AppliedMasks, apply_masks, register_channel_rule, remove_masks
from fisherprune.masks import MaskLayer, find_masks
from fisherprune.pruner import PruneEvent, PruningOptimizer, prune, score
from fisherprune.signals import update_pruning_signals

__all__ = [
    "AppliedMasks",
    "CostModel",
    "CostReport",
    "MaskLayer",
    "PruneEvent",
    "PruningOptimizer",
    "__version__",
    "apply_masks",
    "computational_cost",
    "find_masks",
    "prune",
    "register_channel_rule",
    "register_cost_formula",
    "remove_masks",
    "score",
    "update_pruning_signals",
]
