"""Pruning signals and criteria: the Fisher signal gathered by masks, and the other criteria
compared against it."""

from fisherprune.settings import LOSS_REDUCTIONS, METHODS
from fisherprune.signals.activation import Activation
from fisherprune.signals.criteria import (
    L1,
    Criterion,
    Fisher,
    GradientCriterion,
    Random,
    Taylor,
    resolve_criterion,
)
from fisherprune.signals.fisher import update_pruning_signals
from fisherprune.signals.fisher_mean import FisherMean

__all__ = [
    "L1",
    "LOSS_REDUCTIONS",
    "METHODS",
    "Activation",
    "Criterion",
    "Fisher",
    "FisherMean",
    "GradientCriterion",
    "Random",
    "Taylor",
    "resolve_criterion",
    "update_pruning_signals",
]
