"""The least-squares repair: the refitted weights against numpy's ridge solution, the masked
model against the shrunk one, and what the repair leaves alone."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.calibrate import repair_consumers
from fisherprune.calibrate.repair import MIN_PASSES
from tests import zoo


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 3))


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 12, 3, padding=1),
        nn.BatchNorm2d(12),
        nn.ReLU(),
        nn.Conv2d(12, 10, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(10),
        nn.ReLU(),
        nn.Conv2d(10, 8, 1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    zoo.randomise_norms(net, 0)
    return net.eval()


def _batches(x: Tensor, size: int) -> list[tuple[Tensor, None]]:
    return [(x[i : i + size], None) for i in range(0, x.shape[0], size)]


def _prune_some(masks: dict[str, fp.MaskLayer], seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in masks.values():
            drop = torch.randperm(m.num_channels, generator=g)[: m.num_channels // 3]
            m.mask[drop] = 0.0


def test_linear_refit_equals_numpy_least_squares() -> None:
    """One-pass (sequential=False), ridge=0: each refitted Linear's kept outputs equal numpy's
    least-squares fit of the dense layer's output on its dense input restricted to the kept
    features (plus an intercept), and its removed columns are 0."""
    net = _mlp().double()
    x = torch.randn(200, 6, dtype=torch.float64)
    masks = fp.apply_masks(net, x[:1])
    dense = {n: m.mask.clone() for n, m in masks.items()}
    seen: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    hooks = [
        net.get_submodule(k).register_forward_hook(
            lambda mod, a, o, k=k: seen.__setitem__(k, (a[0].numpy(), o.detach().numpy()))
        )
        for k in ("2", "4")
    ]
    with torch.no_grad():
        net(x)
    for h in hooks:
        h.remove()
    _prune_some(masks)
    report = repair_consumers(
        net, _batches(x, 64), dense, ridge=0.0, rows_per_weight=0, sequential=False, holdout=0.0
    )
    assert set(report.layers) == {"2", "4"} and report.examples == 200
    assert set(report.modes.values()) == {"weights"}
    for name, (inp, out) in seen.items():
        layer = net.get_submodule(name)
        keep = next(m for m in masks.values() if m.num_channels == inp.shape[1]).mask > 0.5
        keep_np = keep.numpy()
        outs = next((m for m in masks.values() if m.num_channels == out.shape[1]), None)
        rows = np.ones(out.shape[1], bool) if outs is None else outs.mask.numpy() > 0.5
        a = np.hstack([inp[:, keep_np], np.ones((inp.shape[0], 1))])
        coef, *_ = np.linalg.lstsq(a, out[:, rows], rcond=None)
        w = layer.weight.detach().numpy()
        np.testing.assert_allclose(w[rows][:, keep_np], coef[:-1].T, rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(
            layer.bias.detach().numpy()[rows], coef[-1], rtol=1e-6, atol=1e-8
        )
        assert not w[:, ~keep_np].any()
        _, before, after = report.layers[name]
        assert after < before


def test_conv_refit_lowers_the_output_error_and_shrinks_exactly() -> None:
    """On a conv net (biased and bias-free convs, BatchNorm): the repaired masked model is closer
    to the dense model on the calibration data than the unrepaired one, and shrink gives
    the repaired masked model's outputs."""
    net = _cnn()
    x = torch.randn(64, 3, 8, 8)
    with torch.no_grad():
        ref = net(x)
    masks = fp.apply_masks(net, x[:1])
    dense = {n: m.mask.clone() for n, m in masks.items()}
    _prune_some(masks)
    with torch.no_grad():
        plain = F.mse_loss(net(x), ref)
    report = repair_consumers(net, _batches(x, 16), dense, positions=16)
    assert report.layers and not report.skipped
    with torch.no_grad():
        repaired = net(x)
        assert F.mse_loss(repaired, ref) < 0.5 * plain
        small = fp.shrink(net)
        torch.testing.assert_close(small(x), repaired, rtol=1e-4, atol=1e-5)


def test_repair_leaves_masks_norm_statistics_and_flags_alone() -> None:
    """The masks and batch-norm statistics come back as they were, and the train flag too."""
    net = _cnn().train()
    x = torch.randn(16, 3, 8, 8)
    masks = fp.apply_masks(net, x[:1])
    dense = {n: m.mask.clone() for n, m in masks.items()}
    _prune_some(masks)
    chosen = {n: m.mask.clone() for n, m in masks.items()}
    stats = {k: v.clone() for k, v in net.state_dict().items() if "running" in k}
    repair_consumers(net, _batches(x, 8), dense)
    assert net.training and all(m.training for m in net.modules())
    for n, m in masks.items():
        assert torch.equal(m.mask, chosen[n])
    for k, v in stats.items():
        assert torch.equal(net.state_dict()[k], v)


def test_layer_over_max_features_is_skipped_and_unchanged() -> None:
    """A layer with more kept features than max_features is reported and left as it was."""
    net = _mlp()
    x = torch.randn(32, 6)
    masks = fp.apply_masks(net, x[:1])
    dense = {n: m.mask.clone() for n, m in masks.items()}
    _prune_some(masks)
    before = net.get_submodule("2").weight.detach().clone()
    report = repair_consumers(net, _batches(x, 16), dense, max_features=3)
    assert "2" in report.skipped and "max_features" in report.skipped["2"]
    assert torch.equal(net.get_submodule("2").weight, before)


@pytest.mark.parametrize(
    ("kw", "match"), [({"ridge": -1.0}, "ridge"), ({"positions": 0}, "positions")]
)
def test_bad_settings_are_refused(kw: dict, match: str) -> None:
    net = _mlp()
    x = torch.randn(4, 6)
    masks = fp.apply_masks(net, x[:1])
    with pytest.raises(ValueError, match=match):
        repair_consumers(net, _batches(x, 4), {n: m.mask.clone() for n, m in masks.items()}, **kw)


def test_missing_dense_masks_are_refused() -> None:
    net = _mlp()
    x = torch.randn(4, 6)
    fp.apply_masks(net, x[:1])
    with pytest.raises(ValueError, match="dense_masks has no values"):
        repair_consumers(net, _batches(x, 4), {})


def test_folded_weights_are_reported_not_refitted() -> None:
    """After a forward of the pruned model (masks not collecting fold into the weights) the
    dense outputs are gone: those layers are skipped with the reason, and left as they are."""
    net = _mlp()
    x = torch.randn(32, 6)
    masks = fp.apply_masks(net, x[:1])
    dense = {n: m.mask.clone() for n, m in masks.items()}
    _prune_some(masks)
    for m in masks.values():
        m.collecting = False
    with torch.no_grad():
        net(x)
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    report = repair_consumers(net, _batches(x, 16), dense)
    assert report.skipped and all("already zero" in why for why in report.skipped.values())
    for k, v in net.state_dict().items():
        assert torch.equal(weights[k], v)


def test_channel_scales_equal_numpy_least_squares() -> None:
    """With few rows per weight each Linear gets one scale per kept input and a new bias, equal
    to numpy's least-squares fit of ``Y ~ (x_K * s) W_K^T + b`` over every row and output."""
    net = _mlp().double()
    x = torch.randn(40, 6, dtype=torch.float64)
    masks = fp.apply_masks(net, x[:1])
    dense = {n: m.mask.clone() for n, m in masks.items()}
    layer = net.get_submodule("4")
    seen: dict[str, np.ndarray] = {}
    h = layer.register_forward_hook(
        lambda mod, a, o: seen.update(x=a[0].numpy().copy(), y=o.detach().numpy().copy())
    )
    with torch.no_grad():
        net(x)
    h.remove()
    w0 = layer.weight.detach().numpy().copy()
    _prune_some(masks)
    report = repair_consumers(net, _batches(x, 20), dense, ridge=0.0, sequential=False, holdout=0.0)
    assert report.modes["4"] == "scales"
    keep = (next(m for m in masks.values() if m.num_channels == 8).mask > 0.5).numpy()
    xk, wk, y = seen["x"][:, keep], w0[:, keep], seen["y"]
    n, out = y.shape
    design = np.zeros((n * out, keep.sum() + out))
    for o in range(out):
        design[o::out, : keep.sum()] = xk * wk[o]  # rows (i, o): channel contributions
        design[o::out, keep.sum() + o] = 1.0
    sol, *_ = np.linalg.lstsq(design, y.reshape(-1), rcond=None)
    scale, bias = sol[: keep.sum()], sol[keep.sum() :]
    np.testing.assert_allclose(
        layer.weight.detach().numpy()[:, keep], wk * scale, rtol=1e-6, atol=1e-9
    )
    np.testing.assert_allclose(layer.bias.detach().numpy(), bias, rtol=1e-6, atol=1e-9)


def test_sequential_refit_uses_the_repaired_models_inputs() -> None:
    """Sequential, ridge=0: the last Linear equals numpy's least-squares fit of the DENSE
    layer's output on the input it gets in the PRUNED model whose first layer is already
    repaired (kept features plus an intercept)."""
    net = _mlp().double()
    x = torch.randn(200, 6, dtype=torch.float64)
    masks = fp.apply_masks(net, x[:1])
    dense = {n: m.mask.clone() for n, m in masks.items()}
    layer = net.get_submodule("4")
    seen: dict[str, np.ndarray] = {}
    h = layer.register_forward_hook(
        lambda mod, a, o: seen.update(x=a[0].numpy().copy(), y=o.detach().numpy().copy())
    )
    with torch.no_grad():
        net(x)
    y = seen["y"]
    _prune_some(masks)
    report = repair_consumers(
        net, _batches(x, 64), dense, ridge=0.0, rows_per_weight=0, holdout=0.0
    )
    assert set(report.layers) == {"2", "4"}
    w = layer.weight.detach().numpy().copy()
    with torch.no_grad():
        net(x)  # the pruned, repaired model: the input layer "4" now gets
    h.remove()
    keep = (next(m for m in masks.values() if m.num_channels == 8).mask > 0.5).numpy()
    a = np.hstack([seen["x"][:, keep], np.ones((x.shape[0], 1))])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    np.testing.assert_allclose(w[:, keep], coef[:-1].T, rtol=1e-6, atol=1e-8)


class _Block(nn.Module):
    """Post-norm (BERT's) encoder block: LN(x + attention(x)), then LN(x + FFN(x))."""

    def __init__(self, d: int = 16, heads: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d // heads  # shrink lowers heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)
        with torch.no_grad():  # blocks whose outputs weigh as much as the residual stream
            for layer in (self.q, self.k, self.v, self.o, self.up, self.down):
                layer.weight.mul_(2.0)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape

        def split(z: Tensor) -> Tensor:
            return z.view(b, t, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim**0.5, -1) @ v
        x = self.ln1(x + self.o(att.transpose(1, 2).reshape(b, t, -1)))
        return self.ln2(x + self.down(F.gelu(self.up(x))))


def test_sequential_repair_helps_a_residual_transformer() -> None:
    """On a 2-block encoder with half of each block's heads and FFN channels removed, the
    sequential repair brings held-out final outputs closer to the dense ones than no repair and
    than the one-pass fit on dense inputs; and shrink still gives the repaired masked model's
    outputs."""
    torch.manual_seed(0)
    net = nn.Sequential(_Block(), _Block()).eval()
    x = torch.randn(64, 12, 16)
    calib, test = x[:48], x[48:]
    with torch.no_grad():
        ref = net(test)
    masks = fp.apply_masks(net, x[:1])
    dense = {n: m.mask.clone() for n, m in masks.items()}
    with torch.no_grad():
        for m in masks.values():  # 2 of 4 heads, 16 of 32 FFN channels
            m.mask[torch.randperm(m.num_channels)[: m.num_channels // 2]] = 0.0
    errors = {}
    for how in ("none", "one-pass", "sequential"):
        model = copy.deepcopy(net)
        if how != "none":
            report = repair_consumers(
                model, _batches(calib, 16), dense, sequential=how == "sequential"
            )
            assert set(report.layers) == {"0.o", "0.down", "1.o", "1.down"}
        with torch.no_grad():
            errors[how] = float(F.mse_loss(model(test), ref))
    assert errors["sequential"] < 0.7 * errors["none"]
    assert errors["sequential"] < errors["one-pass"]
    with torch.no_grad():
        torch.testing.assert_close(fp.shrink(model)(test), model(test), rtol=1e-4, atol=1e-5)


def test_residual_target_is_the_dense_sum_less_the_pruned_residual() -> None:
    """Sequential, ridge=0, float64, in a post-norm encoder whose residual width is pruned too:
    the second block's FFN output layer, added to the stream in ``LN(x + down(h))``, equals
    numpy's least-squares fit of the DENSE sum ``x_d + down(h_d)`` less the PRUNED residual
    ``x_p`` on its pruned input ``h_p`` (kept features plus an intercept), on the outputs the
    pruned model keeps."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), _Block(), _Block()).double().eval()
    x = torch.randn(48, 12, 8, dtype=torch.float64)
    seen: dict[str, Tensor] = {}

    def grab(key: str, value: Tensor) -> None:
        seen[key] = value.detach().reshape(-1, value.shape[-1]).clone()

    hooks = [net[2].ln2.register_forward_pre_hook(lambda m, a: grab("z", a[0]))]
    with torch.no_grad():
        net(x)
    z_dense = seen["z"]
    masks = fp.apply_masks(net, x[:1])
    dense = {n: m.mask.clone() for n, m in masks.items()}
    with torch.no_grad():
        for m in masks.values():
            m.mask[torch.randperm(m.num_channels)[: m.num_channels // 2]] = 0.0
    report = repair_consumers(
        net, _batches(x, 16), dense, ridge=0.0, rows_per_weight=0, holdout=0.0
    )
    assert "2.down" in report.layers
    down = net[2].down
    hooks.append(down.register_forward_pre_hook(lambda m, a: grab("h", a[0])))
    hooks.append(down.register_forward_hook(lambda m, a, o: grab("o", o)))
    with torch.no_grad():
        net(x)  # the repaired model: its residual is the sum less the layer's output
    for h in hooks:
        h.remove()
    residual = seen["z"] - seen["o"]
    rows = (next(m for n, m in masks.items() if n.endswith(".0:out")).mask > 0.5).numpy()
    keep = (next(m for n, m in masks.items() if n.endswith("2_up:out")).mask > 0.5).numpy()
    a = np.hstack([seen["h"].numpy()[:, keep], np.ones((x.shape[0] * 12, 1))])
    target = (z_dense - residual).numpy()[:, rows]
    coef, *_ = np.linalg.lstsq(a, target, rcond=None)
    w = down.weight.detach().numpy()
    np.testing.assert_allclose(w[rows][:, keep], coef[:-1].T, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(down.bias.detach().numpy()[rows], coef[-1], rtol=1e-6, atol=1e-8)


class _Tokens(nn.Module):
    """A token model called as a tokenizer's batch: ``model(x=..., attention_mask=...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(6, 10), nn.Linear(10, 4)

    def forward(self, x: Tensor, attention_mask: Tensor) -> Tensor:
        return self.down(torch.relu(self.up(x)))


def test_padding_tokens_are_left_out_of_the_fit() -> None:
    """With dict inputs carrying an ``attention_mask``, the refitted layer equals numpy's
    least-squares fit over the unmasked tokens only (the padding rows would change it)."""
    torch.manual_seed(0)
    net = _Tokens().double()
    x = torch.randn(40, 7, 6, dtype=torch.float64)
    att = (torch.arange(7) < torch.randint(2, 8, (40, 1))).long()  # (N, T), padded at the end
    x[att == 0] *= 5.0  # padding activations unlike the text's
    masks = fp.apply_masks(net, {"x": x[:1], "attention_mask": att[:1]})
    dense = {n: m.mask.clone() for n, m in masks.items()}
    seen: dict[str, np.ndarray] = {}
    h = net.down.register_forward_hook(
        lambda mod, a, o: seen.update(x=a[0].numpy().copy(), y=o.detach().numpy().copy())
    )
    with torch.no_grad():
        net(x, att)
    h.remove()
    _prune_some(masks)
    batches = [({"x": x[i : i + 10], "attention_mask": att[i : i + 10]}, None) for i in (0, 10)]
    batches += [({"x": x[i : i + 10], "attention_mask": att[i : i + 10]}, None) for i in (20, 30)]
    repair_consumers(net, batches, dense, ridge=0.0, rows_per_weight=0, holdout=0.0)
    keep = (next(iter(masks.values())).mask > 0.5).numpy()
    rows = att.bool().numpy()
    a = np.hstack([seen["x"][rows][:, keep], np.ones((int(rows.sum()), 1))])
    coef, *_ = np.linalg.lstsq(a, seen["y"][rows], rcond=None)
    np.testing.assert_allclose(net.down.weight.detach().numpy()[:, keep], coef[:-1].T, rtol=1e-6)
    a_all = np.hstack([seen["x"].reshape(-1, 10)[:, keep], np.ones((rows.size, 1))])
    coef_all, *_ = np.linalg.lstsq(a_all, seen["y"].reshape(-1, 4), rcond=None)
    assert not np.allclose(coef, coef_all, rtol=1e-3)  # the check is not vacuous


def _held_error(model: nn.Module, dense: nn.Module, held: list[Tensor]) -> float:
    """Relative squared error of ``model``'s outputs against ``dense``'s, float64."""
    with torch.no_grad():
        num = sum(float((model(x) - dense(x)).double().square().sum()) for x in held)
        return num / sum(float(dense(x).double().square().sum()) for x in held)


def test_held_out_batches_undo_a_refit_that_hurts_them() -> None:
    """On a 2-block encoder fitted on 3 tiny batches (ridge 0, every weight) and checked on a
    4th unlike them, the repair without a held-out check raises that batch's output error; with
    ``holdout`` the stages that raise it are undone, so the error (recomputed here against the
    dense model) is no higher than unrepaired and equals the report's."""
    torch.manual_seed(0)
    net = nn.Sequential(_Block(), _Block()).eval()
    dense_net = copy.deepcopy(net)
    fit = [torch.randn(1, 4, 16) for _ in range(3)]  # 12 rows: fewer than the unknowns
    held = [3.0 * torch.randn(2, 6, 16) + 1.0]
    masks = fp.apply_masks(net, fit[0][:1])
    dense = {n: m.mask.clone() for n, m in masks.items()}
    with torch.no_grad():
        for m in masks.values():
            m.mask[torch.randperm(m.num_channels)[: m.num_channels // 2]] = 0.0
    plain = _held_error(copy.deepcopy(net), dense_net, held)
    kw = {"ridge": 0.0, "rows_per_weight": 0}
    blind = copy.deepcopy(net)
    repair_consumers(blind, [(x, None) for x in fit], dense, holdout=0.0, **kw)
    assert _held_error(blind, dense_net, held) > plain  # the fit alone hurts the held-out batch
    report = repair_consumers(net, [(x, None) for x in [*fit, *held]], dense, **kw)
    assert report.held_out is not None and report.held_out[0] == pytest.approx(plain)
    assert _held_error(net, dense_net, held) == pytest.approx(report.held_out[1])
    assert report.held_out[1] <= plain
    assert any("held-out" in why for why in report.skipped.values())


def _deep_mlp(layers: int = 10) -> nn.Module:
    """``layers`` Linear layers with ReLUs between: ``layers - 1`` stages once pruned."""
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Linear(6, 12)]
    for _ in range(layers - 2):
        mods += [nn.ReLU(), nn.Linear(12, 12)]
    return nn.Sequential(*mods, nn.ReLU(), nn.Linear(12, 3)).double()


def _repaired(net: nn.Module, x: Tensor, **kw: object) -> tuple[nn.Module, object]:
    """A pruned copy of ``net`` (a third of every mask's channels), repaired with ``kw``."""
    model = copy.deepcopy(net)
    masks = fp.apply_masks(model, x[:1])
    dense = {n: m.mask.clone() for n, m in masks.items()}
    _prune_some(masks)
    report = repair_consumers(model, _batches(x, 20), dense, **kw)
    return model, report


def test_one_stage_per_pass_is_the_sequential_repair() -> None:
    """``passes`` >= the number of stages gives exactly the weights of ``passes=None`` (one
    stage per pass), and fewer passes other weights (the grouping is not vacuous)."""
    x = torch.randn(200, 6, dtype=torch.float64)
    net = _deep_mlp()
    seq, report = _repaired(net, x)
    assert report.passes == 9
    for passes in (9, 50):
        model, _ = _repaired(net, x, passes=passes)
        for a, b in zip(model.state_dict().values(), seq.state_dict().values(), strict=True):
            assert torch.equal(a, b)
    grouped, report = _repaired(net, x, passes=3)
    assert report.passes == 3
    assert not torch.allclose(grouped[-1].weight, seq[-1].weight)


def test_one_pass_fits_every_layer_on_the_unrepaired_pruned_inputs() -> None:
    """passes=1, ridge=0: the last Linear equals numpy's least-squares fit of the DENSE
    layer's output on the input it gets in the PRUNED model with no layer repaired yet."""
    net = _mlp().double()
    x = torch.randn(200, 6, dtype=torch.float64)
    masks = fp.apply_masks(net, x[:1])
    dense = {n: m.mask.clone() for n, m in masks.items()}
    layer = net.get_submodule("4")
    seen: dict[str, np.ndarray] = {}
    h = layer.register_forward_hook(
        lambda mod, a, o: seen.update(x=a[0].numpy().copy(), y=o.detach().numpy().copy())
    )
    with torch.no_grad():
        net(x)
        y = seen["y"]
        _prune_some(masks)
        copy.deepcopy(net)(x)  # the pruned, unrepaired model: the input "4" gets in one pass
    h.remove()
    kw = {"ridge": 0.0, "rows_per_weight": 0, "holdout": 0.0}
    seq = copy.deepcopy(net)
    repair_consumers(seq, _batches(x, 64), dense, **kw)
    report = repair_consumers(net, _batches(x, 64), dense, passes=1, **kw)
    assert set(report.layers) == {"2", "4"} and report.passes == 1
    keep = (next(m for m in masks.values() if m.num_channels == 8).mask > 0.5).numpy()
    a = np.hstack([seen["x"][:, keep], np.ones((x.shape[0], 1))])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    w = layer.weight.detach().numpy()
    np.testing.assert_allclose(w[:, keep], coef[:-1].T, rtol=1e-6, atol=1e-8)
    assert not np.allclose(w, seq.get_submodule("4").weight.detach().numpy(), atol=1e-6)


def test_held_out_batches_undo_a_group_that_hurts_them() -> None:
    """As the test above, all 4 stages in one pass: the group raises the held-out error, so
    its stages are put back one at a time and kept only where they lower it; the error
    (recomputed against the dense model) is the report's and no higher than unrepaired."""
    torch.manual_seed(0)
    net = nn.Sequential(_Block(), _Block()).eval()
    dense_net = copy.deepcopy(net)
    fit = [torch.randn(1, 4, 16) for _ in range(3)]
    held = [3.0 * torch.randn(2, 6, 16) + 1.0]
    masks = fp.apply_masks(net, fit[0][:1])
    dense = {n: m.mask.clone() for n, m in masks.items()}
    with torch.no_grad():
        for m in masks.values():
            m.mask[torch.randperm(m.num_channels)[: m.num_channels // 2]] = 0.0
    plain = _held_error(copy.deepcopy(net), dense_net, held)
    kw = {"ridge": 0.0, "rows_per_weight": 0, "passes": 1}
    blind = copy.deepcopy(net)
    repair_consumers(blind, [(x, None) for x in fit], dense, holdout=0.0, **kw)
    assert _held_error(blind, dense_net, held) > plain
    report = repair_consumers(net, [(x, None) for x in [*fit, *held]], dense, **kw)
    assert report.passes == 1 and report.held_out is not None
    assert _held_error(net, dense_net, held) == pytest.approx(report.held_out[1])
    assert report.held_out[1] <= plain
    assert any("held-out" in why for why in report.skipped.values())


def test_budget_groups_down_to_min_passes_then_reads_fewer_examples() -> None:
    """A budget of ``examples x (passes + 1)`` forwards: over it the 9 stages run in
    ``MIN_PASSES`` passes (the weights of ``passes=MIN_PASSES``), and a smaller one reads
    only the first examples that fit (the weights of ``max_examples``)."""
    x = torch.randn(200, 6, dtype=torch.float64)
    net = _deep_mlp()
    assert MIN_PASSES == 8
    grouped, report = _repaired(net, x, budget=200 * 9.5)
    assert (report.passes, report.examples) == (8, 200)
    ref, _ = _repaired(net, x, passes=8)
    torch.testing.assert_close(grouped.state_dict(), ref.state_dict(), rtol=0, atol=0)
    cut, report = _repaired(net, x, budget=100 * 9)
    assert (report.passes, report.examples) == (8, 100)
    ref, _ = _repaired(net, x, passes=8, max_examples=100)
    torch.testing.assert_close(cut.state_dict(), ref.state_dict(), rtol=0, atol=0)
    _, report = _repaired(net, x, budget=200 * 10)  # enough for one stage per pass
    assert (report.passes, report.examples) == (9, 200)


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"passes": 0}, "passes"), ({"max_examples": 0}, "max_examples"), ({"budget": 0}, "budget")],
)
def test_bad_pass_settings_are_refused(kw: dict, match: str) -> None:
    net = _mlp()
    x = torch.randn(4, 6)
    masks = fp.apply_masks(net, x[:1])
    with pytest.raises(ValueError, match=match):
        repair_consumers(net, _batches(x, 4), {n: m.mask.clone() for n, m in masks.items()}, **kw)


class _SubLinear(nn.Linear):
    """A subclass with no repair of its own (as Falcon's FalconLinear)."""


def test_a_linear_subclass_is_refitted_as_its_base_class() -> None:
    """A subclass of nn.Linear is repaired with nn.Linear's rows (its nearest registered base
    class), to exactly the weights the same nn.Linear gets."""
    x = torch.randn(200, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    nets = []
    for sub in (False, True):
        net = _mlp().double()
        if sub:
            for i in (2, 4):
                old = net[i]
                net[i] = _SubLinear(old.in_features, old.out_features).double()
                net[i].load_state_dict(old.state_dict())
        masks = fp.apply_masks(net, x[:1])
        dense = {n: m.mask.clone() for n, m in masks.items()}
        _prune_some(masks)
        report = repair_consumers(net, _batches(x, 50), dense, ridge=0.0, rows_per_weight=0,
                                  sequential=False, holdout=0.0)  # fmt: skip
        assert set(report.layers) == {"2", "4"}
        nets.append(net)
    for i in (2, 4):
        torch.testing.assert_close(nets[1][i].weight, nets[0][i].weight, rtol=1e-9, atol=1e-12)
