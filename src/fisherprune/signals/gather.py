"""Folding what backward gathered into each mask's signal: the part every gradient criterion
shares (the per-example statistic is the criterion's; see ``criteria.GradientCriterion``).

For each mask: take the statistics gathered since the last call, all-reduce them over ranks
when ``torch.distributed`` is initialised (so every rank gets the same signal), skip a batch
whose estimate is not finite, and fold ``factor * total / count`` into the signal EMA. All of
it stays on the device: nothing here reads a value back to the host (on a GPU such a read
would wait for the device inside every training step); the example counts of the ranks are
summed and divided by there, and the skip verdicts reach the host without being waited for.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from torch import Tensor

from fisherprune.masks import MaskLayer, MaskSet, as_mask_dict

__all__ = ["fold_statistics", "fold_totals"]


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

    def read(self) -> list[bool]:
        """The flags, once ``ready()``: host memory the copy has finished writing, so reading
        it waits for nothing."""
        return self.flags.tolist()


#: flag copies not read yet, oldest first (checked at every fold, read once ready)
_pending: list[PendingFlags] = []


def _warn_skipped(stacklevel: int) -> None:
    """Warn about every skipped batch whose flags reached the host; keep the others."""
    while _pending and _pending[0].ready():
        done = _pending.pop(0)
        for name, ok in zip(done.names, done.read(), strict=True):
            if not ok:
                warnings.warn(
                    f"mask {name!r}: the batch's pruning-signal estimate is not finite (NaN or "
                    "inf gradients); this batch is skipped and the signal is unchanged",
                    RuntimeWarning,
                    stacklevel=stacklevel,
                )


#: name, mask, summed statistic, what multiplies it (a number, or a 0-d tensor on the device),
#: and whether any example contributed (a 0-d bool tensor; None where the host knows it did)
Ready: TypeAlias = tuple[str, MaskLayer, Tensor, float | Tensor, Tensor | None]


def fold_statistics(
    masks: MaskSet,
    decay: float,
    *,
    loss_reduction: str,
    statistic: Callable[[Tensor], Tensor],
    degree: int,
    factor: float,
    process_group: dist.ProcessGroup | None = None,
) -> Tensor | None:
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
        How many masks' estimates were skipped as not finite, a 0-d tensor on the device (not
        read back here); None when no mask received gradients.
    """
    md = as_mask_dict(masks)
    taken = {name: m.take_statistics(loss_reduction, statistic, degree) for name, m in md.items()}
    return fold_totals(md, taken, decay, factor=factor, process_group=process_group, stacklevel=5)


#: what ``MaskLayer.take_statistics`` returns: ``(total, scale, count)``, or None
Taken: TypeAlias = tuple[Tensor, float, int] | None


def fold_totals(
    masks: MaskSet,
    taken: Mapping[str, Taken],
    decay: float,
    *,
    factor: float,
    process_group: dist.ProcessGroup | None = None,
    stacklevel: int = 4,
) -> Tensor | None:
    """The second half of ``fold_statistics``, for a criterion that took the masks'
    statistics itself (and changed them: ``FisherMean`` subtracts its mean-replacement
    correction): all-reduce ``taken`` over ranks when ``torch.distributed`` is initialised and
    fold ``factor * total * scale / count`` into each mask's signal, as ``fold_statistics``.

    Changes: the signals of the masks in ``taken`` (in place); returns the skipped count.
    ``stacklevel`` places the not-finite warning (4: the caller of the ``update`` that called
    this).
    """
    md = as_mask_dict(masks)
    ready: list[Ready] = []
    if dist.is_available() and dist.is_initialized():
        for name, (total, count) in _all_reduce(taken, md, process_group).items():
            # count is on the device: divided there, and a mask no rank gathered for is left
            # as it is by the fold (its total is 0, so the clamp only avoids 0/0)
            ready.append((name, md[name], total, factor / count.clamp_min(1.0), count > 0))
    else:
        for name, stats in taken.items():
            if stats is not None:
                total, scale, count = stats
                ready.append((name, md[name], total, factor * scale / count, None))
    skipped = _fold_into_signals(ready, float(decay))
    _warn_skipped(stacklevel)
    return skipped


def _all_reduce(
    taken: Mapping[str, Taken],
    md: dict[str, MaskLayer],
    group: dist.ProcessGroup | None,
) -> dict[str, tuple[Tensor, Tensor]]:
    """Every mask's summed statistic and example count over all ranks (a rank without any
    contributes zeros), as ``{name: (total, count)}`` with ``count`` a 0-d tensor on the
    device: one ``all_reduce`` per dtype and device of the signals, nothing read back to the
    host (every rank calls this for every mask, in the same order)."""
    flat: dict[tuple[torch.dtype, torch.device], list[tuple[str, Tensor]]] = {}
    for name, m in md.items():
        stats = taken[name]
        sq = (stats[0] * stats[1]).to(m.signal) if stats else torch.zeros_like(m.signal)
        cnt = sq.new_full((1,), float(stats[2]) if stats else 0.0)
        flat.setdefault((sq.dtype, sq.device), []).append((name, torch.cat([sq, cnt])))
    out: dict[str, tuple[Tensor, Tensor]] = {}
    for entries in flat.values():
        buffer = torch.cat([t for _, t in entries])
        dist.all_reduce(buffer, group=group)
        sizes = [t.numel() for _, t in entries]
        for (name, _), part in zip(entries, buffer.split(sizes), strict=True):
            out[name] = (part[:-1], part[-1])
    return out


#: per (device, sizes of a group's signals): which signal each element of their concatenation
#: belongs to, made on the device once (a copy from the host in every step would wait for it)
_SEGMENTS: dict[tuple[torch.device, tuple[int, ...]], Tensor] = {}


def _segments(device: torch.device, sizes: tuple[int, ...]) -> Tensor:
    key = (device, sizes)
    seg = _SEGMENTS.get(key)
    if seg is None:  # filled on the device: no copy from the host, no size read back
        parts = [torch.full((n,), i, dtype=torch.long, device=device) for i, n in enumerate(sizes)]
        seg = _SEGMENTS[key] = torch.cat(parts)
    return seg


def _fold_into_signals(ready: list[Ready], decay: float) -> Tensor | None:
    """``signal <- decay * signal + (1 - decay) * factor * total`` for each entry whose total
    is finite and that some example contributed to, in place and on the device (no host read);
    the finiteness of each group's totals (one per dtype and device) goes to ``_pending``, and
    the count of entries that were not finite is returned (0-d, on the first group's device;
    None for no entries). The totals are sums of non-negative statistics, so one is finite
    exactly when its sum is.

    Each group is folded as one concatenated vector: about ten kernels for all its masks
    rather than four per mask (on a GPU a step is often bound by how many kernels it launches).
    """
    # (name, signal, total, factor, present) per dtype and device of the signals
    groups: dict[tuple[torch.dtype, torch.device], list[tuple[Any, ...]]] = {}
    skipped: Tensor | None = None
    for name, m, total, factor, present in ready:
        signal = m._buffers["signal"]  # (not ``nn.Module.__getattr__``: once per mask and step)
        key = (signal.dtype, signal.device)
        groups.setdefault(key, []).append((name, signal, total.to(signal), factor, present))
    with torch.no_grad():
        for (_, device), entries in groups.items():
            signals = [e[1] for e in entries]
            totals, factors = [e[2] for e in entries], [e[3] for e in entries]
            ok = torch.stack(torch._foreach_norm(totals, 1)).isfinite()
            if not all(isinstance(f, float) for f in factors):  # (0-d tensors: distributed)
                scaled = torch.cat([t * f for t, f in zip(totals, factors, strict=True)])
            elif factors.count(factors[0]) == len(factors):
                # one factor (one batch size): one product over the concatenation, the same
                # per element (a foreach product by a list of numbers loops on a CPU)
                scaled = torch.cat(totals) * factors[0]
            else:
                scaled = torch.cat(torch._foreach_mul(totals, factors))
            keep = ok
            if any(e[4] is not None for e in entries):
                present = [e[4] if e[4] is not None else ok.new_ones(()) for e in entries]
                keep = ok & torch.stack(present)
            sizes = tuple(t.numel() for t in signals)
            old = torch.cat(signals)
            moved = torch.lerp(old, scaled, 1.0 - decay)
            new = torch.where(keep[_segments(device, sizes)], moved, old)
            torch._foreach_copy_(signals, new.split_with_sizes(sizes))
            _pending.append(PendingFlags([e[0] for e in entries], ok))
            bad = ok.logical_not().sum()
            skipped = bad if skipped is None else skipped + bad.to(skipped.device)
    return skipped
