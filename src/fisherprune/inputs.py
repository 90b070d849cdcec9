"""How example inputs and batches are handed to a model.

An ``example_inputs`` value is one tensor or a tuple / list of the model's positional
arguments; its first tensor's dim 0 is the batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from fisherprune.modes import eval_mode

__all__ = ["as_args", "eval_outputs"]


def as_args(example_inputs: Any) -> tuple:
    """The positional arguments that ``example_inputs`` stands for: a tuple as it is, a list
    as a tuple, anything else as the one argument."""
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def eval_outputs(model: nn.Module, example_inputs: Any) -> list[Tensor]:
    """Every tensor ``model`` returns for ``example_inputs`` in eval mode without autograd,
    flattened in order and detached copies; the model's train/eval flags are given back."""
    with eval_mode(model), torch.no_grad():
        out = model(*as_args(example_inputs))
    return [t.detach().clone() for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
