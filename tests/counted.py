"""What the architecture tests compare against: a model's first output, FlopCounterMode's count
per example (with the grouped matrix product counted as torch's own formula does), and the
shrunk model against the masked one after a random prune."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import fisherprune as fp
from fisherprune.cost.formulas import SAME_AS_TORCH

ATOL = 1e-9  # float64 output difference, relative to max(1, max |expected|)


def call(model: nn.Module, inputs: object) -> Tensor:
    """``model`` on ``inputs`` (a tensor, or a dict of keyword inputs); its first output."""
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return out if isinstance(out, Tensor) else out[0]


def batch_of(inputs: object) -> int:
    """The batch size of ``inputs``: dim 0 of the tensor, or of the dict's first value."""
    t = next(iter(inputs.values())) if isinstance(inputs, dict) else inputs
    return int(t.shape[0])


def flops_per_example(model: nn.Module, inputs: object) -> float:
    """FlopCounterMode's count on ``model`` (autograd on), per example."""
    with FlopCounterMode(display=False, custom_mapping=dict(SAME_AS_TORCH)) as counter:
        call(model, inputs)
    return counter.get_total_flops() / batch_of(inputs)


def prune_at_random(masks: fp.AppliedMasks, seed: int) -> None:
    """Zero 30-50% (at least one, at most all but one) of every mask's entries."""
    gen = torch.Generator().manual_seed(seed)
    for m in masks.values():
        n = m.num_channels
        k = min(n - 1, max(1, round((0.3 + 0.2 * float(torch.rand(1, generator=gen))) * n)))
        m.mask[torch.randperm(n, generator=gen)[:k]] = 0.0


def assert_exact(model: nn.Module, masks: fp.AppliedMasks, check: object) -> nn.Module:
    """Prune at random; the shrunk model gives the masked model's output on ``check`` (another
    batch than the traced one) and FlopCounterMode on it equals computational_cost of the
    masked model. Returns the shrunk model."""
    prune_at_random(masks, 0)
    with torch.no_grad():
        expected = call(model, check)
        small = fp.shrink(model)
        actual = call(small, check)
    assert actual.shape == expected.shape
    scale = max(1.0, float(expected.abs().max()))
    assert float((actual - expected).abs().max()) <= ATOL * scale
    assert flops_per_example(small, check) == fp.computational_cost(model, check).total
    return small
