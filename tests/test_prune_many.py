"""prune_many: the same channels, in the same order, with the same events as ``prune`` called
once per channel; and prune_to_target's chunked selection against a selection that takes an
exact cost report after every single channel."""

from __future__ import annotations

import copy
import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor

import fisherprune as fp
from fisherprune.cost import CostModel
from fisherprune.criteria import L1
from fisherprune.masks import MaskLayer
from fisherprune.pruner import prune, score_all
from fisherprune.pruner.prune import prune_many
from tests import zoo

WIDTHS = {"a": 12, "b": 12, "c": 7, "d": 20, "e": 12}


def _masks(seed: int) -> tuple[dict[str, MaskLayer], dict[str, Tensor], SimpleNamespace]:
    """Masks with random signals, random scores (ties included) and a cost report whose
    marginal costs differ per channel."""
    g = torch.Generator().manual_seed(seed)
    masks = {n: MaskLayer(w) for n, w in WIDTHS.items()}
    for m in masks.values():
        m.signal.copy_(torch.rand(m.num_channels, generator=g))
    masks["d"].mask[[1, 5, 6]] = 0.0  # already pruned: never chosen again
    scores = {n: torch.randint(0, 6, (w,), generator=g).double() / 5 for n, w in WIDTHS.items()}
    marginal = {n: 1 + torch.rand(w, generator=g, dtype=torch.float64) for n, w in WIDTHS.items()}
    report = SimpleNamespace(total=100.0, marginal=marginal)
    return masks, scores, report


def _one_at_a_time(masks, scores, report, until, **kw) -> list[fp.PruneEvent]:
    """``prune`` called until the chained estimated cost is at or below ``until``."""
    events: list[fp.PruneEvent] = []
    cost = report.total
    while cost > until:
        now = SimpleNamespace(total=cost, marginal=report.marginal)
        event = prune(masks, scores, cost=now, **kw)
        if event is None:
            break
        events.append(event)
        cost = event.cost_after
    return events


@pytest.mark.parametrize(
    ("round_to", "min_channels", "uniform", "until"),
    [
        (1, 1, False, 40.0),
        (1, 0.5, False, -1.0),  # unreachable: both stop with every mask at its floor
        (4, 1, False, 50.0),
        (3, 0, False, -1.0),
        (1, 2, [["a", "b", "e"]], 30.0),
        (4, 0.25, [["a", "e"], ["b"]], -1.0),
    ],
)
def test_equals_prune_called_once_per_channel(round_to, min_channels, uniform, until) -> None:
    """Events (channels, scores, signals, estimated costs) and the final masks equal those of
    ``prune`` called in a loop, for every setting prune_to_target passes on."""
    kw = {"min_channels": min_channels, "round_to": round_to, "uniform": uniform, "step": 3}
    for seed in range(4):
        ref_masks, scores, report = _masks(seed)
        masks = copy.deepcopy(ref_masks)
        expected = _one_at_a_time(ref_masks, scores, report, until, **kw)
        got = prune_many(masks, scores, cost=report, until=until, **kw)
        assert len(expected) > 3
        assert got == expected
        for n, m in masks.items():
            assert torch.equal(m.mask, ref_masks[n].mask), n


@pytest.mark.parametrize("uniform", [False, [["a", "b", "e"]]])
def test_equals_prune_called_once_per_channel_with_channels_of_several_rows(uniform) -> None:
    """Masks whose channels span several weight rows (heads: ``channel_width``) take blocks
    of ``round_to / gcd(round_to, width)`` channels in both, with the same events."""
    kw = {"min_channels": 1, "round_to": 8, "uniform": uniform}
    for seed in range(4):
        ref_masks, scores, report = _masks(seed)
        for n, width in {"a": 4, "b": 4, "e": 4, "c": 2, "d": 16}.items():
            ref_masks[n].channel_width = width
        masks = copy.deepcopy(ref_masks)
        expected = _one_at_a_time(ref_masks, scores, report, 30.0, **kw)
        got = prune_many(masks, scores, cost=report, until=30.0, **kw)
        assert {len(e.channels) for e in expected} >= {1, 2}
        assert got == expected
        for n, m in masks.items():
            assert torch.equal(m.mask, ref_masks[n].mask), n


def test_refuses_a_non_finite_score_and_changes_nothing() -> None:
    masks, scores, report = _masks(0)
    scores["c"][2] = float("nan")
    before = {n: m.mask.clone() for n, m in masks.items()}
    with pytest.raises(ValueError, match=r"'c'.*non-finite"):
        prune_many(masks, scores, cost=report, until=0.0)
    assert all(torch.equal(m.mask, before[n]) for n, m in masks.items())


def _select_one_at_a_time(net: torch.nn.Module, example: Tensor, goal: float) -> None:
    """The selection prune_to_target stands for: an exact cost report after every channel,
    the L1 importances read once, ``"auto"`` scores."""
    cost_model = CostModel(net, example)
    masks = fp.find_masks(net)
    importances = L1().scores(masks, net)
    while (report := cost_model.report()).total > goal:
        scores = score_all(importances, dict(report.marginal), "auto")
        assert prune(masks, scores, cost=report) is not None


#: one scoring, no cap (``rounds=1, round_cap=1``): the selection ``_select_one_at_a_time``
#: stands for
ONE_SCORING = {"criterion": L1(), "reconstruct": False, "rounds": 1, "round_cap": 1.0}


def _bigger_resnet() -> torch.nn.Module:
    widths = {k: 6 * v for k, v in zoo.DEFAULT_WIDTHS["resnet_basic"].items()}
    return zoo.build_resnet_basic(widths, seed=0)


def _kept(net) -> dict[str, Tensor]:
    return {n: m.mask.clone() for n, m in fp.find_masks(net).items()}


@pytest.mark.parametrize("target", [0.7, 0.3])
def test_a_report_per_channel_is_the_one_at_a_time_selection(monkeypatch, target) -> None:
    """With chunks of one channel (a tiny STEP_FRACTION) prune_to_target keeps exactly the
    channels of the one-at-a-time selection."""
    monkeypatch.setattr("fisherprune.calibrate.to_target.STEP_FRACTION", 1e-12)
    x = zoo.image_input(1)
    net = _bigger_resnet()
    fp.apply_masks(net, x)
    ref = copy.deepcopy(net)
    result = fp.prune_to_target(net, x, [(x, None)], target, **ONE_SCORING)
    _select_one_at_a_time(ref, x, result.target)
    assert len(result.events) > 20
    kept, expected = _kept(net), _kept(ref)
    assert all(torch.equal(kept[n], expected[n]) for n in kept)


@pytest.mark.parametrize("target", [0.7, 0.5, 0.3])
def test_chunked_selection_is_within_one_chunk_of_one_at_a_time(monkeypatch, target) -> None:
    """With the default chunks (an exact cost report per quarter of the remaining gap) the
    channels kept differ from the one-at-a-time selection's in fewer channels than the
    largest chunk holds (a chunk prices channels at the marginal costs of its start); the
    exact cost meets the target, and did not before the last removal."""
    x = zoo.image_input(1)
    net = _bigger_resnet()
    fp.apply_masks(net, x)
    ref = copy.deepcopy(net)
    removed_at_report: list[int] = []
    report = CostModel.report

    def counting_report(self):
        removed_at_report.append(sum(m.num_channels - m.kept for m in self.masks.values()))
        return report(self)

    monkeypatch.setattr(CostModel, "report", counting_report)
    result = fp.prune_to_target(net, x, [(x, None)], target, **ONE_SCORING)
    monkeypatch.setattr(CostModel, "report", report)
    _select_one_at_a_time(ref, x, result.target)
    chunks = [b - a for a, b in itertools.pairwise(removed_at_report)]
    kept, expected = _kept(net), _kept(ref)
    swapped = sum(int((kept[n] > expected[n]).sum()) for n in kept)
    assert len(chunks) >= 3 and swapped < max(chunks), (swapped, chunks)
    exact = fp.computational_cost(net, x).total
    assert exact == pytest.approx(result.cost_after) and exact <= result.target
    last = result.events[-1]
    with torch.no_grad():
        for n, channels in last.removed.items():
            fp.find_masks(net)[n].mask[list(channels)] = 1.0
    assert fp.computational_cost(net, x).total > result.target


def test_keep_is_a_floor_for_this_call_only() -> None:
    """``keep`` stops the masks it names at that count (``prune_to_target``'s round cap); the
    others go down to their floor; at a count of ``keep`` or less a mask is left as it is."""
    masks, scores, report = _masks(0)
    prune_many(masks, scores, cost=report, until=-1.0, keep={"a": 9, "d": 15, "c": 8})
    kept = {n: m.kept for n, m in masks.items()}
    assert kept == {"a": 9, "b": 1, "c": 7, "d": 15, "e": 1}


def _big_and_small(block_loss: float) -> tuple[dict[str, MaskLayer], dict[str, Any], Any]:
    """A one-channel mask costing 30 whose removal loses ``block_loss`` (a decoder block) and
    20 channels costing 1 that lose 1 each; scores are loss over cost (the block's lowest),
    the cost is 100. Returns the masks, ``prune_many``'s keyword arguments, and the report."""
    masks = {"block": MaskLayer(1), "w": MaskLayer(20)}
    importance = {"block": torch.tensor([block_loss]), "w": torch.ones(20, dtype=torch.float64)}
    marginal = {"block": torch.full((1,), 30.0), "w": torch.ones(20, dtype=torch.float64)}
    scores = {n: importance[n] / marginal[n] for n in masks}
    report = SimpleNamespace(total=100.0, marginal=marginal)
    return masks, {"scores": scores, "importance": importance}, report


def test_a_removal_that_would_overshoot_the_goal_gives_way_to_channels_that_lose_less() -> None:
    """Ten of cost are left to go: the block (lowest score, 30 of cost, loses 20) would land
    the cost at 70; the ten next channels reach the goal losing 10, so they go instead, and
    the block stays."""
    masks, kw, report = _big_and_small(20.0)
    greedy = prune_many(copy.deepcopy(masks), kw["scores"], 0, cost=report, until=90.0)
    assert [e.mask for e in greedy] == ["block"]  # without a goal: the lowest score first
    events = prune_many(masks, **kw, min_channels=0, cost=report, until=90.0, goal=90.0)
    assert events[-1].cost_after == 90.0
    assert masks["block"].mask.tolist() == [1.0]
    assert masks["w"].mask.tolist() == [0.0] * 10 + [1.0] * 10


@pytest.mark.parametrize(
    ("block_loss", "floors"),
    [(20.0, {"w": 15}), (5.0, {})],
    ids=["the channels cannot reach the goal", "the channels would lose more"],
)
def test_an_overshooting_removal_goes_when_smaller_ones_cannot_do_better(block_loss, floors):
    """The block goes as without a goal, and nothing else, when the small channels can give
    only 5 of the 10 needed (a floor keeps 15 of 20), or would lose 10 against its 5."""
    masks, kw, report = _big_and_small(block_loss)
    events = prune_many(
        masks, **kw, min_channels=0, cost=report, until=90.0, goal=90.0, floors=floors
    )
    assert [e.mask for e in events] == ["block"]
    assert events[-1].cost_after == 70.0


def test_a_goal_without_importance_is_refused() -> None:
    masks, kw, report = _big_and_small(1.0)
    with pytest.raises(ValueError, match="importance"):
        prune_many(masks, kw["scores"], cost=report, until=90.0, goal=90.0)


@pytest.mark.parametrize(
    ("importance", "match"),
    [
        ({"block": torch.tensor([20.0])}, "no importance given for mask 'w'"),
        (
            {"block": torch.tensor([20.0]), "w": torch.ones(19)},
            "importance for mask 'w': 19 entries",
        ),
        (
            {"block": torch.tensor([20.0]), "w": torch.tensor([1.0] * 19 + [float("nan")])},
            r"mask 'w'.*non-finite importance",
        ),
    ],
    ids=["missing", "wrong size", "nan"],
)
def test_a_goal_checks_the_importance_like_the_scores(importance, match) -> None:
    """An importance missing for a mask, of the wrong size or not finite for a kept channel is
    refused by name before anything is pruned (it is read only when a removal would overshoot
    the goal, so unchecked it would fail late, with a KeyError, or be ignored)."""
    masks, kw, report = _big_and_small(20.0)
    with pytest.raises(ValueError, match=match):
        prune_many(
            masks, kw["scores"], 0, cost=report, until=90.0, goal=90.0, importance=importance
        )
    assert all(float(m.mask.min()) == 1.0 for m in masks.values())


def test_a_goal_reads_a_float32_importance_as_the_float64_one() -> None:
    """The end-game decides the same with the importances in float32 as in float64."""
    masks, kw, report = _big_and_small(20.0)
    single = {n: v.float() for n, v in kw["importance"].items()}
    events = prune_many(
        masks, kw["scores"], 0, cost=report, until=90.0, goal=90.0, importance=single
    )
    assert [e.mask for e in events] == ["w"] * 10


def test_an_until_below_the_goal_is_refused() -> None:
    """``until`` below ``goal`` is refused: a removal passed over for channels that reach the
    goal would never come back, so the call could stop above ``until`` with that mask above
    its floor (here the 20 channels go, the block stays, and the cost ends at 80 > 75)."""
    masks, kw, report = _big_and_small(20.0)
    with pytest.raises(ValueError, match=r"until \(75.0\) below goal \(90.0\)"):
        prune_many(masks, **kw, min_channels=0, cost=report, until=75.0, goal=90.0)
    assert all(float(m.mask.min()) == 1.0 for m in masks.values())
