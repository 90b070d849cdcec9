"""computational_cost against references: the seed's numbers, and FlopCounterMode / parameter
counts of a physically smaller network built by hand."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import fisherprune as fp
from fisherprune import MaskLayer
from fisherprune.cost.formulas import SAME_AS_TORCH
from tests import tiny_hf, zoo

# Costs are integers far below 2**53 in every convention tested here: compare exactly.
COST_ABS_TOL = 0.0

pytestmark = [
    pytest.mark.filterwarnings("error"),  # e.g. no "mask removes no channel" warning, except:
    # the CNN's m2 covers groups of 2 channels: zeroing one entry alone removes nothing
    pytest.mark.filterwarnings("ignore:zeroing mask 'm2' removes no channel:UserWarning"),
]


# ------------------------------------------------------------------ helpers
def _reference_flops(net: nn.Module, x: Tensor) -> float:
    """FLOPs per example of ``net`` by PyTorch's own counter."""
    with FlopCounterMode(display=False, custom_mapping=dict(SAME_AS_TORCH)) as counter:
        net(x)
    return counter.get_total_flops() / x.shape[0]


def _n_params(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def _assert_cost(got: float, want: float) -> None:
    assert got == pytest.approx(want, abs=COST_ABS_TOL, rel=0)


# --------------------------------------------------------- (a) seed values
def _seed_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(20, 50), nn.ReLU(), MaskLayer(50),
        nn.Linear(50, 30), nn.ReLU(), MaskLayer(30),
        nn.Linear(30, 2),
    )  # fmt: skip


def _twml_weighted_loss(out: Tensor) -> Tensor:
    """TF's weighted loss: two element-wise Muls of size B (``losses * w``, ``w * ones``)."""
    y = torch.zeros(out.shape[0], dtype=torch.long)
    losses = F.cross_entropy(out, y, reduction="none")
    w = torch.tensor(1.0)
    weighted = losses * w
    present = w * torch.ones_like(losses)
    return weighted.sum() / present.sum()


@pytest.mark.parametrize(("with_loss", "total"), [(False, 5120.0), (True, 5122.0)])
def test_seed_mlp_twml(with_loss: bool, total: float) -> None:
    """twml MLP 20-50-30-2: total 5120 (5122 with the loss's two Muls), marginals 100 and 104."""
    net = _seed_mlp()
    r = fp.computational_cost(
        net, torch.randn(4, 20), "twml", loss_fn=_twml_weighted_loss if with_loss else None
    )
    _assert_cost(r.total, total)
    assert torch.equal(r.marginal[net[2]], torch.full((50,), 100.0, dtype=torch.float64))
    assert torch.equal(r.marginal[net[5]], torch.full((30,), 104.0, dtype=torch.float64))


@pytest.mark.parametrize(("with_loss", "total"), [(False, 4338.0), (True, 4340.0)])
def test_seed_mlp_twml_pruned_45_27(with_loss: bool, total: float) -> None:
    """twml MLP pruned to 45/27 units: 4338 (4340 with the loss); marginals 94 (pruned: 0)."""
    net = _seed_mlp()
    with torch.no_grad():
        net[2].mask[[3, 8, 17, 30, 49]] = 0.0
        net[5].mask[[0, 11, 29]] = 0.0
    r = fp.computational_cost(
        net, torch.randn(3, 20), "twml", loss_fn=_twml_weighted_loss if with_loss else None
    )
    _assert_cost(r.total, total)
    # unit of mask 1: its row of layer 1 (2*20-1 + 1 bias) and its column of layer 2 (27 * 2)
    # unit of mask 2: its row of layer 2 (2*45-1 + 1 bias) and its column of layer 3 (2 * 2)
    want1 = torch.where(net[2].mask > 0, 40.0 + 27 * 2, 0.0).double()
    want2 = torch.where(net[5].mask > 0, 90.0 + 2 * 2, 0.0).double()
    assert torch.equal(r.marginal[net[2]], want1)
    assert torch.equal(r.marginal[net[5]], want2)


def test_seed_cnn_twml() -> None:
    """twml CNN 8x8x3 -> conv3x3 SAME 4 -> conv3x3 VALID 5: total 26348, marginals 6632, 2556."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), MaskLayer(4),
        nn.Conv2d(4, 5, 3, bias=False), MaskLayer(5),
    )  # fmt: skip
    r = fp.computational_cost(net, torch.randn(2, 3, 8, 8), "twml")
    _assert_cost(r.total, 26348.0)
    assert torch.equal(r.marginal[net[1]], torch.full((4,), 6632.0, dtype=torch.float64))
    assert torch.equal(r.marginal[net[3]], torch.full((5,), 2556.0, dtype=torch.float64))


# ------------------------------------------------- models and their shrunk twins
def _mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(10, 16), nn.ReLU(), MaskLayer(16),
        nn.Linear(16, 12), nn.ReLU(), MaskLayer(12),
        nn.Linear(12, 3),
    )  # fmt: skip


def _small_mlp(k1: int, k2: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(10, k1), nn.ReLU(), nn.Linear(k1, k2), nn.ReLU(), nn.Linear(k2, 3)
    )


class _CNN(nn.Module):
    """BN, ReLU, max-pool, a depthwise and a grouped conv, flatten into Linear.

    ``m1`` is applied before and after the depthwise conv and ``m2`` before and after the
    grouped conv (groups of 2 channels): a conv that ties its input and output channels
    needs one mask at both ends for a channel (or group) to be removable.
    """

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.m1 = MaskLayer(8)
        self.dw, self.b2 = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.c3, self.b3 = nn.Conv2d(8, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
        self.m2 = MaskLayer(6)
        self.gc, self.b4 = nn.Conv2d(6, 6, 3, padding=1, groups=3), nn.BatchNorm2d(6)
        self.c5, self.b5 = nn.Conv2d(6, 5, 1), nn.BatchNorm2d(5)
        self.m3 = MaskLayer(5)
        self.act, self.flat = nn.ReLU(), nn.Flatten()
        self.fc = nn.Linear(5 * 4 * 4, 3)

    def forward(self, x: Tensor) -> Tensor:  # x: (N, 3, 8, 8)
        h = self.m1(self.act(self.b1(self.c1(x))))
        h = self.m1(self.act(self.b2(self.dw(h))))
        h = self.pool(h)  # (N, 8, 4, 4)
        h = self.m2(self.act(self.b3(self.c3(h))))
        h = self.m2(self.act(self.b4(self.gc(h))))
        h = self.m3(self.act(self.b5(self.c5(h))))
        return self.fc(self.flat(h))


def _small_cnn(k1: int, groups: int, k3: int) -> nn.Sequential:
    """``_CNN`` built with k1 channels at m1, ``groups`` groups of 2 at m2, k3 at m3."""
    k2 = 2 * groups
    return nn.Sequential(
        nn.Conv2d(3, k1, 3, padding=1), nn.BatchNorm2d(k1), nn.ReLU(),
        nn.Conv2d(k1, k1, 3, padding=1, groups=k1, bias=False), nn.BatchNorm2d(k1), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(k1, k2, 3, padding=1, bias=False), nn.BatchNorm2d(k2), nn.ReLU(),
        nn.Conv2d(k2, k2, 3, padding=1, groups=groups), nn.BatchNorm2d(k2), nn.ReLU(),
        nn.Conv2d(k2, k3, 1), nn.BatchNorm2d(k3), nn.ReLU(),
        nn.Flatten(), nn.Linear(k3 * 16, 3),
    )  # fmt: skip


def _zero_random(mask: MaskLayer, gen: torch.Generator, keep_at_least: int) -> None:
    n_zero = int(torch.randint(0, mask.num_channels - keep_at_least + 1, (1,), generator=gen))
    idx = torch.randperm(mask.num_channels, generator=gen)[:n_zero]
    with torch.no_grad():
        mask.mask[idx] = 0.0


def _pruned_mlp(seed: int) -> tuple[nn.Module, nn.Module, Tensor]:
    """(masked MLP, the same network built physically smaller by hand, inputs)."""
    torch.manual_seed(seed)
    net = _mlp()
    gen = torch.Generator().manual_seed(seed)
    if seed:  # seed 0: nothing pruned
        _zero_random(net[2], gen, 1)
        _zero_random(net[5], gen, 1)
    small = _small_mlp(net[2].kept, net[5].kept)
    return net, small, torch.randn(4, 10)


def _pruned_cnn(seed: int) -> tuple[nn.Module, nn.Module, Tensor]:
    """(masked CNN, the same network built physically smaller by hand, inputs)."""
    torch.manual_seed(seed)
    net = _CNN()
    gen = torch.Generator().manual_seed(seed)
    if seed:
        _zero_random(net.m1, gen, 1)
        _zero_random(net.m2, gen, 0)
        _zero_random(net.m3, gen, 1)
        if seed % 2:  # make sure some whole groups go, not only lone channels of a group
            with torch.no_grad():
                net.m2.mask[[2 * (seed % 3), 2 * (seed % 3) + 1]] = 0.0
    # a group of the grouped conv goes only when both of its channels are zeroed
    alive = net.m2.mask.view(3, 2).amax(1) > 0.5
    if not alive.any():
        with torch.no_grad():
            net.m2.mask[4:] = 1.0
        alive = net.m2.mask.view(3, 2).amax(1) > 0.5
    small = _small_cnn(net.m1.kept, int(alive.sum()), net.m3.kept)
    return net, small, torch.randn(3, 3, 8, 8)


MODELS = {"mlp": _pruned_mlp, "cnn": _pruned_cnn}
SEEDS = [0, 1, 2, 3, 4, 5]


# ------------------------------------------------------------- (b) flops
def test_reference_twins_match_unpruned_models() -> None:
    """The hand-built twins at full width have exactly the models' parameter shapes."""
    for net, small in [(_mlp(), _small_mlp(16, 12)), (_CNN(), _small_cnn(8, 3, 5))]:
        got = sorted(tuple(p.shape) for p in net.parameters())
        assert got == sorted(tuple(p.shape) for p in small.parameters())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model", list(MODELS))
def test_flops_equal_flop_counter_on_shrunk_network(model: str, seed: int) -> None:
    """flops total = FlopCounterMode FLOPs per example of the physically smaller network."""
    net, small, x = MODELS[model](seed)
    _assert_cost(fp.computational_cost(net, x, "flops").total, _reference_flops(small, x))


MARGINAL_CASES = [(s, "flops") for s in (0, 3, 4)] + [(4, c) for c in ("twml", "params", "memory")]


@pytest.mark.parametrize(("seed", "convention"), MARGINAL_CASES)
@pytest.mark.parametrize("model", list(MODELS))
def test_marginal_is_cost_saved_by_zeroing_that_channel(
    model: str, seed: int, convention: str
) -> None:
    """marginal[m][k] = total(now) - total(now with entry k of m zeroed), each total fresh."""
    net, _, x = MODELS[model](seed)
    r = fp.computational_cost(net, x, convention)
    for name, mask in fp.find_masks(net).items():
        want = torch.zeros(mask.num_channels, dtype=torch.float64)
        for k in range(mask.num_channels):
            old = float(mask.mask[k])
            with torch.no_grad():
                mask.mask[k] = 0.0
            want[k] = r.total - fp.computational_cost(net, x, convention).total
            with torch.no_grad():
                mask.mask[k] = old
        assert torch.equal(r.marginal[name], want), name
    assert any(bool((v > 0).any()) for v in r.marginal.values())  # the check is not vacuous


def test_one_cost_model_reports_each_state_as_a_fresh_one() -> None:
    """A CostModel kept across prunes, a restore and other prunes (it remembers each term's
    result per channel state) reports, in every state, what a model traced afresh does (the
    CNN: a grouped convolution, whose groups go only when both of their channels do)."""
    net, _, x = _pruned_cnn(0)
    kept = fp.CostModel(net, x, "flops")
    masks = list(fp.find_masks(net).values())
    dense = [m.mask.clone() for m in masks]
    gen = torch.Generator().manual_seed(7)
    states = []
    for i in range(6):
        if i == 3:  # back to dense, then pruned another way: states seen before and new ones
            with torch.no_grad():
                for m, d in zip(masks, dense, strict=True):
                    m.mask.copy_(d)
        else:
            for m in masks:
                _zero_random(m, gen, 1)
        states.append(_assert_reports_as_fresh(kept, net, x))
    assert len(set(states)) > 2  # the states differ: the check is not vacuous


def _assert_reports_as_fresh(kept: fp.CostModel, net: nn.Module, x: object) -> float:
    """``kept`` reports what a cost model traced afresh does for ``net`` as masked now (the
    flops convention); returns the total."""
    got, fresh = kept.report(), fp.computational_cost(net, x, "flops")
    assert got.total == fresh.total and kept.total() == fresh.total
    assert got.by_module == fresh.by_module
    for name in fresh.marginal:
        assert torch.equal(got.marginal[name], fresh.marginal[name]), name
    return got.total


def _masked_bert() -> tuple[nn.Module, object]:
    net, x = tiny_hf.bert(), tiny_hf.token_inputs()
    fp.apply_masks(net, x)
    return net, x


def _masked_resnet() -> tuple[nn.Module, object]:
    net, x = zoo.build_resnet_bottleneck(), zoo.image_input(2)
    fp.apply_masks(net, x)
    return net, x


@pytest.mark.parametrize("build", [_masked_bert, _masked_resnet], ids=["bert", "resnet"])
def test_kept_cost_model_after_single_removals_reports_as_fresh(
    build: Callable[[], tuple[nn.Module, object]],
) -> None:
    """One channel removed at a time, as a pruning run does, from each mask in turn (on BERT:
    the hidden width, heads and MLP units; a torchvision-shaped bottleneck ResNet): the kept
    CostModel, which recomputes only the terms whose channels changed, reports what a fresh
    one does, and every marginal cost is the total saved by zeroing that entry alone."""
    net, x = build()
    kept = fp.CostModel(net, x, "flops")
    masks = fp.find_masks(net)
    order = list(masks.values())
    gen = torch.Generator().manual_seed(0)
    for step in range(2 * len(order)):
        mask = order[step % len(order)]
        live = torch.nonzero(mask.mask > 0.5).flatten()
        with torch.no_grad():
            mask.mask[live[torch.randint(live.numel(), (1,), generator=gen)]] = 0.0
        total = _assert_reports_as_fresh(kept, net, x)
        marginal = kept.report().marginal
        e = kept.entries()
        for name, start in kept.entry_start.items():
            want = torch.zeros(masks[name].num_channels, dtype=torch.float64)
            for k in range(want.numel()):
                alone = e.copy()
                alone[start + k] = 0.0
                want[k] = total - kept.total(alone)
            assert torch.equal(marginal[name], want), (step, name)
    assert all(m.kept < m.num_channels for m in order)  # every mask lost channels


# ----------------------------------------------------- (c) other conventions
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model", list(MODELS))
def test_macs_are_half_the_flop_counter(model: str, seed: int) -> None:
    """macs total = FlopCounterMode FLOPs of the shrunk network / 2, per example."""
    net, small, x = MODELS[model](seed)
    _assert_cost(fp.computational_cost(net, x, "macs").total, _reference_flops(small, x) / 2)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model", list(MODELS))
def test_macs_marginals_are_half_the_flops_marginals(model: str, seed: int) -> None:
    """Every macs marginal is exactly half the flops marginal."""
    net, _, x = MODELS[model](seed)
    flops = fp.computational_cost(net, x, "flops").marginal
    macs = fp.computational_cost(net, x, "macs").marginal
    for name in flops:
        assert torch.equal(macs[name], flops[name] / 2)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model", list(MODELS))
def test_params_equal_shrunk_network_parameter_count(model: str, seed: int) -> None:
    """params total = sum of numel of the hand-built smaller network's parameters."""
    net, small, x = MODELS[model](seed)
    _assert_cost(fp.computational_cost(net, x, "params").total, float(_n_params(small)))


@pytest.mark.parametrize("model", list(MODELS))
def test_memory_positive_and_strictly_decreasing_under_pruning(model: str) -> None:
    """memory is positive and strictly drops when channels are pruned."""
    net, _, x = MODELS[model](0)
    before = fp.computational_cost(net, x, "memory").total
    masks = list(fp.find_masks(net).values())
    assert before > 0
    for m in masks:
        with torch.no_grad():
            m.mask[0] = 0.0
            m.mask[1] = 0.0  # a whole group of the CNN's grouped conv
        after = fp.computational_cost(net, x, "memory").total
        assert 0 < after < before
        before = after


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model", list(MODELS))
def test_memory_equals_memory_of_shrunk_network(model: str, seed: int) -> None:
    """The masked network's memory cost equals that of the hand-built smaller network."""
    net, small, x = MODELS[model](seed)
    want = fp.computational_cost(small, x, "memory").total
    _assert_cost(fp.computational_cost(net, x, "memory").total, want)


# ------------------------------------------------------------- (d) errors
@pytest.mark.parametrize("convention", ["FLOPS", "bogus", ""])
def test_unknown_convention_raises(convention: str) -> None:
    """An unknown convention is a ValueError naming it."""
    with pytest.raises(ValueError, match=rf"unknown cost convention {convention!r}"):
        fp.computational_cost(_mlp(), torch.randn(2, 10), convention)


# ----------------------------------------------------- (e) batch invariance
@pytest.mark.parametrize("convention", ["flops", "macs", "twml", "params", "memory"])
@pytest.mark.parametrize("model", list(MODELS))
def test_per_example_cost_independent_of_batch_size(model: str, convention: str) -> None:
    """Total and marginals per example are the same with 1 or 5 example inputs."""
    net, _, x = MODELS[model](3)
    x1 = x[:1]
    x5 = torch.cat([x, x])[:5]
    assert x5.shape[0] == 5
    r1 = fp.computational_cost(net, x1, convention)
    r5 = fp.computational_cost(net, x5, convention)
    _assert_cost(r5.total, r1.total)
    for name in r1.marginal:
        assert torch.equal(r5.marginal[name], r1.marginal[name])


class _Attention(nn.Module):
    """nn.MultiheadAttention over tokens, then a linear head on their mean."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.fc = nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:
        y, _ = self.attn(x, x, x, need_weights=False)
        return self.fc(y.mean(1))


def test_multihead_attention_projections_are_counted_in_eval_mode() -> None:
    """In eval mode without autograd nn.MultiheadAttention runs as one fused op that PyTorch's
    counter prices at 0; the cost model still counts its input and output projections and the
    two attention products, by a hand count: 2*L*d*3d (q, k, v) + 2*L*d*d (out) + 2 * 2*L*L*d
    (q k^T and the weighted sum of v, over all heads) + the head, per example. PyTorch's
    counter has no formula for CPU's fused attention kernel, with or without autograd; it is
    given torch's own flash-attention formula for it (``SAME_AS_TORCH``)."""
    length, d = 5, 16
    model = _Attention(d).eval()
    x = torch.randn(2, length, d)
    hand = 2 * length * d * 3 * d + 2 * length * d * d + 2 * 2 * length * length * d + 2 * d * 3
    assert fp.computational_cost(model, x).total == hand
    with (
        torch.enable_grad(),
        FlopCounterMode(display=False, custom_mapping=dict(SAME_AS_TORCH)) as counter,
    ):
        model(x)  # the unfused path, op by op
    assert counter.get_total_flops() / x.shape[0] == hand
