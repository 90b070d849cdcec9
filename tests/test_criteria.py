"""Criteria objects (``fisherprune.criteria``): L1 against the shrunk network's weights, Random's
stream, Fisher / Taylor against the optimizer's former string methods, a criterion written outside
the package driving ``PruningOptimizer``, and the docs' example."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import zoo
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.criteria import L1, Criterion, Fisher, GradientCriterion, Random, Taylor

CONV_ARCHS = ["resnet_basic", "resnet_bottleneck", "densenet", "mobilenetv2", "vgg"]


def _prune_randomly(masks: fp.AppliedMasks, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        fp.prune(masks, {k: torch.rand(m.num_channels, generator=g) for k, m in masks.items()})


@pytest.mark.parametrize("name", CONV_ARCHS)
def test_l1_of_masked_model_is_l1_of_shrunk_model(name: str) -> None:
    """The L1 score of every kept channel equals the L1 norm of its producing weights in the
    shrunk network: weight slices that read a pruned channel of another group do not count,
    even while the masks are collecting (so nothing has zeroed those slices)."""
    arch = zoo.ARCHS[name]
    model = arch.build(seed=1)
    x = arch.example_input(2)
    masks = fp.apply_masks(model, x[:1])
    for m in masks.values():
        m.collecting = True
    total = sum(m.num_channels for m in masks.values())
    _prune_randomly(masks, total // 3, seed=2)
    scores = L1(normalize="none").scores(masks, model)
    small = dict(fp.shrink(model, x[:1]).named_parameters())
    for key, m in masks.items():
        group = masks.groups[key]
        ref = torch.zeros(m.kept, dtype=torch.float64)
        for pname, dim in group.members:
            module, _, leaf = pname.rpartition(".")
            if leaf == "weight" and module in group.producers:
                ref += small[pname].detach().abs().double().movedim(dim, 0).flatten(1).sum(1)
        kept = torch.nonzero(m.mask > 0.5).flatten()
        torch.testing.assert_close(scores[key][kept], ref, rtol=1e-9, atol=1e-12)


def test_l1_mean_normalisation_over_kept_channels() -> None:
    """``normalize="mean"`` divides each group by its mean over the unpruned channels."""
    arch = zoo.ARCHS["vgg"]
    model = arch.build(seed=0)
    masks = fp.apply_masks(model, arch.example_input(1))
    _prune_randomly(masks, 5, seed=0)
    raw = L1(normalize="none").scores(masks, model)
    norm = L1().scores(masks, model)
    for key, m in masks.items():
        alive = m.mask > 0.5
        torch.testing.assert_close(norm[key][alive].mean(), torch.tensor(1.0, dtype=torch.float64))
        torch.testing.assert_close(norm[key], raw[key] / raw[key][alive].mean())


def test_l1_needs_applied_masks() -> None:
    """Hand-placed MaskLayers carry no producer information: a clear error, not a guess."""
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), fp.MaskLayer(6), nn.Linear(6, 2))
    with pytest.raises(ValueError, match="apply_masks"):
        L1().scores(fp.find_masks(net), net)
    with pytest.raises(ValueError, match="normalize"):
        L1(normalize="max")


def test_random_scores_shapes_and_stream() -> None:
    """One score per channel in [0, 1); the same generator seed gives the same scores."""
    arch = zoo.ARCHS["resnet_basic"]
    masks = fp.apply_masks(arch.build(), arch.example_input(1))
    model = nn.Linear(1, 1)  # not read
    a = Random(seed=3).scores(masks, model)
    b = Random(seed=3).scores(masks, model)
    for key, m in masks.items():
        assert a[key].shape == (m.num_channels,)
        assert a[key].dtype == torch.float64
        assert bool(((a[key] >= 0) & (a[key] < 1)).all())
        torch.testing.assert_close(a[key], b[key])


# ------------------------------------------------------------ criteria as objects
def _docs_example() -> dict:
    """Run the code block of docs/usage.md's "Writing a criterion" and return its names."""
    text = (Path(__file__).parent.parent / "docs" / "usage.md").read_text()
    block = text.split("<!-- criterion-example -->", 1)[1].split("```python\n", 1)[1]
    code = block.split("```", 1)[0]
    assert len(code.strip().splitlines()) <= 30  # the promised short example
    names: dict = {}
    exec(compile(code, "docs/usage.md", "exec"), names)
    return names


def _conv_bn_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
        nn.Conv2d(6, 5, 3, padding=1), nn.BatchNorm2d(5), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(5, 4),
    )  # fmt: skip
    with torch.no_grad():
        net[1].weight.copy_(torch.tensor([0.9, -0.4, 1.3, 0.25, -0.7, 1.1]))
        net[4].weight.copy_(torch.tensor([0.6, -0.3, 0.8, 1.2, -0.95]))
    return net


def test_docs_criterion_written_outside_drives_the_optimizer() -> None:
    """The docs' BatchNormScale, a criterion defined outside the package, decides what
    ``PruningOptimizer`` prunes: with ``flops_weight=0`` and weights held still (lr 0), the
    channels go in the order of |gamma| over both BatchNorms, read directly from the layers."""
    crit = _docs_example()["BatchNormScale"]()
    net = _conv_bn_net()
    x, y = torch.randn(8, 3, 6, 6), torch.randint(0, 4, (8,))
    masks = fp.apply_masks(net, x[:1])
    opt = fp.PruningOptimizer(
        net, x[:1], lr=0.0, momentum=0.0, prune_every=1, flops_weight=0, criterion=crit
    )
    assert not any(m.collecting for m in masks.values())  # weights only: nothing gathered
    gammas = [(abs(v), 1, i) for i, v in enumerate(net[1].weight.tolist())]
    gammas += [(abs(v), 4, i) for i, v in enumerate(net[4].weight.tolist())]
    expected = sorted(gammas)[:4]
    for _ in range(4):
        opt.minimize(F.cross_entropy(net(x), y))
    got = []
    for ev in opt.history:
        bn = next(
            int(p.split(".")[0])
            for p, _ in masks.groups[ev.mask].members
            if p.endswith("weight")
            and isinstance(net.get_submodule(p.rpartition(".")[0]), nn.BatchNorm2d)
        )
        got.append((bn, ev.channel))
    assert got == [(bn, i) for _, bn, i in expected]


class _FourthPower(GradientCriterion):
    """A user's gradient criterion: mean_n g[n, k]^4."""

    degree = 4
    factor = 1.0

    def statistic(self, g: Tensor) -> Tensor:
        return g.pow(4).sum(0)


def test_user_gradient_criterion_matches_a_float64_per_example_loop() -> None:
    """A ``GradientCriterion`` written outside the package gets its statistic of the true
    per-example mask gradients (mean-reduced loss undone by N**degree), equal to a plain loop
    over examples that differentiates each example's loss w.r.t. a leaf mask, in float64."""
    torch.manual_seed(1)
    net = nn.Sequential(
        nn.Linear(5, 7), nn.Tanh(), fp.MaskLayer(7), nn.Linear(7, 6), nn.ReLU(),
        fp.MaskLayer(6), nn.Linear(6, 3),
    ).double()  # fmt: skip
    x, y = torch.randn(9, 5, dtype=torch.float64), torch.randint(0, 3, (9,))
    masks = fp.find_masks(net)
    F.cross_entropy(net(x), y).backward()
    fp.update_pruning_signals(masks, decay=0.0, criterion=_FourthPower())
    ref = {n: torch.zeros(m.num_channels, dtype=torch.float64) for n, m in masks.items()}
    for m in masks.values():
        m.collecting = False
    for i in range(x.shape[0]):
        leaves = {}
        for n, m in masks.items():
            leaves[n] = torch.ones(m.num_channels, dtype=torch.float64, requires_grad=True)
            m.mask = leaves[n]
        loss = F.cross_entropy(net(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(loss, list(leaves.values()))
        for n, g in zip(leaves, grads, strict=True):
            ref[n] += g.pow(4) / x.shape[0]
    for n, m in masks.items():
        torch.testing.assert_close(m.signal, ref[n], rtol=1e-9, atol=1e-15)


def test_random_state_resumes_the_same_stream() -> None:
    """Random's generator state travels with the optimizer state: a restored criterion draws
    what the original draws next, not what a fresh one draws."""
    arch = zoo.ARCHS["vgg"]
    model = arch.build()
    masks = fp.apply_masks(model, arch.example_input(1))
    a = Random(seed=5)
    first = a.scores(masks, model)
    restored = Random(seed=5)
    restored.load_state_dict(a.state_dict())
    nxt_a, nxt_r = a.scores(masks, model), restored.scores(masks, model)
    assert all(torch.equal(nxt_a[k], nxt_r[k]) for k in masks)
    assert not any(torch.equal(nxt_a[k], first[k]) for k in masks)


def test_optimizer_takes_a_criterion_or_a_method_not_both() -> None:
    """``method`` is a shorthand; giving both, or an unknown name, is an error naming it."""
    arch = zoo.ARCHS["vgg"]
    model = arch.build()
    x = arch.example_input(1)
    fp.apply_masks(model, x)
    with pytest.raises(ValueError, match="not both"):
        fp.PruningOptimizer(model, x, method="taylor", criterion=L1())
    with pytest.raises(ValueError, match="unknown criterion 'l3'"):
        fp.PruningOptimizer(model, x, criterion="l3")
    with pytest.raises(TypeError, match="Criterion"):
        fp.PruningOptimizer(model, x, criterion=3)  # type: ignore[arg-type]


def test_resume_refuses_another_criterion() -> None:
    """A state saved while pruning by L1 does not load into an optimizer ranking by Fisher:
    the resumed run would choose channels by another rule."""
    arch = zoo.ARCHS["vgg"]
    model = arch.build()
    x = arch.example_input(1)
    fp.apply_masks(model, x)
    state = fp.PruningOptimizer(model, x, criterion="l1").state_dict()
    with pytest.raises(ValueError, match="criterion"):
        fp.PruningOptimizer(model, x, criterion=Fisher()).load_state_dict(state)


def test_l1_in_the_optimizer_finds_groups_on_the_model() -> None:
    """``PruningOptimizer(criterion="l1")`` with masks found on the model (no ``AppliedMasks``
    passed) ranks by the same L1 scores as the groups ``apply_masks`` returned, weighed by
    cost ("auto"): its first prune is the lowest L1 / marginal FLOPs channel."""
    arch = zoo.ARCHS["resnet_basic"]
    model = arch.build(seed=3)
    x = arch.example_input(4)
    masks = fp.apply_masks(model, x[:1])
    opt = fp.PruningOptimizer(model, x[:1], lr=0.0, momentum=0.0, prune_every=1, criterion="l1")
    marginal = fp.computational_cost(model, x[:1]).marginal
    l1 = L1().scores(masks, model)
    best = min(
        (float(l1[k][c] / (marginal[k][c] + 1e-6)), i, c, k)
        for i, k in enumerate(masks)
        for c in range(masks[k].num_channels)
    )
    opt.minimize(model(x).logsumexp(1).mean())
    assert (opt.history[0].mask, opt.history[0].channel) == (best[3], best[2])


def test_taylor_object_equals_the_method_shorthand() -> None:
    """``criterion=Taylor()`` and ``method="taylor"`` are the same rule: identical signals and
    prune events over a few steps from the same start."""
    arch = zoo.ARCHS["vgg"]
    x = arch.example_input(8)
    runs = []
    for kwargs in ({"method": "taylor"}, {"criterion": Taylor()}):
        model = arch.build(seed=2)
        masks = fp.apply_masks(model, x[:1])
        opt = fp.PruningOptimizer(model, x[:1], lr=0.01, prune_every=2, **kwargs)
        for _ in range(4):
            opt.minimize(model(x).logsumexp(1).mean())
        runs.append(
            ([e.as_dict() for e in opt.history], [m.signal.clone() for m in masks.values()])
        )
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 2
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))


def test_criterion_base_refuses_bad_importances() -> None:
    """A user's importance of the wrong length is an error naming the mask, not a silent
    broadcast."""

    class Short(Criterion):
        def importance(self, masks, model):
            return {n: torch.ones(1) for n in masks}

    arch = zoo.ARCHS["vgg"]
    model = arch.build()
    masks = fp.apply_masks(model, arch.example_input(1))
    with pytest.raises(ValueError, match="values for mask"):
        Short().scores(masks, model)
