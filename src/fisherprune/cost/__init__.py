"""Cost of a masked network: cost conventions, per-op formulas and marginal cost per channel."""

from fisherprune.cost.conventions import (
    CONVENTIONS,
    formula_for,
    register_cost_formula,
    unregister_cost_formula,
)
from fisherprune.cost.latency import LatencySpec
from fisherprune.cost.latency_curve import LatencyCurve
from fisherprune.cost.model import CostModel, CostReport, MarginalCosts, computational_cost

__all__ = [
    "CONVENTIONS",
    "CostModel",
    "CostReport",
    "LatencyCurve",
    "LatencySpec",
    "MarginalCosts",
    "computational_cost",
    "formula_for",
    "register_cost_formula",
    "unregister_cost_formula",
]
