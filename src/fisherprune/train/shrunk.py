"""The pruned model of a ``fisherprune train`` run, physically smaller: what the fine-tuning
trains once pruning has finished, and what the end of the run exports and times.

Once the pruner has finished, the trainer shrinks its model in place with the optimizer carried
over (``fisherprune.shrink(..., inplace=True, optimizer=popt)``: momentum and Adam moments are
sliced as the weights are), so fine-tuning pays the small model's cost instead of the dense
model's plus the masks'. The masked model is gone then, so what the end of the run still needs
from it is read off first: the plan (the kept channels, written as ``plan.json`` and into the
``state_dict`` export) and the dense architecture (the latency line's reference and the dense
parameter count).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from fisherprune.export import PruningPlan, shrink
from fisherprune.graph import remove_masks
from fisherprune.pruner import PruningOptimizer

__all__ = ["Pruned", "shrink_pruned"]


@dataclass(frozen=True)
class Pruned:
    """A pruned model, shrunk, with what its masked form told."""

    small: nn.Module  # no masks: the pruned channels are gone from the weights
    plan: PruningPlan  # the kept channels of each module, read off the masked model
    #: the masked model's architecture with its masks removed, on the CPU: the latency
    #: reference and the dense parameter count. Its weights are those the masked model had
    #: when it was shrunk (after a resume past the shrink: those it was built with).
    dense: nn.Module


def shrink_pruned(
    model: nn.Module, example: Tensor, popt: PruningOptimizer, *, inplace: bool
) -> Pruned:
    """Shrink the masked ``model`` that ``popt`` pruned; keep its plan and a dense copy.

    Args:
        model: the masked model (masks as ``popt`` left them).
        example: one input to trace and check the shrink with, on the model's device.
        popt: the pruner; its cost model gives the plan without tracing again.
        inplace: shrink ``model`` itself and hand ``popt`` the shrunk parameters with their
            optimizer state sliced (``popt`` must have finished; ``popt.shrunk`` is set); else
            shrink a copy and leave ``model`` and ``popt`` as they are.

    Returns:
        The shrunk model (``model`` itself when ``inplace``), the plan and the dense copy.

    Raises:
        ValueError, ShrinkError: as ``fisherprune.shrink`` (nothing changed then).
    """
    plan = PruningPlan.from_model(model, example, cost_model=popt.cost_model)
    dense = _cpu_copy(model)
    remove_masks(dense)
    small = shrink(model, example, inplace=inplace, optimizer=popt if inplace else None)
    return Pruned(small=small, plan=plan, dense=dense)


def _cpu_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are copied straight to the CPU
    (no second copy on the model's device, where memory may be short; gradients left out)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("cpu", copy=True), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to("cpu", copy=True)
    return copy.deepcopy(model, memo)
