"""One pruning step: zero the channel (or aligned block of channels) with the lowest score."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fisherprune.masks import MaskLayer, MaskSet, as_mask_dict
from fisherprune.pruner.uniform import uniform_classes
from fisherprune.settings import check_min_channels, check_round_to

__all__ = [
    "PruneEvent",
    "block_size",
    "floor_of",
    "lowest_kept",
    "mask_floor",
    "prune",
    "prune_many",
    "rounding",
]


@dataclass(frozen=True)
class PruneEvent:
    """What one call of ``prune`` did.

    Attributes:
        mask: name of the mask that lost channels.
        channel: index of the (lowest-scoring) channel removed.
        score: its score when it was chosen; with ``round_to > 1``, the mean score of the
            block removed.
        signal: its pruning signal then (the block's summed signal with ``round_to > 1``).
        cost_before: cost per example before (NaN when no cost was given).
        cost_after: cost per example after, ``cost_before`` minus the marginal costs of the
            channels removed (NaN likewise).
        step: the optimizer step it happened at (0 outside an optimizer).
        channels: every channel removed from ``mask``, lowest score first (``(channel,)``
            unless ``round_to > 1``).
        also: with ``uniform=True``, the other copies of ``mask`` in repeated blocks and the
            channels each lost in the same step; ``signal`` and the costs cover them all.
    """

    mask: str
    channel: int
    score: float
    signal: float
    cost_before: float = math.nan
    cost_after: float = math.nan
    step: int = 0
    channels: tuple[int, ...] = ()
    also: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __post_init__(self) -> None:
        if not self.channels:
            object.__setattr__(self, "channels", (self.channel,))
        else:  # a list from JSON or a checkpoint
            object.__setattr__(self, "channels", tuple(int(c) for c in self.channels))
        also = tuple((str(n), tuple(int(c) for c in cs)) for n, cs in self.also)
        object.__setattr__(self, "also", also)

    @property
    def removed(self) -> dict[str, tuple[int, ...]]:
        """Every mask that lost channels in this step, with the channels it lost."""
        return {self.mask: self.channels, **dict(self.also)}

    @property
    def count(self) -> int:
        """How many channels this step removed in all."""
        return sum(len(c) for c in self.removed.values())

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def rounding(mask: MaskLayer, round_to: int) -> int:
    """The multiple of channels ``mask`` keeps under ``round_to``: ``round_to`` counts weight
    rows, so a channel spanning several (``MaskLayer.channel_width``: an attention head spans
    ``head_dim``) needs fewer of them. Heads of 64 with ``round_to=8`` go one at a time (any
    count of them is 8-aligned); heads of 12 go two at a time (24 rows). A mask whose kept
    count a kernel needs to be a multiple of something (``MaskLayer.keep_multiple``) keeps
    the least common multiple of both."""
    rows = round_to // math.gcd(round_to, mask.channel_width)
    return math.lcm(rows, mask.keep_multiple)


def block_size(alive: int, round_to: int) -> int:
    """Channels to remove together from a mask with ``alive`` channels so that the count it
    keeps lands on a multiple of ``round_to``."""
    return alive % round_to or round_to


def lowest_kept(alive: int, floor: int, round_to: int = 1) -> int:
    """Fewest channels ``prune`` can leave in a mask that keeps ``alive`` now, given its
    ``floor`` (``floor_of``) and ``round_to``."""
    first = alive - block_size(alive, round_to)
    if first < floor:
        return alive
    return first - (first - floor) // round_to * round_to


def floor_of(min_channels: int | float, width: int) -> int:
    """Channels a mask of ``width`` channels keeps at least."""
    if isinstance(min_channels, float):
        return max(1, math.ceil(min_channels * width))
    return min_channels


def mask_floor(min_channels: int | float, mask: MaskLayer) -> int:
    """Channels ``mask`` keeps at least: ``floor_of`` its width, and never fewer than the
    mask's own ``min_kept`` where it has one (an ``ExpertGate`` keeps ``top_k`` experts)."""
    return max(floor_of(min_channels, mask.num_channels), getattr(mask, "min_kept", 0))


def prune(
    masks: MaskSet,
    scores: Mapping[str, Tensor] | Sequence[Tensor],
    min_channels: int | float = 1,
    *,
    cost: Any = None,
    step: int = 0,
    round_to: int = 1,
    uniform: bool | Sequence[Sequence[str]] = False,
) -> PruneEvent | None:
    """Zero exactly one mask entry: the lowest score over all masks (or, with ``round_to``,
    the one block of channels with the lowest mean score).

    Already pruned channels are never chosen, and no mask goes below
    ``min_channels`` kept channels (nor below its own floor: ``mask_floor``). Ties are
    broken deterministically: lowest score, then the earlier mask in the order of ``masks``,
    then the lower channel index. A NaN or infinite score of any kept channel is refused
    (``ValueError``, nothing changed): it means the signal diverged (a NaN loss, NaN
    weights), and no channel can be chosen safely from it.

    With ``round_to = k > 1`` every mask keeps a multiple of ``k`` channels (CPU and GPU
    kernels process channels in vector-width blocks, commonly 8 or 16: 9 channels run as
    slowly as 16); ``k`` counts weight rows, so a mask whose channels span several
    (attention heads: ``rounding``) keeps a multiple of ``k / gcd(k, head_dim)`` of them,
    any head count for heads of 64. A mask's candidate is then its ``r`` lowest-scoring
    alive channels, where ``r`` brings its kept count down to the next multiple of ``k``
    (``r = k`` once it is on one), ranked across masks by their mean score: with ``"auto"``
    scores and the per-mask uniform marginal costs of a ``CostModel``, that is the block's
    summed signal over its summed cost. A block that would take a mask below
    ``min_channels`` is not a candidate, so a mask stops at the lowest multiple of ``k`` at
    or above its floor; when no multiple of ``k`` lies between its floor and its width (e.g.
    12 channels, floor 9, ``k = 8``, or a mask narrower than ``k`` with a floor of 1), it
    keeps its full width. With ``cost``, the event's ``cost_after`` subtracts the block's
    summed marginal costs: exact when the cost is linear in the mask's count, an estimate
    otherwise (``PruningOptimizer`` records the exact cost).

    Changes: one entry (``round_to`` = 1) or one block of entries of one ``mask.mask``
    buffer (of each copy, with ``uniform``) is set to 0, in place.

    Args:
        masks: ``{name: MaskLayer}`` or a sequence (named "0", "1", ...).
        scores: per mask, a tensor of scores (same keys or order as ``masks``).
        min_channels: the fewest channels any mask may keep: an int (0 allows emptying a
            mask), or a fraction in (0, 1) of each mask's width (rounded up, at least 1),
            which keeps a cost-blind criterion from thinning a layer to one channel.
        cost: optional ``CostReport`` of the current state; fills the event's costs.
        step: recorded in the event.
        round_to: keep every mask's width in weight rows a multiple of this (1: no
            rounding; see ``rounding``).
        uniform: prune the copies of a mask in repeated blocks together
            (``fisherprune.pruner.uniform.uniform_classes``): each copy loses its own
            lowest-scoring channels (or block), ranked by the mean score over all copies, so
            every block keeps the same widths. Or the classes themselves (lists of mask
            names; ``PruningOptimizer`` passes those of ``pruner.uniform.plan_uniform``).

    Returns:
        The ``PruneEvent``, or ``None`` when nothing can be pruned any more
        (every mask is at its floor): nothing is changed then.

    Raises:
        ValueError: ``min_channels`` < 0, ``round_to`` < 1, scores that do not match the
            masks, a NaN or infinite score for a channel not yet pruned (the message names
            the mask and channel; no mask is changed), or (``uniform``) copies of a mask that
            keep different counts.
    """
    check_min_channels(min_channels)
    round_to = check_round_to(round_to)
    md = as_mask_dict(masks)
    sd = _scores_by_name(md, scores)
    order = {n: i for i, n in enumerate(md)}
    best: tuple[float, int, int, dict[str, list[int]]] | None = None
    for members in _classes(md, uniform):
        n_alive = _common_count(md, members)
        r = block_size(n_alive, rounding(md[members[0]], round_to))
        if n_alive - r < mask_floor(min_channels, md[members[0]]):
            continue
        chosen = {n: _lowest_alive(md[n], sd[n], r) for n in members}
        cand = _candidate(chosen, sd, order)
        if best is None or cand[:3] < best[:3]:
            best = cand
    if best is None:
        return None
    before = float(cost.total) if cost is not None else math.nan
    return _remove(md, best, before, cost, step)


def prune_many(
    masks: MaskSet,
    scores: Mapping[str, Tensor] | Sequence[Tensor],
    min_channels: int | float = 1,
    *,
    cost: Any,
    until: float,
    step: int = 0,
    round_to: int = 1,
    uniform: bool | Sequence[Sequence[str]] = False,
    keep: Mapping[str, int] | None = None,
    stop_at_keep: bool = False,
    floors: Mapping[str, int] | None = None,
    goal: float | None = None,
    importance: Mapping[str, Tensor] | None = None,
) -> list[PruneEvent]:
    """What calling ``prune`` over and over with the same arguments does while the estimated
    cost is above ``until``, in one pass: the same channels in the same order, the same events.

    With the scores and the marginal costs fixed, each mask (or class of copies) offers its
    alive channels in one sorted order, and its successive candidates (blocks of that order)
    have non-decreasing mean scores; so the repeated lowest-candidate choice of ``prune`` is a
    merge of those sequences, kept in a heap. The per-call rescan of every mask (a sort per
    mask per removed channel: about 14 ms per channel on a ResNet-50) becomes one sort per
    mask and ``log(masks)`` per channel. The estimated cost starts at ``cost.total`` and loses
    each removed block's summed marginal cost, as the ``cost_before`` / ``cost_after`` of
    ``prune``'s events chained together; it is exact while the cost is linear in each mask's
    count, so callers take a fresh cost report between calls (``prune_to_target`` does, per
    quarter of the remaining gap).

    Changes: the removed entries of the ``mask`` buffers are set to 0, in place.

    Args:
        masks, scores, min_channels, step, round_to, uniform: as in ``prune``.
        cost: the ``CostReport`` of the current state (its marginal costs price each channel).
        until: stop once the estimated cost is at or below this (at least one channel is
            removed when the cost is above it and any can be).
        keep: per mask name, the fewest channels it may keep in this call, on top of its
            floor (``prune_to_target``'s cap on one round's removals); a class of copies
            reads its first member's. Absent names: the floor alone.
        stop_at_keep: stop as soon as a mask whose ``keep`` lies above its floor reaches
            ``keep`` (nothing is removed when one is there already): the caller re-scores
            before going on (``prune_to_target``'s ``rescore_at_cap``).
        floors: per mask name, a floor of its own above ``min_channels``' (a class of copies
            reads its first member's; ``prune_to_target``'s ``floor_power``): unlike ``keep``,
            reaching it never ends the call.
        goal: with ``importance``, the cost the caller prunes to (``prune_to_target``'s
            goal; at most ``until``). A candidate whose removal would leave the estimated cost
            more than ``OVERSHOOT`` of ``goal`` below it (a whole decoder block when a few
            channels are left to go) is passed over, with what its mask would remove after
            it, when the candidates that would come next from the other masks reach ``goal``
            losing less summed ``importance`` than it alone; else it goes as without ``goal``.
        importance: per mask name, what removing each channel loses (the criterion's
            importances the scores were made from); read only with ``goal``.

    Returns:
        The events in order (one per ``prune`` call it stands for). The estimated cost after
        the last is above ``until`` only when every mask reached its floor (or ``keep``), or
        with ``stop_at_keep`` one reached its ``keep``.

    Raises:
        ValueError: as ``prune``, or ``goal`` without ``importance`` or above ``until``, or an
            ``importance`` that does not match the masks or is not finite for a kept channel,
            checked as the scores (nothing is changed).
    """
    check_min_channels(min_channels)
    round_to = check_round_to(round_to)
    if goal is not None and importance is None:
        raise ValueError("prune_many(goal=...) needs the importance each channel's removal loses")
    if goal is not None and until < goal:
        raise ValueError(
            f"prune_many: until ({until}) below goal ({goal}): a removal passed over for "
            "smaller ones that reach the goal would not come back to go further"
        )
    md = as_mask_dict(masks)
    sd = _scores_by_name(md, scores)
    lost_by = None if goal is None else _scores_by_name(md, importance, "importance")
    order = {n: i for i, n in enumerate(md)}
    queues: list[_Queue] = []
    for members in _classes(md, uniform):
        n_alive = _common_count(md, members)
        sorted_alive = {n: _lowest_alive(md[n], sd[n], n_alive) for n in members}
        floor = max(mask_floor(min_channels, md[members[0]]), (floors or {}).get(members[0], 0))
        capped = stop_at_keep and (keep or {}).get(members[0], 0) > floor
        floor = max(floor, (keep or {}).get(members[0], 0))
        queues.append(
            _Queue(sorted_alive, n_alive, floor, rounding(md[members[0]], round_to), capped)
        )
    heap = []
    for i, q in enumerate(queues):
        chosen = q.next_block()
        if chosen is None and q.capped:
            return []
        if chosen is not None:
            heap.append((*_candidate(chosen, sd, order)[:3], i, chosen))
    heapq.heapify(heap)
    events: list[PruneEvent] = []
    total = float(cost.total)

    def key(chosen: dict[str, list[int]]) -> tuple[Any, ...]:
        return _candidate(chosen, sd, order)[:3]

    while heap and total > until:
        v, first, k, i, chosen = heapq.heappop(heap)
        if (
            goal is not None
            and lost_by is not None
            and total - _saved(cost, chosen) < goal * (1 - OVERSHOOT)
        ):
            fill = _fill(heap, queues, total - goal, cost, lost_by, key)
            if fill < _lost(lost_by, chosen):
                continue  # smaller removals get there for less: this mask waits (off the heap)
        events.append(_remove(md, (v, first, k, chosen), total, cost, step))
        total = events[-1].cost_after
        queues[i].taken(chosen)
        nxt = queues[i].next_block()
        if nxt is None and queues[i].capped:
            break
        if nxt is not None:
            heapq.heappush(heap, (*_candidate(nxt, sd, order)[:3], i, nxt))
    return events


def _fill(
    heap: list[Any],
    queues: list[_Queue],
    need: float,
    cost: Any,
    importance: Mapping[str, Tensor],
    key: Callable[[dict[str, list[int]]], tuple[Any, ...]],
) -> float:
    """What the removals that would come next from the queues on ``heap`` (in its order, ``key``
    ranking a queue's next block; a queue has at most one entry there, none once its entry is
    popped) lose in summed ``importance`` until their marginal costs add up to ``need``;
    infinite when they cannot. Changes nothing (it runs on copies of the heap and queues)."""
    heap = list(heap)
    states = {h[3]: replace(queues[h[3]]) for h in heap}
    saved = lost = 0.0
    while saved < need:
        if not heap:
            return math.inf
        *_, i, chosen = heapq.heappop(heap)
        saved, lost = saved + _saved(cost, chosen), lost + _lost(importance, chosen)
        states[i].taken(chosen)
        if (nxt := states[i].next_block()) is not None:
            heapq.heappush(heap, (*key(nxt), i, nxt))
    return lost


def _lost(importance: Mapping[str, Tensor], chosen: dict[str, list[int]]) -> float:
    """The summed ``importance`` of the channels ``chosen`` (per mask name)."""
    return sum(float(importance[n][c].sum()) for n, c in chosen.items())


def _saved(cost: Any, chosen: dict[str, list[int]]) -> float:
    """The summed marginal cost of the channels ``chosen`` (per mask name)."""
    return sum(float(cost.marginal[n][c].sum()) for n, c in chosen.items())


#: how far below its goal ``prune_many`` lets one removal take the cost (a share of the goal)
#: while a smaller removal could still reach it
OVERSHOOT = 0.02


@dataclass
class _Queue:
    """One class of copies in ``prune_many``: each member's alive channels, lowest score
    first, the multiple of channels they keep (``rounding``), whether reaching ``floor`` ends
    the call (``stop_at_keep``) and how many of them are gone."""

    sorted_alive: dict[str, list[int]]
    alive: int
    floor: int
    multiple: int
    capped: bool = False
    gone: int = 0

    def next_block(self) -> dict[str, list[int]] | None:
        """Each member's next block (what ``prune`` would choose now), or None at the floor."""
        r = block_size(self.alive, self.multiple)
        if self.alive - r < self.floor:
            return None
        return {n: idx[self.gone : self.gone + r] for n, idx in self.sorted_alive.items()}

    def taken(self, chosen: dict[str, list[int]]) -> None:
        r = len(next(iter(chosen.values())))
        self.alive -= r
        self.gone += r


def _classes(md: Mapping[str, Any], uniform: bool | Sequence[Sequence[str]]) -> list[list[str]]:
    """The classes of masks pruned together: each mask alone, ``uniform_classes``, or the
    given classes (a mask in none of them is a class of its own)."""
    if isinstance(uniform, bool):
        return uniform_classes(md) if uniform else [[n] for n in md]
    classes = [[n for n in c if n in md] for c in uniform]
    classes = [c for c in classes if c]
    listed = {n for c in classes for n in c}
    return classes + [[n] for n in md if n not in listed]


def _common_count(md: Mapping[str, Any], members: list[str]) -> int:
    """The alive count the copies ``members`` share.

    Raises:
        ValueError: copies that keep different counts.
    """
    alive_counts = {n: int((md[n].host_mask() > 0.5).sum()) for n in members}
    n_alive = alive_counts[members[0]]
    if any(c != n_alive for c in alive_counts.values()):
        raise ValueError(
            "uniform=True needs the copies of a repeated mask to keep the same number of "
            f"channels, but {', '.join(f'{n!r} keeps {c}' for n, c in alive_counts.items())}"
            ": prune them to equal widths first, or use uniform=False"
        )
    return n_alive


def _candidate(
    chosen: dict[str, list[int]], sd: Mapping[str, Tensor], order: Mapping[str, int]
) -> tuple[float, int, int, dict[str, list[int]]]:
    """A candidate's ranking key (mean score, mask order, first channel) and its channels."""
    v = float(torch.cat([sd[n][c] for n, c in chosen.items()]).mean())
    first = next(iter(chosen))
    return v, order[first], chosen[first][0], chosen


def _remove(
    md: Mapping[str, Any],
    cand: tuple[float, int, int, dict[str, list[int]]],
    before: float,
    cost: Any,
    step: int,
) -> PruneEvent:
    """Zero the candidate's channels and describe it; ``cost_after`` is ``before`` less their
    summed marginal costs (NaN without ``cost``)."""
    v, _, k, chosen = cand
    name, *others = chosen
    after = math.nan if cost is None else before - _saved(cost, chosen)
    with torch.no_grad():
        for n, c in chosen.items():
            md[n].mask[c] = 0.0
            md[n].record_values(all_ones=False)
    signal = sum(float(md[n].signal[c].sum()) for n, c in chosen.items())
    also = tuple((n, tuple(chosen[n])) for n in others)
    return PruneEvent(name, k, v, signal, before, after, step, tuple(chosen[name]), also)


def _scores_by_name(
    md: Mapping[str, Any],
    scores: Mapping[str, Tensor] | Sequence[Tensor],
    what: str = "scores",
) -> dict[str, Tensor]:
    """Scores (or, named by ``what``, another per-channel quantity) per mask name, as float64
    on the CPU; checked against the masks (and finite for every kept channel)."""
    if isinstance(scores, Mapping):
        given = {str(k): v for k, v in scores.items()}
    else:
        seq = list(scores)
        if len(seq) != len(md):
            raise ValueError(f"{len(seq)} {what} tensors given for {len(md)} masks")
        given = dict(zip(md, seq, strict=True))  # a sequence follows the order of masks
    out = {}
    for name, m in md.items():
        if name not in given:
            raise ValueError(f"no {what} given for mask {name!r}")
        s = given[name].detach().double().cpu().flatten()
        if s.numel() != m.num_channels:
            raise ValueError(
                f"{what} for mask {name!r}: {s.numel()} entries, the mask has "
                f"{m.num_channels} channels"
            )
        _check_finite(name, s, m.host_mask() > 0.5, what.removesuffix("s"))
        out[name] = s
    return out


def _lowest_alive(m: Any, s: Tensor, r: int) -> list[int]:
    """The ``r`` alive channels of mask ``m`` with the lowest scores ``s`` (ties: lower index).
    In numpy: on these host copies a torch sort cost about 100 us a mask, each decision."""
    idx = np.flatnonzero((m.host_mask() > 0.5).numpy())  # ascending: stable ties
    return idx[np.argsort(s.numpy()[idx], kind="stable")[:r]].tolist()


def _check_finite(name: str, scores: Tensor, alive: Tensor, what: str = "score") -> None:
    """Raise ValueError when a channel of mask ``name`` that is still kept (``alive``) has a NaN
    or infinite score (or ``what``)."""
    bad = torch.nonzero(alive & ~torch.isfinite(scores)).flatten()
    if bad.numel():
        k = int(bad[0])
        raise ValueError(
            f"prune: mask {name!r} has {bad.numel()} kept channel(s) with a non-finite {what} "
            f"(channel {k}: {float(scores[k])}); the pruning signal diverged (a NaN or infinite "
            "loss, gradients or weights), so nothing was pruned: lower the learning rate or "
            "check the data for NaN"
        )
