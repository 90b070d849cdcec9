"""The weight decay of a run that would overtrain its rows is chosen by validation on held-out
training rows (``fisherprune.train.regularize``), never on the eval split."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from fisherprune.train.config import TrainConfig
from fisherprune.train.data import Dataset
from fisherprune.train.devices import Precision
from fisherprune.train.models import build_model
from fisherprune.train.regularize import (
    DEFAULT_WEIGHT_DECAY,
    WEIGHT_DECAYS,
    choose_weight_decay,
    needs_search,
)


def _noisy_regression(n: int = 120) -> Dataset:
    """Targets that are mostly noise, 100 training rows and 20 eval rows."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 24, generator=g)
    y = 0.5 * x[:, 0] + torch.randn(n, generator=g)
    return Dataset(x[:100], y[:100], x[100:], y[100:], None, (24,), None, "noisy")


def _choose(config: TrainConfig, data: Dataset, steps: int = 600) -> object:
    torch.manual_seed(0)
    model = build_model("mlp", (24,), 1, 32, 2)
    return choose_weight_decay(
        config, data, model, steps=steps, trial_steps=60, batch_size=32,
        loss=lambda out, y: F.mse_loss(out.reshape(y.shape), y),
        precision=Precision("fp32", torch.device("cpu")), device=torch.device("cpu"),
    )  # fmt: skip


def test_small_table_decay_is_the_best_on_held_out_training_rows_only() -> None:
    """A run of 600 steps of 32 on 100 rows: every candidate is tried, scored on 20 held-out
    training rows, the lowest validation MSE wins; the eval split is never read (NaN there
    changes nothing)."""
    data = _noisy_regression()
    choice = _choose(TrainConfig(), data)
    assert choice.searched and choice.val_rows == 20
    assert [d for d, _, _ in choice.scores] == list(WEIGHT_DECAYS)
    best = min(choice.scores, key=lambda s: s[1])
    assert choice.value == best[0]
    blind = dataclasses.replace(data, x_eval=torch.full_like(data.x_eval, float("nan")))
    assert _choose(TrainConfig(), blind) == choice


def test_a_given_decay_or_a_short_run_is_not_searched() -> None:
    """``--weight_decay`` is used as given; a run of fewer than 10 passes over its rows, or one
    starting from trained weights, takes the default without training anything."""
    data = _noisy_regression()
    assert _choose(TrainConfig(weight_decay=0.01), data).value == 0.01
    short = _choose(TrainConfig(), data, steps=30)
    assert not short.searched and short.value == DEFAULT_WEIGHT_DECAY
    assert not needs_search(TrainConfig(init_from="w.pt"), data, 600, 32)
