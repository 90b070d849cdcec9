"""How long each phase of ``fisherprune train`` lasts, and whether the dense model learned.

The phases, in order:

* dense: ``burn_in`` steps of plain training (the pruner gathers its signal meanwhile);
  ``--pruning.burn_in`` when given, else the larger of ``--epochs`` epochs and
  ``--min_dense_steps`` (3 epochs of a 142-row table are 6 steps: not a trained model). With
  ``--init_from`` the model is trained already: the dense phase takes ``statistics_steps``
  steps with a learning rate of 0, which only fills the pruning signal's moving average.
* pruning: one prune every ``--pruning_iter`` steps until the cost target is reached; it
  ends when the target is reached, so fine-tuning always starts from a model at the target
  (or at the step cap, with a warning, when the cap comes first).
* fine-tune: ``--fine_tune_steps`` steps at the target.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fisherprune.calibrate.latency_line import fit_latency_line
from fisherprune.pruner import PruningOptimizer
from fisherprune.settings import OPTIMIZERS, parse_flops_weight
from fisherprune.train.config import TrainConfig

__all__ = [
    "DenseCheck",
    "build_optimizer",
    "burn_in_steps",
    "check_dense",
    "inner_optimizer",
    "statistics_steps",
    "step_cap",
]

#: a classifier this close to chance or to the majority-class rate (in accuracy) learned nothing
ACCURACY_MARGIN = 0.03
#: a regressor whose MSE is at least this fraction of the eval labels' variance learned nothing
MSE_FRACTION = 0.97


#: the inner optimizer of each name in ``settings.OPTIMIZERS`` (the seed's is momentum SGD),
#: from the parameters, the run's settings and the weight decay
_INNER_OPTIMIZERS: dict[
    str, Callable[[list[nn.Parameter], TrainConfig, float], torch.optim.Optimizer]
] = {
    "sgd": lambda params, cfg, wd: torch.optim.SGD(
        params, lr=cfg.learning_rate, momentum=cfg.momentum, weight_decay=wd
    ),
    "adam": lambda params, cfg, wd: torch.optim.Adam(params, lr=cfg.learning_rate, weight_decay=wd),
    "adamw": lambda params, cfg, wd: torch.optim.AdamW(
        params, lr=cfg.learning_rate, weight_decay=wd
    ),
}
assert set(_INNER_OPTIMIZERS) == set(OPTIMIZERS)


def inner_optimizer(
    name: str, params: list[nn.Parameter], config: TrainConfig, weight_decay: float
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (in ``settings.OPTIMIZERS``) over ``params``, with ``config``'s
    learning rate (and momentum) and ``weight_decay``."""
    return _INNER_OPTIMIZERS[name](params, config, weight_decay)


def build_optimizer(
    config: TrainConfig,
    model: nn.Module,
    example: Tensor,
    burn_in: int,
    weight_decay: float,
    latency_calibration: dict[str, Any] | None = None,
) -> PruningOptimizer:
    """The run's ``PruningOptimizer`` over ``model``'s trainable parameters: the inner
    optimizer of ``config.optimizer`` with ``weight_decay``, a prune every ``pruning_iter``
    steps after ``burn_in``. With the ``latency`` convention its cost is fitted to the model
    timed whole at several sizes (``fit_latency_line``), unless ``latency_calibration`` (a
    resumed checkpoint's, ``PruningOptimizer.latency_calibration``) gives the fit: then
    nothing is timed whole."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = PruningOptimizer(
        model,
        example,
        optimizer=inner_optimizer(config.optimizer, params, config, weight_decay),
        prune_every=config.pruning_iter,
        burn_in=burn_in,
        decay=config.pruning_decay,
        flops_weight=parse_flops_weight(config.pruning_flops_weight, "pruning_flops_weight"),
        flops_target=config.pruning_flops_target,
        min_channels=config.pruning_min_channels,
        round_to=config.pruning_round_to,
        uniform=config.pruning_uniform,
        convention=config.pruning_convention,
        score_convention=config.pruning_score_convention,
        criterion=config.pruning_criterion,
        latency=config.latency_spec(),
        latency_calibration=latency_calibration,
    )
    if config.pruning_convention == "latency" and latency_calibration is None:
        fit_latency_line(opt.cost_model, model, example)
    return opt


def statistics_steps(decay: float) -> int:
    """Steps after which an EMA of factor ``decay`` holds 95% of its weight in new terms
    (``decay ** n <= 0.05``): about 60 steps at the default 0.95."""
    return max(1, math.ceil(math.log(0.05) / math.log(decay))) if decay > 0 else 1


def burn_in_steps(config: TrainConfig, batches_per_epoch: int) -> int:
    """Steps of the dense phase (see the module docstring)."""
    if config.pruning_burn_in is not None:
        return config.pruning_burn_in
    if config.init_from:
        return statistics_steps(config.pruning_decay)
    return max(math.ceil(config.epochs * batches_per_epoch), config.min_dense_steps)


def step_cap(config: TrainConfig, burn_in: int, channels: int) -> int:
    """``config.steps``, or enough steps to prune every one of ``channels`` and fine-tune."""
    if config.steps is not None:
        return config.steps
    return burn_in + config.pruning_iter * (channels + 1) + config.fine_tune_steps + 1


@dataclass(frozen=True)
class DenseCheck:
    """Whether the dense model learned, measured on the eval split."""

    learned: bool
    baseline: float  # the best trivial predictor's accuracy, or the eval labels' variance
    message: str  # empty when it learned


def check_dense(value: float, y_eval: Tensor, num_classes: int | None) -> DenseCheck:
    """Compare the dense model's eval metric ``value`` with a trivial predictor on the same
    labels: for a classifier, the better of chance (1/classes) and always answering the most
    frequent eval class; for a regressor, always answering the mean (MSE = variance)."""
    if num_classes is not None:
        counts = torch.bincount(y_eval.reshape(-1).long(), minlength=num_classes)
        majority = float(counts.max()) / max(1, y_eval.numel())
        baseline = max(1.0 / num_classes, majority)
        learned = value > baseline + ACCURACY_MARGIN
        message = (
            f"the dense model did not learn: eval accuracy {value:.4f} is within "
            f"{ACCURACY_MARGIN * 100:.0f} points of chance ({1 / num_classes:.4f}) or of the "
            f"majority class ({majority:.4f})"
        )
    else:
        y = y_eval.double()
        baseline = float(((y - y.mean(0)) ** 2).mean())
        learned = value < MSE_FRACTION * baseline
        message = (
            f"the dense model did not learn: eval MSE {value:.6g} is no better than "
            f"predicting the mean ({baseline:.6g})"
        )
    if learned:
        return DenseCheck(True, baseline, "")
    return DenseCheck(
        False,
        baseline,
        message + "; train it longer (--min_dense_steps, --epochs), change --learning_rate, "
        "or check the features (scale, label column)",
    )
