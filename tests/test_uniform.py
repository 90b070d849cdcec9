"""uniform=True: copies of a mask in repeated blocks keep the same widths."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import fisherprune as fp
from fisherprune.pruner.uniform import uniform_classes


def _masks(**widths: int) -> dict[str, fp.MaskLayer]:
    return {n: fp.MaskLayer(w) for n, w in widths.items()}


def test_copies_are_names_equal_up_to_block_indices_with_equal_widths():
    masks = _masks(
        **{
            "layer_0_mlp:out": 8,
            "layer_11_mlp:out": 8,
            "layer_0_attn:out": 4,
            "layer_1_attn:out": 4,
            "conv1:out": 8,
            "conv2:out": 8,
            "stage_0_x:out": 8,
            "stage_1_x:out": 6,
        }
    )
    assert uniform_classes(masks) == [
        ["layer_0_mlp:out", "layer_11_mlp:out"],
        ["layer_0_attn:out", "layer_1_attn:out"],
        ["conv1:out"],
        ["conv2:out"],
        ["stage_0_x:out"],
        ["stage_1_x:out"],
    ]


def _reference(masks, scores, r):
    """Brute force: the class whose copies' r lowest alive scores have the lowest mean."""
    best = None
    for members in uniform_classes(masks):
        picks = {}
        for n in members:
            alive = [k for k in range(masks[n].num_channels) if masks[n].mask[k] > 0.5]
            picks[n] = sorted(alive, key=lambda k, n=n: (float(scores[n][k]), k))[:r]
        v = sum(float(scores[n][k]) for n in members for k in picks[n]) / (r * len(members))
        if best is None or v < best[0]:
            best = (v, picks)
    return best[1]


@pytest.mark.parametrize("seed", range(5))
def test_each_prune_removes_the_lowest_mean_class_from_every_copy(seed):
    g = torch.Generator().manual_seed(seed)
    masks = _masks(**{"b_0_fc:out": 6, "b_1_fc:out": 6, "b_2_fc:out": 6, "head:out": 5})
    for _ in range(6):
        scores = {n: torch.rand(m.num_channels, generator=g) for n, m in masks.items()}
        want = _reference(masks, scores, 1)
        event = fp.prune(masks, scores, 1, uniform=True)
        assert {n: list(c) for n, c in event.removed.items()} == want
        assert event.count == len(want)


def test_uniform_with_round_to_keeps_multiples_in_every_copy():
    masks = _masks(**{"b_0_fc:out": 12, "b_1_fc:out": 12})
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        scores = {n: torch.rand(12, generator=g) for n in masks}
        fp.prune(masks, scores, 1, round_to=4, uniform=True)
        kept = {int(m.mask.sum()) for m in masks.values()}
        assert len(kept) == 1 and kept.pop() % 4 == 0


def test_copies_with_different_counts_are_refused():
    masks = _masks(**{"b_0_fc:out": 4, "b_1_fc:out": 4})
    with torch.no_grad():
        masks["b_0_fc:out"].mask[0] = 0.0
    scores = {n: torch.rand(4) for n in masks}
    with pytest.raises(ValueError, match="same number of channels"):
        fp.prune(masks, scores, 1, uniform=True)


class Blocks(nn.Module):
    """A stack of identical residual MLP blocks in a ModuleList."""

    def __init__(self, width: int = 8, hidden: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
            for _ in range(depth)
        )
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


def test_optimizer_keeps_repeated_blocks_equal_and_cost_exact():
    torch.manual_seed(0)
    model = Blocks()
    x = torch.randn(16, 4)
    y = torch.randint(0, 3, (16,))
    fp.apply_masks(model, x)
    opt = fp.PruningOptimizer(model, x, prune_every=1, uniform=True, flops_target="60%")
    for _ in range(40):
        opt.minimize(nn.functional.cross_entropy(model(x), y))
    hidden = [m for n, m in opt.masks.items() if "blocks" in n]
    assert len(hidden) == 3
    assert len({int(m.mask.sum()) for m in hidden}) == 1
    assert int(hidden[0].mask.sum()) < 16
    small = fp.shrink(model, x)
    widths = {b[0].out_features for b in small.blocks}
    assert len(widths) == 1
    assert fp.computational_cost(small, x).total == pytest.approx(opt.cost().total)


def test_uniform_is_part_of_the_settings_a_resume_must_keep():
    model = Blocks()
    x = torch.randn(2, 4)
    fp.apply_masks(model, x)
    state = fp.PruningOptimizer(model, x, uniform=True).state_dict()
    with pytest.raises(ValueError, match="uniform"):
        fp.PruningOptimizer(model, x, uniform=False).load_state_dict(state)


def test_events_round_trip_through_their_dict():
    masks = _masks(**{"b_0_fc:out": 3, "b_1_fc:out": 3})
    event = fp.prune(masks, {n: torch.arange(3.0) for n in masks}, 1, uniform=True)
    again = fp.PruneEvent(
        **{k: list(v) if isinstance(v, tuple) else v for k, v in event.as_dict().items()}
    )
    assert again == event
    assert list(itertools.chain(*again.removed.values())) == [0, 0]
