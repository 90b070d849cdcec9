"""A dry run for a width normalised by registered norms: remove one of its channels from a copy
of the model and run the copy.

A width a norm normalises is the model's hidden width, and code often reads it back from a
tensor's shape (``b, t, c = x.shape`` then ``reshape(b, t, 3, heads, c // heads)``): a number
the trace cannot follow, which would make the shrunk model fail. Such a group is not offered:
importing this module adds ``width_problem`` to ``fisherprune.graph.placement.WIDTH_CHECKS``
(``graph`` cannot import ``export``, which imports it).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fisherprune._errors import first_line
from fisherprune.export.modules import update_metadata
from fisherprune.graph.groups import ChannelGroup
from fisherprune.graph.placement import WIDTH_CHECKS
from fisherprune.inputs import eval_outputs
from fisherprune.masks.layer import MaskLayer
from fisherprune.masks.points import no_fold, remove_mask_points

__all__ = ["width_problem"]


def width_problem(
    model: nn.Module, example_inputs: Any, group: ChannelGroup, mask: MaskLayer
) -> str | None:
    """Why the model, with the group's first channel removed, fails or differs from the masked
    model with that channel's entry of ``mask`` zeroed; None if it gives the same outputs.

    The model is left as it was (its mask is restored, its weights are not folded): a deep
    copy (without masks) is sliced along every parameter dim of the group (tied parameters
    stay tied), its modules' attributes follow (``fisherprune.register_shrink_rule``), and it
    is run once in eval mode, as is the masked model.
    """
    small = copy.deepcopy(model)
    remove_mask_points(small)
    params = dict(small.named_parameters(remove_duplicate=False))
    params.update(dict(small.named_buffers(remove_duplicate=False)))
    new: dict[int, Tensor] = {}
    with torch.no_grad():
        for (name, dim), members in group.members.items():
            t = params[name]
            keep = torch.as_tensor(np.flatnonzero(members != 0), device=t.device)
            base = new.get(id(t), t)
            new[id(t)] = base.index_select(dim, keep)
    changed: dict[int, tuple[nn.Module, dict[str, tuple[int, ...]]]] = {}
    made: dict[int, Tensor] = {}  # one new object per old one, so tied parameters stay tied
    for mod in small.modules():
        for store, param in ((mod._parameters, True), (mod._buffers, False)):
            for tname, t in list(store.items()):
                if t is None or id(t) not in new:
                    continue
                if id(t) not in made:
                    v = new[id(t)]
                    made[id(t)] = nn.Parameter(v, requires_grad=False) if param else v
                changed.setdefault(id(mod), (mod, {}))[1][tname] = tuple(t.shape)
                store[tname] = made[id(t)]
    for mod, old in changed.values():
        update_metadata(mod, old)
    try:
        got = eval_outputs(small, example_inputs)
    except Exception as e:  # the model's own error is the reason
        return (
            f"the model does not run with one of these channels removed ({first_line(e)}): its "
            "code probably reads this width from a tensor's shape"
        )
    saved = mask.mask.detach().clone()
    try:
        with torch.no_grad():
            mask.mask.fill_(1.0)
            mask.mask[0] = 0.0
        with no_fold(model):
            want = eval_outputs(model, example_inputs)
    finally:
        with torch.no_grad():
            mask.mask.copy_(saved)
    if len(got) != len(want) or any(not _close(a, b) for a, b in zip(got, want, strict=True)):
        return (
            "the model with one of these channels removed does not give the masked model's "
            "outputs: its code probably reads this width from a tensor's shape"
        )
    return None


def _close(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` equals ``b`` to the rounding of their dtype, relative to max(1, |b|)."""
    if a.shape != b.shape:
        return False
    if not a.is_floating_point() or a.numel() == 0:
        return bool(torch.equal(a, b))
    rtol = 1e-9 if a.dtype == torch.float64 else 1e-4 if a.dtype == torch.float32 else 1e-2
    scale = float(b.abs().max().clamp_min(1.0))
    return float((a - b).abs().max()) <= rtol * scale


WIDTH_CHECKS.append(width_problem)
