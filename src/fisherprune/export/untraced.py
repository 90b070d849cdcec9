"""Slicing what a plan's trace did not see: experts its inputs reach no row of.

A mixture of experts written as an ``nn.ModuleList`` of expert modules runs only the experts its
router picks, so the inputs ``shrink`` traces with may leave out an expert that ``apply_masks``
saw and masked (the rows routed to it differ). ``apply_masks`` recorded each mask's group: the
parameter dims its channels live in and which index is which channel
(``ChannelGroup.members``). ``recorded_slices`` gives, for each parameter the plan's trace did
not see but a recorded group did, the indices to keep along each of its dims: an index goes
when the entry of its channel is 0 in the mask of the group it belongs to, as the trace would
have said. A parameter no recorded group holds is not followed here (``plan._check_reached``
refuses a plan that would need it).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from torch import nn

from fisherprune.masks import MaskLayer
from fisherprune.masks.points import find_holder

__all__ = ["recorded_params", "recorded_slices"]


def _groups(model: nn.Module) -> dict[str, object]:
    """The groups ``apply_masks`` recorded, by mask name ({} for masks placed by hand)."""
    found = find_holder(model)
    return dict(getattr(found[1], "groups", {}) or {}) if found else {}


def recorded_params(model: nn.Module) -> set[str]:
    """The parameters (and buffers) whose channels a recorded group follows."""
    return {p for g in _groups(model).values() for p, _ in g.params}  # type: ignore[attr-defined]


def recorded_slices(
    model: nn.Module, traced: set[str], masks: Mapping[str, MaskLayer]
) -> dict[str, dict[int, np.ndarray]]:
    """For each parameter not in ``traced`` that a recorded group holds, the removed indices
    along each dim it is sliced on (a bool array per dim; only parameters that lose some)."""
    gone: dict[str, dict[int, np.ndarray]] = {}
    for name, group in _groups(model).items():
        mask = masks.get(name)
        if mask is None:
            continue
        off = (mask.host_mask() < 0.5).numpy()
        if not off.any():
            continue
        for (param, dim), members in group.members.items():  # type: ignore[attr-defined]
            if param in traced:
                continue
            ours = members >= 0
            dims = gone.setdefault(param, {})
            removed = dims.setdefault(dim, np.zeros(members.shape, dtype=bool))
            removed[ours] |= off[members[ours]]
    return {p: {d: r for d, r in dims.items() if r.any()} for p, dims in gone.items()}
