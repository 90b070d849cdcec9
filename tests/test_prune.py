"""Tests of the one-channel prune step (``fisherprune.prune``) and of channel scores.

Each test states one invariant in its docstring. Everything is deterministic
(fixed seeds, hand-written scores) and runs in well under a second.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fisherprune as fp
from fisherprune.pruner import check_flops_weight, score

# tolerances
SCORE_RTOL = 1e-12  # score() works in float64
SCORE_ATOL = 0.0
COST_ATOL = 1e-9  # costs are sums of integer FLOP counts in float64
EPS = 1e-6  # the documented epsilon of the "auto" score


# ---------------------------------------------------------------- helpers
def make_masks(*sizes: int, names: str | None = None) -> dict[str, fp.MaskLayer]:
    """Fresh masks (all ones) named by the letters of ``names`` (default a, b, c...)."""
    names = names or "abcdefgh"[: len(sizes)]
    return {n: fp.MaskLayer(k) for n, k in zip(names, sizes, strict=True)}


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def snapshot(masks: dict[str, fp.MaskLayer]) -> dict[str, torch.Tensor]:
    return {n: m.mask.detach().clone() for n, m in masks.items()}


def zeroed(before: dict[str, torch.Tensor], masks: dict[str, fp.MaskLayer]) -> list[tuple]:
    """The (mask, channel) entries that went from 1 to 0 since ``before``."""
    out = []
    for n, m in masks.items():
        for k in torch.nonzero(before[n] != m.mask).flatten().tolist():
            assert before[n][k] == 1 and m.mask[k] == 0, "a mask entry changed other than 1 -> 0"
            out.append((n, k))
    return out


def mlp_with_masks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(10, 8),
        nn.Tanh(),
        fp.MaskLayer(8),
        nn.Linear(8, 6),
        nn.Tanh(),
        fp.MaskLayer(6),
        nn.Linear(6, 2),
    )


# ------------------------------------------------------------ the choice
def test_zeroes_exactly_the_global_minimum():
    """One call zeroes exactly one entry: the lowest score over all masks."""
    masks = make_masks(4, 3, 5)
    scores = {
        "a": t(4.0, 3.0, 9.0, 7.0),
        "b": t(8.0, 2.5, 6.0),
        "c": t(5.0, 2.0, 3.0, 4.0, 2.1),  # global min: c[1]
    }
    before = snapshot(masks)
    event = fp.prune(masks, scores)
    assert zeroed(before, masks) == [("c", 1)]
    assert (event.mask, event.channel) == ("c", 1)


def test_already_pruned_channels_are_excluded():
    """A pruned channel is never chosen again, even when its score is the lowest."""
    masks = make_masks(3, 3)
    masks["a"].mask[0] = 0.0
    masks["b"].mask[2] = 0.0
    scores = {"a": t(-100.0, 5.0, 6.0), "b": t(7.0, 4.0, -math.inf)}
    before = snapshot(masks)
    event = fp.prune(masks, scores)
    assert zeroed(before, masks) == [("b", 1)]
    assert (event.mask, event.channel, event.score) == ("b", 1, 4.0)


def test_tie_break_lowest_score_beats_mask_order():
    """Tie-break level 1: a lower score wins even when it is in a later mask."""
    masks = make_masks(2, 2)
    scores = {"a": t(1.0, 1.0), "b": t(1.0, 1.0 - 1e-12)}
    event = fp.prune(masks, scores)
    assert (event.mask, event.channel) == ("b", 1)


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_tie_break_equal_scores_earlier_mask_in_given_order(order):
    """Tie-break level 2: equal scores in two masks -> the mask given first is pruned."""
    base = make_masks(3, 3)
    masks = {n: base[n] for n in order}
    scores = {"a": t(5.0, 2.0, 5.0), "b": t(5.0, 5.0, 2.0)}
    event = fp.prune(masks, scores)
    expected = {"a": ("a", 1), "b": ("b", 2)}[order[0]]
    assert (event.mask, event.channel) == expected
    assert int(masks[order[1]].mask.sum()) == 3


def test_tie_break_equal_scores_in_a_sequence_of_masks():
    """Tie-break level 2 with masks given as a list: the earlier list entry ("0") wins."""
    masks = [fp.MaskLayer(2), fp.MaskLayer(2)]
    event = fp.prune(masks, [t(3.0, 1.0), t(1.0, 3.0)])
    assert (event.mask, event.channel) == ("0", 1)
    assert masks[0].mask.tolist() == [1.0, 0.0]
    assert masks[1].mask.tolist() == [1.0, 1.0]


def test_tie_break_equal_scores_lower_channel_index():
    """Tie-break level 3: equal scores in one mask -> the lower channel index, then the next."""
    masks = make_masks(5)
    scores = {"a": t(3.0, 1.0, 9.0, 1.0, 1.0)}
    chosen = [fp.prune(masks, scores).channel for _ in range(3)]
    assert chosen == [1, 3, 4]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["all", "one"])
def test_non_finite_scores_are_refused_and_nothing_is_pruned(bad, where):
    """A NaN or infinite score of a kept channel (one of them, or every one as in a NaN
    model) raises ValueError naming the mask, and no mask entry changes."""
    masks = make_masks(2, 3)
    scores = {"a": t(1.0, 2.0), "b": t(bad, bad, bad) if where == "all" else t(3.0, bad, 0.5)}
    before = snapshot(masks)
    with pytest.raises(ValueError, match=r"mask 'b'.*non-finite score.*nothing was pruned"):
        fp.prune(masks, scores, min_channels=0)
    assert zeroed(before, masks) == []


def test_non_finite_score_of_a_pruned_channel_is_ignored():
    """The check covers kept channels only: a NaN where a channel is already pruned is fine."""
    masks = make_masks(2, 2)
    masks["b"].mask[0] = 0.0
    event = fp.prune(masks, {"a": t(4.0, 5.0), "b": t(math.nan, 1.0)}, min_channels=0)
    assert (event.mask, event.channel) == ("b", 1)


@pytest.mark.parametrize("min_channels", [0, 1, 2, 3])
def test_never_below_min_channels(min_channels):
    """A mask at min_channels kept channels is skipped even if it holds the lowest score."""
    masks = make_masks(4, 5)
    for k in range(4 - min_channels):  # leave exactly min_channels alive in "a"
        masks["a"].mask[k] = 0.0
    scores = {"a": t(-9.0, -9.0, -9.0, -9.0), "b": t(1.0, 2.0, 0.5, 3.0, 4.0)}
    event = fp.prune(masks, scores, min_channels=min_channels)
    assert (event.mask, event.channel) == ("b", 2)
    assert masks["a"].kept == min_channels


def test_returns_none_and_changes_nothing_at_the_floor():
    """When every mask is at min_channels, prune returns None and leaves all masks as they were."""
    masks = make_masks(3, 2)
    masks["a"].mask[1] = 0.0
    masks["a"].mask[2] = 0.0
    masks["b"].mask[0] = 0.0
    before = snapshot(masks)
    signals_before = {n: m.signal.clone() for n, m in masks.items()}
    assert fp.prune(masks, {"a": t(0.0, 0.0, 0.0), "b": t(0.0, 0.0)}, min_channels=1) is None
    assert all(torch.equal(before[n], m.mask) for n, m in masks.items())
    assert all(torch.equal(signals_before[n], m.signal) for n, m in masks.items())


@pytest.mark.parametrize("min_channels", [0, 1, 2])
@pytest.mark.parametrize("score_kind", ["random", "constant"])
def test_repeated_calls_terminate_without_repruning(min_channels, score_kind):
    """Calling prune repeatedly prunes each channel at most once, stops at the floor, then None."""
    sizes = (4, 3, 5)
    masks = make_masks(*sizes)
    gen = torch.Generator().manual_seed(1234)
    total = sum(sizes)
    events = []
    for _ in range(total):  # more calls than there can ever be prunes
        if score_kind == "random":
            scores = {n: torch.rand(m.num_channels, generator=gen) for n, m in masks.items()}
        else:
            scores = {n: torch.zeros(m.num_channels) for n, m in masks.items()}
        event = fp.prune(masks, scores, min_channels=min_channels)
        if event is None:
            break
        events.append((event.mask, event.channel))
    pairs = set(events)
    assert len(pairs) == len(events), "a channel was pruned twice"
    assert len(events) == total - min_channels * len(sizes)
    assert all(m.kept == min_channels for m in masks.values())
    for _ in range(2):
        assert (
            fp.prune(
                masks,
                {n: torch.zeros(m.num_channels) for n, m in masks.items()},
                min_channels=min_channels,
            )
            is None
        )


# ---------------------------------------------------------------- events
def test_event_fields_without_cost():
    """The event names the mask and channel, its score and signal; costs NaN; step recorded."""
    masks = make_masks(3, 3)
    masks["b"].signal.copy_(torch.tensor([0.25, 0.5, 0.125]))
    event = fp.prune(masks, {"a": t(3.0, 4.0, 5.0), "b": t(6.0, 7.0, 2.0)}, step=17)
    assert isinstance(event, fp.PruneEvent)
    assert event.mask == "b"
    assert event.channel == 2
    assert event.score == 2.0
    assert event.signal == 0.125
    assert math.isnan(event.cost_before) and math.isnan(event.cost_after)
    assert event.step == 17
    assert fp.prune(masks, {"a": t(3.0, 4.0, 5.0), "b": t(6.0, 7.0, 2.0)}).step == 0


def test_event_costs_come_from_the_cost_report():
    """With cost=, cost_before is the report's total and cost_after = before - marginal."""
    net = mlp_with_masks()
    x = torch.randn(2, 10)
    report = fp.computational_cost(net, x)
    masks = fp.find_masks(net)
    scores = {
        n: torch.arange(m.num_channels, 0, -1, dtype=torch.float64) for n, m in masks.items()
    }  # lowest: the last channel of each, tie -> first mask
    event = fp.prune(masks, scores, cost=report)
    assert (event.mask, event.channel) == ("2", 7)
    assert event.cost_before == report.total
    expected_after = report.total - float(report.marginal["2"][7])
    assert event.cost_after == pytest.approx(expected_after, abs=COST_ATOL)
    assert event.cost_after < event.cost_before


@pytest.mark.parametrize("round_to", [1, 2])
def test_event_cost_after_matches_the_recomputed_cost(round_to):
    """cost_after equals the cost of the network measured again after the prune; with
    round_to, cost_after is before minus the block's marginal costs, exact because each block
    lies in one layer's outputs."""
    net = mlp_with_masks()
    x = torch.randn(2, 10)
    masks = fp.find_masks(net)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        report = fp.computational_cost(net, x)
        scores = {n: torch.rand(m.num_channels, generator=gen) for n, m in masks.items()}
        event = fp.prune(masks, scores, cost=report, round_to=round_to)
        assert len(event.channels) == round_to
        assert event.cost_after == pytest.approx(fp.computational_cost(net, x).total, abs=COST_ATOL)


def test_event_as_dict_round_trips():
    """PruneEvent.as_dict() rebuilds an equal event."""
    masks = make_masks(2)
    event = fp.prune(masks, {"a": t(2.0, 1.0)}, step=3)
    again = fp.PruneEvent(**event.as_dict())
    assert again.mask == event.mask and again.channel == event.channel
    assert again.step == 3 and again.score == event.score


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("length", [2, 4])
def test_mismatched_score_length_raises(length):
    """Scores whose length differs from the mask's channel count raise ValueError."""
    masks = make_masks(3, 3)
    before = snapshot(masks)
    with pytest.raises(ValueError, match=r"'b'.*3 channels"):
        fp.prune(masks, {"a": t(1.0, 2.0, 3.0), "b": torch.zeros(length)})
    assert all(torch.equal(before[n], m.mask) for n, m in masks.items())


def test_missing_scores_for_a_mask_raise():
    """A mask without scores raises ValueError naming it."""
    masks = make_masks(2, 2)
    with pytest.raises(ValueError, match="'b'"):
        fp.prune(masks, {"a": t(1.0, 2.0)})


@pytest.mark.parametrize("bad", [-1, 1.5, "1"])
def test_bad_min_channels_raises(bad):
    """min_channels must be an int >= 0."""
    with pytest.raises(ValueError, match="min_channels"):
        fp.prune(make_masks(2), {"a": t(1.0, 2.0)}, min_channels=bad)


def test_positional_scores_follow_the_order_of_masks():
    """A sequence of scores is matched to the masks in their given order, whatever their names."""
    first, second = fp.MaskLayer(3), fp.MaskLayer(3)
    masks = {"1": first, "0": second}  # e.g. masks picked out of a Sequential in a custom order
    event = fp.prune(masks, [t(5.0, 0.0, 5.0), t(9.0, 9.0, 9.0)])
    assert (event.mask, event.channel) == ("1", 1)
    assert first.mask.tolist() == [1.0, 0.0, 1.0]
    assert second.mask.tolist() == [1.0, 1.0, 1.0]


# ------------------------------------------------------------------ scores
S = torch.tensor([0.0, 1.0, 2.5, 3.0], dtype=torch.float64)
C = torch.tensor([0.0, 100.0, 4.0, 0.5], dtype=torch.float64)


def test_score_auto_is_signal_over_cost_plus_eps():
    """Mode "auto": s / (c + 1e-6), compared with hand-computed values."""
    expected = torch.tensor(
        [0.0 / (0.0 + EPS), 1.0 / (100.0 + EPS), 2.5 / (4.0 + EPS), 3.0 / (0.5 + EPS)],
        dtype=torch.float64,
    )
    got = score(S, C, "auto")
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=SCORE_RTOL, atol=SCORE_ATOL)


def test_score_auto_free_channel_ranks_last_and_dead_channel_first():
    """Mode "auto": a dead channel (s=0) scores 0; a costless live channel scores s * 1e6."""
    got = score(t(0.0, 2.0), t(50.0, 0.0), "auto")
    assert got[0] == 0.0
    assert got[1] == pytest.approx(2.0e6, rel=SCORE_RTOL)


@pytest.mark.parametrize(
    ("w", "expected"),
    [
        (0.5, [0.0 - 0.0, 1.0 - 50.0, 2.5 - 2.0, 3.0 - 0.25]),
        (2, [0.0, 1.0 - 200.0, 2.5 - 8.0, 3.0 - 1.0]),
        (1e-3, [0.0, 1.0 - 0.1, 2.5 - 0.004, 3.0 - 0.0005]),
    ],
)
def test_score_float_weight_is_signal_minus_weighted_cost(w, expected):
    """A float w: s - w * c, compared with hand-computed values."""
    got = score(S, C, check_flops_weight(w))
    torch.testing.assert_close(got, t(*expected), rtol=SCORE_RTOL, atol=SCORE_ATOL)


@pytest.mark.parametrize("w", [0, 0.0])
def test_score_zero_weight_is_plain_signal(w):
    """Weight 0: the score is the signal itself, whatever the cost."""
    got = score(S, C, check_flops_weight(w))
    torch.testing.assert_close(got, S, rtol=0.0, atol=0.0)


def test_score_does_not_modify_its_inputs():
    """score() returns a new tensor; the signal it was given is untouched."""
    s = S.clone()
    out = score(s, C, 0.0)
    out += 1.0
    assert torch.equal(s, S)


@pytest.mark.parametrize("spelling", ["auto", "AUTO", "Auto"])
def test_check_flops_weight_accepts_auto_in_any_case(spelling):
    """The seed's spelling "AUTO" and other cases normalise to "auto"."""
    assert check_flops_weight(spelling) == "auto"


@pytest.mark.parametrize(("value", "expected"), [(0, 0.0), (2, 2.0), (0.25, 0.25)])
def test_check_flops_weight_normalises_numbers_to_float(value, expected):
    """Non-negative finite numbers become floats."""
    out = check_flops_weight(value)
    assert isinstance(out, float) and out == expected


@pytest.mark.parametrize("bad", ["fisher", "", "autoo", "0.5"])
def test_check_flops_weight_rejects_unknown_strings(bad):
    """Strings other than "auto" raise ValueError naming flops_weight and the string."""
    with pytest.raises(ValueError, match=r"flops_weight.*'auto'"):
        check_flops_weight(bad)


@pytest.mark.parametrize("bad", [-1, -0.5, -1e-12])
def test_check_flops_weight_rejects_negatives(bad):
    """Negative weights raise ValueError saying it must be >= 0."""
    with pytest.raises(ValueError, match=r"flops_weight.*>= 0"):
        check_flops_weight(bad)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_check_flops_weight_rejects_non_finite(bad):
    """NaN and inf raise ValueError saying the weight must be finite."""
    with pytest.raises(ValueError, match=r"flops_weight.*finite"):
        check_flops_weight(bad)


@pytest.mark.parametrize("bad", [True, False])
def test_check_flops_weight_rejects_booleans(bad):
    """Booleans are not weights: rejected with a message naming flops_weight and bool."""
    with pytest.raises((TypeError, ValueError), match=r"flops_weight.*bool"):
        check_flops_weight(bad)


@pytest.mark.parametrize("bad", [None, [0.5], torch.tensor(0.5)])
def test_check_flops_weight_rejects_other_types(bad):
    """Neither a string nor a number: TypeError naming flops_weight."""
    with pytest.raises(TypeError, match="flops_weight"):
        check_flops_weight(bad)


def test_fractional_min_channels_keeps_that_share_of_each_mask() -> None:
    """min_channels=0.5 stops each mask at ceil(half its width): 2 of 3 and 3 of 6 channels."""
    small, big = fp.MaskLayer(3), fp.MaskLayer(6)
    scores = {"small": torch.arange(3.0), "big": torch.arange(6.0) + 0.5}
    for _ in range(20):
        if fp.prune({"small": small, "big": big}, scores, min_channels=0.5) is None:
            break
    assert (small.kept, big.kept) == (2, 3)


@pytest.mark.parametrize("bad", [1.0, 1.5, -0.1, 0.0, True])
def test_min_channels_outside_int_or_fraction_raises(bad: object) -> None:
    """min_channels must be an int >= 0 or a fraction in (0, 1); anything else is refused."""
    with pytest.raises(ValueError, match="min_channels"):
        fp.prune([fp.MaskLayer(3)], [torch.zeros(3)], min_channels=bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- round_to
def brute_force_block(scores: torch.Tensor, alive: torch.Tensor, k: int) -> tuple[list[int], float]:
    """Reference for one mask: the r lowest-scoring alive channels, r = alive % k or k, taken
    by a plain loop (lowest score, then lower index), and their mean score."""
    n_alive = int(alive.sum())
    r = n_alive % k or k
    pool = sorted((float(scores[i]), i) for i in range(len(scores)) if alive[i])
    chosen = [i for _, i in pool[:r]]
    return chosen, sum(float(scores[i]) for i in chosen) / r


def test_round_to_removes_the_block_with_the_lowest_mean_score():
    """With round_to, the chosen mask is the one whose block (its r lowest channels, r bringing
    it to a multiple of round_to) has the lowest mean score, not the lowest single score."""
    masks = make_masks(8, 8)
    scores = {"a": t(0.01, 9, 9, 9, 9, 9, 9, 9), "b": t(1, 1, 1, 1, 1, 1, 1, 1)}
    # round_to=4: a's block is its 4 lowest, channel 0 and three 9s (mean 6.75); b's block
    # of 4 has mean 1, so b loses channels 0-3
    before = snapshot(masks)
    event = fp.prune(masks, scores, round_to=4)
    assert event.mask == "b" and event.channels == (0, 1, 2, 3)
    assert zeroed(before, masks) == [("b", 0), ("b", 1), ("b", 2), ("b", 3)]
    assert event.score == pytest.approx(1.0, rel=SCORE_RTOL)
    # round_to=1 picks a's single lowest channel instead
    assert fp.prune(make_masks(8, 8), scores).mask == "a"


def test_round_to_first_block_aligns_the_count_then_whole_blocks_follow():
    """A mask of 13 channels with round_to=8 first loses 5 (to 8), then 8 (to 0 with
    min_channels=0): every kept count after a prune is a multiple of round_to."""
    masks = make_masks(13)
    scores = {"a": torch.linspace(0, 1, 13, dtype=torch.float64)}
    sizes = []
    while (event := fp.prune(masks, scores, min_channels=0, round_to=8)) is not None:
        sizes.append((len(event.channels), int(masks["a"].mask.sum())))
    assert sizes == [(5, 8), (8, 0)]


@pytest.mark.parametrize("seed", range(6))
def test_round_to_block_matches_a_brute_force_reference(seed):
    """Over random scores and partly pruned masks, the block removed equals the reference:
    per mask the r lowest alive channels, across masks the lowest mean (earlier mask on ties)."""
    gen = torch.Generator().manual_seed(seed)
    masks = make_masks(11, 16, 7)
    for m in masks.values():
        dead = torch.rand(m.num_channels, generator=gen) < 0.3
        m.mask[dead] = 0.0
    scores = {n: torch.rand(m.num_channels, generator=gen).double() for n, m in masks.items()}
    k = 4
    candidates = []
    for order, (n, m) in enumerate(masks.items()):
        alive = m.mask > 0.5
        if int(alive.sum()) - (int(alive.sum()) % k or k) >= 1:
            chosen, mean = brute_force_block(scores[n], alive, k)
            candidates.append((mean, order, chosen[0], n, chosen))
    mean, _, _, name, chosen = min(candidates)
    event = fp.prune(masks, scores, round_to=k)
    assert (event.mask, list(event.channels)) == (name, chosen)
    assert event.score == pytest.approx(mean, rel=SCORE_RTOL)


@pytest.mark.parametrize(
    ("width", "min_channels", "k", "expected"),
    [
        (16, 1, 8, 8),
        (16, 9, 8, 16),
        (12, 0, 8, 0),
        (12, 9, 8, 12),
        (5, 1, 8, 5),
        (5, 0, 8, 0),
        (24, 0.3, 8, 8),
        (10, 3, 1, 3),
        (17, 2, 4, 4),
    ],
)
def test_round_to_stops_at_the_lowest_multiple_above_the_floor(width, min_channels, k, expected):
    """Pruning one mask until prune returns None leaves the lowest multiple of k at or above
    its floor (hand-computed), or its full width when no such multiple lies below it; and
    ``lowest_kept`` (which the optimizer's floor warning uses) predicts the same."""
    from fisherprune.pruner.prune import floor_of, lowest_kept

    masks = make_masks(width)
    scores = {"a": torch.arange(width, dtype=torch.float64)}
    while fp.prune(masks, scores, min_channels=min_channels, round_to=k) is not None:
        pass
    kept = int(masks["a"].mask.sum())
    assert kept == expected
    assert lowest_kept(width, floor_of(min_channels, width), k) == expected


def test_round_to_ties_go_to_the_earlier_mask_then_the_lower_channels():
    """Equal block means: the earlier mask (in the given order) loses its block; within a mask,
    equal scores are taken lowest channel index first."""
    masks = make_masks(4, 4, names="xy")
    scores = {"y": t(1, 1, 1, 1), "x": t(1, 1, 1, 1)}
    event = fp.prune(masks, scores, round_to=2)
    assert (event.mask, event.channels) == ("x", (0, 1))
    event = fp.prune(dict(reversed(list(masks.items()))), scores, round_to=2)
    assert (event.mask, event.channels) == ("y", (0, 1))


def test_round_to_event_round_trips_through_json():
    """A block event survives as_dict -> JSON -> PruneEvent with its channels as a tuple."""
    import json

    masks = make_masks(6)
    event = fp.prune(masks, {"a": t(5, 4, 3, 2, 1, 0)}, round_to=4)
    again = fp.PruneEvent(**json.loads(json.dumps(event.as_dict())))
    assert (again.mask, again.channel, again.channels) == ("a", 5, (5, 4))
    assert (again.score, again.signal) == (event.score, event.signal)


@pytest.mark.parametrize("bad", [0, -8, 2.0, True, "8"])
def test_bad_round_to_raises(bad):
    """round_to must be an int >= 1; a bad one raises ValueError naming it and changes nothing."""
    masks = make_masks(4)
    before = snapshot(masks)
    with pytest.raises(ValueError, match="round_to"):
        fp.prune(masks, {"a": t(1, 2, 3, 4)}, round_to=bad)
    assert torch.equal(before["a"], masks["a"].mask)
