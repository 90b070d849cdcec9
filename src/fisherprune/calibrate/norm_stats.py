"""Batch-norm statistics re-estimated for the network as its channels are now.

One-shot pruning scores channels in rounds. Removing channels shifts the distribution every
later batch norm sees, while its running mean and variance stay those of the dense network:
without a repair the pruned network's activations drift, and by 30% of a CNN's FLOPs it
classifies at chance (benchmarks/one_shot_defaults.py). A signal measured on such a network
ranks channels of a network nobody will serve. ``prune_to_target`` therefore re-estimates the
statistics on the calibration inputs before each round after the first (the "adaptive batch
norm" of EagleEye, Li et al. 2020, used here to measure, not to serve), and puts the dense
statistics back before the repair, which fits the pruned layers to the dense outputs.

Only ``torch.nn`` batch norms that track running statistics are re-estimated;
``SyncBatchNorm`` is left alone (its training-mode forward needs a process group).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from fisherprune.inputs import call_model
from fisherprune.modes import eval_mode

__all__ = ["NormStats", "batch_norms"]


def batch_norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The batch norms of ``model`` whose running statistics can be re-estimated."""
    return [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        and not isinstance(m, nn.SyncBatchNorm)
        and m.track_running_stats
        and m.running_mean is not None
        and m.running_var is not None
    ]


def _statistics(m: nn.modules.batchnorm._BatchNorm) -> list[Tensor]:
    """The running-statistics buffers of ``m`` that exist."""
    kept = (m.running_mean, m.running_var, m.num_batches_tracked)
    return [t for t in kept if t is not None]


class NormStats:
    """The running statistics of a model's batch norms, kept to be put back.

    ``NormStats(model)`` copies them (a few floats per channel); ``reestimate`` replaces them
    by those of the calibration inputs; ``restore`` writes the copies back in place.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.norms = batch_norms(model)
        self._saved = [[t.detach().clone() for t in _statistics(m)] for m in self.norms]

    @torch.no_grad()
    def reestimate(self, batches: Iterable[tuple[Any, Any]]) -> int:
        """Set every batch norm's running mean and variance to the average over ``batches``'
        inputs run through the model as it is now (masks included); returns the examples
        read. Changes: the batch norms' buffers only. Every module stays in eval mode except
        the batch norms, so dropout and the like do not change what they see; their momentum
        and mode are given back."""
        if not self.norms:
            return 0
        momenta = [m.momentum for m in self.norms]
        seen = 0
        with eval_mode(self.model):
            try:
                for m in self.norms:
                    m.reset_running_stats()
                    m.momentum = None  # a cumulative average over the batches
                    m.train()
                for inputs, _ in batches:
                    call_model(self.model, inputs)
                    seen += 1
            finally:
                for m, momentum in zip(self.norms, momenta, strict=True):
                    m.momentum = momentum
        return seen

    @torch.no_grad()
    def restore(self) -> None:
        """Write the copied statistics back into the batch norms' buffers, in place."""
        for m, saved in zip(self.norms, self._saved, strict=True):
            for t, s in zip(_statistics(m), saved, strict=True):
                t.copy_(s)
