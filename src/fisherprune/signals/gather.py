"""Folding what backward gathered into each mask's signal: the part every gradient criterion
shares (the per-example statistic is the criterion's; see ``criteria.GradientCriterion``).

For each mask: take the statistics gathered since the last call, all-reduce them over ranks
when ``torch.distributed`` is initialised (so every rank gets the same signal), skip a batch
whose estimate is not finite, and fold ``factor * total / count`` into the signal EMA.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from fisherprune.masks import MaskLayer, MaskSet, as_mask_dict

__all__ = ["fold_statistics"]


def fold_statistics(
    masks: MaskSet,
    decay: float,
    *,
    loss_reduction: str,
    statistic: Callable[[Tensor], Tensor],
    degree: int,
    factor: float,
    process_group: dist.ProcessGroup | None = None,
) -> list[Tensor]:
    """``signal <- decay * signal + (1 - decay) * factor * mean_n statistic(g_n)`` in place for
    every mask that received gradients since the last call; their gathered statistics are
    cleared. A batch whose estimate is not finite is skipped for that mask, with a warning.

    Args:
        masks: the masks, as ``{name: MaskLayer}`` or a sequence.
        decay: the EMA factor, already checked to lie in [0, 1).
        loss_reduction: ``"mean"`` or ``"sum"`` (see ``MaskLayer.take_statistics``).
        statistic: (N, C) per-example mask gradients -> (C,) sum over examples.
        degree: the statistic's degree of homogeneity in ``g``.
        factor: the constant in front (1/2 for Fisher).
        process_group: the group to all-reduce over (default: the world, when initialised).

    Returns:
        The signal tensors, in the order of ``masks``.
    """
    md = as_mask_dict(masks)
    distributed = dist.is_available() and dist.is_initialized()
    ready: list[tuple[str, MaskLayer, Tensor, float]] = []  # name, mask, sum, its factor
    for name, m in md.items():
        stats = m.take_statistics(loss_reduction, statistic, degree)
        if distributed:
            stats = _all_reduce(stats, m, process_group)
        if stats is not None:
            total, scale, count = stats
            ready.append((name, m, total, factor * scale / count))
    if ready and not _all_finite([t for _, _, t, _ in ready]):
        kept = []
        for entry in ready:
            if bool(torch.isfinite(entry[2]).all()):
                kept.append(entry)
                continue
            warnings.warn(
                f"mask {entry[0]!r}: the batch's pruning-signal estimate is not finite (NaN or "
                "inf gradients); this batch is skipped and the signal is unchanged",
                RuntimeWarning,
                stacklevel=3,
            )
        ready = kept
    _fold_into_signals(ready, float(decay))
    return [m.signal for m in md.values()]


def _all_finite(totals: list[Tensor]) -> bool:
    """Whether every entry of every tensor is finite, with one host sync when they share a
    device: the totals are sums of non-negative statistics, so their grand total is finite
    exactly when each entry is (an overflow of the grand total only costs the caller the
    per-mask check)."""
    if any(t.device != totals[0].device for t in totals):
        return all(bool(torch.isfinite(t).all()) for t in totals)
    return math.isfinite(float(torch.cat(totals).sum()))


def _all_reduce(
    stats: tuple[Tensor, float, int] | None, m: MaskLayer, group: dist.ProcessGroup | None
) -> tuple[Tensor, float, int] | None:
    """Sum one mask's statistics over ranks (a rank without any contributes zeros)."""
    sq = stats[0] * stats[1] if stats else torch.zeros_like(m.signal)
    cnt = torch.tensor([float(stats[2]) if stats else 0.0], dtype=sq.dtype, device=sq.device)
    dist.all_reduce(sq, group=group)
    dist.all_reduce(cnt, group=group)
    return (sq, 1.0, int(cnt.item())) if cnt.item() > 0 else None


def _fold_into_signals(ready: list[tuple[str, MaskLayer, Tensor, float]], decay: float) -> None:
    """``signal <- decay * signal + (1 - decay) * factor * total`` for each entry, in place;
    entries sharing a factor, dtype and device are updated by one multi-tensor operation."""
    groups: dict[tuple[float, torch.dtype, torch.device], list[tuple[Tensor, Tensor]]] = {}
    for _, m, total, factor in ready:
        key = (factor, m.signal.dtype, m.signal.device)
        groups.setdefault(key, []).append((m.signal, total.to(m.signal)))
    with torch.no_grad():
        for (factor, _, _), pairs in groups.items():
            signals = [sig for sig, _ in pairs]
            torch._foreach_mul_(signals, decay)
            torch._foreach_add_(signals, [t for _, t in pairs], alpha=(1.0 - decay) * factor)
