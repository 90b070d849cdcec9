"""``fisherprune.criteria.FisherMean`` (prune_to_target's default criterion when it repairs,
issue 31): the Fisher signal of replacing each channel by its mean, and the joint increments on
masks several layers read, against float64 loops over examples."""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.calibrate.to_target import estimate_signals
from fisherprune.criteria import FisherMean
from fisherprune.masks.points import SharedProduct


def shifted(head: nn.Linear, h: Tensor, keep: Tensor, y: Tensor, abar: Tensor) -> Tensor:
    """g'[n, k] = (h_nk - abar_k) dL_n/dz_nk with z = h * keep what ``head`` reads, one example
    at a time: (N, units) float64."""
    rows = []
    for n in range(h.shape[0]):
        z = (h[n] * keep).requires_grad_(True)
        loss = F.cross_entropy(F.linear(z, head.weight, head.bias)[None], y[n : n + 1])
        (delta,) = torch.autograd.grad(loss, z)
        rows.append((h[n] - abar) * delta)
    return torch.stack(rows)


def reference(head: nn.Linear, h: Tensor, keep: Tensor, y: Tensor, abar: Tensor) -> Tensor:
    """1/2 mean_n g'[n, k]^2 (``shifted``; abar = 0 gives the library's Fisher)."""
    return 0.5 * (shifted(head, h, keep, y, abar) ** 2).mean(0)


def joint_reference(g: Tensor, own: Tensor, alive: list[int]) -> Tensor:
    """Plain loops: kept channels in ascending ``own`` order score the increment of
    1/2 mean_n (sum of g[n, k] over the channels up to them)^2, made non-decreasing, at least
    ``own``; the others keep ``own``."""
    want, total, floor, before = own.clone(), torch.zeros(g.shape[0], dtype=g.dtype), 0.0, 0.0
    for k in sorted(alive, key=lambda k: float(own[k])):
        total = total + g[:, k]
        joint = float(0.5 * (total**2).mean())
        floor = max(floor, joint - before, 0.0)
        want[k], before = max(floor, float(own[k])), joint
    return want


def calibrated(crit: FisherMean) -> tuple[nn.Sequential, dict, Tensor, Tensor, Tensor]:
    """A float64 Linear(5, 6)-ReLU-Linear(6, 3) with its hidden units masked and unit 2 pruned,
    two mean-reduced batches (4 and 5 examples) passed under ``crit.observing``, then
    ``crit.update(decay=0)``: the net, its masks, the hidden activations h (9, 6), the mask
    as a float64 keep vector, and the labels."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    x, y = torch.randn(9, 5, dtype=torch.float64), torch.randint(0, 3, (9,))
    masks = fp.apply_masks(net, x[:2])
    (mask,) = masks.values()
    mask.mask[2] = 0.0
    mask.collecting = True
    with crit.observing(net, masks):
        for part in (slice(0, 4), slice(4, 9)):
            F.cross_entropy(net(x[part]), y[part]).backward()
    crit.update(masks, decay=0.0)
    with torch.no_grad():
        h, keep = torch.relu(net[0](x)), mask.mask.double()
    return net, masks, h, keep, y


def test_mean_replacement_signal_matches_a_float64_loop_over_examples() -> None:
    """Linear-ReLU-Linear, two mean-reduced calibration batches of different sizes, one unit
    already pruned: the signal is 1/2 mean_n ((h_nk - abar_k) dL_n/dz_nk)^2 with abar_k the
    unit's mean over both batches as the second layer reads it (z), each example's gradient
    taken alone in float64."""
    net, masks, h, keep, y = calibrated(FisherMean())
    (mask,) = masks.values()
    want = reference(net[2], h, keep, y, (h * keep).mean(0))
    torch.testing.assert_close(mask.signal.double(), want, rtol=1e-6, atol=0.0)  # float32 buffer
    plain = reference(net[2], h, keep, y, torch.zeros(6, dtype=torch.float64))  # Fisher
    assert not torch.allclose(want, plain)  # the mean changed something


def test_joint_all_scores_increments_of_mean_replaced_gradients() -> None:
    """``joint="all"`` on the same net: each kept unit, in the order of its mean-replaced
    signal, scores the increment of 1/2 mean_n (sum of g'[n,k] over the lowest units up to
    it)^2, made non-decreasing and at least its own signal; the pruned unit keeps its own."""
    crit = FisherMean(joint="all")
    net, masks, h, keep, y = calibrated(crit)
    (got,) = crit.importance(masks, net).values()
    abar = (h * keep).mean(0)
    own = reference(net[2], h, keep, y, abar)
    want = joint_reference(shifted(net[2], h, keep, y, abar), own, [0, 1, 3, 4, 5])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
    assert not torch.allclose(want[[0, 1, 3, 4, 5]], own[[0, 1, 3, 4, 5]])  # cross terms count


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(c, 5, 3, padding=1), nn.Conv2d(5, c, 1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.b(torch.relu(self.a(x)))


class _Residual(nn.Module):
    """A residual stream of 4 channels read by both blocks' first convolution and the head
    (coupled), each block's inner width of 5 read by its second convolution alone."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.blocks = nn.ModuleList([_Block(4), _Block(4)])
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.stem(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean((2, 3)))


#: the modules reading each mask of ``_Residual``, by the mask's name
READERS = {
    "fisherprune_masks.stem:out": ("blocks.0.a", "blocks.1.a", "head"),
    "fisherprune_masks.blocks_0_a:out": ("blocks.0.b",),
    "fisherprune_masks.blocks_1_a:out": ("blocks.1.b",),
}


def _residual_data() -> tuple[_Residual, Tensor, Tensor, list[tuple[Tensor, Tensor]]]:
    torch.manual_seed(5)
    net = _Residual().double().eval()
    x, y = torch.randn(11, 2, 5, 5, dtype=torch.float64), torch.randint(0, 3, (11,))
    return net, x, y, [(x[:4], y[:4]), (x[4:8], y[4:8]), (x[8:], y[8:])]


def _consumer_inputs(
    net: nn.Module, x: Tensor, y: Tensor, readers: dict[str, tuple[str, ...]] = READERS
) -> dict[str, tuple[Tensor, Tensor]]:
    """Each reading module's input z (N, C, ...) and every example's own dL_n/dz, one example
    at a time in float64, on the net without masks."""
    names = {n for by in readers.values() for n in by}
    modules = dict(net.named_modules())
    z: dict[str, list[Tensor]] = {n: [] for n in names}
    dz: dict[str, list[Tensor]] = {n: [] for n in names}

    def capture(name: str, leaves: dict[str, Tensor]) -> Callable[[nn.Module, tuple], tuple]:
        def hook(module: nn.Module, args: tuple) -> tuple:
            # a copy this module alone reads, still in the graph: its gradient is the loss's
            # through this module only (the input itself also feeds a residual add)
            leaves[name] = args[0].clone()
            return (leaves[name],)

        return hook

    for i in range(x.shape[0]):
        leaves: dict[str, Tensor] = {}
        handles = [modules[n].register_forward_pre_hook(capture(n, leaves)) for n in names]
        loss = F.cross_entropy(net(x[i : i + 1]), y[i : i + 1])
        for h in handles:
            h.remove()
        for n, g in zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True):
            z[n].append(leaves[n].detach())
            dz[n].append(g)
    return {n: (torch.cat(z[n]), torch.cat(dz[n])) for n in names}


def _shifted_by_places(inputs: dict[str, tuple[Tensor, Tensor]], readers: tuple) -> Tensor:
    """g'[n, k] = sum over the reading modules p, over positions, of
    (z_p[n, k, pos] - abar_pk) * dL_n/dz_p[n, k, pos], abar_pk z_p's mean over examples and
    positions: (N, C)."""
    total = None
    for p in readers:
        z, dz = inputs[p]
        dims = [0, *range(2, z.dim())]
        abar = z.mean(dims, keepdim=True)
        part = ((z - abar) * dz).sum(list(range(2, z.dim()))) if z.dim() > 2 else (z - abar) * dz
        total = part if total is None else total + part
    assert total is not None
    return total


def test_coupled_stream_scores_joint_increments_and_each_reader_its_own_mean() -> None:
    """A residual CNN, three mean-reduced batches (4, 4, 3): every mask's signal is
    1/2 mean_n g'^2 with g' summed over its reading modules, each with its own mean over the
    calibration set and positions (float64 loop over examples, the net without masks); the
    stream (three readers) scores the joint increments of g', the inner widths their signal."""
    net, x, y, batches = _residual_data()
    inputs = _consumer_inputs(net, x, y)
    crit = FisherMean()
    masks = dict(fp.apply_masks(net, x[:1]))
    with crit.observing(net, masks):
        estimate_signals(net, masks, batches, F.cross_entropy, crit)
    got = crit.importance(masks, net)
    assert set(masks) == set(READERS)
    for name, readers in READERS.items():
        g = _shifted_by_places(inputs, readers)
        own = 0.5 * (g**2).mean(0)
        torch.testing.assert_close(masks[name].signal.double(), own, rtol=1e-5, atol=1e-12)
        c = g.shape[1]
        want = joint_reference(g, own, list(range(c))) if len(readers) > 1 else own
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-12)
    stream = "fisherprune_masks.stem:out"
    assert not torch.allclose(got[stream], masks[stream].signal.double())  # not vacuous


def test_checkpointed_blocks_give_the_same_signals() -> None:
    """With the blocks checkpointed for the pass (their forwards recomputed in backward), no
    statistic is counted twice: the signals and scores equal the plain pass's."""
    out = []
    for blocks in (False, True):
        net, x, _, batches = _residual_data()
        crit = FisherMean()
        masks = dict(fp.apply_masks(net, x[:1]))
        with crit.observing(net, masks):
            estimate_signals(net, masks, batches, F.cross_entropy, crit,
                             blocks=net.blocks if blocks else None)  # fmt: skip
        out.append(crit.scores(masks, net))
    for name in out[0]:
        torch.testing.assert_close(out[1][name], out[0][name], rtol=1e-12, atol=0.0)


def test_a_checkpointed_pass_holds_no_product_after_its_backward() -> None:
    """The blocks' forwards recomputed in backward make mask products again; once the
    backward is done none of them is still held (``SharedProduct``: the recomputation's end
    drops its hold, as the model call's end does for the first forward)."""
    net, x, _, batches = _residual_data()
    crit = FisherMean()
    masks = dict(fp.apply_masks(net, x[:1]))
    with crit.observing(net, masks):
        estimate_signals(net, masks, batches, F.cross_entropy, crit, blocks=net.blocks)
    assert getattr(SharedProduct._latest, "out", None) is None


def test_uncoupled_masks_keep_no_per_example_state() -> None:
    """On the MLP (no mask with two readers), what the criterion keeps between passes does not
    grow with the number of calibration passes: per-channel sums only."""

    def kept_elements(passes: int) -> int:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
        x, y = torch.randn(8 * passes, 5), torch.randint(0, 3, (8 * passes,))
        crit = FisherMean()
        masks = fp.apply_masks(net, x[:2])
        for m in masks.values():
            m.collecting = True
        with crit.observing(net, masks):
            for i in range(passes):
                F.cross_entropy(net(x[8 * i : 8 * i + 8]), y[8 * i : 8 * i + 8]).backward()
            net(x[:1])  # the next pass pairs the last one
            records = crit._records.values()
            return sum(
                t.numel()
                for r in records
                for t in [
                    *(v for pair in r.sums.values() for v in pair),
                    *(v for pair in r.shifts.values() for v in pair),
                ]
            )

    assert kept_elements(2) == kept_elements(6) > 0


def test_pruning_optimizer_refuses_it() -> None:
    """Training runs no ``observing`` block: ``PruningOptimizer`` says to use prune_to_target."""
    net = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
    x = torch.randn(2, 5)
    fp.apply_masks(net, x)
    with pytest.raises(ValueError, match="prune_to_target"):
        fp.PruningOptimizer(net, x, torch.optim.SGD(net.parameters(), lr=0.1),
                            criterion="fisher_mean")  # fmt: skip


def test_unknown_joint_is_refused() -> None:
    with pytest.raises(ValueError, match="joint must be one of"):
        FisherMean(joint="some")


def test_a_pass_holds_no_activation_after_its_backward() -> None:
    """Under ``observing``, once a pass's backward is done the masked inputs the criterion
    read are freed (what it keeps are sums): a checkpointed decoder's activations are not
    held across the pass."""
    net, x, y, _ = _residual_data()
    crit = FisherMean()
    masks = dict(fp.apply_masks(net, x[:1]))
    seen: list[weakref.ref] = []
    handle = net.blocks[1].b.register_forward_pre_hook(lambda m, a: seen.append(weakref.ref(a[0])))
    with crit.observing(net, masks):
        for m in masks.values():
            m.collecting = True
        F.cross_entropy(net(x[:4]), y[:4]).backward()
        gc.collect()
        assert seen and all(r() is None for r in seen)
    handle.remove()


class _NormedTwoReaders(nn.Module):
    """A width of 6 under a LayerNorm, read by two layers: coupled, but normalised across."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.norm = nn.Linear(5, 6), nn.LayerNorm(6)
        self.a, self.b = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(torch.tanh(self.inp(x)))
        return self.a(h) + self.b(torch.relu(h))


def _plain(net: nn.Module) -> nn.Module:
    """A copy of ``net`` without its masks (the reference loops run on the plain model)."""
    plain = copy.deepcopy(net)
    fp.remove_masks(plain)
    return plain


def test_a_width_normalised_across_keeps_its_own_signal() -> None:
    """A width two layers read but a LayerNorm normalises across (a transformer's hidden
    width) is scored by its own signal, not by joint increments (``joint="all"`` scores the
    same width jointly: the check is not vacuous)."""
    torch.manual_seed(4)
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    net = _NormedTwoReaders().double()
    masks = dict(fp.apply_masks(net, x[:1]))
    (name,) = [n for n, m in masks.items() if m.num_channels == 6]
    assert id(masks[name]) in fp.criteria.coupled_masks(net)
    crit = FisherMean()
    with crit.observing(net, masks):
        estimate_signals(net, masks, [(x, y)], F.cross_entropy, crit)
    got = crit.importance(masks, net)[name]
    torch.testing.assert_close(got, masks[name].signal.double(), rtol=0, atol=0)
    g = _shifted_by_places(_consumer_inputs(_plain(net), x, y, {name: ("a", "b")}), ("a", "b"))
    torch.testing.assert_close(got, 0.5 * (g**2).mean(0), rtol=1e-5, atol=1e-12)
    joint = FisherMean(joint="all")
    with joint.observing(net, masks):
        estimate_signals(net, masks, [(x, y)], F.cross_entropy, joint)
    assert not torch.equal(joint.importance(masks, net)[name], masks[name].signal.double())


class _SometimesTwoReaders(_NormedTwoReaders):
    """``_NormedTwoReaders`` whose readers of the width are those named in ``reading``."""

    reading: tuple[str, ...] = ("a", "b")

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(torch.tanh(self.inp(x)))
        outs = {"a": lambda: self.a(h), "b": lambda: self.b(torch.relu(h))}
        return sum((outs[r]() for r in self.reading), torch.zeros(()))


def test_a_reader_absent_from_a_pass_adds_nothing_to_it() -> None:
    """Two passes of 6 examples, ``a`` reading the width in the first only, ``b`` in both:
    the signal is 1/2 mean_n g'^2 with g' summed over the readers of each example's pass,
    each reader's mean over the examples it read (float64 loop on the net without masks)."""
    torch.manual_seed(6)
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    net = _SometimesTwoReaders().double()
    masks = dict(fp.apply_masks(net, x[:1]))
    (name,) = [n for n, m in masks.items() if m.num_channels == 6]
    passes = ((slice(0, 6), ("a", "b")), (slice(6, 12), ("b",)))

    def batches(model: _SometimesTwoReaders) -> Iterator[tuple[Tensor, Tensor]]:
        for part, reading in passes:
            model.reading = reading
            yield x[part], y[part]

    crit = FisherMean()
    with crit.observing(net, masks):
        estimate_signals(net, masks, batches(net), F.cross_entropy, crit)
    plain = _plain(net)
    seen = []
    for part, reading in passes:
        plain.reading = reading
        seen.append(_consumer_inputs(plain, x[part], y[part], {name: reading}))
    zb, dzb = (torch.cat([seen[0]["b"][i], seen[1]["b"][i]]) for i in (0, 1))
    za, dza = seen[0]["a"]
    g = (zb - zb.mean(0)) * dzb
    g[:6] += (za - za.mean(0)) * dza
    torch.testing.assert_close(masks[name].signal.double(), 0.5 * (g**2).mean(0),
                               rtol=1e-5, atol=1e-12)  # fmt: skip


class _LSTMReader(nn.Module):
    """A linear layer with ReLU (positive means) read by an LSTM, which the repair cannot
    refit, then a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.rnn = nn.LSTM(6, 4, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:  # (N, steps, 5)
        return self.head(self.rnn(torch.relu(self.inp(x)))[0][:, -1])


def test_a_width_read_by_a_layer_the_repair_cannot_refit_keeps_its_own_signal() -> None:
    """No refit replaces the channels an LSTM reads by their means (it has no least-squares
    repair), so their mean-replaced signal would price a removal that does not happen: they are
    scored by the plain Fisher signal."""
    torch.manual_seed(5)
    x, y = torch.randn(8, 3, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    net = _LSTMReader().double()
    masks = dict(fp.apply_masks(net, x[:1]))
    (name,) = [n for n, m in masks.items() if m.num_channels == 6]
    plain = fp.criteria.Fisher()
    estimate_signals(net, masks, [(x, y)], F.cross_entropy, plain)
    want = plain.importance(masks, net)[name].clone()  # (the signal buffer, rewritten next)
    crit = FisherMean()
    with crit.observing(net, masks):
        estimate_signals(net, masks, [(x, y)], F.cross_entropy, crit)
    got = crit.importance(masks, net)[name]
    assert float(got.abs().max()) > 0
    torch.testing.assert_close(got, want.double(), rtol=1e-6, atol=0)
