"""shrink: the physically smaller network (the seed left this as a TODO)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from fisherprune._errors import first_line
from fisherprune.cost import CostModel
from fisherprune.export.carry import OptimizerCarry, inner_optimizer
from fisherprune.export.modules import has_shrink_rule
from fisherprune.export.plan import PruningPlan
from fisherprune.export.widen import HALF, float32_outputs, is_half_precision
from fisherprune.inputs import Inputs, eval_outputs
from fisherprune.masks import MaskLayer
from fisherprune.masks.points import find_holder, no_fold, remembered_inputs
from fisherprune.tolerance import output_rtol

__all__ = ["ShrinkError", "shrink", "shrink_dry_run"]


class ShrinkError(RuntimeError):
    """A shrunk model failed a postcondition (the input model is left untouched).

    Attributes:
        module: the innermost module whose forward the shrunk model failed in, when its forward
            raised there (None otherwise, or when it failed outside every submodule).
    """

    def __init__(self, message: str, module: str | None = None) -> None:
        super().__init__(message)
        self.module = module


def shrink(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    inplace: bool = False,
    check: bool = True,
    optimizer: Any = None,
) -> nn.Module:
    """Return the physically smaller network: pruned channels removed, no masks left.

    Works on a deep copy by default (the masked model is left as it is); with
    ``inplace=True`` the model itself is shrunk. Every pruned channel is removed
    from its producers and consumers (conv in/out, depthwise and grouped conv with
    ``groups`` updated, BatchNorm, GroupNorm, Linear, flatten into Linear, biases);
    module metadata follows; the model's class and forward code are kept.

    With ``optimizer`` (a ``torch.optim.Optimizer`` over the model's parameters, or the
    ``PruningOptimizer`` that pruned it, once it has finished) training goes on on the smaller
    model: the optimizer's parameter groups get the shrunk parameters and their state (momentum
    buffers, Adam's moments) sliced as the weights were, so its next steps move the kept
    weights as they would have moved in the masked model, at the cost of the smaller one.

    Postconditions, checked when ``check`` (default): in eval mode the shrunk model
    gives the masked model's output on ``example_inputs``; it has no more
    parameters (fewer when anything was pruned); no mask is left.

    Args:
        model: a masked model (``apply_masks`` or hand-placed MaskLayers).
        example_inputs: inputs to trace and check with (a tensor, a tuple of positional
            inputs or a dict of keyword inputs); defaults to those kept by ``apply_masks``.
        inplace: shrink ``model`` itself instead of a copy.
        check: verify the postconditions.
        optimizer: an optimizer to carry over to the shrunk parameters (needs ``inplace``).

    Returns:
        The shrunk model (``model`` itself when ``inplace``).

    Raises:
        ValueError: no masks, no example inputs, a zeroed channel that cannot be removed
            exactly (the message says which and why), ``optimizer`` without ``inplace``, a
            ``PruningOptimizer`` that has not finished, or an optimizer state that cannot be
            sliced (nothing changed then).
        ShrinkError: a postcondition failed; with ``inplace=False`` nothing changed.
    """
    if optimizer is not None:
        _check_carry(optimizer, inplace)
    example_inputs = remembered_inputs(model, example_inputs)
    plan = PruningPlan.from_model(model, example_inputs)
    carry = OptimizerCarry.prepare(model, plan, optimizer) if optimizer is not None else None
    with no_fold(model):  # reading the masked model must not zero its weights
        ref = _comparable_outputs(model, example_inputs) if check else None
    n_before = sum(p.numel() for p in model.parameters())  # masks hold buffers, not parameters
    target = model if inplace else copy.deepcopy(model)
    _apply_and_check(target, plan, carry, optimizer, example_inputs, ref, n_before)
    return target


def shrink_dry_run(
    model: nn.Module, example_inputs: Any = None, *, cost_model: CostModel | None = None
) -> None:
    """``shrink(model, example_inputs)`` with its checks, on a copy that shares every tensor
    with ``model`` and is thrown away: the plan replaces the tensors it slices (new objects)
    and changes none in place, so no weight is copied whole (a decoder's weights would
    otherwise be held twice while ``apply_masks`` tries its groups), and a tensor whose kept
    indices form one run (``apply_masks`` removes each group's first channels) is narrowed as
    a view of the original rather than copied (``PruningPlan.apply(views=True)``): no sliced
    copy of the weights either. Where the copy fails with views (a forward that needs a
    contiguous weight), it is made again with copies, as ``shrink`` makes it, and that
    verdict stands. ``model`` is unchanged.
    With ``cost_model`` (a ``CostModel`` of ``model`` as masked now; mask values may have
    changed since) the plan is read off it and the model is not traced again, as
    ``apply_masks`` does for its trials.

    Raises:
        as ``shrink``.
    """
    example_inputs = remembered_inputs(model, example_inputs)
    plan = PruningPlan.from_model(model, example_inputs, cost_model=cost_model)
    with no_fold(model):
        ref = _comparable_outputs(model, example_inputs)
    n_before = sum(p.numel() for p in model.parameters())
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    checked = (plan, None, None, example_inputs, ref, n_before)
    try:  # deepcopy adds to its memo: each copy gets its own
        _apply_and_check(copy.deepcopy(model, dict(shared)), *checked, views=True)
    except Exception:  # the copies' verdict stands
        _apply_and_check(copy.deepcopy(model, dict(shared)), *checked)


def _apply_and_check(
    target: nn.Module,
    plan: PruningPlan,
    carry: OptimizerCarry | None,
    optimizer: Any,
    example_inputs: Any,
    ref: list[Tensor] | None,
    n_before: int,
    views: bool = False,
) -> None:
    """Apply ``plan`` to ``target`` (carrying ``optimizer`` over; ``views``: as
    ``PruningPlan.apply``'s), then check it unless ``ref`` is None (``shrink``'s
    ``check=False``)."""
    plan.apply(target, views=views)
    if carry is not None:  # before the check: a failed check leaves the two consistent
        carry.apply(target)
        mark = getattr(optimizer, "mark_shrunk", None)
        if mark is not None:
            mark()
    if ref is not None:
        _check(target, example_inputs, ref, n_before, list(plan.modules))


def _check_carry(optimizer: Any, inplace: bool) -> None:
    if not inplace:
        raise ValueError(
            "shrink(optimizer=...) hands the optimizer the shrunk parameters, which exist only "
            "when the model itself is shrunk: pass inplace=True"
        )
    inner_optimizer(optimizer)  # a TypeError naming what was given
    if getattr(optimizer, "finished", True) is False:
        raise ValueError(
            "the PruningOptimizer has not finished pruning: shrinking now would take its masks "
            "away mid-schedule; shrink once popt.finished is True"
        )


def _check(
    small: nn.Module,
    example_inputs: Any,
    ref: list[Tensor] | None,
    n_before: int,
    sliced: list[str],
) -> None:
    if any(isinstance(m, MaskLayer) for m in small.modules()) or find_holder(small):
        raise ShrinkError("a mask is left in the shrunk model")
    n_after = sum(p.numel() for p in small.parameters())
    if n_after > n_before or (sliced and n_after == n_before):
        raise ShrinkError(f"parameters did not drop: {n_before} before, {n_after} after")
    with _open_forwards(small) as open_now:
        try:
            out = eval_outputs(small, example_inputs)
        except Exception as e:  # a shape the plan got wrong surfaces as the layer's own error
            where = open_now[-1] if open_now else None
            raise ShrinkError(
                f"the shrunk model fails{f' in {where}' if where else ''} on the example "
                f"inputs ({first_line(e)}); {_unruled(small, sliced)}please report this with "
                "the model",
                module=where,
            ) from e
    if ref is None:
        return
    if is_half_precision(small):
        out = _comparable_outputs(small, example_inputs)
    if len(out) != len(ref):
        raise ShrinkError("the shrunk model returns a different number of tensors")
    for a, b in zip(out, ref, strict=True):
        if a.shape != b.shape:
            raise ShrinkError(f"output shape changed: {tuple(b.shape)} -> {tuple(a.shape)}")
        if a.numel() == 0:
            continue  # nothing to compare (a detector that finds no box): the shapes agree
        if a.is_floating_point():
            rtol = output_rtol(a.dtype)  # float32 reorders sums; half: see _comparable_outputs
            scale = b.abs().max().clamp_min(1.0)
            err = (a - b).abs().max()
            if err > rtol * scale:
                raise ShrinkError(
                    f"the shrunk model's output differs from the masked model's by {err:.3g} "
                    f"(tolerance {rtol * float(scale):.3g}); please report this with the model"
                )
        elif not torch.equal(a, b):
            raise ShrinkError("the shrunk model's output differs from the masked model's")


@contextmanager
def _open_forwards(model: nn.Module) -> Iterator[list[str]]:
    """Within the block, the names of ``model``'s submodules whose forward has begun and not
    ended, outermost first: after a forward raised, the last is the innermost one it failed
    in. Adds a forward pre-hook and a forward hook to every submodule for the block only."""
    open_now: list[str] = []

    def close(name: str) -> None:  # also drops any inner forward whose error was caught
        if name in open_now:
            del open_now[len(open_now) - 1 - open_now[::-1].index(name) :]

    handles = []
    for name, m in model.named_modules():
        if name:
            handles.append(m.register_forward_pre_hook(lambda _m, _a, n=name: open_now.append(n)))
            handles.append(m.register_forward_hook(lambda _m, _a, _o, n=name: close(n)))
    try:
        yield open_now
    finally:
        for h in handles:
            h.remove()


def _comparable_outputs(model: nn.Module, example_inputs: Any) -> list[Tensor]:
    """The outputs the shrunk and the masked model are compared by: their own, or for a model
    held in fp16 / bf16 its outputs in float32 on float32 inputs (``float32_outputs``, which
    widens one call's weights at a time). Slicing changes no weight's value, so in float32
    the two agree to float32 rounding, whatever the depth; in half precision their different
    sums round apart by more than any fixed tolerance, and a width would be refused for
    rounding, not for a wrong plan (issue 36)."""
    if not is_half_precision(model):
        return eval_outputs(model, example_inputs)
    inputs = Inputs.of(example_inputs).map_leaves(
        lambda x, _b: x.float() if isinstance(x, Tensor) and x.dtype in HALF else x
    )
    return float32_outputs(model, inputs.value())


def _unruled(small: nn.Module, sliced: list[str]) -> str:
    """The sliced modules whose class has no shrink rule, as the start of a hint ("" if none):
    their attributes kept the old widths, the usual cause of a shrunk forward failing."""
    modules = dict(small.named_modules())
    names = [
        f"{n or '<model>'} ({type(modules[n]).__name__})"
        for n in sliced
        if n in modules and not has_shrink_rule(modules[n])
    ]
    if not names:
        return ""
    return (
        f"sliced modules with no shrink rule to update their attributes: {', '.join(names)} "
        "(see fisherprune.register_shrink_rule); if that is not the cause, "
    )
