"""The Fisher signal gathered in backward, against a float64 per-example reference loop.

Reference (Theis et al. 2018, Eq. 8): for every example n alone, a fresh leaf mask ``m``
of ones replaces each MaskLayer, ``g_n = d loss_n / d m`` by ``torch.autograd.grad``, and
``Delta = 0.5 * mean_n g_n^2``. A mask applied at several places is one leaf used at every
place, so autograd sums ``g`` over the places before it is squared.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Mapping

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fisherprune as fp
from fisherprune import MaskLayer
from fisherprune.signals import gather

RTOL = 1e-9  # float64 everywhere: the only differences are summation order
ATOL = 1e-14

LossFn = Callable[[Tensor, Tensor], Tensor]


# ------------------------------------------------------------------ models
class _SharedMaskNet(nn.Module):
    """One MaskLayer applied at two places of one forward (coupled channels)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 6)
        self.fc2 = nn.Linear(6, 6)
        self.mask = MaskLayer(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h1 = self.mask(torch.relu(self.fc1(x)))
        h2 = self.mask(torch.relu(self.fc2(h1)))
        return self.out(h1 + h2)


class _ChannelsLastNet(nn.Module):
    """(N, L, C) activations masked on dim=-1, then averaged over L."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.mask = MaskLayer(6, dim=-1)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.mask(torch.relu(self.fc1(x)))).mean(1)


def _mlp() -> tuple[nn.Module, Tensor]:
    net = nn.Sequential(
        nn.Linear(5, 7), nn.Tanh(), MaskLayer(7), nn.Linear(7, 6), nn.ReLU(), MaskLayer(6),
        nn.Linear(6, 3),
    )  # fmt: skip
    return net, torch.randn(9, 5)


def _cnn_bn() -> tuple[nn.Module, Tensor]:
    net = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), MaskLayer(4),
        nn.Conv2d(4, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), MaskLayer(3),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 3),
    )  # fmt: skip
    for bn in (net[1], net[5]):  # non-trivial running statistics and affine parameters
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        nn.init.uniform_(bn.weight, 0.5, 1.5)
        nn.init.uniform_(bn.bias, -0.2, 0.2)
    # BatchNorm in training mode normalises with the statistics of the whole batch, so one
    # example's output (and loss) depends on every other example and a "per-example gradient"
    # of the batch loss is not the gradient of that example's loss alone; a batch-of-one loop
    # would even use different statistics. In eval mode BN uses its running statistics, each
    # example's loss depends on that example only, and the per-example loop is exact.
    net.eval()
    return net, torch.randn(6, 2, 6, 6)


def _shared() -> tuple[nn.Module, Tensor]:
    return _SharedMaskNet(), torch.randn(8, 5)


def _channels_last() -> tuple[nn.Module, Tensor]:
    return _ChannelsLastNet(), torch.randn(7, 5, 4)


MODELS = {
    "mlp": _mlp,
    "cnn_bn_eval": _cnn_bn,
    "shared_mask": _shared,
    "channels_last": _channels_last,
}


def _make(name: str, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(seed)
    net, x = MODELS[name]()
    net = net.double()
    y = torch.randint(0, 3, (x.shape[0],))
    return net, x.double(), y


def _loss(reduction: str) -> LossFn:
    return lambda out, y: F.cross_entropy(out, y, reduction=reduction)


# --------------------------------------------------------------- reference
class _LeafMask(nn.Module):
    """Stand-in for a MaskLayer in the reference: multiplies by leaf tensors of ones.

    ``per_place=False``: one leaf for the whole forward (what a shared mask is).
    ``per_place=True``: a fresh leaf at every call (only to show that summing matters).
    """

    def __init__(self, size: int, dim: int, per_place: bool) -> None:
        super().__init__()
        self.size, self.dim, self.per_place = size, dim, per_place
        self.leaves: list[Tensor] = []

    def reset(self) -> None:
        self.leaves = [] if self.per_place else [self._fresh()]

    def _fresh(self) -> Tensor:
        return torch.ones(self.size, dtype=torch.float64, requires_grad=True)

    def forward(self, x: Tensor) -> Tensor:
        if self.per_place:
            self.leaves.append(self._fresh())
        shape = [1] * x.dim()
        shape[self.dim % x.dim()] = -1
        return x * self.leaves[-1].view(shape)


def _reference_per_example(
    model: nn.Module, x: Tensor, y: Tensor, per_place: bool = False
) -> dict[str, Tensor]:
    """Per MaskLayer name, per-example gradients g[n] = d loss_n / d m: (N, C), float64.

    With ``per_place=True``: (N, P, C), one gradient per place the mask is applied at.
    """
    ref = copy.deepcopy(model)  # the library model is never touched
    stand_ins: dict[str, _LeafMask] = {}
    by_id = {id(m): n for n, m in ref.named_modules() if isinstance(m, MaskLayer)}
    for parent in list(ref.modules()):
        for child_name, child in list(parent._modules.items()):
            if isinstance(child, MaskLayer):
                name = by_id[id(child)]  # a module used twice maps to one stand-in
                if name not in stand_ins:
                    stand_ins[name] = _LeafMask(child.num_channels, child.dim, per_place)
                parent._modules[child_name] = stand_ins[name]
    grads: dict[str, list[Tensor]] = {n: [] for n in stand_ins}
    for n in range(x.shape[0]):
        for leaf in stand_ins.values():
            leaf.reset()
        loss_n = F.cross_entropy(ref(x[n : n + 1]), y[n : n + 1])
        for name, leaf in stand_ins.items():
            g = torch.autograd.grad(loss_n, leaf.leaves, retain_graph=True)
            grads[name].append(torch.stack(g) if per_place else g[0])
    return {k: torch.stack(v) for k, v in grads.items()}


def _reference_signal(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """0.5 * mean over examples of g^2, per mask."""
    return {k: 0.5 * (g**2).mean(0) for k, g in _reference_per_example(model, x, y).items()}


def _library_estimate(
    model: nn.Module, x: Tensor, y: Tensor, reduction: str = "mean", decay: float = 0.0
) -> dict[str, Tensor]:
    masks = fp.find_masks(model)
    model.zero_grad(set_to_none=True)
    _loss(reduction)(model(x), y).backward()
    fp.update_pruning_signals(masks, decay=decay, loss_reduction=reduction)
    return {k: m.signal.clone() for k, m in masks.items()}


def _assert_close(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------- tests
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(MODELS))
def test_signal_matches_per_example_reference(name: str, reduction: str) -> None:
    """With decay 0 the signal equals 0.5 * mean_n (d loss_n / d m)^2 of the per-example loop."""
    model, x, y = _make(name)
    got = _library_estimate(model, x, y, reduction)
    want = _reference_signal(model, x, y)
    assert all(v.abs().max() > 0 for v in want.values())
    _assert_close(got, want)


def test_shared_mask_sums_before_squaring() -> None:
    """A mask used at two places gets (g_1 + g_2)^2, which differs from g_1^2 + g_2^2."""
    model, x, y = _make("shared_mask")
    got = _library_estimate(model, x, y)["mask"]
    shared = _reference_per_example(model, x, y)["mask"]  # (N, C)
    per_place = _reference_per_example(model, x, y, per_place=True)["mask"]  # (N, 2, C)
    assert per_place.shape[1] == 2
    torch.testing.assert_close(per_place.sum(1), shared, rtol=RTOL, atol=ATOL)  # chain rule
    sum_then_square = 0.5 * (shared**2).mean(0)
    square_then_sum = 0.5 * (per_place**2).sum(1).mean(0)
    torch.testing.assert_close(got, sum_then_square, rtol=RTOL, atol=ATOL)
    assert not torch.allclose(got, square_then_sum, rtol=1e-3)


@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_batch_size_invariance(batch_size: int) -> None:
    """Size-weighted mean of batch estimates over any partition = the all-example mean of g^2/2."""
    torch.manual_seed(0)
    model, _ = _mlp()
    model = model.double()
    x = torch.randn(64, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (64,))
    want = _reference_signal(model, x, y)
    acc = {k: torch.zeros_like(v) for k, v in want.items()}
    for start in range(0, 64, batch_size):  # 7 -> nine batches of 7 and one of 1
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        est = _library_estimate(model, xb, yb, "mean")
        for k in acc:
            acc[k] += est[k] * xb.shape[0] / 64
    _assert_close(acc, want)


def test_several_backwards_then_one_update_pool_all_examples() -> None:
    """Several backward passes folded by one update give the estimate over their union."""
    torch.manual_seed(0)
    model, _ = _mlp()
    model = model.double()
    x = torch.randn(20, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (20,))
    masks = fp.find_masks(model)
    for start, stop in [(0, 7), (7, 8), (8, 20)]:
        F.cross_entropy(model(x[start:stop]), y[start:stop]).backward()
    fp.update_pruning_signals(masks, decay=0.0)
    _assert_close({k: m.signal for k, m in masks.items()}, _reference_signal(model, x, y))


@pytest.mark.parametrize("decay", [0.0, 0.5, 0.96])
def test_ema_of_two_updates(decay: float) -> None:
    """Two updates from zero give d*(1-d)*f1 + (1-d)*f2 with f1, f2 the reference estimates."""
    model, x, y = _make("cnn_bn_eval")
    x1, y1, x2, y2 = x[:3], y[:3], x[3:], y[3:]
    f1, f2 = _reference_signal(model, x1, y1), _reference_signal(model, x2, y2)
    _library_estimate(model, x1, y1, decay=decay)
    got = _library_estimate(model, x2, y2, decay=decay)
    want = {k: decay * (1 - decay) * f1[k] + (1 - decay) * f2[k] for k in f1}
    _assert_close(got, want)


@pytest.mark.parametrize("decay", [-0.1, 1.0, 1.5, math.nan, math.inf])
def test_decay_outside_unit_interval_raises(decay: float) -> None:
    """A decay outside [0, 1) is a ValueError that names decay and the interval."""
    model, x, y = _make("mlp")
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\)"):
        fp.update_pruning_signals(fp.find_masks(model), decay=decay)


def test_unknown_loss_reduction_raises() -> None:
    """A loss_reduction other than 'mean' or 'sum' is a ValueError naming it."""
    model, _, _ = _make("mlp")
    with pytest.raises(ValueError, match=r"loss_reduction.*'none'"):
        fp.update_pruning_signals(fp.find_masks(model), decay=0.0, loss_reduction="none")


def _nan_batch(x: Tensor) -> Tensor:
    bad = x.clone()
    bad[1, 0] = math.nan
    return bad


def test_nan_batch_is_skipped_with_warning() -> None:
    """A batch with NaN gradients warns (RuntimeWarning) and leaves every signal unchanged."""
    model, x, y = _make("mlp")
    masks = fp.find_masks(model)
    _library_estimate(model, x, y, decay=0.5)
    before = {k: m.signal.clone() for k, m in masks.items()}
    assert all(v.abs().max() > 0 for v in before.values())
    F.cross_entropy(model(_nan_batch(x)), y).backward()
    with pytest.warns(RuntimeWarning, match="not finite"):
        fp.update_pruning_signals(masks, decay=0.5)
    for k, m in masks.items():
        assert torch.equal(m.signal, before[k])


def test_nan_batch_warning_waits_for_the_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the skip verdict is still on its way to the host (a GPU), the NaN batch is skipped
    at once and the warning comes at the first later update that finds the verdict there."""
    model, x, y = _make("mlp")
    masks = fp.find_masks(model)
    _library_estimate(model, x, y, decay=0.5)
    before = {k: m.signal.clone() for k, m in masks.items()}
    F.cross_entropy(model(_nan_batch(x)), y).backward()
    monkeypatch.setattr(gather.PendingFlags, "ready", lambda self: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp.update_pruning_signals(masks, decay=0.5)
    assert all(torch.equal(m.signal, before[k]) for k, m in masks.items())
    monkeypatch.undo()
    with pytest.warns(RuntimeWarning, match="not finite"):
        fp.update_pruning_signals(masks, decay=0.5)


def test_clean_batch_after_nan_batch_is_exact() -> None:
    """A skipped NaN batch leaves nothing behind: the next clean batch's estimate is exact."""
    model, x, y = _make("mlp")
    masks = fp.find_masks(model)
    F.cross_entropy(model(_nan_batch(x)), y).backward()
    with pytest.warns(RuntimeWarning):
        fp.update_pruning_signals(masks, decay=0.0)
    assert all(torch.equal(m.signal, torch.zeros_like(m.signal)) for m in masks.values())
    _assert_close(_library_estimate(model, x[:5], y[:5]), _reference_signal(model, x[:5], y[:5]))


def test_one_backward_and_no_per_example_mask() -> None:
    """One loss.backward() yields the exact signal; the mask stays one (C,) buffer, no copies."""
    model, x, y = _make("cnn_bn_eval")
    masks = fp.find_masks(model)
    buffers_before = {k: (tuple(b.shape), b.data_ptr()) for k, b in model.named_buffers()}
    backward_calls = []
    out = model(x)
    out.register_hook(lambda g: backward_calls.append(g.shape))
    F.cross_entropy(out, y).backward()
    fp.update_pruning_signals(masks, decay=0.0)
    assert len(backward_calls) == 1
    _assert_close({k: m.signal for k, m in masks.items()}, _reference_signal(model, x, y))
    assert {k: (tuple(b.shape), b.data_ptr()) for k, b in model.named_buffers()} == buffers_before
    for m in masks.values():
        assert m.mask.shape == (m.num_channels,)
        assert m.signal.shape == (m.num_channels,)
        assert not m.mask.requires_grad
        assert list(m.parameters()) == []


def _no_grad_upstream(case: str) -> nn.Module:
    if case == "mask_on_model_input":
        return nn.Sequential(MaskLayer(5), nn.Linear(5, 3))
    frozen = nn.Linear(5, 6).requires_grad_(False)  # e.g. a frozen pretrained feature extractor
    return nn.Sequential(frozen, nn.ReLU(), MaskLayer(6), nn.Linear(6, 3))


@pytest.mark.parametrize("case", ["mask_on_model_input", "mask_after_frozen_layers"])
def test_signal_when_nothing_upstream_requires_grad(case: str) -> None:
    """The signal matches the reference even when the masked tensor does not require grad."""
    torch.manual_seed(0)
    model = _no_grad_upstream(case).double()
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    want = _reference_signal(model, x, y)
    assert all(v.abs().max() > 0 for v in want.values())
    _assert_close(_library_estimate(model, x, y), want)


def _inplace_after_mask() -> nn.Module:
    """A mask between BatchNorm and ``ReLU(inplace=True)``: the ReLU rewrites the mask's output."""
    return nn.Sequential(
        nn.Linear(5, 6), nn.BatchNorm1d(6), MaskLayer(6), nn.ReLU(inplace=True), nn.Linear(6, 3)
    ).eval()  # fmt: skip


def test_inplace_op_after_mask_trains_like_the_unmasked_model() -> None:
    """An all-ones collecting mask before ReLU(inplace=True) keeps the unmasked model's grads."""
    torch.manual_seed(0)
    model = _inplace_after_mask().double()
    plain = nn.Sequential(*(m for m in copy.deepcopy(model) if not isinstance(m, MaskLayer)))
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    for net in (model, plain):
        F.cross_entropy(net(x), y).backward()
    for (name, p), q in zip(
        ((n, p) for n, p in model.named_parameters()), plain.parameters(), strict=True
    ):
        assert torch.equal(p.grad, q.grad), name


def test_inplace_op_after_mask_drops_one_batch_then_matches_reference() -> None:
    """The batch whose mask input was rewritten in place is dropped; the next ones are exact."""
    torch.manual_seed(0)
    model = _inplace_after_mask().double()
    x1, x2 = torch.randn(2, 6, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    assert torch.equal(_library_estimate(model, x1, y)["2"], torch.zeros(6))  # dropped
    _assert_close(_library_estimate(model, x2, y), _reference_signal(model, x2, y))


def test_mask_buffer_stays_differentiable_under_torch_func() -> None:
    """A non-collecting all-ones mask swapped for a differentiated tensor (functional_call)
    stays in the graph: its gradient is the batch mean of the per-example reference."""
    model, x, y = _make("mlp")
    masks = fp.find_masks(model)
    for m in masks.values():
        m.collecting = False
    want = {k: g.mean(0) for k, g in _reference_per_example(model, x, y).items()}
    rest = {k: v for k, v in model.state_dict().items() if not k.endswith(".mask")}

    def loss(mask_values: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(torch.func.functional_call(model, {**rest, **mask_values}, x), y)

    got = torch.func.grad(loss)({f"{k}.mask": m.mask.clone() for k, m in masks.items()})
    _assert_close({k.removesuffix(".mask"): v for k, v in got.items()}, want)


def _vmapped_mask_grads(
    model: nn.Module, masks: Mapping[str, MaskLayer], x: Tensor, y: Tensor
) -> dict[str, Tensor]:
    """Each example's loss gradient w.r.t. each mask, by ``torch.func.vmap(grad(...))`` over
    ``functional_call`` with the masks' values as its inputs: (N, C) by mask name."""
    rest = {k: v for k, v in model.state_dict().items() if not k.endswith(".mask")}

    def loss(mask_values: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        out = torch.func.functional_call(model, {**rest, **mask_values}, xi.unsqueeze(0))
        return F.cross_entropy(out, yi.unsqueeze(0), reduction="sum")

    values = {f"{k}.mask": m.mask.clone() for k, m in masks.items()}
    got = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(values, x, y)
    return {k.removesuffix(".mask"): v for k, v in got.items()}


@pytest.mark.parametrize("name", ["mlp", "cnn_bn_eval", "shared_mask"])
def test_per_example_gradients_by_vmap_through_collecting_masks(name: str) -> None:
    """``torch.func.vmap(grad(...))`` through a model whose masks collect (per-example
    gradients for DP-SGD, or a reference): it runs (the masks' gathering had made a tensor
    require grad inside the transform, which it refuses) and gives each example's mask
    gradient, equal to the per-example reference."""
    model, x, y = _make(name)
    masks = fp.find_masks(model)
    assert all(m.collecting for m in masks.values())
    want = _reference_per_example(model, x, y)
    _assert_close(_vmapped_mask_grads(model, masks, x, y), want)


def test_vmap_through_collecting_mask_points_gives_what_their_signal_squares() -> None:
    """The same through the mask points ``apply_masks`` places (a conv net with BatchNorm in
    eval mode and a residual MLP head): ``1/2 mean_n g_n^2`` of the per-example gradients
    ``torch.func`` computes equals the signal the masks gather in one ordinary backward."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(),
        nn.Linear(6 * 16, 8), nn.ReLU(), nn.Linear(8, 3),
    ).double().eval()  # fmt: skip
    x, y = torch.randn(5, 2, 4, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    masks = fp.apply_masks(model, x[:1])
    model.double()
    F.cross_entropy(model(x), y, reduction="sum").backward()
    fp.update_pruning_signals(masks, decay=0.0, loss_reduction="sum")
    g = _vmapped_mask_grads(model, masks, x, y)
    for k, m in masks.items():
        want = 0.5 * g[k].pow(2).mean(0)
        torch.testing.assert_close(m.signal.double(), want, rtol=1e-6, atol=1e-12, msg=k)


def _dot_reference(grad: Tensor, x: Tensor, dim: int) -> Tensor:
    """Per-(example, channel) sums of ``grad * x`` by a float64 loop."""
    grad, x = grad.double().movedim(dim, 1), x.double().movedim(dim, 1)
    want = torch.empty(x.shape[:2], dtype=torch.float64)
    for n in range(x.shape[0]):
        for c in range(x.shape[1]):
            want[n, c] = (grad[n, c] * x[n, c]).sum()
    return want


DOT_TOLERANCE = {
    torch.float64: {"rtol": 1e-12, "atol": 1e-11},
    torch.float32: {"rtol": 1e-5, "atol": 1e-4},
    # each product is rounded to the inputs' precision, the sum is not: the error is that of
    # the products, a few units of 2**-8 (bf16) / 2**-11 (fp16) of the sum of their sizes
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-1},
    torch.float16: {"rtol": 3e-3, "atol": 3e-2},
}


@pytest.fixture(params=["fused", "generic"])
def dot_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on the fused batch-norm-backward path (where the shape takes it) and again
    with that path refused, as a backend that lacks it refuses it."""
    from fisherprune.masks import layer

    monkeypatch.setattr(layer, "_NO_FUSED", set())
    if request.param == "generic":

        def refuse(*_a: object, **_k: object) -> None:
            raise RuntimeError("tensor does not have a device")

        monkeypatch.setattr(torch.ops.aten, "native_batch_norm_backward", refuse)
    return str(request.param)


@pytest.mark.parametrize("dtype", list(DOT_TOLERANCE))
@pytest.mark.parametrize(
    "shape, dim", [((3, 5, 7), 1), ((4, 8, 64, 64), 1), ((2, 4, 3, 64, 64), 1), ((4, 96, 24), 2)]
)
def test_per_example_channel_dot_against_loop(
    shape: tuple[int, ...], dim: int, dtype: torch.dtype, dot_path: str
) -> None:
    """The per-(example, channel) dot product, on the fused path and on the generic one that
    serves every backend, equals a plain float64 loop over examples and channels; half-precision
    inputs give a float32 result."""
    from fisherprune.masks.layer import _per_example_channel_dot

    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(shape, generator=gen, dtype=torch.float64)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).relu()
    g_in, x_in = grad.to(dtype), x.to(dtype)
    got = _per_example_channel_dot(g_in, x_in, dim)
    low = dtype in (torch.bfloat16, torch.float16)
    assert got.dtype == (torch.float32 if low else dtype)
    assert got.shape == (shape[0], shape[dim])
    torch.testing.assert_close(
        got.double(), _dot_reference(g_in, x_in, dim), **DOT_TOLERANCE[dtype]
    )


def test_out_of_memory_in_the_fused_dot_is_not_taken_for_a_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full device raises as it is; the fused path stays in use for later calls."""
    from fisherprune.masks import layer

    monkeypatch.setattr(layer, "_NO_FUSED", set())

    def full(*_a: object, **_k: object) -> None:
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(torch.ops.aten, "native_batch_norm_backward", full)
    x = torch.rand(4, 8, 64, 64)
    with pytest.raises(torch.OutOfMemoryError):
        layer._per_example_channel_dot(x, x, 1)
    assert not layer._NO_FUSED


def test_refused_fused_dot_is_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend that refuses the fused path is asked once: later calls go straight to the
    generic path (no exception raised and caught in every backward)."""
    from fisherprune.masks import layer

    monkeypatch.setattr(layer, "_NO_FUSED", set())
    calls: list[int] = []

    def refuse(*_a: object, **_k: object) -> None:
        calls.append(1)
        raise RuntimeError("tensor does not have a device")

    monkeypatch.setattr(torch.ops.aten, "native_batch_norm_backward", refuse)
    x = torch.rand(4, 8, 64, 64)
    for _ in range(3):
        layer._per_example_channel_dot(x, x, 1)
    assert len(calls) == 1 and ("cpu", torch.float32) in layer._NO_FUSED


def _conv_pool_net(mask_before_pool: bool) -> nn.Sequential:
    torch.manual_seed(3)
    layers: list[nn.Module] = [nn.Conv2d(2, 5, 3, padding=1), nn.ReLU()]
    pool_and_mask: list[nn.Module] = [nn.MaxPool2d(2), MaskLayer(5)]
    layers += pool_and_mask[::-1] if mask_before_pool else pool_and_mask
    layers += [nn.Conv2d(5, 4, 3), nn.Flatten(), nn.Linear(4 * 2 * 2, 3)]
    return nn.Sequential(*layers).double()


def test_mask_after_max_pool_gives_the_signal_and_cost_of_the_mask_before_it() -> None:
    """A 0/1 channel mask commutes with max pooling, so a MaskLayer placed after the pool
    (where apply_masks puts it, on a 4x smaller tensor) has the per-example reference signal
    of the MaskLayer placed before it, and every channel the same marginal FLOPs."""
    x = torch.randn(6, 2, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    before, after = _conv_pool_net(True), _conv_pool_net(False)
    assert isinstance(before[2], MaskLayer) and isinstance(after[3], MaskLayer)
    want = _reference_signal(before, x, y)["2"]
    assert want.abs().max() > 0
    torch.testing.assert_close(_library_estimate(after, x, y)["3"], want, rtol=RTOL, atol=ATOL)
    cost_before = fp.computational_cost(before, x[:1])
    cost_after = fp.computational_cost(after, x[:1])
    assert cost_after.total == cost_before.total
    torch.testing.assert_close(cost_after.marginal["3"], cost_before.marginal["2"])
