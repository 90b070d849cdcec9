"""Non-finite input never prunes (issue 35, point 3): ``PruningOptimizer`` skips a prune whose
window of batches held a non-finite estimate and says so once; ``prune_to_target`` stops with
an error naming the batch; the repair leaves non-finite rows out, by layer, instead of failing
inside."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fisherprune as fp
from fisherprune.masks import find_masks


def _mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, torch.randn(64, 8), torch.randint(0, 4, (64,))


def _skip_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "no channel pruned" in str(w.message)]


def test_nan_losses_never_prune_and_it_is_said_once() -> None:
    """20 NaN losses with a prune due at every step: no channel is pruned and one warning
    says why (the old optimizer pruned nine channels on a signal that held no batch)."""
    model, x, y = _mlp()
    fp.apply_masks(model, x[:1])
    opt = fp.PruningOptimizer(model, x[:1], prune_every=1, flops_target="50%", lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(20):
            opt.minimize(F.cross_entropy(model(x), y) * float("nan"))
    assert opt.history == []
    assert all(m.kept == m.num_channels for m in find_masks(model).values())
    (told,) = _skip_warnings(caught)
    assert "not finite" in told


def test_a_nan_batch_skips_the_next_prune_only() -> None:
    """A NaN batch (the loop updating the weights itself, ``after_update``) makes the prune
    due after it a skip; the window after that is clean and prunes again."""
    model, x, y = _mlp()
    fp.apply_masks(model, x[:1])
    opt = fp.PruningOptimizer(model, x[:1], prune_every=2, flops_target="50%", lr=0.01)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(1, 7):  # prunes due at steps 2, 4, 6
            opt.zero_grad()
            F.cross_entropy(model(bad if step == 3 else x), y).backward()
            opt.after_update()
    assert [e.step for e in opt.history] == [2, 6]


def test_prune_to_target_on_all_nan_batches_stops_naming_the_batch() -> None:
    """Every calibration batch NaN: a ValueError naming batch 1 and nothing pruned (the old
    code removed 16 of 32 channels on no signal at all)."""
    model, x, y = _mlp()
    x = x * float("nan")
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    with pytest.raises(ValueError, match=r"not finite.*batch 1 of 4 is nan \(and 3 other"):
        fp.prune_to_target(model, x[:1], batches, "50%", loss_fn=F.cross_entropy)
    assert all(m.kept == m.num_channels for m in find_masks(model).values())


def test_prune_to_target_on_nan_weights_stops_naming_the_mask() -> None:
    """A criterion that reads weights (L1) on a NaN weight: a ValueError naming the mask
    whose importance is not finite, before any channel goes."""
    model, x, y = _mlp()
    with torch.no_grad():
        model[0].weight[3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"l1 importance of mask '.*' is not finite"):
        fp.prune_to_target(model, x[:1], [(x, y)], "50%", criterion="l1", reconstruct=False)


def test_the_repair_leaves_nan_rows_out_by_layer() -> None:
    """One NaN input among 64 (L1 reads no gradient, so the pruning goes on): the repair
    leaves that row out of the layer it reaches, names the layer with a warning and refits
    it on the rest (it failed inside with ``max() arg is an empty sequence``)."""
    model, x, y = _mlp()
    x[3, 2] = float("nan")
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    with pytest.warns(RuntimeWarning, match=r"left out rows holding NaN or inf: 2 \(1 rows\)"):
        result = fp.prune_to_target(model, x[:1], batches, "50%", criterion="l1")
    assert result.repair is not None and result.repair.nonfinite == {"2": 1}
    assert "2" in result.repair.layers
    assert all(torch.isfinite(p).all() for p in model.parameters())
