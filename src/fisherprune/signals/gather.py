"""Folding what backward gathered into each mask's signal: the part every gradient criterion
shares (the per-example statistic is the criterion's; see ``criteria.GradientCriterion``).

For each mask: take the statistics gathered since the last call, all-reduce them over ranks
when ``torch.distributed`` is initialised (so every rank gets the same signal), skip a batch
whose estimate is not finite, and fold ``factor * total / count`` into the signal EMA.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fisherprune.masks import MaskLayer, MaskSet, as_mask_dict

__all__ = ["fold_statistics"]


class PendingFlags:
    """Which masks' batches were finite in one fold, copied towards the host without waiting:
    read (and warned about) only once the copy has landed, so that a training step on a GPU
    never waits for it. On the CPU the flags are the host tensor and ready at once."""

    def __init__(self, names: list[str], ok: Tensor) -> None:
        self.names = names
        self.event: Any = None
        if ok.device.type == "cuda":
            self.flags = torch.empty(ok.shape, dtype=ok.dtype, pin_memory=True)
            self.flags.copy_(ok, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.flags = ok.to("cpu", non_blocking=True)

    def ready(self) -> bool:
        """Whether the flags are on the host (asks the device; never waits)."""
        return self.event is None or bool(self.event.query())


#: flag copies not read yet, oldest first (checked at every fold, read once ready)
_pending: list[PendingFlags] = []


def _warn_skipped(stacklevel: int) -> None:
    """Warn about every skipped batch whose flags reached the host; keep the others."""
    while _pending and _pending[0].ready():
        done = _pending.pop(0)
        for name, ok in zip(done.names, done.flags.tolist(), strict=True):
            if not ok:
                warnings.warn(
                    f"mask {name!r}: the batch's pruning-signal estimate is not finite (NaN or "
                    "inf gradients); this batch is skipped and the signal is unchanged",
                    RuntimeWarning,
                    stacklevel=stacklevel,
                )


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
    cleared. A batch whose estimate is not finite is skipped for that mask (decided on the
    device), with a warning once that verdict reaches the host: at once on the CPU, at a later
    call on a GPU (nothing here waits for the device).

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
    _fold_into_signals(ready, float(decay))
    _warn_skipped(stacklevel=4)
    return [m.signal for m in md.values()]


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
    """``signal <- decay * signal + (1 - decay) * factor * total`` for each entry whose total
    is finite, in place and on the device (no host read); the finiteness of each group's
    totals (one per dtype and device) goes to ``_pending``. The totals are sums of
    non-negative statistics, so one is finite exactly when its sum is."""
    groups: dict[tuple[torch.dtype, torch.device], list[tuple[str, Tensor, Tensor, float]]] = {}
    for name, m, total, factor in ready:
        key = (m.signal.dtype, m.signal.device)
        groups.setdefault(key, []).append((name, m.signal, total.to(m.signal), factor))
    with torch.no_grad():
        for entries in groups.values():
            totals = [t for _, _, t, _ in entries]
            ok = torch.stack(torch._foreach_norm(totals, 1)).isfinite()
            for (_, sig, total, factor), fine in zip(entries, ok.unbind(), strict=True):
                moved = torch.lerp(sig, total * factor, 1.0 - decay)
                sig.copy_(torch.where(fine, moved, sig))
            _pending.append(PendingFlags([name for name, _, _, _ in entries], ok))
