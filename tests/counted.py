"""What the architecture tests compare against: a model's first output and FlopCounterMode's
count per example (with the grouped matrix product counted as torch's own formula does)."""

from __future__ import annotations

from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from fisherprune.cost.formulas import SAME_AS_TORCH


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
