"""Pruning criteria (``fisherprune.criteria.Fisher()``, ``Taylor()``, ``L1()``, ``Random(seed)``,
``Activation()``) and the ``Criterion`` base to write your own; see
``fisherprune.signals.criteria``."""

from fisherprune.signals.activation import Activation
from fisherprune.signals.criteria import (
    CRITERIA,
    L1,
    NORMALIZE,
    Criterion,
    Fisher,
    GradientCriterion,
    Random,
    Taylor,
    groups_of,
    register_criterion,
    resolve_criterion,
)
from fisherprune.signals.fisher_mean import FisherMean, coupled_masks

__all__ = [
    "CRITERIA",
    "L1",
    "NORMALIZE",
    "Activation",
    "Criterion",
    "Fisher",
    "FisherMean",
    "GradientCriterion",
    "Random",
    "Taylor",
    "coupled_masks",
    "groups_of",
    "register_criterion",
    "resolve_criterion",
]
