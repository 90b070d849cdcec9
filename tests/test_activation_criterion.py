"""The activation criterion (structured Wanda / FLAP, ``fisherprune.criteria.Activation``):
against a float64 hand computation, through ``prune_to_target``, and refused where no
calibration pass runs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import fisherprune as fp
from fisherprune.criteria import Activation
from fisherprune.masks.blocks import BlockGate
from fisherprune.signals.activation import hook_points


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 2)).double()


def test_activation_importance_is_column_norm_times_rms() -> None:
    """Hidden unit k of Linear->ReLU->Linear scores ``||W2[:, k]||_2 * sqrt(mean_n h[n,k]^2)``
    over every calibration example (h the ReLU output), summed over two batches; a pruned
    unit reads 0 and scores 0."""
    model = _mlp()
    x = torch.randn(7, 3, dtype=torch.float64)
    masks = fp.apply_masks(model, x[:1])
    (name,) = masks  # the hidden width is the only prunable group
    masks[name].mask[4] = 0.0
    crit = Activation(normalize="none")
    with torch.no_grad(), crit.observing(model, masks):
        model(x[:3])
        model(x[3:])
    h = torch.relu(x @ model[0].weight.T + model[0].bias)
    h[:, 4] = 0.0
    ref = model[2].weight.norm(dim=0) * h.square().mean(0).sqrt()
    got = crit.scores(masks, model)[name]
    torch.testing.assert_close(got, ref.detach(), rtol=1e-12, atol=1e-15)
    assert got[4] == 0 and bool((got[:4] > 0).any())


class _ReadByLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 6)
        self.rnn = nn.LSTM(6, 4, batch_first=True, bidirectional=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(torch.relu(self.fc(x)))[0].mean(1))


def test_a_width_a_recurrent_layer_reads_scores_by_its_input_weights() -> None:
    """The width an LSTM reads scores ``(||W_ih[:, k]|| + ||W_ih_reverse[:, k]||) *
    sqrt(mean over examples and steps of h[.., k]^2)``: its first layer's input weights, each
    direction's, read that width (it was refused: the LSTM has no ``weight``)."""
    torch.manual_seed(0)
    model = _ReadByLSTM().double()
    x = torch.randn(5, 7, 3, dtype=torch.float64)
    masks = fp.apply_masks(model, x[:1])
    name = next(k for k, g in masks.groups.items() if ("fc.weight", 0) in g.params)
    crit = Activation(normalize="none")
    with torch.no_grad(), crit.observing(model, masks):
        model(x)
    h = torch.relu(model.fc(x)).detach()
    w = model.rnn.weight_ih_l0.norm(dim=0) + model.rnn.weight_ih_l0_reverse.norm(dim=0)
    ref = w.detach() * h.square().mean((0, 1)).sqrt()
    torch.testing.assert_close(crit.scores(masks, model)[name], ref, rtol=1e-12, atol=1e-15)


def test_prune_to_target_with_activation_removes_lowest_scores() -> None:
    """``prune_to_target(criterion="activation")`` observes the calibration batches with no
    gradient and removes the hidden units of lowest hand-computed score (every unit costs
    the same, so the ranking alone decides)."""
    model = _mlp()
    x = torch.randn(16, 3, dtype=torch.float64)
    h = torch.relu(x @ model[0].weight.T + model[0].bias)
    ref = (model[2].weight.norm(dim=0) * h.square().mean(0).sqrt()).detach()
    batches = [(x[:8], None), (x[8:], None)]
    result = fp.prune_to_target(
        model, x[:1], batches, 0.6, criterion="activation", reconstruct=False, rounds=1,
        round_cap=1.0,
    )  # fmt: skip
    (mask,) = fp.find_masks(model).values()
    removed = set(torch.nonzero(mask.mask < 0.5).flatten().tolist())
    assert removed == set(ref.argsort()[: len(removed)].tolist())
    assert len(removed) >= 2 and result.examples == 16
    assert all(p.grad is None for p in model.parameters())


class _CountingFisher(fp.criteria.Fisher):
    """Fisher that also counts the rows reaching the masked layers under ``observing``."""

    uses_activations = True

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    @contextmanager
    def observing(self, model: nn.Module, masks: object) -> Iterator[None]:
        def count(module: nn.Module, args: tuple) -> None:
            self.rows.append(args[0].shape[0])

        _, handles = hook_points(model, lambda point: count, "counting")
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def test_a_gradient_criterion_that_reads_activations_sees_every_calibration_pass() -> None:
    """``prune_to_target`` runs a gradient criterion's signal passes under its ``observing``:
    a Fisher that also counts forward rows sees both calibration batches in every round."""
    model = _mlp()
    x = torch.randn(16, 3, dtype=torch.float64)
    batches = [(x[:8], torch.zeros(8, dtype=torch.long)), (x[8:], torch.ones(8, dtype=torch.long))]
    crit = _CountingFisher()
    result = fp.prune_to_target(model, x[:1], batches, 0.6, criterion=crit, reconstruct=False,
                                loss_fn=nn.functional.cross_entropy)  # fmt: skip
    assert result.rounds >= 1 and result.examples == 16
    assert crit.rows == [8, 8] * result.rounds  # one masked layer: one count per forward


def test_optimizer_refuses_activation_criterion() -> None:
    """Training runs no calibration passes, so ``PruningOptimizer`` refuses the criterion."""
    model = _mlp()
    fp.apply_masks(model, torch.randn(1, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="prune_to_target"):
        fp.PruningOptimizer(model, torch.randn(1, 3, dtype=torch.float64), criterion="activation")


def test_activation_scores_need_a_forward() -> None:
    """Scores asked for before any observed forward pass are an error, not zeros."""
    model = _mlp()
    masks = fp.apply_masks(model, torch.randn(1, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="observing"):
        Activation().scores(masks, model)


def test_a_block_scores_the_rms_size_of_its_change_to_the_residual_stream() -> None:
    """A Llama's block gate (``blocks=True``) scores block ``i`` by ``sqrt(mean over example
    positions of ||h_{i+1} - h_i||^2)``, with ``h`` the hidden states the model returns (the
    last block's output is returned after the final norm, so the reference stops before it);
    a block gated off scores 0."""
    from tests.test_depth import IDS, _llama

    model = _llama()
    masks = fp.apply_masks(model, {"input_ids": IDS}, blocks=True)
    (gate,) = (n for n, m in masks.items() if isinstance(m, BlockGate))
    masks[gate].mask[1] = 0.0
    crit = Activation()
    with torch.no_grad(), crit.observing(model, masks):
        hidden = model(IDS[:2], output_hidden_states=True).hidden_states
        hidden2 = model(IDS[2:], output_hidden_states=True).hidden_states
    got = crit.scores(masks, model)[gate]
    for i in range(3):
        change = torch.cat([hidden[i + 1] - hidden[i], hidden2[i + 1] - hidden2[i]])
        ref = change.square().sum(-1).mean().sqrt()
        torch.testing.assert_close(got[i], ref.to(got.dtype), rtol=1e-6, atol=1e-9)
    assert got[1] == 0 and bool((got[[0, 2, 3]] > 0).all())


def test_activation_prunes_the_near_identity_blocks_first() -> None:
    """``prune_to_target(criterion="activation", blocks="only")`` on a Llama whose blocks 1
    and 2 barely change the hidden state removes those two."""
    from tests.test_depth import IDS, near_identity_llama

    model = near_identity_llama()
    inputs = {"input_ids": IDS}
    fp.prune_to_target(
        model, inputs, [(inputs, None)], "60%", criterion="activation", blocks="only",
        reconstruct=False,
    )  # fmt: skip
    (gate,) = (m for m in fp.find_masks(model).values() if isinstance(m, BlockGate))
    assert gate.mask.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_a_block_no_forward_reached_is_not_scored_zero() -> None:
    """A gated block that no calibration forward ran (here the last of four) has no size of
    change: the criterion refuses to score the gate rather than give that block 0, which
    would rank it first for removal."""
    from tests.test_depth import _stack

    model, x, _ = _stack()
    masks = fp.apply_masks(model, x[:1], blocks=True)
    (gate,) = (n for n, m in masks.items() if isinstance(m, BlockGate))
    crit = Activation()
    with torch.no_grad(), crit.observing(model, masks):
        h = model.inp(x)
        for block in model.layers[:3]:
            h = block(h)
    with pytest.raises(ValueError, match=rf"{gate}.*block.*not found"):
        crit.scores({gate: masks[gate]}, model)  # the unrun block's channels are refused too


def test_a_float64_block_change_is_measured_in_float64() -> None:
    """In a float64 model a block's score is its change's RMS to float64 precision (as the
    channels' input statistics are), not rounded through float32."""
    from tests.test_depth import _stack

    model, x, _ = _stack()
    masks = fp.apply_masks(model, x[:1], blocks=True)
    (gate,) = (n for n, m in masks.items() if isinstance(m, BlockGate))
    crit = Activation()
    with torch.no_grad(), crit.observing(model, masks):
        model(x)
    got = crit.scores(masks, model)[gate]
    with torch.no_grad():
        h, want = model.inp(x), []
        for block in model.layers:
            h, before = block(h), h
            want.append((h - before).square().sum(-1).mean().sqrt())
    assert got.dtype == torch.float64 and float(got.min()) > 0
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-12, atol=0)


class _Float32Sizes(TorchFunctionMode):
    """The largest float32 tensor any torch call makes while active."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            self.most = max(self.most, out.numel())
        return out


def test_a_half_precision_block_change_is_summed_in_float32_a_slice_at_a_time(
    monkeypatch,
) -> None:
    """A block's change in float16 is widened to float32 at most ``WIDEN_CHUNK`` elements at
    a time (no float32 copy of the activations), and the score is the float64 one to
    float16's precision, also where the change passes 256 and its square would not fit."""
    from fisherprune.signals import activation

    monkeypatch.setattr(activation, "WIDEN_CHUNK", 64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 16, generator=g).half()
    y = x + (torch.randn(4, 8, 16, generator=g) * 400).half()
    changes, spy = activation._BlockChanges(), _Float32Sizes()
    with spy:
        changes(nn.Identity(), (x,), {}, y)
    assert spy.most <= 64
    ref = (y.double() - x.double()).square().sum(-1).mean().sqrt()
    assert changes.rms() == pytest.approx(float(ref), rel=2e-2)


def test_half_precision_channel_inputs_are_summed_in_float32_a_slice_at_a_time(
    monkeypatch,
) -> None:
    """A masked layer's float16 input is widened to float32 at most ``WIDEN_CHUNK`` elements
    at a time, and its squares are summed there: values past 256, whose squares float16
    cannot hold, give the float64 RMS (to float16's precision), not inf."""
    from fisherprune.signals import activation

    monkeypatch.setattr(activation, "WIDEN_CHUNK", 64)
    x = torch.randn(3, 10, 6, generator=torch.Generator().manual_seed(1)) * 400  # (N, L, C)
    point = SimpleNamespace(arg=0, dim=-1, size=6)
    squares, spy = activation._InputSquares(point), _Float32Sizes()
    with spy:
        squares(nn.Identity(), (x.half(),))
    assert spy.most <= 64
    want = x.half().double().square().mean(dim=(0, 1)).sqrt()
    torch.testing.assert_close(squares.rms(), want, rtol=1e-6, atol=0)
