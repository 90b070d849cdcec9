"""The Lightning callback runs the same schedule as ``PruningOptimizer`` in a plain loop."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from fisherprune.export import shrink  # noqa: E402
from fisherprune.graph import apply_masks  # noqa: E402
from fisherprune.integrations.lightning import FisherPruningCallback  # noqa: E402
from fisherprune.masks import MaskLayer, find_masks  # noqa: E402
from fisherprune.pruner import PruningOptimizer  # noqa: E402

if not hasattr(PruningOptimizer, "after_update"):  # the callback's hook into the pruner
    pytest.skip("PruningOptimizer.after_update is not in this tree", allow_module_level=True)

SETTINGS = {"prune_every": 3, "burn_in": 6, "decay": 0.8, "flops_target": "50%"}
STEPS = 90


class _Module(pl.LightningModule):
    def __init__(self, optimizer: str = "sgd", dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(),
                                 nn.Linear(12, 3)).to(dtype)  # fmt: skip
        self.optimizer = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        if self.optimizer == "adamw":  # with a per-step LR schedule, which holds the optimizer
            opt = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
            every = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": every, "interval": "step"}}
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _data(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * 2 * 16, 6, generator=g, dtype=dtype)
    return x, x[:, :3].argmax(1)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _data()
    return [(x[i : i + 16], y[i : i + 16]) for i in range(0, x.shape[0], 16)]


def _fit(
    accumulate: int = 1,
    optimizer: str = "sgd",
    dtype: torch.dtype = torch.float32,
    shrink_when_finished: bool = False,
    **trainer_args: Any,
) -> tuple[_Module, FisherPruningCallback]:
    module = _Module(optimizer, dtype)
    callback = FisherPruningCallback(
        torch.zeros(1, 6, dtype=dtype), shrink_when_finished=shrink_when_finished, **SETTINGS
    )
    trainer = pl.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, logger=False, callbacks=[callback],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accumulate_grad_batches=accumulate, **trainer_args,
    )  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(*_data(dtype)), batch_size=16))
    return module, callback


def test_callback_prunes_the_channels_a_plain_pruning_loop_prunes() -> None:
    """Same model, batches and SGD: Trainer.fit with the callback and a plain loop of
    ``PruningOptimizer.minimize`` prune the same channels at the same steps."""
    _, callback = _fit()
    assert callback.pruner is not None and callback.pruner.finished
    reference = _Module()
    apply_masks(reference, torch.zeros(1, 6))
    popt = PruningOptimizer(
        reference, torch.zeros(1, 6),
        optimizer=torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9), **SETTINGS,
    )  # fmt: skip
    for x, y in _batches()[:STEPS]:
        popt.minimize(F.cross_entropy(reference(x), y))
    got = [(e.step, e.mask, list(e.channels)) for e in callback.pruner.history]
    want = [(e.step, e.mask, list(e.channels)) for e in popt.history]
    assert got == want and len(got) > 0
    assert callback.pruner.cost().total <= callback.pruner.target


def test_pruned_module_shrinks_to_a_model_with_the_same_outputs() -> None:
    module, _ = _fit()
    x = torch.randn(8, 6)
    with torch.no_grad():
        masked = module(x)
        small = shrink(module, torch.zeros(1, 6))
        assert torch.allclose(small(x), masked, atol=1e-5)
    kept = {n: m.kept for n, m in find_masks(module).items()}
    assert sum(kept.values()) < 28


def test_with_gradient_accumulation_the_pruner_counts_optimizer_steps() -> None:
    _, callback = _fit(accumulate=2)
    assert callback.pruner is not None
    assert callback.pruner.counter - 1 == STEPS
    assert all(e.step % SETTINGS["prune_every"] == 0 for e in callback.pruner.history)


def test_settings_that_belong_to_lightning_are_refused() -> None:
    with pytest.raises(TypeError, match="Lightning owns the model and its optimizer"):
        FisherPruningCallback(torch.zeros(1, 6), lr=0.1)


X64 = torch.zeros(1, 6, dtype=torch.float64)


@pytest.mark.parametrize(("optimizer", "accumulate"), [("sgd", 1), ("adamw", 1), ("sgd", 2)])
def test_shrink_when_finished_ends_with_the_weights_of_the_masked_run_shrunk_after_it(
    optimizer: str, accumulate: int
) -> None:
    """The steps after pruning train the module shrunk in place (its optimizer state, LR
    schedule and gradient accumulation carried on) to the weights the masked module reaches
    and is then shrunk to (float64)."""
    small, callback = _fit(accumulate, optimizer, torch.float64, shrink_when_finished=True)
    masked, reference = _fit(accumulate, optimizer, torch.float64)
    assert callback.pruner is not None and reference.pruner is not None
    assert callback.pruner.shrunk and not reference.pruner.shrunk
    assert [e.step for e in callback.pruner.history] == [e.step for e in reference.pruner.history]
    assert callback.pruner.history[-1].step < STEPS - 20  # many steps trained the shrunk module
    late = shrink(masked, X64).state_dict()
    got = small.state_dict()
    assert got.keys() == late.keys()
    for k, v in got.items():
        torch.testing.assert_close(v, late[k], rtol=1e-9, atol=1e-12, msg=k)


def test_shrunk_module_has_no_masks_fewer_parameters_and_its_forward_runs_the_small_net() -> None:
    small, _ = _fit(shrink_when_finished=True)
    masked, _ = _fit()
    assert not any(isinstance(m, MaskLayer) for m in small.modules())
    assert sum(p.numel() for p in small.parameters()) < sum(
        p.numel() for p in _Module().parameters()
    )
    x = torch.randn(8, 6)
    with torch.no_grad():
        torch.testing.assert_close(small.eval()(x), masked.eval()(x), rtol=1e-4, atol=1e-5)


@pytest.fixture
def _process_left_as_it_was() -> Iterator[None]:
    """Undo what a one-process DDP fit sets up for the whole process: its process group,
    environment (LOCAL_RANK, MASTER_PORT, OMP_NUM_THREADS) and torch's thread count."""
    environ, threads = dict(os.environ), torch.get_num_threads()
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("_process_left_as_it_was")
def test_shrink_when_finished_refuses_a_strategy_that_wraps_the_module() -> None:
    with pytest.raises(ValueError, match="DDPStrategy wraps in DistributedDataParallel"):
        _fit(shrink_when_finished=True, strategy="ddp")


class _TwoOptimizers(_Module):
    def configure_optimizers(self) -> Any:
        first, second = self.net[0].parameters(), self.net[2:].parameters()
        return torch.optim.SGD(first, lr=0.1), torch.optim.SGD(second, lr=0.1)


def test_a_module_with_two_optimizers_is_refused() -> None:
    module = _TwoOptimizers()
    module.automatic_optimization = False  # Lightning refuses two under automatic optimization
    callback = FisherPruningCallback(torch.zeros(1, 6), shrink_when_finished=True, **SETTINGS)
    trainer = pl.Trainer(
        max_steps=2, accelerator="cpu", devices=1, logger=False, callbacks=[callback],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="needs exactly one optimizer, the module configures 2"):
        trainer.fit(module, DataLoader(TensorDataset(*_data()), batch_size=16))
