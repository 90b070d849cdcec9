"""Fisher pruning inside a Lightning ``Trainer.fit``: the seed's schedule as a callback.

.. code-block:: python

    import lightning as L
    from fisherprune.integrations.lightning import FisherPruningCallback

    callback = FisherPruningCallback(example_inputs, flops_target="50%", prune_every=20)
    L.Trainer(max_steps=2000, callbacks=[callback]).fit(module, train_loader)
    small = fisherprune.shrink(module, example_inputs)   # or module.net, its network

Needs ``lightning`` (the ``lightning`` extra); nothing in fisherprune imports this module.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
from torch import Tensor

from fisherprune.graph import apply_masks
from fisherprune.inputs import Inputs
from fisherprune.masks import find_masks
from fisherprune.pruner import PruningOptimizer

__all__ = ["FisherPruningCallback"]

log = logging.getLogger("fisherprune")

_OWNED = ("optimizer", "lr", "momentum", "nesterov", "weight_decay", "model")


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

    Attributes:
        pruner: the ``PruningOptimizer`` (its ``history``, ``cost()``, ``finished``), set
            when training starts; its state is saved in Lightning checkpoints and restored
            when a fit resumes from one.

    Raises:
        TypeError: a setting that belongs to Lightning (the model, the optimizer, its rates).
    """

    def __init__(self, example_inputs: Any, **settings: Any) -> None:
        for bad in _OWNED:
            if bad in settings:
                raise TypeError(
                    f"FisherPruningCallback does not take {bad!r}: Lightning owns the model "
                    "and its optimizer"
                )
        self.example_inputs = example_inputs
        self.settings = settings
        self.pruner: PruningOptimizer | None = None
        self._restored: dict[str, Any] | None = None
        self._global_step = -1  # the trainer's optimizer steps at the last update

    def _example(self, module: pl.LightningModule) -> Any:
        return (
            Inputs.of(self.example_inputs)
            .map(lambda t: t.to(module.device) if isinstance(t, Tensor) else t)
            .value()
        )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Apply masks to the module unless it has some (they move to its device)."""
        if not find_masks(pl_module):
            apply_masks(pl_module, self._example(pl_module))
            pl_module.to(pl_module.device)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start the pruner on the module's optimizer (once per callback), restored from a
        checkpoint when the fit resumes from one.

        Raises:
            ValueError: the module has no optimizer, or more than one.
        """
        if self.pruner is not None:
            return
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"FisherPruningCallback needs exactly one optimizer, the module configures "
                f"{len(trainer.optimizers)}"
            )
        self.pruner = PruningOptimizer(
            pl_module,
            self._example(pl_module),
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
        """After an optimizer step: fold the gradients into the signals, prune when due."""
        if self.pruner is None or trainer.global_step == self._global_step:
            return  # no optimizer step in this batch (gradient accumulation)
        self._global_step = trainer.global_step
        self.pruner.after_update()

    def state_dict(self) -> dict[str, Any]:
        """The pruner's state (counter, masks, signals, history), for Lightning checkpoints."""
        return self.pruner.state_dict() if self.pruner is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep a checkpoint's pruner state, loaded when training starts."""
        self._restored = state_dict or None
