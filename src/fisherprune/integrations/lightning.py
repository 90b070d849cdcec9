"""Fisher pruning inside a Lightning ``Trainer.fit``: the seed's schedule as a callback.

.. code-block:: python

    import lightning as L
    from fisherprune.integrations.lightning import FisherPruningCallback

    callback = FisherPruningCallback(example_inputs, flops_target="50%", prune_every=20)
    L.Trainer(max_steps=2000, callbacks=[callback]).fit(module, train_loader)
    small = fisherprune.shrink(module, example_inputs)   # or module.net, its network

With ``shrink_when_finished=True`` the module is shrunk in place right after the optimizer step
in which pruning ends, with Lightning's optimizer carried over (``fisherprune.shrink(...,
optimizer=)``), so the rest of ``fit`` fine-tunes the smaller network at its own cost.

Needs ``lightning`` (the ``lightning`` extra); nothing in fisherprune imports this module.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl

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


class FisherPruningCallback(pl.Callback):
    """Run ``PruningOptimizer``'s schedule inside ``Trainer.fit``.

    At fit start the LightningModule gets masks (``apply_masks``) unless it has some; after
    every optimizer step (every ``accumulate_grad_batches`` batches) the gathered gradients
    are folded into the Fisher signals, and every ``prune_every`` steps (after ``burn_in``)
    the channel with the lowest signal per unit of cost is removed, until the cost reaches
    ``flops_target``; then signals are no longer gathered. Lightning's optimizer (the
    module's only one) updates the weights; automatic optimization is assumed.

    Args:
        example_inputs: one batch of the module's ``forward`` inputs (a tensor, a tuple of
            positional inputs or a dict of keyword inputs), used to trace it once.
        **settings: ``PruningOptimizer``'s pruning settings (``flops_target``, ``prune_every``,
            ``burn_in``, ``decay``, ``flops_weight``, ``min_channels``, ``round_to``,
            ``convention``, ``score_convention``, ``criterion``, ``loss_reduction``).
        shrink_when_finished: once pruning has finished, shrink the LightningModule in place
            right after that optimizer step (with gradient accumulation, at the step, not
            between the batches it accumulates) and hand Lightning's optimizer the shrunk
            parameters with their state sliced (``fisherprune.shrink(module, inplace=True,
            optimizer=...)``): the remaining steps train the physically smaller network, and
            the module's ``forward`` runs the shrunk submodules that replaced the masked ones.
            LR schedulers go on as they are (they hold the optimizer, not its parameters).
            Off by default: the module then keeps its masks to the end.

    Attributes:
        pruner: the ``PruningOptimizer`` (its ``history``, ``cost()``, ``finished``), set
            when training starts; its state is saved in Lightning checkpoints and restored
            when a fit resumes from one.

    Raises:
        TypeError: a setting that belongs to Lightning (the model, the optimizer, its rates).
    """

    def __init__(
        self, example_inputs: Any, *, shrink_when_finished: bool = False, **settings: Any
    ) -> None:
        refuse_owned_settings(settings, "Lightning")
        self.example_inputs = example_inputs
        self.shrink_when_finished = bool(shrink_when_finished)
        self.settings = settings
        self.pruner: PruningOptimizer | None = None
        self._restored: dict[str, Any] | None = None
        self._inputs: Any = None  # example_inputs on the module's device (set at train start)
        self._global_step = -1  # the trainer's optimizer steps at the last update

    def _example(self, module: pl.LightningModule) -> Any:
        return inputs_on(self.example_inputs, module.device)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Apply masks to the module unless it has some (they move to its device)."""
        if not find_masks(pl_module):
            apply_masks(pl_module, self._example(pl_module))
            pl_module.to(pl_module.device)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start the pruner on the module's optimizer (once per callback), restored from a
        checkpoint when the fit resumes from one.

        Raises:
            ValueError: the module has no optimizer, or more than one; with
                ``shrink_when_finished``, a strategy that wraps the module (DDP, FSDP,
                DeepSpeed: the wrapper holds the parameters a shrink replaces).
        """
        if self.pruner is not None:
            return
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"FisherPruningCallback needs exactly one optimizer, the module configures "
                f"{len(trainer.optimizers)}"
            )
        if self.shrink_when_finished and trainer.strategy.model is not pl_module:
            raise ValueError(
                f"shrink_when_finished cannot shrink a module that "
                f"{type(trainer.strategy).__name__} wraps in "
                f"{type(trainer.strategy.model).__name__} (the wrapper keeps the parameters "
                "the shrink replaces): train on one device, or leave shrink_when_finished off "
                "and call fisherprune.shrink after fit"
            )
        self._inputs = self._example(pl_module)
        self.pruner = PruningOptimizer(
            pl_module,
            self._inputs,
            optimizer=trainer.optimizers[0],
            **self.settings,
        )
        if self._restored is not None:
            self.pruner.load_state_dict(self._restored)
        self._global_step = trainer.global_step
        log.info("Fisher pruning in Lightning: target %.6g per example", self.pruner.target)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """After an optimizer step: fold the gradients into the signals, prune when due;
        with ``shrink_when_finished``, shrink the module in place once pruning has finished."""
        if self.pruner is None or trainer.global_step == self._global_step:
            return  # no optimizer step in this batch (gradient accumulation)
        self._global_step = trainer.global_step
        self.pruner.after_update()
        if self.shrink_when_finished:
            shrink_if_finished(self.pruner, self._inputs)

    def state_dict(self) -> dict[str, Any]:
        """The pruner's state (counter, masks, signals, history), for Lightning checkpoints."""
        return self.pruner.state_dict() if self.pruner is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep a checkpoint's pruner state, loaded when training starts."""
        self._restored = state_dict or None
