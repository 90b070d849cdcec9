"""Carry an optimizer over a shrink: its parameters and per-parameter state follow the slicing.

Once pruning is over, training goes on faster on the physically smaller model than on the
masked one: a masked step still runs every pruned channel and then the masks' own kernels (on a
GPU the step is bound by the host's launches, and the masks added 1.2-1.4x to a plain step),
while the shrunk step runs fewer and narrower kernels. ``shrink(model, inplace=True,
optimizer=opt)`` shrinks the model and hands ``opt`` the new parameters with their momentum
buffers, Adam moments and the like sliced exactly as the weights were, so that training goes on
as it would have on the masked model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fisherprune.export.plan import PruningPlan

__all__ = ["OptimizerCarry", "inner_optimizer"]

log = logging.getLogger("fisherprune")

#: one slice of a tensor: ``{dim: kept indices}``
Kept = dict[int, list[int]]


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` that holds the parameters: ``optimizer`` itself, or the one
    a ``PruningOptimizer`` wraps.

    Raises:
        TypeError: neither.
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer or a fisherprune.PruningOptimizer, got "
            f"{type(optimizer).__name__}"
        )
    return inner


def _named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters(remove_duplicate=False))


def _kept_by_name(plan: PruningPlan) -> dict[str, Kept]:
    """``{qualified tensor name: {dim: kept indices}}`` of every tensor the plan slices."""
    out: dict[str, Kept] = {}
    for mname, tensors in plan.modules.items():
        for tname, spec in tensors.items():
            full = f"{mname}.{tname}" if mname else tname
            out[full] = {int(d): list(k) for d, k in spec["kept"].items()}
    return out


def _sliced(t: Tensor, kept: Kept) -> Tensor:
    for d, idx in kept.items():
        t = t.index_select(d, torch.as_tensor(idx, dtype=torch.long, device=t.device))
    return t.contiguous()


@dataclass
class OptimizerCarry:
    """What ``shrink`` needs to hand an optimizer the shrunk parameters: made by ``prepare``
    before the model changes (so that a state it cannot slice refuses before anything does),
    applied by ``apply`` once the plan was applied."""

    optimizer: torch.optim.Optimizer
    #: id of each optimizer parameter the model holds -> (its qualified name, what it keeps)
    names: dict[int, tuple[str, Kept]]

    @classmethod
    def prepare(cls, model: nn.Module, plan: PruningPlan, optimizer: Any) -> OptimizerCarry:
        """Check that every per-parameter state of ``optimizer`` can follow the plan.

        A state tensor is carried when it has its parameter's shape (sliced like the weight:
        momentum buffers, Adam's moments) or a single element (a step count); anything else
        (a factored second moment, as Adafactor keeps) is refused here, before the model is
        touched.

        Raises:
            TypeError: ``optimizer`` is not an optimizer.
            ValueError: a state tensor of another shape on a parameter the plan slices.
        """
        inner = inner_optimizer(optimizer)
        kept = _kept_by_name(plan)
        by_id: dict[int, str] = {}
        for name, p in _named_parameters(model).items():
            by_id.setdefault(id(p), name)
        names: dict[int, tuple[str, Kept]] = {}
        for p in _parameters(inner):
            name = by_id.get(id(p))
            if name is None:
                continue  # not the model's (a loss module's): left as it is
            slices = kept.get(name, {})
            names[id(p)] = (name, slices)
            if not slices:
                continue
            for key, value in inner.state.get(p, {}).items():
                if isinstance(value, Tensor) and value.numel() > 1 and value.shape != p.shape:
                    raise ValueError(
                        f"cannot carry {type(inner).__name__}'s state {key!r} of {name} (shape "
                        f"{tuple(value.shape)}, the parameter's {tuple(p.shape)}) over the "
                        "shrink: only states shaped like their parameter are sliced; shrink "
                        "without optimizer= and build a new optimizer for the smaller model"
                    )
        return cls(inner, names)

    def apply(self, model: nn.Module) -> int:
        """Put the shrunk model's parameters in place of the old ones in the optimizer's
        parameter groups and move their state over, sliced. Returns how many parameters
        changed. Changes: the optimizer's ``param_groups`` and ``state``."""
        after = _named_parameters(model)
        swapped = 0
        for group in self.optimizer.param_groups:
            params = []
            for p in group["params"]:
                found = self.names.get(id(p))
                if found is None:
                    params.append(p)
                    continue
                name, slices = found
                new = after.get(name)
                if new is None:
                    log.info("shrink: %s is no longer in the model; the optimizer drops it", name)
                    self.optimizer.state.pop(p, None)
                    swapped += 1
                    continue
                params.append(new)
                if new is p:
                    continue
                state = self.optimizer.state.pop(p, None)
                if state:
                    self.optimizer.state[new] = {
                        k: _sliced(v, slices) if _follows(v, p) else v for k, v in state.items()
                    }
                swapped += 1
            group["params"] = params
        return swapped


def _follows(value: Any, p: Tensor) -> bool:
    return isinstance(value, Tensor) and value.numel() > 1 and value.shape == p.shape


def _parameters(optimizer: torch.optim.Optimizer) -> Iterable[Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]
