"""The hidden units of a recurrent layer (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``), masked inside
its recurrence.

Hidden unit j of every layer and direction is one channel (``nn.LSTM`` has one hidden size
for all of them; ``fisherprune.graph.module_forwards`` ties them). A removed unit must be absent
from every step: its state is multiplied by the mask after each step, so that no later step,
no layer above and no reader of the outputs sees it, as in the shrunk layer, which has no such
unit. A forward hook on the layer does that: while the unit mask is all ones and no signal is
collected, the layer's own forward (its fused kernel) is kept; otherwise its output is computed
again step by step (``fisherprune.recurrent.recurrent_forward``) with the mask acting on each
step's state, which also gathers the Fisher signal there (each step's per-example gradient,
summed over the steps before squaring, as for any mask applied at several places).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fisherprune.masks import tracing
from fisherprune.masks.layer import MaskLayer, all_ones
from fisherprune.masks.points import MaskPoint
from fisherprune.recurrent import recurrent_forward

__all__ = ["RecurrentUnits"]

_SIGNATURE = inspect.signature(lambda input, hx=None: None)


class RecurrentUnits:
    """A forward hook (with kwargs) masking ``module``'s hidden units by ``mask``;
    ``channels``: the mask entry of each unit."""

    def __init__(self, name: str, module: nn.RNNBase, mask: MaskLayer, channels: np.ndarray):
        size = module.hidden_size
        self.point = MaskPoint(name, 0, 1, size, [(mask, np.arange(size), channels)])
        self.masks = [mask]
        self.cache: dict[str, Any] = {}

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, _out: Any) -> Any:
        if tracing.active() is not None:
            return None  # the tracer runs its own forward
        idle = all_ones(self.masks, self.cache) and not self.masks[0].mask.requires_grad
        if idle and not (torch.is_grad_enabled() and self.masks[0].collecting):
            return None
        bound = _SIGNATURE.bind(*args, **kwargs)
        return recurrent_forward(
            module,  # type: ignore[arg-type]
            bound.arguments["input"],
            bound.arguments.get("hx"),
            step_hook=self._step,
        )

    def _step(self, h: Tensor, to_examples: Any) -> Tensor:
        return self.point.apply(h, to_examples=to_examples)
