"""No layer collapse by default (issue 31): on a CNN trained on scikit-learn's digits, one
scoring of every channel at the dense point removes nearly all of the last convolution's
channels; ``prune_to_target``'s defaults (rounds that grow with the share removed, each
round taking at most ``round_cap`` of a mask's kept channels, signals re-estimated between)
do not, ``PruningOptimizer`` used one-shot does not, and the result and ``fisherprune
prune``'s report say what was left of each group."""

from __future__ import annotations

import copy
import inspect
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.calibrate.to_target import ROUND_CAP
from fisherprune.cli.main import build_parser
from fisherprune.modes import eval_mode
from tests.test_cli import run_cli
from tests.test_cli_prune import _data_and_weights

ONE_SCORING = {"criterion": "fisher", "rounds": 1, "round_cap": 1.0}  # before issue 31


def _digits() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    y = torch.tensor(d.target)
    return x[:1200], y[:1200], x[1200:], y[1200:]


@pytest.fixture(scope="module")
def trained() -> nn.Module:
    """Convolutions of 8, 16 and 32 channels with batch norm, a max-pool, a global average
    pool and a linear head, trained for 150 SGD steps (test accuracy ~0.96)."""
    x, y, _, _ = _digits()
    torch.manual_seed(0)

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]

    net = nn.Sequential(
        *block(1, 8), *block(8, 16), nn.MaxPool2d(2), *block(16, 32),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        i = torch.randint(0, len(y), (64,), generator=g)
        opt.zero_grad()
        F.cross_entropy(net(x[i]), y[i]).backward()
        opt.step()
    return net.eval()


def _batches() -> list[tuple[Tensor, Tensor]]:
    x, y, _, _ = _digits()
    return [(x[i : i + 64], y[i : i + 64]) for i in range(0, 256, 64)]


@torch.no_grad()
def _accuracy(net: nn.Module) -> float:
    _, _, x, y = _digits()
    return float((net.eval()(x).argmax(1) == y).double().mean())


def _prune(net: nn.Module, **kw: object) -> tuple[fp.PruneResult, list[str]]:
    x, _, _, _ = _digits()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fp.prune_to_target(net, x[:2], _batches(), "50%", loss_fn=F.cross_entropy, **kw)
    return result, [str(w.message) for w in caught]


def test_one_scoring_collapses_a_layer_and_says_so(trained: nn.Module) -> None:
    """The settings before issue 31 (one round, no cap) leave a layer at one channel: a
    warning names the round that took most of it, another the mask left at its floor, and
    the result lists it in ``at_floor`` with ``min_kept_fraction`` 1/32."""
    net = copy.deepcopy(trained)
    result, caught = _prune(net, **ONE_SCORING)
    (collapsed,) = result.at_floor
    assert result.kept[collapsed] == (1, 32) and result.min_kept_fraction == 1 / 32
    assert any("round 1 removed most" in w and collapsed in w for w in caught)
    assert any("left at their floor" in w and collapsed in w for w in caught)
    assert _accuracy(net) < 0.5


def test_the_defaults_do_not_collapse_a_layer(trained: nn.Module) -> None:
    """With every argument at its default the same network keeps at least an eighth of
    every layer, nothing is left at its floor, no warning is given, and the test accuracy
    stays within 0.2 of the dense model's (one scoring: below 0.5)."""
    net = copy.deepcopy(trained)
    result, caught = _prune(net)
    assert result.cost_after <= result.target
    assert result.min_kept_fraction >= 1 / 8 and not result.at_floor and not caught
    assert _accuracy(net) > _accuracy(trained) - 0.2


@pytest.mark.parametrize("kw", [{}, {"rounds": 1}, {"criterion": "l1"}, {"flops_weight": 0}])
def test_no_round_removes_more_than_the_cap(trained: nn.Module, kw: dict) -> None:
    """Replaying the events round by round, no mask loses more than ``round_cap`` of the
    channels it kept when the round started (or one channel, if that is more), whatever the
    rounds, criterion or weighting; a round cut short by the cap is followed by another
    (rounds=1 still meets the target)."""
    net = copy.deepcopy(trained)
    result, _ = _prune(net, reconstruct=False, **kw)
    kept = {n: w for n, (_, w) in result.kept.items()}
    for r in range(1, result.rounds + 1):
        lost = dict.fromkeys(kept, 0)
        for e in (e for e in result.events if e.step == r):
            lost[e.mask] += len(e.channels)
        assert all(lost[n] <= max(ROUND_CAP * kept[n], 1) for n in kept), (r, lost, kept)
        kept = {n: kept[n] - lost[n] for n in kept}
    assert kept == {n: k for n, (k, _) in result.kept.items()}
    assert result.cost_after <= result.target


def test_rescore_at_cap_ends_the_round_at_the_first_mask_capped(trained: nn.Module) -> None:
    """With ``rescore_at_cap=True``, replaying the events round by round: at most one mask
    reaches its cap (``ceil((1 - round_cap) * kept)`` channels left) in a round, and when
    one does, the round's last removal is from it; so the signals are re-estimated right
    after, and more rounds run than without (the target is still met)."""
    net = copy.deepcopy(trained)
    result, _ = _prune(net, reconstruct=False, rescore_at_cap=True)
    plain, _ = _prune(copy.deepcopy(trained), reconstruct=False)
    kept = {n: w for n, (_, w) in result.kept.items()}
    capped_rounds = 0
    for r in range(1, result.rounds + 1):
        events = [e for e in result.events if e.step == r]
        least = {n: min(math.ceil(k * (1 - ROUND_CAP) - 1e-9), k - 1) for n, k in kept.items()}
        for e in events:
            kept[e.mask] -= len(e.channels)
        capped = [n for n in kept if kept[n] == least[n]]
        assert len(capped) <= 1, (r, capped)
        if capped:
            capped_rounds += 1
            assert events[-1].mask == capped[0], (r, capped, events[-1].mask)
    assert capped_rounds > 0 and result.rounds > plain.rounds
    assert result.cost_after <= result.target


@pytest.mark.parametrize("kw", [ONE_SCORING, {"rescore_at_cap": True}, {}])
def test_floor_power_keeps_its_share_of_every_mask(trained: nn.Module, kw: dict) -> None:
    """With ``floor_power=1`` every mask keeps at least ``ceil(width * target / start)`` of
    its channels, whatever the rounds or re-scoring, and the target is still met: one scoring
    no longer leaves a layer at one channel (without the floor it does)."""
    net = copy.deepcopy(trained)
    result, _ = _prune(net, reconstruct=False, floor_power=1.0, **kw)
    share = result.target / result.cost_before
    assert all(k >= math.ceil(w * share - 1e-9) for k, w in result.kept.values()), result.kept
    assert result.cost_after <= result.target and not result.at_floor


def test_a_floor_power_that_cannot_meet_the_target_is_refused_up_front(trained: nn.Module) -> None:
    """A floor that keeps nearly every channel (``floor_power=0.05`` at 50%: 97% of each
    mask, so the convolutions keep 8, 16 and 31 channels) cannot meet the target: refused
    before anything changes, naming ``floor_power`` and that floor's share of the FLOPs,
    counted by ``FlopCounterMode`` on the network built at those widths (before: pruned to
    that floor, with a warning)."""
    from torch.utils.flop_counter import FlopCounterMode

    def flops(width: int) -> int:
        net = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1), nn.MaxPool2d(2),
            nn.Conv2d(16, width, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(width, 10),
        )  # fmt: skip
        with FlopCounterMode(display=False) as counter:
            net(torch.zeros(1, 1, 8, 8))
        return counter.get_total_flops()

    net = copy.deepcopy(trained)
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(ValueError, match="out of reach") as caught:
        _prune(net, reconstruct=False, floor_power=0.05)
    text = str(caught.value)
    assert "floor_power=0.05" in text and "raise floor_power" in text, text
    assert f"its floor is {flops(31) / flops(32):.1%}" in text, (flops(31) / flops(32), text)
    assert not fp.find_masks(net)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"round_cap": 0.0}, "round_cap"), ({"round_cap": 1.5}, "round_cap"),
     ({"rounds": "many"}, "rounds"), ({"rounds": 0}, "rounds"),
     ({"rescore_at_cap": "yes"}, "rescore_at_cap"), ({"floor_power": 0}, "floor_power"),
     ({"floor_power": True}, "floor_power"), ({"floor_power": "1"}, "floor_power")],
)  # fmt: skip
def test_bad_round_settings_are_refused_before_anything_changes(
    trained: nn.Module, kw: dict, match: str
) -> None:
    net = copy.deepcopy(trained)
    with pytest.raises(ValueError, match=match):
        _prune(net, **kw)
    assert not fp.find_masks(net)


def test_kept_matches_the_masks(trained: nn.Module) -> None:
    """``PruneResult.kept`` is each mask's (kept, width) and ``min_kept_fraction`` their
    smallest ratio."""
    net = copy.deepcopy(trained)
    result, _ = _prune(net, reconstruct=False)
    masks = fp.find_masks(net)
    assert result.kept == {n: (m.kept, m.num_channels) for n, m in masks.items()}
    assert result.min_kept_fraction == min(m.kept / m.num_channels for m in masks.values())


def test_pruning_optimizer_one_shot_does_not_collapse_a_layer(trained: nn.Module) -> None:
    """``PruningOptimizer`` used one-shot (lr=0, one prune per calibration batch, the signals
    re-estimated between prunes) keeps at least an eighth of every layer of the network
    that one scoring collapses: it removes one channel per scoring."""
    net = copy.deepcopy(trained)
    x, _, _, _ = _digits()
    fp.apply_masks(net, x[:2])
    opt = fp.PruningOptimizer(net, x[:2], lr=0.0, momentum=0.0, prune_every=1,
                              flops_target="50%")  # fmt: skip
    batches = _batches()
    with eval_mode(net):
        for step in range(500):
            if opt.finished:
                break
            xb, yb = batches[step % len(batches)]
            opt.minimize(F.cross_entropy(net(xb), yb))
    assert opt.finished and opt.cost().total <= opt.target
    assert min(m.kept / m.num_channels for m in fp.find_masks(net).values()) >= 1 / 8


def test_cli_shares_the_library_defaults() -> None:
    """``fisherprune prune``'s --rounds and --round_cap default to ``prune_to_target``'s."""
    args = build_parser().parse_args(["prune", "mlp", "--out", "o"])
    params = inspect.signature(fp.prune_to_target).parameters
    assert (args.rounds, args.round_cap) == (
        params["rounds"].default,
        params["round_cap"].default,
    )


def test_cli_report_says_what_was_left_of_each_group(tmp_path: Path) -> None:
    """report.json gives each group's kept channels and width, the smallest kept share and
    the groups at their floor; the printed output names every group."""
    data, weights, _, _ = _data_and_weights(tmp_path)
    out = tmp_path / "out"
    cli = run_cli(
        "prune", "mlp", "--width", "32", "--depth", "2", "--weights", weights, "--data", data,
        "--target", "50%", "--out", out,
    )  # fmt: skip
    assert cli.code == 0, cli.err
    report = json.loads((out / "report.json").read_text())
    kept = report["channels_kept"]
    assert kept and all(0 < g["kept"] <= g["of"] for g in kept.values())
    shares = [g["kept"] / g["of"] for g in kept.values()]
    assert report["min_kept_fraction"] == pytest.approx(min(shares))
    assert report["groups_at_floor"] == [] and report["rounds"] >= 2
    assert all(name in cli.out for name in kept)
