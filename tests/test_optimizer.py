"""Tests of ``fisherprune.PruningOptimizer``: schedule, update order, scoring modes,
targets and stopping, wrapped optimizers, resuming, bad inputs and logging.

Models are tiny (an MLP 10 -> 8 -> 6 -> 4 -> 2 on random data, a CNN on 8x8 inputs);
seeds are fixed; each test states one invariant in its docstring.
"""

from __future__ import annotations

import copy
import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fisherprune as fp
from tests.host_reads import spied_tensor_reads
from tests.zoo import build_resnet_basic, image_input

# tolerances
PARAM_RTOL = 1e-6  # same arithmetic in the same order: parameters agree to float32 rounding
PARAM_ATOL = 1e-7
SIGNAL_RTOL = 1e-4  # Fisher estimate from the library vs. per-example autograd, float32
SIGNAL_ATOL = 1e-9
SCORE_RTOL = 1e-5
COST_ATOL = 1e-9
NEAR_ONE_DECAY = 1.0 - 1e-9  # rounds to 1.0 in float32: signals set by hand stay put

# the MLP: widths and its flops per example (2 per multiply-accumulate)
IN, H1, H2, H3, OUT = 10, 8, 6, 4, 2
MLP_COST = 2 * (IN * H1 + H1 * H2 + H2 * H3 + H3 * OUT)  # 320
MLP_MARGINAL = {"2": 2 * (IN + H2), "5": 2 * (H1 + H3), "8": 2 * (H2 + OUT)}  # 32, 24, 16
MLP_CHANNELS = H1 + H2 + H3


# ---------------------------------------------------------------- helpers
def make_mlp(seed: int = 0) -> nn.Sequential:
    """MLP with three masks named "2", "5", "8" (tanh: no dead units, all signals > 0)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN, H1),
        nn.Tanh(),
        fp.MaskLayer(H1),
        nn.Linear(H1, H2),
        nn.Tanh(),
        fp.MaskLayer(H2),
        nn.Linear(H2, H3),
        nn.Tanh(),
        fp.MaskLayer(H3),
        nn.Linear(H3, OUT),
    )


def make_cnn(seed: int = 0) -> nn.Sequential:
    """CNN on 3x8x8 inputs with masks "2" (4 channels) and "5" (5 channels)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        fp.MaskLayer(4),
        nn.Conv2d(4, 5, 3),
        nn.ReLU(),
        fp.MaskLayer(5),
        nn.Flatten(),
        nn.Linear(5 * 6 * 6, 2),
    )


def mlp_batches(n: int, batch: int = 16, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, IN, generator=gen), torch.randint(0, OUT, (batch,), generator=gen))
        for _ in range(n)
    ]


def cnn_batches(n: int, batch: int = 4, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 3, 8, 8, generator=gen), torch.randint(0, 2, (batch,), generator=gen))
        for _ in range(n)
    ]


def example(model: nn.Module) -> torch.Tensor:
    return torch.zeros(2, 3, 8, 8) if isinstance(model[0], nn.Conv2d) else torch.zeros(2, IN)


def train(opt: fp.PruningOptimizer, model: nn.Module, batches) -> None:
    for x, y in batches:
        opt.minimize(F.cross_entropy(model(x), y))


def masks_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.mask.detach().clone() for n, m in fp.find_masks(model).items()}


def signals_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.signal.detach().clone() for n, m in fp.find_masks(model).items()}


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_params_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=n)


def fisher_estimate(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Reference Fisher estimate 1/2 * mean_n (dL_n/dm)^2, one example at a time."""
    grads: dict[str, list[torch.Tensor]] = {}
    for n in range(x.shape[0]):
        h = x[n : n + 1]
        leaves = {}
        for name, mod in model.named_children():
            if isinstance(mod, fp.MaskLayer):
                leaves[name] = mod.mask.detach().clone().requires_grad_(True)
                h = h * leaves[name]
            else:
                h = mod(h)
        loss = F.cross_entropy(h, y[n : n + 1])
        for name, g in zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True):
            grads.setdefault(name, []).append(g)
    return {name: 0.5 * torch.stack(gs).pow(2).mean(0) for name, gs in grads.items()}


def expected_choice(scores: dict[str, torch.Tensor]) -> tuple[str, int]:
    """The documented choice: lowest score, then earlier mask, then lower channel index."""
    cands = [
        (float(s[k]), order, k, name)
        for order, (name, s) in enumerate(scores.items())
        for k in range(s.numel())
    ]
    _, _, k, name = min(cands)
    return name, k


def run_until_finished(opt, model, batches) -> None:
    for x, y in batches:
        opt.minimize(F.cross_entropy(model(x), y))
        if opt.finished:
            return


# ---------------------------------------------------------------- schedule
def test_counter_starts_at_one_and_counts_steps():
    """The counter is 1 before the first step and N + 1 after N steps."""
    model = make_mlp()
    opt = fp.PruningOptimizer(model, example(model), prune_every=1000)
    assert opt.counter == 1
    train(opt, model, mlp_batches(7))
    assert opt.counter == 8


@pytest.mark.parametrize(
    ("prune_every", "burn_in", "steps", "expected"),
    [
        (3, 4, 20, [6, 9, 12, 15, 18]),
        (3, 6, 20, [9, 12, 15, 18]),  # counter must be strictly above burn_in
        (1, 0, 5, [1, 2, 3, 4, 5]),
        (5, 0, 12, [5, 10]),
        (4, 11, 16, [12, 16]),
    ],
)
def test_prunes_exactly_at_the_scheduled_steps(prune_every, burn_in, steps, expected):
    """A prune happens at counter c iff c > burn_in and c % prune_every == 0 (no target)."""
    model = make_mlp()
    opt = fp.PruningOptimizer(
        model, example(model), lr=0.05, prune_every=prune_every, burn_in=burn_in
    )
    train(opt, model, mlp_batches(steps))
    assert [e.step for e in opt.history] == expected
    pruned = sum(int((m == 0).sum()) for m in masks_of(model).values())
    assert pruned == len(expected)


# -------------------------------------------------------------- step order
class RecordingSGD(torch.optim.SGD):
    """SGD that records the masks and signals as they are when the parameters move."""

    def __init__(self, params, masks: dict[str, fp.MaskLayer], lr: float) -> None:
        super().__init__(params, lr=lr)
        self.watched = masks
        self.seen: list[tuple[dict, dict]] = []

    def step(self, closure=None):
        self.seen.append(
            (
                {n: m.mask.clone() for n, m in self.watched.items()},
                {n: m.signal.clone() for n, m in self.watched.items()},
            )
        )
        return super().step(closure)


def test_parameters_move_before_signals_and_prune():
    """Within a step the parameter update comes first: it sees last step's signals and masks."""
    model = make_mlp()
    masks = fp.find_masks(model)
    inner = RecordingSGD(model.parameters(), masks, lr=0.05)
    opt = fp.PruningOptimizer(model, example(model), optimizer=inner, prune_every=2)
    batches = mlp_batches(2)
    for i, (x, y) in enumerate(batches):
        masks_before, signals_before = masks_of(model), signals_of(model)
        opt.minimize(F.cross_entropy(model(x), y))
        seen_masks, seen_signals = inner.seen[i]
        assert all(torch.equal(seen_masks[n], masks_before[n]) for n in masks)
        assert all(torch.equal(seen_signals[n], signals_before[n]) for n in masks)
        assert all(not torch.equal(m.signal, signals_before[n]) for n, m in masks.items())
    assert len(opt.history) == 1 and opt.history[0].step == 2


def test_prune_uses_the_signal_including_this_steps_batch():
    """With decay 0 the prune at step 2 follows batch 2's Fisher estimate, not batch 1's."""
    model = make_mlp(seed=6)  # seeds picked so that the two batches rank channels differently
    opt = fp.PruningOptimizer(model, example(model), lr=0.05, prune_every=2, decay=0.0)
    (x1, y1), (x2, y2) = mlp_batches(2, batch=4, seed=2)
    costs = opt.cost().marginal

    def choice(est):
        return expected_choice({n: est[n].double() / (costs[n] + 1e-6) for n in est})

    est1 = fisher_estimate(model, x1, y1)
    opt.minimize(F.cross_entropy(model(x1), y1))
    est2 = fisher_estimate(model, x2, y2)
    assert choice(est1) != choice(est2), "precondition: the two batches disagree"
    opt.minimize(F.cross_entropy(model(x2), y2))
    (event,) = opt.history
    assert (event.mask, event.channel) == choice(est2)
    before = float(est1[event.mask][event.channel])
    assert event.signal != pytest.approx(before, rel=SIGNAL_RTOL)
    assert event.signal == pytest.approx(float(est2[event.mask][event.channel]), rel=SIGNAL_RTOL)
    for n, m in fp.find_masks(model).items():
        torch.testing.assert_close(m.signal, est2[n], rtol=SIGNAL_RTOL, atol=SIGNAL_ATOL)


def test_step_with_a_closure_collects_the_closures_gradients():
    """step(closure), the torch idiom, updates params and signals from the closure's backward."""
    model = make_mlp()
    opt = fp.PruningOptimizer(model, example(model), lr=0.05, prune_every=1000)
    ((x, y),) = mlp_batches(1)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.isfinite(loss)
    assert all(bool((m.signal > 0).all()) for m in fp.find_masks(model).values())


# ------------------------------------------------------------ scoring modes
HAND_SIGNALS = {  # candidates at index 1; every other channel is 100
    "2": 3.0,  # cost 32: s/c = 0.094, s - c = -29   -> the float weight 1.0 picks it
    "5": 1.2,  # cost 24: s/c = 0.050, s - c = -22.8 -> "auto" picks it
    "8": 1.0,  # cost 16: s/c = 0.063, s - c = -15   -> the plain signal picks it
}


@pytest.mark.parametrize(
    ("flops_weight", "expected_mask"),
    [("auto", "5"), ("AUTO", "5"), (1.0, "2"), (1, "2"), (0, "8"), (0.0, "8")],
)
def test_flops_weight_modes_pick_per_their_formula(flops_weight, expected_mask):
    """Mode "auto" prunes min s/(c+1e-6), a float w min s - w*c, and 0 min s: three picks."""
    model = make_mlp()
    masks = fp.find_masks(model)
    for n, m in masks.items():
        m.signal.fill_(100.0)
        m.signal[1] = HAND_SIGNALS[n]
    opt = fp.PruningOptimizer(
        model,
        example(model),
        lr=0.05,
        prune_every=1,
        decay=NEAR_ONE_DECAY,
        flops_weight=flops_weight,
    )
    marginal = opt.cost().marginal
    assert {n: float(marginal[n][1]) for n in masks} == MLP_MARGINAL  # precondition
    ((x, y),) = mlp_batches(1)
    opt.minimize(F.cross_entropy(model(x), y))
    (event,) = opt.history
    assert (event.mask, event.channel) == (expected_mask, 1)
    s, c = float(masks[event.mask].signal[1]), float(MLP_MARGINAL[event.mask])
    assert s == pytest.approx(HAND_SIGNALS[event.mask], rel=SCORE_RTOL)
    w = fp.pruner.check_flops_weight(flops_weight)
    formula = s / (c + 1e-6) if w == "auto" else s - w * c
    assert event.score == pytest.approx(formula, rel=SCORE_RTOL)


def test_score_convention_weighs_signals_by_another_cost_than_the_target():
    """With score_convention="memory" the pick is min signal / marginal activation elements
    (2 per hidden unit here: the linear's and the tanh's output), not per marginal FLOPs; the
    target and the event's costs stay in FLOPs."""
    model = make_mlp()
    masks = fp.find_masks(model)
    for n, m in masks.items():
        m.signal.fill_(100.0)
        m.signal[1] = HAND_SIGNALS[n]
    opt = fp.PruningOptimizer(
        model,
        example(model),
        lr=0.05,
        prune_every=1,
        decay=NEAR_ONE_DECAY,
        flops_target="50%",
        score_convention="memory",
    )
    memory = fp.computational_cost(model, example(model), convention="memory").marginal
    assert {n: float(memory[n][1]) for n in masks} == {"2": 2.0, "5": 2.0, "8": 2.0}
    ((x, y),) = mlp_batches(1)
    opt.minimize(F.cross_entropy(model(x), y))
    (event,) = opt.history
    assert (event.mask, event.channel) == ("8", 1)  # "auto" on FLOPs would pick "5"
    assert event.score == pytest.approx(HAND_SIGNALS["8"] / (2.0 + 1e-6), rel=SCORE_RTOL)
    assert (event.cost_before, event.cost_after) == (MLP_COST, MLP_COST - MLP_MARGINAL["8"])
    assert opt.target == 0.5 * MLP_COST


# ----------------------------------------------------------------- targets
@pytest.mark.parametrize(
    ("make", "flops_target", "target"),
    [
        (make_mlp, 200.0, 200.0),
        (make_mlp, "50%", 0.5 * MLP_COST),
        (make_mlp, 0.5, 0.5 * MLP_COST),
        (make_mlp, "0.3", 0.3 * MLP_COST),
        (make_cnn, "50%", None),
    ],
)
def test_pruning_stops_at_most_one_channel_below_target(make, flops_target, target):
    """Pruning continues while cost > target and stops right after the cost first gets <= target."""
    model = make()
    opt = fp.PruningOptimizer(
        model, example(model), lr=0.05, prune_every=1, flops_target=flops_target
    )
    if target is None:
        target = 0.5 * opt.start_cost
    assert opt.target == pytest.approx(target, abs=COST_ATOL)
    batches = mlp_batches(40) if make is make_mlp else cnn_batches(20)
    run_until_finished(opt, model, batches)
    assert opt.finished
    assert opt.history, "nothing was pruned"
    assert all(e.cost_before > target for e in opt.history)
    assert all(e.cost_after > target for e in opt.history[:-1])
    last = opt.history[-1]
    assert last.cost_after <= target < last.cost_before
    assert opt.cost().total == pytest.approx(last.cost_after, abs=COST_ATOL)


def test_after_finishing_masks_stop_collecting_and_signals_freeze():
    """Once the target is met no mask collects; later steps change neither signals nor masks."""
    model = make_mlp()
    opt = fp.PruningOptimizer(model, example(model), lr=0.05, prune_every=1, flops_target="80%")
    batches = mlp_batches(30)
    run_until_finished(opt, model, batches[:20])
    assert opt.finished
    assert all(m.collecting is False for m in fp.find_masks(model).values())
    signals, masks, params = signals_of(model), masks_of(model), params_of(model)
    n_events = len(opt.history)
    train(opt, model, batches[20:])
    assert len(opt.history) == n_events
    assert all(torch.equal(signals[n], s) for n, s in signals_of(model).items())
    assert all(torch.equal(masks[n], m) for n, m in masks_of(model).items())
    assert any(not torch.equal(params[n], p) for n, p in params_of(model).items())


@pytest.mark.parametrize("min_channels", [1, 2])
def test_target_below_floor_warns_and_stops_at_the_floor(min_channels, recwarn):
    """A target under the min_channels floor warns at construction; pruning stops at the floor,
    warning "pruning stopped" exactly once."""
    model = make_mlp()
    with pytest.warns(UserWarning, match="min_channels"):
        opt = fp.PruningOptimizer(
            model,
            example(model),
            lr=0.05,
            prune_every=1,
            flops_target=10,
            min_channels=min_channels,
        )
    recwarn.clear()
    train(opt, model, mlp_batches(MLP_CHANNELS + 5))
    stopped = [w for w in recwarn if "pruning stopped" in str(w.message)]
    assert len(stopped) == 1
    assert opt.finished
    assert len(opt.history) == MLP_CHANNELS - 3 * min_channels
    assert all(m.kept == min_channels for m in fp.find_masks(model).values())
    assert opt.cost().total > 10


def test_round_to_floor_warns_naming_round_to_and_stops_at_it():
    """With round_to=4 the masks (8, 6, 4 units) can only go down to 4, 4 and 4: a target
    below that cost warns naming round_to, and pruning stops exactly there."""
    model = make_mlp()
    floor_cost = 2 * (IN * 4 + 4 * 4 + 4 * 4 + 4 * OUT)  # 4 units in each hidden layer
    with pytest.warns(UserWarning, match="round_to=4"):
        opt = fp.PruningOptimizer(
            model, example(model), prune_every=1, flops_target=floor_cost - 1, round_to=4
        )
    with pytest.warns(UserWarning, match="pruning stopped"):
        train(opt, model, mlp_batches(12))
    assert opt.finished
    assert [m.kept for m in fp.find_masks(model).values()] == [4, 4, 4]
    assert opt.cost().total == pytest.approx(floor_cost, abs=COST_ATOL)


@pytest.mark.parametrize("flops_target", [MLP_COST, 1000.0, "100%", "150%"])
def test_target_at_or_above_start_cost_warns_and_prunes_nothing(flops_target):
    """A target the model already meets warns at construction and nothing is ever pruned."""
    model = make_mlp()
    with pytest.warns(UserWarning, match="starting cost"):
        opt = fp.PruningOptimizer(
            model, example(model), lr=0.05, prune_every=1, flops_target=flops_target
        )
    train(opt, model, mlp_batches(6))
    assert opt.history == []
    assert all(bool((m == 1).all()) for m in masks_of(model).values())


# -------------------------------------------------------- wrapped optimizers
def test_given_adam_is_used_instead_of_sgd():
    """optimizer=Adam moves parameters exactly as plain Adam would (no pruning in burn-in)."""
    model, plain = make_mlp(), make_mlp()
    batches = mlp_batches(6)
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    opt = fp.PruningOptimizer(
        model, example(model), lr=123.0, momentum=0.0, optimizer=adam, burn_in=10_000
    )
    assert opt.optimizer is adam
    train(opt, model, batches)

    ref = torch.optim.Adam(plain.parameters(), lr=0.01)
    for x, y in batches:
        ref.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        ref.step()
    assert all(bool((m == 1).all()) for m in masks_of(model).values())
    assert_params_close(params_of(model), params_of(plain))

    sgd_model = make_mlp()  # discrimination: SGD at the same lr lands elsewhere
    sgd = fp.PruningOptimizer(sgd_model, example(sgd_model), lr=0.01, burn_in=10_000)
    train(sgd, sgd_model, batches)
    assert not torch.allclose(params_of(sgd_model)["0.weight"], params_of(model)["0.weight"])


@pytest.mark.parametrize("nesterov", [False, True])
def test_default_sgd_matches_torch_sgd(nesterov):
    """The default optimizer is torch SGD with the given lr, momentum and nesterov setting."""
    model, plain = make_mlp(), make_mlp()
    batches = mlp_batches(6)
    opt = fp.PruningOptimizer(
        model, example(model), lr=0.05, momentum=0.9, nesterov=nesterov, burn_in=10_000
    )
    assert opt.optimizer.defaults["nesterov"] is nesterov
    train(opt, model, batches)
    ref = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9, nesterov=nesterov)
    for x, y in batches:
        ref.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        ref.step()
    assert_params_close(params_of(model), params_of(plain))


def test_nesterov_differs_from_plain_momentum():
    """nesterov=True changes the trajectory (the option is not ignored)."""
    runs = []
    for nesterov in (False, True):
        model = make_mlp()
        opt = fp.PruningOptimizer(
            model, example(model), lr=0.05, momentum=0.9, nesterov=nesterov, burn_in=10_000
        )
        train(opt, model, mlp_batches(4))
        runs.append(params_of(model)["0.weight"])
    assert not torch.allclose(runs[0], runs[1])


def test_nesterov_without_momentum_raises():
    """nesterov=True with momentum 0 is rejected with a message naming nesterov."""
    model = make_mlp()
    with pytest.raises(ValueError, match="nesterov"):
        fp.PruningOptimizer(model, example(model), momentum=0.0, nesterov=True)


# ------------------------------------------------------------------ resume
@pytest.mark.parametrize(
    ("split", "extra"),
    [(5, {}), (6, {}), (5, {"score_convention": "memory", "round_to": 2})],
)
def test_resume_from_checkpoint_matches_an_uninterrupted_run(split, extra, tmp_path):
    """Saving after K steps, reloading into a fresh model and optimizer and running N - K more
    gives the same masks, signals, counter, history and parameters as N steps in one go (also
    with another score convention and channel rounding)."""
    total = 14
    batches = mlp_batches(total)
    kwargs = dict(lr=0.05, momentum=0.9, prune_every=2, burn_in=1, decay=0.8, **extra)

    whole = make_mlp()
    opt_whole = fp.PruningOptimizer(whole, example(whole), **kwargs)
    train(opt_whole, whole, batches)

    first = make_mlp()
    opt_first = fp.PruningOptimizer(first, example(first), **kwargs)
    train(opt_first, first, batches[:split])
    path = tmp_path / "ckpt.pt"
    torch.save({"opt": opt_first.state_dict(), "model": first.state_dict()}, path)

    resumed = make_mlp(seed=99)  # different initial weights: the checkpoint must restore them
    opt_resumed = fp.PruningOptimizer(resumed, example(resumed), **kwargs)
    ckpt = torch.load(path)
    resumed.load_state_dict(ckpt["model"])
    opt_resumed.load_state_dict(ckpt["opt"])
    train(opt_resumed, resumed, batches[split:])

    assert opt_resumed.counter == opt_whole.counter == total + 1
    assert [e.as_dict() for e in opt_resumed.history] == [e.as_dict() for e in opt_whole.history]
    assert len(opt_whole.history) > len(opt_first.history) > 0
    for n, m in masks_of(whole).items():
        assert torch.equal(masks_of(resumed)[n], m), n
    for n, s in signals_of(whole).items():
        torch.testing.assert_close(signals_of(resumed)[n], s, rtol=PARAM_RTOL, atol=SIGNAL_ATOL)
    assert_params_close(params_of(resumed), params_of(whole))


# -------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prune_every": 0}, "prune_every"),
        ({"prune_every": -3}, "prune_every"),
        ({"prune_every": 2.5}, "prune_every"),
        ({"burn_in": -1}, "burn_in"),
        ({"decay": 1.0}, "decay"),
        ({"decay": -0.1}, "decay"),
        ({"decay": 1.5}, "decay"),
        ({"decay": math.nan}, "decay"),
        ({"flops_weight": "fisher"}, "flops_weight"),
        ({"flops_weight": -1.0}, "flops_weight"),
        ({"convention": "gflops"}, "convention"),
        ({"score_convention": "seconds"}, "score_convention"),
        ({"min_channels": -1}, "min_channels"),
        ({"round_to": 0}, "round_to"),
        ({"round_to": 1.5}, "round_to"),
        ({"loss_reduction": "median"}, "loss_reduction"),
        ({"flops_target": "lots"}, "flops_target"),
    ],
)
def test_bad_settings_raise_naming_the_problem(kwargs, match):
    """Each bad setting raises ValueError whose message names the setting."""
    model = make_mlp()
    with pytest.raises(ValueError, match=match):
        fp.PruningOptimizer(model, example(model), **kwargs)


@pytest.mark.parametrize(
    ("saved", "now", "named"),
    [
        ({}, {"score_convention": "memory"}, "score_convention"),
        ({"round_to": 2}, {}, "round_to"),
        ({"convention": "macs"}, {"convention": "params"}, "convention"),
    ],
)
def test_resume_with_other_selection_settings_raises_naming_them(saved, now, named):
    """Loading a state saved with other cost conventions or round_to raises ValueError naming
    the setting, and leaves the masks and counter as they were."""
    model = make_mlp()
    opt = fp.PruningOptimizer(model, example(model), prune_every=2, **saved)
    train(opt, model, mlp_batches(5))
    state = opt.state_dict()
    other = make_mlp()
    opt2 = fp.PruningOptimizer(other, example(other), prune_every=2, **now)
    before = masks_of(other)
    with pytest.raises(ValueError, match=named):
        opt2.load_state_dict(state)
    assert opt2.counter == 1
    assert all(torch.equal(before[n], m) for n, m in masks_of(other).items())


def test_state_saved_without_settings_still_loads():
    """A state from before the settings were recorded (no "settings" key) loads as it is."""
    model = make_mlp()
    opt = fp.PruningOptimizer(model, example(model), prune_every=2)
    train(opt, model, mlp_batches(5))
    state = opt.state_dict()
    del state["settings"]
    other = make_mlp()
    opt2 = fp.PruningOptimizer(other, example(other), prune_every=2)
    opt2.load_state_dict(state)
    assert opt2.counter == opt.counter and len(opt2.history) == len(opt.history) > 0


def test_round_to_keeps_every_mask_at_a_multiple_and_reaches_the_target():
    """With round_to=2 every prune removes 2 channels of one mask, every kept count is even,
    and pruning stops once the cost reaches the target, the cost falling by each block's
    exact marginal FLOPs."""
    model = make_mlp()
    opt = fp.PruningOptimizer(model, example(model), prune_every=1, round_to=2, flops_target=0.5)
    run_until_finished(opt, model, mlp_batches(40))
    assert opt.history and all(len(e.channels) == 2 for e in opt.history)
    assert all(int(m.sum()) % 2 == 0 for m in masks_of(model).values())
    assert opt.cost().total <= 0.5 * MLP_COST < opt.history[-1].cost_before
    assert opt.history[-1].cost_after == pytest.approx(opt.cost().total, abs=COST_ATOL)


def test_model_without_masks_raises():
    """A model with no MaskLayer raises ValueError saying so."""
    model = nn.Sequential(nn.Linear(IN, H1), nn.Tanh(), nn.Linear(H1, OUT))
    with pytest.raises(ValueError, match="no MaskLayer"):
        fp.PruningOptimizer(model, torch.zeros(2, IN))


class AuxBranch(nn.Module):
    """The loss uses only the main branch; ``m_aux`` is applied but never reaches the output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.m_main, self.l2 = nn.Linear(IN, H1), fp.MaskLayer(H1), nn.Linear(H1, OUT)
        self.la, self.m_aux = nn.Linear(IN, H3), fp.MaskLayer(H3)
        self.aux: torch.Tensor | None = None

    def forward(self, x):
        h = self.m_main(torch.tanh(self.l1(x)))
        self.aux = self.m_aux(torch.tanh(self.la(x)))
        return self.l2(h)


def test_a_mask_no_loss_reaches_is_kept_whole_with_a_warning_naming_it():
    """A mask that gets no gradient while others do (a branch whose output the loss does not
    use) is named in a warning on the first step and never pruned: its signal is 0 for want
    of a gradient, not because its channels do not matter (it raised and stopped the run)."""
    model = AuxBranch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cost model may also remark on the unused branch
        opt = fp.PruningOptimizer(model, torch.zeros(2, IN), prune_every=1, flops_target=0.01)
    batches = mlp_batches(30)
    x, y = batches[0]
    with pytest.warns(RuntimeWarning, match=r"m_aux.* stay whole") as caught:
        opt.minimize(F.cross_entropy(model(x), y))
    assert all("m_main" not in str(w.message) for w in caught)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*received no gradient")  # told once
        warnings.filterwarnings("ignore", "pruning stopped")  # (m_main reaches its floor)
        train(opt, model, batches[1:])
    assert bool((model.m_aux.mask == 1).all())
    assert int(model.m_main.mask.sum()) < H1
    assert {n for e in opt.history for n in e.removed} == {"m_main"}


def test_the_masks_no_loss_reached_are_kept_whole_after_a_resume():
    """The masks no gradient has reached are part of the optimizer's state: a resumed run keeps
    them whole too."""
    model = AuxBranch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fp.PruningOptimizer(model, torch.zeros(2, IN), prune_every=1, burn_in=5)
        train(opt, model, mlp_batches(2))
        state = copy.deepcopy(opt.state_dict())
        resumed = fp.PruningOptimizer(model, torch.zeros(2, IN), prune_every=1, burn_in=5)
    resumed.load_state_dict(state)
    assert state["unreached"] == ["m_aux"]
    model.aux = None  # (a resumed loop whose aux branch now runs, but its output is unused)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(resumed, model, mlp_batches(10, seed=3))
    assert bool((model.m_aux.mask == 1).all()) and resumed.history


def test_a_first_step_that_reaches_no_mask_raises_naming_them():
    """A loss that reaches no mask at all (computed from something other than the model's
    outputs) makes the first step raise ValueError naming the masks: nothing could be pruned
    on such signals."""
    model = AuxBranch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fp.PruningOptimizer(model, torch.zeros(2, IN), prune_every=1)
    ((x, _),) = mlp_batches(1)
    model(x)
    with pytest.raises(ValueError, match=r"m_main.*m_aux|m_aux.*m_main"):
        opt.minimize(model.l2.weight.pow(2).sum())


class SkipNonFiniteSGD(torch.optim.SGD):
    """SGD that skips a step whose gradients are not finite (as AMP's GradScaler does)."""

    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if all(bool(torch.isfinite(g).all()) for g in grads):
            return super().step(closure)
        return None


def test_nan_gradients_warn_and_leave_signals_unchanged():
    """A batch with NaN gradients warns, leaves every signal as it was, and training goes on."""
    model = make_mlp()
    inner = SkipNonFiniteSGD(model.parameters(), lr=0.05)
    opt = fp.PruningOptimizer(model, example(model), optimizer=inner, burn_in=10_000)
    batches = mlp_batches(3)
    train(opt, model, batches[:1])
    signals = signals_of(model)
    x, y = batches[1]
    with pytest.warns(RuntimeWarning, match="not finite"):
        opt.minimize(F.cross_entropy(model(x), y) * math.nan)
    assert all(torch.equal(signals[n], s) for n, s in signals_of(model).items())
    assert opt.counter == 3
    params = params_of(model)
    train(opt, model, batches[2:])
    assert opt.counter == 4
    assert all(not torch.equal(signals[n], s) for n, s in signals_of(model).items())
    assert all(bool(torch.isfinite(s).all()) for s in signals_of(model).values())
    assert any(not torch.equal(params[n], p) for n, p in params_of(model).items())


# ----------------------------------------------------------------- logging
def test_prune_events_are_logged(caplog):
    """Every prune is logged at INFO on the "fisherprune" logger with its step, mask and channel."""
    caplog.set_level(logging.INFO, logger="fisherprune")
    model = make_mlp()
    opt = fp.PruningOptimizer(model, example(model), lr=0.05, prune_every=2)
    train(opt, model, mlp_batches(6))
    records = [r for r in caplog.records if r.name == "fisherprune" and "pruned" in r.getMessage()]
    assert len(records) == len(opt.history) == 3
    for rec, event in zip(records, opt.history, strict=True):
        assert rec.levelno == logging.INFO
        assert f"step {event.step}" in rec.getMessage()
        assert f"{event.mask}[{event.channel}]" in rec.getMessage()


def test_state_dict_round_trip_keeps_history_as_events():
    """load_state_dict restores the history as PruneEvent objects equal to the saved ones."""
    model = make_mlp()
    opt = fp.PruningOptimizer(model, example(model), lr=0.05, prune_every=1)
    train(opt, model, mlp_batches(3))
    state = copy.deepcopy(opt.state_dict())
    fresh = make_mlp()
    opt2 = fp.PruningOptimizer(fresh, example(fresh), lr=0.05, prune_every=1)
    opt2.load_state_dict(state)
    assert all(isinstance(e, fp.PruneEvent) for e in opt2.history)
    assert opt2.history == opt.history
    assert masks_of(fresh).keys() == masks_of(model).keys()
    assert all(torch.equal(masks_of(fresh)[n], m) for n, m in masks_of(model).items())


def test_a_prune_decision_copies_only_what_changed_to_the_host() -> None:
    """Each copy to the host waits for a GPU: a prune decision copies the signals in one copy,
    and only the masks that the last prune changed (every mask was read before, and is kept
    on the host until it is written)."""
    model = build_resnet_basic()
    x, y = image_input(8), torch.arange(8) % 5
    fp.apply_masks(model, x[:1])
    popt = fp.PruningOptimizer(model, x[:1], lr=0.01, momentum=0.9, prune_every=2, decay=0.5)
    copies = []
    with spied_tensor_reads() as reads:
        for _ in range(6):
            with reads.watching():
                popt.minimize(F.cross_entropy(model(x), y))
            if reads.prune_time:
                masks = [r for r in reads.prune_time if r.startswith("cpu at masks/layer.py")]
                signals = [r for r in reads.prune_time if r.startswith("cpu at signals/")]
                copies.append((len(masks), len(signals)))
    changed = [1 + len(e.also) for e in popt.history]
    assert len(copies) == len(changed) == 3
    assert copies[0][0] <= len(popt.masks)
    assert copies[1:] == [(n, 1) for n in changed[:-1]] and copies[0][1] == 1
