"""The repair of a layer whose targets are its own dense outputs (an LM head) from the
cross-Gram of its pruned and dense inputs (``repair_sums.CrossSums``): the refit it writes,
and that no (features x vocabulary) matrix is made for it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fisherprune as fp
from fisherprune.calibrate import repair_consumers, repair_sums
from fisherprune.calibrate.repair_fit import LayerFit
from fisherprune.calibrate.repair_sums import CrossSums
from tests.test_memory_bounds import _LargestNew

transformers = pytest.importorskip("transformers")


def test_cross_gram_fit_of_a_wide_linear_writes_the_float64_ridge_refit() -> None:
    """A linear layer with more outputs than twice its inputs, fitted through its forward hook
    (dense call, then pruned call), sums the cross-Gram and writes the float64 ridge solution
    for the explicit targets ``X_d W^T + b`` of its original weights; the removed columns are
    zero."""
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(6, 400)
    w0, b0 = layer.weight.detach().double().clone(), layer.bias.detach().double().clone()
    kept = torch.tensor([0, 2, 3, 5])
    dense = torch.randn(300, 6, generator=g)
    pruned = dense + 0.3 * torch.randn(300, 6, generator=g)
    pruned[:, [1, 4]] = 0.0
    fit = LayerFit(layer, kept, dim=1, positions=1)
    fit.cross_if_smaller()
    assert isinstance(fit.sums, CrossSums)
    with torch.no_grad():
        fit.hook(layer, (dense,), layer(dense))
        fit.pruned = True
        fit.hook(layer, (pruned,), layer(pruned))
    mode, *_ = fit.solve_and_set(0.1, rows_per_weight=20.0)
    rows = torch.cat([pruned[:, kept], torch.ones(300, 1)], 1).double()  # the reference
    y = dense.double() @ w0.T + b0
    a, b = rows.T @ rows, rows.T @ y
    lam = 0.1 * float(a.diagonal().mean())
    prior = torch.cat([w0[:, kept], b0[:, None]], 1).T
    want = torch.linalg.solve(a + lam * torch.eye(5, dtype=torch.float64), b + lam * prior)
    assert mode == "weights"  # 300 rows for 5 features
    torch.testing.assert_close(layer.weight[:, kept].double(), want[:4].T, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.bias.double(), want[4], rtol=1e-6, atol=1e-6)
    assert not layer.weight[:, [1, 4]].any()


def _largest_made_by_the_repair(cross: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """The most bytes of any tensor made while repairing (in one pass, ridge 0.1, one of four
    batches held out) a one-layer Llama with a 4000-token vocabulary, its hidden width 32 -> 24, in
    micro-batches of 6 tokens (``cross``: as the repair does; else with every fit on
    ``Sums``); and the bytes of the LM head's float32 ``X^T Y`` (its 24 kept features x the
    vocabulary)."""
    monkeypatch.setattr(repair_sums, "BLOCK_ELEMENTS", 24 * 500)  # 500 of 4000 columns a block
    if not cross:
        monkeypatch.setattr(LayerFit, "cross_if_smaller", lambda self: None)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4000, hidden_size=32, num_hidden_layers=1, intermediate_size=48,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 4000, (4, 6), generator=torch.Generator().manual_seed(1))
    masks = fp.apply_masks(model, {"input_ids": ids[:1]})
    dense = {n: torch.ones_like(m.mask) for n, m in masks.items()}
    with torch.no_grad():
        next(m for m in masks.values() if m.num_channels == 32).mask[:8] = 0.0
    spy = _LargestNew()
    with spy:
        batches = [{"input_ids": ids[i : i + 1]} for i in range(4)]
        report = repair_consumers(model, batches, dense, ridge=0.1, passes=1)
    assert "lm_head" in report.layers
    return spy.most, 24 * 4000 * 4


def test_lm_head_repair_makes_no_features_by_vocabulary_matrix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Repairing a decoder whose hidden width is pruned makes no tensor as large as the LM
    head's ``X^T Y`` (its kept features x the vocabulary, which the fit on ``Sums`` makes):
    none larger than one micro-batch's logits in float64 (6 tokens x the vocabulary)."""
    most, xty = _largest_made_by_the_repair(True, monkeypatch)
    assert 0 < most <= 6 * 4000 * 8 < xty
    assert _largest_made_by_the_repair(False, monkeypatch)[0] >= xty  # the check is not vacuous
