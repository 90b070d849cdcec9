"""Cost of a masked network: per-op formulas and marginal cost per channel."""

from fisherprune.cost.formulas import CONVENTIONS, register_cost_formula
from fisherprune.cost.model import CostModel, CostReport, MarginalCosts, computational_cost

__all__ = [
    "CONVENTIONS",
    "CostModel",
    "CostReport",
    "MarginalCosts",
    "computational_cost",
    "register_cost_formula",
]
