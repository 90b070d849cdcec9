"""The Fisher signal where a mask's input rows are not the batch (issue 34): tokens flattened by
a view before a Linear (dim 0 is N*L), and rows selected or reordered by data (the experts of a
mixture-of-experts block). Each signal is checked against a per-example loop: one backward per
example, the gradient of that example's loss with respect to the mask buffer itself (made a
leaf that requires grad, with collecting off), squared and averaged. Every model is traced with
one batch and run with another batch size and sequence length.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.masks.points import find_holder
from fisherprune.masks.rows import register_row_rule
from tests.counted import hf_moe
from tests.host_reads import spied_tensor_reads
from tests.test_moe import _moe_net

#: float64 models: the signal buffers are float32 (apply_masks makes them so), hence float32's
#: rounding; float32 models (CPU's grouped matrix product computes in float32 only): its sums
RTOL64, ATOL64 = 1e-6, 1e-15
RTOL32, ATOL32 = 2e-4, 1e-9


class TokenMLP(nn.Module):
    """(N, L, D) -> the tokens flattened to (N*L, D) -> Linear -> GELU -> Linear -> back, then a
    classifier over the mean token."""

    def __init__(self, dim: int = 6, width: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.up = nn.Linear(dim, width)
        self.act = nn.GELU()
        self.down = nn.Linear(width, dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        n, length, d = h.shape
        t = self.down(self.act(self.up(h.view(-1, d))))
        return self.head((h + t.view(n, length, d)).mean(1))


def _reference(
    masks: fp.AppliedMasks, losses: list[tuple[object, ...]], loss_of
) -> dict[str, Tensor]:
    """0.5 * mean_n (d loss_n / d mask)^2 by one backward per example, in float64."""
    ms = list(masks.values())
    for m in ms:
        m.collecting = False
        m.mask.requires_grad_(True)
    try:
        ref = {k: torch.zeros(m.num_channels, dtype=torch.float64) for k, m in masks.items()}
        for example in losses:
            grads = torch.autograd.grad(loss_of(*example), [m.mask for m in ms])
            for k, g in zip(masks, grads, strict=True):
                ref[k] += 0.5 * g.double() ** 2 / len(losses)
        return ref
    finally:
        for m in ms:
            m.mask.requires_grad_(False)
            m.collecting = True


def _signals(masks: fp.AppliedMasks, loss: Tensor) -> dict[str, Tensor]:
    loss.backward()
    fp.update_pruning_signals(masks, decay=0.0)
    return {k: m.signal.double() for k, m in masks.items()}


def _assert_signals(got: dict[str, Tensor], want: dict[str, Tensor], rtol: float, atol: float):
    assert got.keys() == want.keys()
    for k in want:
        assert float(want[k].abs().max()) > 0, k  # the reference reaches every mask
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=k)


# ======================================================= tokens flattened by a view
def test_flattened_tokens_signal_equals_per_example_loop() -> None:
    """Hidden and MLP widths read through ``x.view(-1, H)``: the signal is the per-example
    loop's at a runtime batch (3, length 5) other than the traced one (2, length 7)."""
    torch.manual_seed(0)
    model = TokenMLP().double()
    masks = fp.apply_masks(model, torch.randn(2, 7, 4, dtype=torch.float64))
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    y = torch.tensor([0, 2, 1])

    def loss_of(i: int) -> Tensor:
        return F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])

    want = _reference(masks, [(i,) for i in range(3)], loss_of)
    got = _signals(masks, F.cross_entropy(model(x), y))
    assert {mp.rows.kind for mp in find_holder(model)[1].points} >= {"tokens"}
    _assert_signals(got, want, RTOL64, ATOL64)


# ============================================ hand-written and Hugging Face MoE blocks
@pytest.mark.parametrize("style", ["grouped", "gathered", "loop"])
def test_hand_written_moe_signal_equals_per_example_loop(style: str) -> None:
    """Hidden width (router and experts read flattened tokens) and experts' width (rows sorted
    for a grouped product, repeated per expert, or gathered per expert by ``torch.where``)."""
    model, x0 = _moe_net(style)
    masks = fp.apply_masks(model, x0)
    x = torch.randn(3, 5, 6, dtype=x0.dtype, generator=torch.Generator().manual_seed(2))
    target = torch.randn(3, 5, 5, dtype=x0.dtype, generator=torch.Generator().manual_seed(3))

    def loss_of(i: int) -> Tensor:
        return F.mse_loss(model(x[i : i + 1]), target[i : i + 1])

    want = _reference(masks, [(i,) for i in range(3)], loss_of)
    got = _signals(masks, F.mse_loss(model(x), target))
    rtol, atol = (RTOL32, ATOL32) if style == "grouped" else (RTOL64, ATOL64)
    _assert_signals(got, want, rtol, atol)


def _lm_loss(model: nn.Module, ids: Tensor, labels: Tensor) -> Tensor:
    """Mean over the examples of each example's mean token cross-entropy."""
    logits = model(input_ids=ids).logits
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    return per_token.view(ids.shape).mean(1).mean()


@pytest.mark.parametrize("experts", ["grouped_mm", "batched_mm", "eager"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_hf_moe_signal_equals_per_example_loop(kind: str, experts: str) -> None:
    """Qwen3-MoE and Mixtral (tiny configs, traced on (2, 8) ids, run on (3, 6)): every mask's
    signal (heads, hidden width, each layer's experts' width) is the per-example loop's."""
    model, traced = hf_moe(kind, experts)
    masks = fp.apply_masks(model, traced)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 99, (3, 6), generator=gen)
    labels = torch.randint(0, 99, (3, 6), generator=gen)

    def loss_of(i: int) -> Tensor:
        return _lm_loss(model, ids[i : i + 1], labels[i : i + 1])

    want = _reference(masks, [(i,) for i in range(3)], loss_of)
    got = _signals(masks, _lm_loss(model, ids, labels))
    rtol, atol = (RTOL32, ATOL32) if experts == "grouped_mm" else (RTOL64, ATOL64)
    _assert_signals(got, want, rtol, atol)


# ============================================================== what is not followed
class Reversed(nn.Module):
    """Tokens flattened and then reversed along dim 0: no rule says whose each row is."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:  # (N, L, 4)
        h = torch.relu(self.up(x.reshape(-1, 4).flip(0)))
        return self.down(h).flip(0).view(x.shape[0], -1, 2).sum(1)


def test_rows_not_followed_are_named_in_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Rows reordered by an operator no rule follows: apply_masks says in one warning which
    point's signal counts each row as one example; a step still collects a finite signal."""
    torch.manual_seed(0)
    model = Reversed()
    with caplog.at_level(logging.WARNING, logger="fisherprune"):
        masks = fp.apply_masks(model, torch.randn(2, 3, 4))
    said = [r.getMessage() for r in caplog.records if "approximate" in r.getMessage()]
    assert len(said) == 1 and "masks at down is approximate" in said[0]
    model(torch.randn(3, 5, 4)).pow(2).mean().backward()
    fp.update_pruning_signals(masks, decay=0.0)
    assert all(bool(torch.isfinite(m.signal).all()) for m in masks.values())


def test_row_rule_registered_twice_is_refused() -> None:
    """The row rules are a registry: a second rule for an operator is an error."""
    with pytest.raises(ValueError, match="already has a row rule"):
        register_row_rule(torch.ops.aten.view)(lambda *a: None)


def test_collecting_step_with_selected_rows_reads_nothing_back() -> None:
    """A collecting step of a MoE whose experts sort their rows (tokens flattened, rows
    followed at run time) makes no host read from fisherprune's code."""
    model, x = _moe_net("grouped")
    masks = fp.apply_masks(model, x)
    with spied_tensor_reads() as reads, reads.watching():
        model(x[:1].repeat(3, 1, 1)).pow(2).mean().backward()
    assert reads.step == []
    fp.update_pruning_signals(masks, decay=0.0)
