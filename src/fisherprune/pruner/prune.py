"""One pruning step: zero the single channel with the lowest score."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from fisherprune.masks import MaskSet, as_mask_dict

__all__ = ["PruneEvent", "check_min_channels", "floor_of", "prune"]


@dataclass(frozen=True)
class PruneEvent:
    """What one call of ``prune`` did.

    Attributes:
        mask: name of the mask that lost a channel.
        channel: index of that channel in the mask.
        score: its score when it was chosen.
        signal: its pruning signal then.
        cost_before: cost per example before (NaN when no cost was given).
        cost_after: cost per example after, ``cost_before - marginal`` (NaN likewise).
        step: the optimizer step it happened at (0 outside an optimizer).
    """

    mask: str
    channel: int
    score: float
    signal: float
    cost_before: float = math.nan
    cost_after: float = math.nan
    step: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_min_channels(min_channels: Any) -> None:
    """Raises ValueError unless ``min_channels`` is an int >= 0 or a fraction in (0, 1)."""
    ok_int = isinstance(min_channels, int) and not isinstance(min_channels, bool)
    if ok_int and min_channels >= 0:
        return
    if isinstance(min_channels, float) and 0.0 < min_channels < 1.0:
        return
    raise ValueError(
        f"min_channels must be an int >= 0 or a fraction in (0, 1), got {min_channels!r}"
    )


def floor_of(min_channels: int | float, width: int) -> int:
    """Channels a mask of ``width`` channels keeps at least."""
    if isinstance(min_channels, float):
        return max(1, math.ceil(min_channels * width))
    return min_channels


def prune(
    masks: MaskSet,
    scores: Mapping[str, Tensor] | Sequence[Tensor],
    min_channels: int | float = 1,
    *,
    cost: Any = None,
    step: int = 0,
) -> PruneEvent | None:
    """Zero exactly one mask entry: the lowest score over all masks.

    Already pruned channels are never chosen, and no mask goes below
    ``min_channels`` kept channels. Ties are broken deterministically: lowest
    score, then the earlier mask in the order of ``masks``, then the lower
    channel index. NaN scores count as +inf (never preferred).

    Changes: one entry of one ``mask.mask`` buffer is set to 0, in place.

    Args:
        masks: ``{name: MaskLayer}`` or a sequence (named "0", "1", ...).
        scores: per mask, a tensor of scores (same keys or order as ``masks``).
        min_channels: the fewest channels any mask may keep: an int (0 allows emptying a
            mask), or a fraction in (0, 1) of each mask's width (rounded up, at least 1),
            which keeps a cost-blind criterion from thinning a layer to one channel.
        cost: optional ``CostReport`` of the current state; fills the event's costs.
        step: recorded in the event.

    Returns:
        The ``PruneEvent``, or ``None`` when nothing can be pruned any more
        (every mask is at ``min_channels``): nothing is changed then.

    Raises:
        ValueError: ``min_channels`` < 0, or scores that do not match the masks.
    """
    check_min_channels(min_channels)
    md = as_mask_dict(masks)
    if isinstance(scores, Mapping):
        sd = {str(k): v for k, v in scores.items()}
    else:
        seq = list(scores)
        if len(seq) != len(md):
            raise ValueError(f"{len(seq)} score tensors given for {len(md)} masks")
        sd = dict(zip(md, seq, strict=True))  # a sequence follows the order of masks
    best: tuple[float, int, int, str] | None = None
    for order, (name, m) in enumerate(md.items()):
        if name not in sd:
            raise ValueError(f"no scores given for mask {name!r}")
        s = sd[name].detach().double().cpu().flatten()
        if s.numel() != m.num_channels:
            raise ValueError(
                f"scores for mask {name!r} have {s.numel()} entries, the mask has "
                f"{m.num_channels} channels"
            )
        alive = m.mask.detach().cpu() > 0.5
        if int(alive.sum()) <= floor_of(min_channels, m.num_channels):
            continue
        s = torch.where(torch.isnan(s), torch.full_like(s, math.inf), s)
        s = torch.where(alive, s, torch.full_like(s, math.inf))
        v = float(s.min())
        k = int(torch.nonzero(alive & (s == v))[0, 0])  # never an already pruned channel
        cand = (v, order, k, name)
        if best is None or cand[:3] < best[:3]:
            best = cand
    if best is None:
        return None
    v, _, k, name = best
    m = md[name]
    before = after = math.nan
    if cost is not None:
        before = float(cost.total)
        after = before - float(cost.marginal[name][k])
    with torch.no_grad():
        m.mask[k] = 0.0
    return PruneEvent(name, k, v, float(m.signal[k]), before, after, step)
