"""Scores that weigh a channel's pruning signal against its marginal cost.

Lower scores are pruned first (SEED.md, DESIGN.md):
    "auto":   s / (c + 1e-6)  the seed's default; a channel that costs nothing is
              practically never pruned, a dead channel (s = 0) goes first.
    float w:  s - w * c       Theis et al.'s Delta + beta * DeltaC with DeltaC = -c.
    0:        s               the plain Fisher signal.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["FlopsWeight", "check_flops_weight", "score"]

FlopsWeight = str | float | int
_EPS = 1e-6


def check_flops_weight(flops_weight: FlopsWeight) -> str | float:
    """Normalise ``flops_weight`` to ``"auto"`` or a float.

    Raises:
        ValueError: an unknown string, a negative or non-finite number.
        TypeError: neither a string nor a number.
    """
    if isinstance(flops_weight, str):
        if flops_weight.lower() != "auto":
            raise ValueError(
                f"flops_weight must be 'auto' or a number >= 0, got the string {flops_weight!r}"
            )
        return "auto"
    if isinstance(flops_weight, bool) or not isinstance(flops_weight, (int, float)):
        raise TypeError(
            f"flops_weight must be 'auto' or a number, got {type(flops_weight).__name__}"
        )
    w = float(flops_weight)
    if not (w >= 0 and w != float("inf")):
        raise ValueError(f"flops_weight must be a finite number >= 0, got {flops_weight!r}")
    return w


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
