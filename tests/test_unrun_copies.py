"""Experts a router sends no example to: copies of a module the trace does not see run.

A mixture-of-experts layer written as an ``nn.ModuleList`` of experts calls only those its router
picks, so a width they share with the rest of the model (the hidden width each expert reads and
writes) cannot be followed into an expert the example inputs do not reach: ``apply_masks`` keeps
such a width whole. ``shrink`` slices an expert its own inputs miss by the groups
``apply_masks`` recorded, and refuses where none was (a mask placed by hand). Without this, the
shrunk model was exported and failed on the first row routed to such an expert.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fisherprune as fp


class _RoutedExperts(nn.Module):
    """Each row goes to the one expert its router (reading the input) picks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.router = nn.Linear(6, 8), nn.Linear(6, 3)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(3)
        )
        self.head = nn.Linear(8, 2)

    def pick(self, x: Tensor) -> Tensor:
        return self.router(x).argmax(-1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        pick, out = self.pick(x), torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (pick == e).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, expert(h[rows]))
        return self.head(h + out)


def _rows() -> tuple[_RoutedExperts, Tensor, Tensor]:
    model = _RoutedExperts().eval()
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        pick = model.pick(x)
    assert set(pick.tolist()) == {0, 1, 2}
    return model, x, pick


def test_a_width_shared_with_an_expert_the_example_misses_is_kept_whole() -> None:
    """Traced with rows that reach one expert only, the hidden width every expert reads is
    left unmasked, with a reason naming the experts that did not run; that expert's own
    hidden units stay prunable."""
    model, x, pick = _rows()
    masks = fp.apply_masks(model, x[pick == 1][:4])
    assert sorted(masks) == ["fisherprune_masks.experts_1_0:out"]
    (why,) = [s.reason for s in masks.skipped if ("embed.weight", 0) in s.params]
    assert "experts.0, experts.2 did not run" in why and "a copy of them" in why


def _pruned(model: _RoutedExperts, x: Tensor) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp.prune_to_target(model, x[:16], [(x[:32], None), (x[32:], None)], 0.5, seed=0,
                           loss_fn=lambda out, _: out.pow(2).mean())  # fmt: skip


def test_shrink_with_inputs_that_miss_experts_slices_them_as_apply_masks_recorded() -> None:
    """Masks placed with rows for every expert, pruned, then shrunk with inputs that reach one
    expert only: the experts those inputs miss are sliced by the groups ``apply_masks``
    recorded, so the shrunk model gives the masked outputs on rows routed to every expert
    (their weights kept the dense widths, and the first such row failed)."""
    model, x, pick = _rows()
    _pruned(model, x)
    gone = [n for n, m in fp.find_masks(model).items() if m.kept < m.num_channels]
    assert any("experts_0" in n for n in gone) and any("embed" in n for n in gone)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the cost model names the masks it does not see)
        small = fp.shrink(model, x[pick == 1][:8])
    with torch.no_grad():
        torch.testing.assert_close(small(x), model(x))


class _HandMasked(_RoutedExperts):
    """The experts' hidden units masked by hand: no group is recorded for them."""

    def __init__(self) -> None:
        super().__init__()
        for expert in self.experts:
            expert.insert(2, fp.MaskLayer(16))


def test_shrink_refuses_inputs_that_miss_an_expert_whose_hand_placed_mask_prunes() -> None:
    """A hand-placed mask in an expert the inputs miss, with channels removed: nothing tells
    which weights they live in, so ``shrink`` refuses, naming the mask and what to pass."""
    model = _HandMasked().eval()
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        pick = model.pick(x)
        model.experts[0][2].mask[[1, 2]] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"experts\.0\.2.*reach every copy"):
            fp.shrink(model, x[pick == 1][:8])
        small = fp.shrink(model, x)
    with torch.no_grad():
        torch.testing.assert_close(small(x), model(x))


def test_shrink_with_inputs_for_every_expert_gives_the_masked_outputs_on_every_row() -> None:
    """The same pruned model shrunk with rows for every expert gives the masked model's
    outputs on rows routed to each of them."""
    model, x, _ = _rows()
    _pruned(model, x)
    small = fp.shrink(model, x)
    with torch.no_grad():
        torch.testing.assert_close(small(x), model(x))
        assert F.mse_loss(small(x), model(x)) < 1e-10
