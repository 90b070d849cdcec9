"""Baseline criteria of ``fisherprune.signals.criteria``: L1 norm of producing weights, random."""

from __future__ import annotations

import pytest
import torch
import zoo
from torch import nn

import fisherprune as fp
from fisherprune.signals.criteria import l1_norm_scores, random_scores

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
    scores = l1_norm_scores(masks, model, normalize="none")
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
    raw = l1_norm_scores(masks, model, normalize="none")
    norm = l1_norm_scores(masks, model)
    for key, m in masks.items():
        alive = m.mask > 0.5
        torch.testing.assert_close(norm[key][alive].mean(), torch.tensor(1.0, dtype=torch.float64))
        torch.testing.assert_close(norm[key], raw[key] / raw[key][alive].mean())


def test_l1_needs_applied_masks() -> None:
    """Hand-placed MaskLayers carry no producer information: a clear error, not a guess."""
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), fp.MaskLayer(6), nn.Linear(6, 2))
    with pytest.raises(ValueError, match="apply_masks"):
        l1_norm_scores(fp.find_masks(net), net)
    masks = fp.apply_masks(
        nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)), torch.randn(1, 4)
    )
    with pytest.raises(ValueError, match="normalize"):
        l1_norm_scores(masks, nn.Linear(1, 1), normalize="max")


def test_random_scores_shapes_and_stream() -> None:
    """One score per channel in [0, 1); the same generator seed gives the same scores."""
    arch = zoo.ARCHS["resnet_basic"]
    masks = fp.apply_masks(arch.build(), arch.example_input(1))
    a = random_scores(masks, torch.Generator().manual_seed(3))
    b = random_scores(masks, torch.Generator().manual_seed(3))
    for key, m in masks.items():
        assert a[key].shape == (m.num_channels,)
        assert a[key].dtype == torch.float64
        assert bool(((a[key] >= 0) & (a[key] < 1)).all())
        torch.testing.assert_close(a[key], b[key])
