"""Fold the Fisher statistics of the last batch into each mask's signal.

Per example n and channel k, with ``g[n, k]`` the derivative of example n's
loss with respect to mask entry k (summed over every place the mask acts),
the batch estimate is ``Delta_k = 1/2 * mean_n g[n, k]^2`` (Theis et al. 2018,
Eq. 8). It does not depend on the batch size: with a mean-reduced loss each
``g`` carries a factor 1/N, which is undone here (the seed did not, SEED.md).
"""

from __future__ import annotations

import logging
import math
import warnings

import torch
import torch.distributed as dist
from torch import Tensor

from fisherprune.masks import MaskLayer, MaskSet, as_mask_dict

__all__ = ["LOSS_REDUCTIONS", "METHODS", "update_pruning_signals"]

log = logging.getLogger("fisherprune")
LOSS_REDUCTIONS = ("mean", "sum")
METHODS = ("fisher", "taylor")


def update_pruning_signals(
    masks: MaskSet,
    decay: float = 0.96,
    *,
    loss_reduction: str = "mean",
    method: str = "fisher",
    process_group: dist.ProcessGroup | None = None,
) -> list[Tensor]:
    """Update every collecting mask's ``signal`` with the batch gathered since the last call.

    Call after ``loss.backward()``. Changes, for each mask that received gradients,
    ``mask.signal <- decay * signal + (1 - decay) * batch_estimate`` in place and
    clears the gathered statistics. A batch whose estimate is not finite (NaN or
    inf gradients) is skipped with a warning, leaving the signal as it was. With
    ``torch.distributed`` initialised, the sums are all-reduced first, so every
    rank gets the same signal.

    Args:
        masks: the masks, as ``{name: MaskLayer}`` or a sequence.
        decay: EMA factor in [0, 1); 0 makes the signal equal the batch estimate.
        loss_reduction: ``"mean"`` if the loss was averaged over the batch (the
            per-example gradients are rescaled by the batch size), ``"sum"`` if summed.
        method: ``"fisher"`` (default): ``1/2 mean_n g^2``; ``"taylor"``: ``mean_n |g|``,
            a first-order Taylor criterion after Molchanov et al. 2017, for comparison. It is
            not the paper's normalised criterion (no average over positions, no per-layer
            L2 normalisation); used without a cost weight it favours pruning wide late layers.
        process_group: the group to all-reduce over (default: the world, when initialised).

    Returns:
        The signal tensors, in the order of ``masks``.

    Raises:
        ValueError: ``decay`` outside [0, 1) or an unknown ``loss_reduction``.
    """
    if not (isinstance(decay, (int, float)) and 0.0 <= float(decay) < 1.0):
        raise ValueError(f"decay must be in [0, 1), got {decay!r}")
    if not isinstance(method, str) or method.lower() not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    method = method.lower()
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
    md = as_mask_dict(masks)
    distributed = dist.is_available() and dist.is_initialized()
    half = 0.5 if method == "fisher" else 1.0
    ready: list[tuple[str, MaskLayer, Tensor, float]] = []  # name, mask, sum, its factor
    for name, m in md.items():
        stats = m._take_statistics(loss_reduction, method)
        if distributed:
            stats = _all_reduce(stats, m, process_group)
        if stats is not None:
            total, scale, count = stats
            ready.append((name, m, total, half * scale / count))
    if ready and not _all_finite([t for _, _, t, _ in ready]):
        kept = []
        for entry in ready:
            if bool(torch.isfinite(entry[2]).all()):
                kept.append(entry)
                continue
            warnings.warn(
                f"mask {entry[0]!r}: the batch's Fisher estimate is not finite (NaN or inf "
                "gradients); this batch is skipped and the signal is unchanged",
                RuntimeWarning,
                stacklevel=2,
            )
        ready = kept
    _fold_into_signals(ready, float(decay))
    return [m.signal for m in md.values()]


def _all_finite(totals: list[Tensor]) -> bool:
    """Whether every entry of every tensor is finite, with one host sync when they share a
    device: the totals are sums of squares or of absolute values, so their grand total is
    finite exactly when each entry is (an overflow of the grand total only costs the caller
    the per-mask check)."""
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
