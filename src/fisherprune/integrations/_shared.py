"""What the training-loop callbacks (``hf``, ``lightning``) share: the settings they refuse,
the example inputs moved to the model's device, and the shrink once pruning has finished."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from fisherprune.export import shrink
from fisherprune.inputs import Inputs
from fisherprune.pruner import PruningOptimizer

log = logging.getLogger("fisherprune")

#: settings of the training loop's own (its model, its optimizer and rates)
_OWNED = ("optimizer", "lr", "momentum", "nesterov", "weight_decay", "model")


def refuse_owned_settings(settings: Mapping[str, Any], owner: str) -> None:
    """Refuse a setting that belongs to the training loop (``owner``, named in the message).

    Raises:
        TypeError: ``settings`` holds the model, the optimizer or one of its rates.
    """
    for bad in _OWNED:
        if bad in settings:
            raise TypeError(
                f"FisherPruningCallback does not take {bad!r}: {owner} owns the model and its "
                "optimizer"
            )


def inputs_on(example_inputs: Any, device: torch.device) -> Any:
    """``example_inputs`` with every tensor in it moved to ``device`` (a new structure)."""
    moved = Inputs.of(example_inputs).map_leaves(
        lambda t, _batched: t.to(device) if isinstance(t, Tensor) else t
    )
    return moved.value()


def shrink_if_finished(pruner: PruningOptimizer, example_inputs: Any) -> bool:
    """Once pruning has finished, shrink the pruner's model in place with the loop's optimizer
    (the one ``pruner`` wraps) carried over, so that the remaining steps train the smaller
    model; call it right after an optimizer step. Returns whether it shrank now.

    Changes: the model's pruned modules (replaced by smaller ones, masks gone), the optimizer's
    parameter groups and state (sliced), ``pruner.shrunk``."""
    if not pruner.finished or pruner.shrunk:
        return False
    shrink(pruner.model, example_inputs, inplace=True, optimizer=pruner)
    log.info("pruning finished: the model is shrunk in place for the remaining steps")
    return True
