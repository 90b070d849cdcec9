"""Fisher pruning inside a Hugging Face ``Trainer``: the seed's schedule as a callback.

.. code-block:: python

    from fisherprune.integrations.hf import FisherPruningCallback

    callback = FisherPruningCallback(example_inputs, flops_target="50%", prune_every=20)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()                      # signals every step, a prune every 20 steps
    small = fisherprune.shrink(model, example_inputs)

With ``shrink_when_finished=True`` the model is shrunk in place as soon as pruning ends, with
the Trainer's optimizer carried over (``fisherprune.shrink(..., optimizer=)``), so the rest of
``train()`` fine-tunes the smaller model at its own cost instead of the masked one's.

Needs ``transformers`` (the ``hf`` extra); nothing in fisherprune imports this module.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from fisherprune.graph import apply_masks
from fisherprune.integrations._shared import (
    inputs_on,
    refuse_owned_settings,
    shrink_if_finished,
)
from fisherprune.masks import find_masks
from fisherprune.pruner import PruningOptimizer

__all__ = ["FisherPruningCallback"]

log = logging.getLogger("fisherprune")


class FisherPruningCallback(TrainerCallback):
    """Run ``PruningOptimizer``'s schedule inside ``Trainer.train()``.

    At the start of training the model gets masks (``apply_masks``) unless it has some; after
    every optimizer step the gathered gradients are folded into the Fisher signals, and every
    ``prune_every`` steps (after ``burn_in``) the channel with the lowest signal per unit of
    cost is removed, until the cost reaches ``flops_target``; then signals are no longer
    gathered. The Trainer's own optimizer updates the weights.

    Args:
        example_inputs: a batch of the model's inputs (a dict of keyword inputs, as the
            Trainer passes them, minus the labels), used to trace it once.
        **settings: ``PruningOptimizer``'s pruning settings (``flops_target``, ``prune_every``,
            ``burn_in``, ``decay``, ``flops_weight``, ``min_channels``, ``round_to``,
            ``uniform``, ``convention``, ``score_convention``, ``criterion``). The loss is
            taken to be a mean over the batch, as a Trainer's is.
        shrink_when_finished: once pruning has finished, shrink the Trainer's model in place
            at the end of that step and hand its optimizer the shrunk parameters with their
            state sliced (``fisherprune.shrink(model, inplace=True, optimizer=...)``): the
            remaining steps train the physically smaller model. Off by default: the model then
            keeps its masks to the end (``fisherprune.shrink`` afterwards).

    Attributes:
        pruner: the ``PruningOptimizer`` (its ``history``, ``cost()``, ``finished``), set
            when training starts.
    """

    def __init__(
        self, example_inputs: Any, *, shrink_when_finished: bool = False, **settings: Any
    ) -> None:
        refuse_owned_settings(settings, "the Trainer")
        self.example_inputs = example_inputs
        self.shrink_when_finished = bool(shrink_when_finished)
        self.settings = settings
        self._inputs: Any = None  # example_inputs on the model's device (set at train begin)
        self.pruner: PruningOptimizer | None = None

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        """Apply masks if the model has none and start the pruner (once per callback: a later
        ``train()`` of the same model goes on with it).

        Raises:
            ValueError: the callback already prunes another model (given to a second
                ``Trainer``: that model would get no masks, and the first would lose channels
                on the second's steps).
        """
        if self.pruner is not None:
            if model is not None and model is not self.pruner.model:
                raise ValueError(
                    "this FisherPruningCallback already prunes the model of another Trainer "
                    f"({type(self.pruner.model).__name__}); give each Trainer its own callback"
                )
            return
        if model is None or optimizer is None:
            raise ValueError("the Trainer passed no model or optimizer to the callback")
        inputs = inputs_on(self.example_inputs, next(model.parameters()).device)
        if not find_masks(model):
            apply_masks(model, inputs)
        self._inputs = inputs
        self.pruner = PruningOptimizer(model, inputs, optimizer=optimizer, **self.settings)
        log.info("Fisher pruning in the Trainer: target %.6g per example", self.pruner.target)

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Fold this step's gradients into the signals; prune when due; with
        ``shrink_when_finished``, shrink the model in place once pruning has finished."""
        pruner = self.pruner
        if pruner is None:
            return
        pruner.after_update()
        if self.shrink_when_finished:
            shrink_if_finished(pruner, self._inputs)
