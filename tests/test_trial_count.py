"""How much apply_masks pays to find the groups its trial shrink fails on: no trace of its own
for the trials, and about two trials per failing group (not a bisection's trace per trial)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fisherprune as fp
from tests.counted import assert_exact

FIXED = (0, 2, 3)  # the blocks whose hidden width is written into the code


class Block(nn.Module):
    """A residual MLP whose forward reshapes its hidden units to ``self.shape``: ``(-1,)``
    follows any width; ``(hidden,)`` holds the width in the code, so that shrinking it fails
    inside this block."""

    def __init__(self, dim: int, hidden: int, fixed: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.shape = (hidden,) if fixed else (-1,)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.fc1(x))
        return x + self.fc2(h.reshape(*h.shape[:-1], *self.shape))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.blocks = nn.Sequential(*(Block(8, 12, i in FIXED) for i in range(5)))
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.embed(x)).mean(1))


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts whole-model traces and trial shrinks (dry runs) while the test runs."""
    seen = {"traces": 0, "trials": 0}

    def counting(module: object, name: str, key: str) -> None:
        real = getattr(module, name)

        def spy(*args: object, **kwargs: object) -> object:
            seen[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)

    counting(sys.modules["fisherprune.graph.placement"], "trace_model", "traces")
    counting(sys.modules["fisherprune.cost.model"], "trace_model", "traces")
    counting(sys.modules["fisherprune.export.width_probe"], "shrink_dry_run", "trials")
    return seen


def test_failing_groups_cost_no_trace_and_two_trials_each(counts: dict[str, int]) -> None:
    """Three blocks of five hold their hidden width in the code: apply_masks keeps exactly
    those three widths whole (the other hidden widths and the residual width stay masked, and
    shrink is exact on them), tracing the model twice in all (its groups; the masked model,
    for the mask check and every trial) and running at most 2 * failing + 2 trial shrinks
    (the bisection before ran 12, tracing once more for each)."""
    torch.manual_seed(0)
    model = Stack().double().eval()
    masks = fp.apply_masks(model, torch.randn(2, 4, 6, dtype=torch.float64))
    assert counts["traces"] == 2
    assert counts["trials"] <= 2 * len(FIXED) + 2
    whole = [s.params[0][0] for s in masks.skipped if "shrinking" in s.reason]
    assert sorted(whole) == [f"blocks.{i}.fc1.weight" for i in FIXED]
    kept = [[f"blocks.{i}.fc1"] for i in range(5) if i not in FIXED]
    residual = sorted(["embed", *(f"blocks.{i}.fc2" for i in range(5))])
    assert sorted(sorted(g.producers) for g in masks.groups.values()) == sorted([*kept, residual])
    assert_exact(model, masks, torch.randn(3, 4, 6, dtype=torch.float64))
