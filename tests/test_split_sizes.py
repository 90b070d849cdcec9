"""A width split at unequal sizes that the module holds in an attribute (the mixed
depthwise convolution of MixNet: ``torch.split(x, self.splits, 1)``, each piece its own kernel
size, as timm writes ``MixedConv2d``): every piece stays prunable, and ``shrink`` sets the
attribute to the channels each piece keeps. References: the masked model's outputs, PyTorch's
``FlopCounterMode`` on the shrunk model, and a plan applied to a fresh model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import fisherprune as fp

ATOL_F64 = 1e-12


class MixedConv(nn.ModuleDict):
    """Depthwise convolutions of 3x3, 5x5 and 7x7 over pieces of 6, 5 and 5 channels."""

    def __init__(self, channels: int = 16, kernels: tuple[int, ...] = (3, 5, 7)) -> None:
        super().__init__()
        first = channels - (len(kernels) - 1) * (channels // len(kernels))
        self.splits = [first] + [channels // len(kernels)] * (len(kernels) - 1)
        for i, (k, c) in enumerate(zip(kernels, self.splits, strict=True)):
            self[str(i)] = nn.Conv2d(c, c, k, padding=k // 2, groups=c)

    def forward(self, x: Tensor) -> Tensor:
        pieces = torch.split(x, self.splits, 1)
        return torch.cat([conv(p) for conv, p in zip(self.values(), pieces, strict=True)], 1)


class MixNetBlock(nn.Module):
    """Expand (1x1), mixed depthwise, project (1x1), as MixNet's inverted residual."""

    def __init__(self, sizes_as: type = list) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.expand = nn.Conv2d(8, 16, 1)
        self.mixed = MixedConv()
        self.mixed.splits = sizes_as(self.mixed.splits)
        self.project = nn.Conv2d(16, 8, 1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.stem(x))
        h = h + self.project(torch.relu(self.mixed(torch.relu(self.expand(h)))))
        return self.head(h.mean((2, 3)))


def _model(sizes_as: type = list) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    return MixNetBlock(sizes_as).double().eval(), torch.randn(3, 3, 10, 10, dtype=torch.float64)


def _flops(model: nn.Module, x: Tensor) -> float:
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(x)
    return counter.get_total_flops() / x.shape[0]


def _pieces(masks: fp.AppliedMasks) -> list[str]:
    """The masks of the expanded width, one per piece, in order."""
    return [k for k, g in masks.groups.items() if ("expand.weight", 0) in g.params]


def _prune(masks: fp.AppliedMasks) -> None:
    """Remove 1, 1 and 2 channels of the pieces (6, 5 and 5 channels)."""
    for k, drop in zip(_pieces(masks), ([0], [1], [0, 3]), strict=True):
        masks[k].mask[torch.tensor(drop)] = 0.0


def test_each_piece_of_the_split_width_is_a_prunable_group() -> None:
    """The expanded width is masked as three groups of 6, 5 and 5 channels, each read by its
    own depthwise convolution (and the projection), not kept whole for its split."""
    model, x = _model()
    masks = fp.apply_masks(model, x[:1])
    groups = [masks.groups[k] for k in _pieces(masks)]
    assert [g.num_channels for g in groups] == [6, 5, 5]
    assert [g.consumers for g in groups] == [[f"mixed.{i}", "project"] for i in range(3)]
    assert not any("expand.weight" in str(s.params) for s in masks.skipped)


@pytest.mark.parametrize("sizes_as", [list, tuple])
def test_shrink_sets_the_split_sizes_and_gives_the_masked_outputs(sizes_as: type) -> None:
    """Pieces losing 1, 1 and 2 channels: the shrunk model splits at the sizes kept (in the
    attribute's own type), gives the masked outputs (float64), and FlopCounterMode on it
    equals the masked model's cost."""
    model, x = _model(sizes_as)
    masks = fp.apply_masks(model, x[:1])
    _prune(masks)
    with torch.no_grad():
        want = model(x)
    small = fp.shrink(model, x[:1])
    assert small.mixed.splits == sizes_as([5, 4, 3])
    assert [c.weight.shape[0] for c in small.mixed.values()] == [5, 4, 3]
    with torch.no_grad():
        torch.testing.assert_close(small(x), want, atol=ATOL_F64, rtol=0)
    assert fp.computational_cost(model, x).total == _flops(small, x)


def test_plan_sets_the_split_sizes_on_a_fresh_model(tmp_path: Path) -> None:
    """The plan, saved and loaded, rebuilds the shrunk model (its split sizes included) from a
    fresh one; a model whose attribute holds other sizes is refused by name."""
    model, x = _model()
    masks = fp.apply_masks(model, x[:1])
    _prune(masks)
    small = fp.shrink(model, x[:1])
    fp.PruningPlan.from_model(model, x[:1]).save(tmp_path / "plan.json")
    plan = fp.PruningPlan.load(tmp_path / "plan.json")
    fresh = plan.apply(_model()[0])
    assert fresh.mixed.splits == [5, 4, 3]
    fresh.load_state_dict(small.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), small(x), atol=0, rtol=0)
    for wrong in ([8, 8], [4, 6, 6]):  # other pieces; a piece smaller than the plan's
        other = _model()[0]
        other.mixed.splits = wrong
        with pytest.raises(fp.PlanMismatchError, match="'splits'"):
            plan.apply(other)


def test_sizes_written_into_the_code_keep_the_width_whole() -> None:
    """Sizes that no attribute holds (written into the forward) keep the width whole, with
    the reason."""

    class Fixed(MixedConv):
        def forward(self, x: Tensor) -> Tensor:
            pieces = torch.split(x, [6, 5, 5], 1)
            return torch.cat([c(p) for c, p in zip(self.values(), pieces, strict=True)], 1)

    model, x = _model()
    model.mixed = Fixed().double()
    del model.mixed.splits
    masks = fp.apply_masks(model, x[:1])
    assert not any(("expand.weight", 0) in g.params for g in masks.groups.values())
    assert any("splits channels at fixed sizes" in s.reason for s in masks.skipped)


def test_sizes_two_attributes_hold_keep_the_width_whole() -> None:
    """Two attributes holding the split's sizes (which one the code read cannot be told):
    the width is kept whole, with the reason, not shrunk by a guess."""
    model, x = _model()
    model.mixed.out_splits = list(model.mixed.splits)
    masks = fp.apply_masks(model, x[:1])
    assert not any(("expand.weight", 0) in g.params for g in masks.groups.values())
    assert any("splits channels at fixed sizes" in s.reason for s in masks.skipped)
