"""Scores that weigh a channel's pruning signal against its marginal cost.

Lower scores are pruned first (the seed's rule, Theis et al. 2018; docs/design.md):
    "auto":   s / (c + 1e-6)  the seed's default; a channel that costs nothing is
              practically never pruned, a dead channel (s = 0) goes first.
    float w:  s - w * c       Theis et al.'s Delta + beta * DeltaC with DeltaC = -c.
    0:        s               the plain Fisher signal.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["FlopsWeight", "score", "score_all"]

FlopsWeight = str | float | int
_EPS = 1e-6


def score(signal: Tensor, cost: Tensor, flops_weight: str | float) -> Tensor:
    """Score of each channel (float64) from its signal and marginal cost."""
    s = signal.detach().double().cpu()
    c = cost.detach().double().cpu()
    if flops_weight == "auto":
        return s / (c + _EPS)
    if flops_weight == 0:
        return s.clone()
    return s - float(flops_weight) * c


def score_all(
    signals: Mapping[str, Tensor], costs: Mapping[str, Tensor], flops_weight: str | float
) -> dict[str, Tensor]:
    """Scores for every mask: ``{name: tensor}``."""
    return {
        n: score(signals[n], costs[n] if n in costs else torch.zeros_like(signals[n]), flops_weight)
        for n in signals
    }
