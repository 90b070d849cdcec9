"""``FisherMean``: the Fisher signal of the removal ``prune_to_target`` really makes, its
default criterion when it repairs (issue 31).

``criteria.Fisher`` scores channel ``k`` by ``F_k = 1/2 mean_n g[n,k]^2``, the second-order
loss of setting the channel to 0 (Theis et al. 2018). The repair then refits each consumer of
a removed channel by least squares, with its bias, so the channel is in effect replaced by its
mean activation ``abar_k`` (as that consumer reads it), not by 0. A consumer without a bias
absorbs the mean only through its other inputs' means (the positive means of ReLU outputs);
the correction is made there too, which measured better on the digits CNNs, whose
convolutions have none (ResNet-18 at 30% of its FLOPs 0.947 against 0.933 with the correction
left out where the reader has no bias, 8 seeds). A recurrent layer's input, for which the
repair has no least-squares fit at all, replaces nothing by its mean: its place adds no
correction (a digits-rows LSTM at 50% / 30% of its FLOPs went from behind Taylor, 0.963 /
0.937, to within noise of it or first, 0.968 / 0.947, 8 seeds). To first order, example
``n``'s loss then
changes by

    g'[n, k] = sum over positions of (x[n, k, pos] - abar_k) * dL/dx[n, k, pos]
             = g[n, k] - sum over the places p reading k of abar_pk * s_p[n, k],

with ``s_p[n, k]`` the per-example sum over positions of the loss gradient w.r.t. the masked
input at place ``p`` (the gradient of an additive shift of the channel there; each consumer
gets its own bias, so each place its own mean). The signal is ``1/2 mean_n g'[n,k]^2``.

On a mask that more than one module reads (a residual stream: every block's first layer, the
shortcut, the head; a transformer's hidden width), no single refit absorbs what its channels
share, and removing several of them at once costs the cross terms too. There each kept channel
scores the increment it adds to the joint loss of its group (the group-level view of Liu et
al. 2021, applied to the group's lowest channels): with the kept channels ordered by their
signal, lowest first,

    J_m = 1/2 mean_n (sum of g'[n,k] over the m lowest kept k)^2,

channel ``m`` scores ``J_m - J_(m-1)``, made non-decreasing along the order and never below its
own signal. Masks one module reads keep their own signal: that module's refit absorbs a common
mode. So does a width a norm normalises across (a LayerNorm or RMSNorm of a transformer's
hidden width): the norm makes it scale-invariant, its channels' gradients sum to about 0 per
example, and the joint loss of removing many is a second-order artefact; with the joint
increments there, a 1.05M Llama-shaped decoder pruned to half its parameters lost 4 points of
held-out perplexity against the seed's signal (``benchmarks/lm_quality.py``).
Measured on trained networks the tests do not otherwise use (``benchmarks/
one_shot_defaults.py``), this is first or within noise of first on every row, where the plain
signal fell behind Taylor on ResNet-18 at 30% and on the digits MLP at 50%.

Memory: per pass, the means' sums and ``s`` of the pass are folded at once into per-channel
sums over examples (``sum g s_p`` and ``sum s_p s_q`` over the places of a mask), so that what
is kept does not grow with the calibration set, except on the coupled masks, whose joint
increments need every example's ``g'``: there each pass's ``s`` is kept, ``(N, C)`` per place,
until ``update``. The corrections are made in float64; activations are reduced in their own
dtype with a float64 accumulator, never copied whole to float64.

Statistics come only from forward passes with gradients inside ``observing`` (``prune_to_target``
runs its signal passes there); ``PruningOptimizer`` refuses it (training runs no such block).
One process only: the sums of other ranks are not gathered.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fisherprune._dist import in_group
from fisherprune.masks import MaskLayer, MaskSet, as_mask_dict
from fisherprune.masks.norm_points import NormPoint
from fisherprune.masks.points import MaskPoint, find_holder
from fisherprune.masks.recompute import recomputing
from fisherprune.masks.row_tracker import to_examples
from fisherprune.settings import check_decay, check_loss_reduction
from fisherprune.signals.activation import hook_points
from fisherprune.signals.criteria import GradientCriterion, register_criterion
from fisherprune.signals.gather import fold_totals

__all__ = ["FisherMean", "coupled_masks", "joint_increments", "normalised_masks"]

log = logging.getLogger("fisherprune")


def coupled_masks(model: nn.Module) -> set[int]:
    """The ids of the masks ``apply_masks`` placed at the input of more than one module."""
    found = find_holder(model)
    if found is None:
        return set()
    readers: Counter[int] = Counter()
    for point in found[1].points:
        readers.update({id(m) for m, _, _ in point.parts})
    return {m for m, n in readers.items() if n > 1}


def normalised_masks(model: nn.Module) -> set[int]:
    """The ids of the masks on a width that a norm normalises across (a LayerNorm or RMSNorm
    of a transformer's hidden width: ``apply_masks`` gave it a ``NormPoint``)."""
    found = find_holder(model)
    if found is None:
        return set()
    return {id(m) for h in found[1].handles if isinstance(h, NormPoint) for m, _, _ in h.parts}


def joint_increments(
    score: Tensor, g: Tensor, mask: Tensor, *, at_least_own: bool = True
) -> Tensor:
    """Each kept channel's increment of the joint loss of its group (module docstring).

    Args:
        score: (C,) each channel's own signal; it orders the kept channels, lowest first.
        g: (N, C) per-example gradients (float64; a mean-reduced loss's 1/N undone).
        mask: (C,) the mask; channels at 0 keep ``score``.
        at_least_own: never score a channel below its own signal.

    Returns:
        A new (C,) float64 tensor: ``J_m - J_(m-1)`` at the channel of rank ``m``, with
        ``J_m = 1/2 mean_n (sum of g over the m lowest kept channels)^2``, made non-decreasing
        along the order and non-negative.
    """
    out = score.detach().double().cpu().clone()
    kept = torch.nonzero(mask.detach().cpu() > 0.5).flatten()
    if len(kept):
        order = kept[torch.argsort(out[kept], stable=True)]  # lowest signal first
        joint = 0.5 * g.cpu()[:, order].cumsum(1).square().mean(0)  # J_1 .. J_K
        steps = torch.diff(joint, prepend=joint.new_zeros(1))
        steps = steps.cummax(0).values.clamp_min(0.0)
        out[order] = steps.maximum(out[order]) if at_least_own else steps
    return out


class _Place:
    """One masked consumer input: the float64 sum of its values per position of the masked
    dim over every pass (for ``abar``), and this pass's per-example sum of its gradient per
    position (``shift``, ``s``)."""

    def __init__(self, point: MaskPoint, hooked: dict[int, weakref.ref[Tensor]]) -> None:
        self.point, self.hooked = point, hooked
        self.sum: Tensor | None = None  # (size,) float64
        self.rows = 0
        self.shift: Tensor | None = None  # (N, size) float64, this pass

    def __call__(self, module: nn.Module, args: tuple) -> None:
        x = args[self.point.arg]
        if (
            isinstance(module, nn.RNNBase)  # no refit there: abar stays 0
            or recomputing()
            or not torch.is_grad_enabled()
            or not isinstance(x, Tensor)
            or not x.requires_grad
            or self._seen(x)
        ):
            return
        # an input several consumers share counts once; a weak reference, so that the pass's
        # activations are not held beyond what autograd holds (a checkpointed block's are not)
        self.hooked[id(x)] = weakref.ref(x)
        d = self.point.dim % x.dim()
        others = [i for i in range(x.dim()) if i != d]
        part = x.detach().sum(others, dtype=torch.float64) if others else x.detach().double()
        self.sum = part if self.sum is None else self.sum + part
        self.rows += x.numel() // self.point.size
        reduce = to_examples(self.point.rows.kind, x, self.point.probe, self.point.scope)
        x.register_hook(self._gradient_hook(reduce or None))

    def _seen(self, x: Tensor) -> bool:
        ref = self.hooked.get(id(x))
        return ref is not None and ref() is x

    def _gradient_hook(self, reduce: Callable[[Tensor], Tensor] | None) -> Any:
        def hook(grad: Tensor) -> None:
            b, d = self.point.rows.dim % grad.dim(), self.point.dim % grad.dim()
            others = [i for i in range(grad.dim()) if i not in (b, d)]
            s = grad.detach()
            s = s.sum(others, dtype=torch.float64) if others else s.double()
            s = s if b < d else s.t()  # (rows, size)
            s = s if reduce is None else reduce(s)  # (N, size)
            self.shift = s if self.shift is None else self.shift + s

        return hook

    def mean(self) -> Tensor:
        """``abar`` per position (float64), zeros before any pass."""
        if self.sum is None:
            return torch.zeros(self.point.size, dtype=torch.float64)
        return self.sum / max(self.rows, 1)


class _Term:
    """The positions of one place that carry a mask's channels, each channel at most once
    (a place that reads a channel at two positions gives two terms: each its own mean)."""

    def __init__(self, place: _Place, pos: Tensor, idx: Tensor) -> None:
        self.place, self.pos, self.idx = place, pos, idx

    @staticmethod
    def split(place: _Place, pos: Tensor, idx: Tensor) -> list[_Term]:
        """``(pos, idx)`` cut into terms whose ``idx`` has no repeats."""
        out: list[_Term] = []
        left = torch.ones(len(idx), dtype=torch.bool)
        while bool(left.any()):
            at = torch.nonzero(left).flatten()
            _, first = _first_of_each(idx[at])
            take = at[first]
            out.append(_Term(place, pos[take], idx[take]))
            left[take] = False
        return out


def _first_of_each(v: Tensor) -> tuple[Tensor, Tensor]:
    """The distinct values of ``v`` and the index of each one's first occurrence."""
    values, inverse = torch.unique(v, return_inverse=True)
    first = torch.full((len(values),), len(v), dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(len(v)), reduce="amin")
    return values, first


class _MaskRecord:
    """What one mask's terms gathered in the current ``observing`` block."""

    def __init__(self, mask: MaskLayer, terms: list[_Term], coupled: bool) -> None:
        self.mask, self.terms, self.coupled = mask, terms, coupled
        self.seen = 0  # passes of the mask paired so far
        #: the terms that have seen a gradient, in the order their rows of ``sums`` take
        #: (an input several modules share is hooked at one of them: the others never do)
        self.slots: dict[int, int] = {}
        #: per pass size n: (sum_n g s_p (P', C), sum_n s_p s_q (C, P', P')), float64, over
        #: the terms of ``slots``
        self.sums: dict[int, tuple[Tensor, Tensor]] = {}
        #: coupled only: pass index -> (the terms that saw a gradient, their s: (P', N, C))
        self.shifts: dict[int, tuple[Tensor, Tensor]] = {}
        #: a forward handed this mask gradients of different row counts (told once): those
        #: passes keep the plain signal
        self.unpaired = False

    def pair(self, name: str) -> None:
        """Pair the pass that just ended with the mask's gradient of that pass: add to the
        sums (and keep the shifts of a coupled mask). Changes the records only."""
        shifts = [t.place.shift for t in self.terms]
        passes = self.mask.closed_passes()
        new, self.seen = len(passes) - self.seen, len(passes)
        if all(s is None for s in shifts) or new == 0:
            return  # no gradient reached these inputs, or the mask's pass was dropped
        if new > 1:
            if len({int(p.shape[0]) for p in passes[-new:]}) == 1:
                raise ValueError(
                    f"fisher_mean: mask {name!r} closed {new} gradient passes in one forward: "
                    "the model ran more than once for one loss; call it once per loss"
                )
            if not self.unpaired:  # places whose rows apply_masks could not tie to examples
                log.warning(
                    "fisher_mean: mask %r gets gradients of different row counts in one "
                    "forward (places whose rows are not the examples: apply_masks said "
                    "which): its signal there is the plain Fisher signal, not corrected for "
                    "the repair's means",
                    name,
                )
            self.unpaired = True
            return
        g = passes[-1].double()
        n, c = g.shape
        rows = [j for j, s in enumerate(shifts) if s is not None]
        s_all = g.new_zeros(len(rows), n, c)
        for at, j in enumerate(rows):
            term, s = self.terms[j], shifts[j]
            assert s is not None
            if s.shape[0] != n:
                raise ValueError(
                    f"fisher_mean: mask {name!r} has {n} examples in its gradient but "
                    f"{s.shape[0]} at its input of {term.place.point.module_name!r}"
                )
            s_all[at][:, term.idx.to(g.device)] = s[:, term.pos.to(s.device)].to(g.device)
        if self.coupled:
            self.shifts[self.seen - 1] = (torch.tensor(rows, dtype=torch.long), s_all)
            return
        for j in rows:
            self.slots.setdefault(j, len(self.slots))
        size = len(self.slots)
        gs, ss = self.sums.get(n, (g.new_zeros(0, c), g.new_zeros(c, 0, 0)))
        if gs.shape[0] < size:  # a term seen for the first time: room for its rows
            gs = torch.cat([gs, g.new_zeros(size - gs.shape[0], c)])
            grown = g.new_zeros(c, size, size)
            grown[:, : ss.shape[1], : ss.shape[2]] = ss
            ss = grown
        if len(rows) < size or any(self.slots[j] != at for at, j in enumerate(rows)):
            in_slots = g.new_zeros(size, n, c)  # this pass's rows at their slots, 0 elsewhere
            in_slots[torch.tensor([self.slots[j] for j in rows], device=g.device)] = s_all
            s_all = in_slots
        gs += torch.einsum("pnc,nc->pc", s_all, g)
        by_channel = s_all.permute(2, 0, 1)  # (C, P, N)
        ss.baddbmm_(by_channel, by_channel.transpose(1, 2))  # in place: no (C, P, P) temporary
        self.sums[n] = (gs, ss)

    def means(self) -> Tensor:
        """``abar`` of each term at its channels, (P, C) float64 (0 elsewhere)."""
        out = torch.zeros(len(self.terms), self.mask.num_channels, dtype=torch.float64)
        for j, term in enumerate(self.terms):
            out[j, term.idx] = term.place.mean().cpu()[term.pos]
        return out

    def correction(self, abar: Tensor, factor: Callable[[int], float]) -> Tensor | None:
        """``sum over passes of factor(n) * sum_n (g'^2 - g^2)``, (C,) float64, or None."""
        total = None
        terms = list(self.slots)  # slot order
        for n, (gs, ss) in self.sums.items():
            a = abar[terms[: gs.shape[0]]].to(gs.device)
            part = (torch.einsum("pc,cpq,qc->c", a, ss, a) - 2 * (a * gs).sum(0)) * factor(n)
            total = part if total is None else total + part
        return total


@register_criterion("fisher_mean")
class FisherMean(GradientCriterion):
    """``1/2 mean_n g'[n,k]^2``, the Fisher signal of replacing each channel by its mean (what
    the repair does), with the joint increments on masks several modules read (module
    docstring). ``prune_to_target``'s default criterion when it repairs.

    Args:
        joint: ``"coupled"`` (default): the joint increments on masks more than one module
            reads; ``"none"``: every channel scores its own signal; ``"all"``: the joint
            increments on every mask (keeps every mask's per-example ``g'``).

    Raises:
        ValueError: an unknown ``joint``.
    """

    uses_activations: ClassVar[bool] = True  # reads forward statistics under ``observing``
    degree: ClassVar[int] = 2
    factor: ClassVar[float] = 0.5
    JOINT: ClassVar[tuple[str, ...]] = ("coupled", "none", "all")

    def __init__(self, joint: str = "coupled") -> None:
        super().__init__()
        if joint not in self.JOINT:
            raise ValueError(f"joint must be one of {', '.join(self.JOINT)}, got {joint!r}")
        self.joint = joint
        self._records: dict[str, _MaskRecord] = {}
        self._places: list[_Place] = []
        self._corrected: dict[str, Tensor] = {}  # coupled masks: (examples, C) g', float64

    def statistic(self, g: Tensor) -> Tensor:
        """``sum_n g[n,k]^2`` in float64 (the correction is made in ``update``)."""
        g = g.double()
        return torch.linalg.vecdot(g, g, dim=0)

    @contextmanager
    def observing(self, model: nn.Module, masks: Mapping[str, MaskLayer]) -> Iterator[None]:
        """Within the ``with`` block, every forward with gradients adds each masked consumer
        input's sums and hooks its gradient; each pass is paired with the masks' gradients
        when the next one starts (and at ``update``). Records of earlier blocks are dropped on
        entry. Changes: adds one forward pre-hook per masked consumer and one on ``model``,
        removed on exit, and one gradient hook per masked input; outputs and gradients are
        unchanged.
        """
        hooked: dict[int, weakref.ref[Tensor]] = {}
        self._places, handles = hook_points(model, lambda p: _Place(p, hooked), "fisher_mean")
        terms: dict[int, list[_Term]] = {}
        for at in self._places:
            for m, pos, idx in at.point.parts:
                terms.setdefault(id(m), []).extend(_Term.split(at, pos, idx))
        every = self.joint == "all"
        coupled = set()
        if self.joint == "coupled":  # several readers, and no norm across the width
            coupled = coupled_masks(model) - normalised_masks(model)
        self._records = {
            name: _MaskRecord(m, terms.get(id(m), []), every or id(m) in coupled)
            for name, m in masks.items()
            if every or id(m) in terms or id(m) in coupled
        }
        for r in self._records.values():
            r.seen = len(r.mask.closed_passes())

        def start(module: nn.Module, args: tuple) -> None:
            self._pair()
            hooked.clear()

        handles.append(model.register_forward_pre_hook(start))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _pair(self) -> None:
        for name, record in self._records.items():
            record.pair(name)
        for place in self._places:
            place.shift = None

    def update(
        self,
        masks: MaskSet,
        decay: float = 0.96,
        *,
        loss_reduction: str = "mean",
        process_group: dist.ProcessGroup | None = None,
    ) -> Tensor | None:
        """Fold ``1/2 mean_n g'^2`` into each mask's signal as ``Fisher.update`` folds
        ``1/2 mean_n g^2`` (a mask without records under ``observing`` gets the plain
        signal), and keep the coupled masks' ``g'`` for ``importance``. Changes: the signals;
        the sums paired so far are dropped (the means go on over the ``observing`` block).

        Raises:
            ValueError: ``torch.distributed`` runs more than one process.
        """
        if in_group():
            raise ValueError(
                "fisher_mean reads this process's activations and gradients only: run "
                "prune_to_target on one process, or give criterion='fisher'"
            )
        decay, mean = check_decay(decay), check_loss_reduction(loss_reduction) == "mean"
        self._pair()
        self._corrected = {}
        taken: dict[str, Any] = {}
        for name, m in as_mask_dict(masks).items():
            record = self._records.get(name)
            if record is None:
                taken[name] = m.take_statistics(loss_reduction, self.statistic, self.degree)
                continue
            abar, kept = record.means(), []
            statistic = self._keeping(record, abar, mean, kept) if record.coupled else None
            got = m.take_statistics(loss_reduction, statistic or self.statistic, self.degree)
            fix = record.correction(abar, lambda n: float(n**self.degree) if mean else 1.0)
            if got is not None and fix is not None and not record.coupled:
                total, scale, count = got
                got = ((total * scale + fix.to(total.device)).clamp_min(0.0), 1.0, count)
            if kept:
                self._corrected[name] = torch.cat(kept)
            taken[name] = got
            record.sums, record.shifts, record.slots, record.seen = {}, {}, {}, 0
        return fold_totals(masks, taken, decay, factor=self.factor, process_group=process_group)

    def _keeping(
        self, record: _MaskRecord, abar: Tensor, mean: bool, kept: list[Tensor]
    ) -> Callable[[Tensor], Tensor]:
        """The statistic of a coupled mask: each pass's ``g'`` squared; ``g'`` itself is added
        to ``kept`` per example (a mean-reduced loss's 1/N undone) for the joint increments."""
        at = itertools.count()

        def statistic(g: Tensor) -> Tensor:
            g = g.double()
            shift = record.shifts.pop(next(at), None)
            if shift is not None:
                rows, s_all = shift
                g = g - torch.einsum("pc,pnc->nc", abar[rows].to(g.device), s_all)
            kept.append((g * (g.shape[0] if mean else 1)).cpu())
            return torch.linalg.vecdot(g, g, dim=0)

        return statistic

    @torch.no_grad()
    def importance(self, masks: Mapping[str, MaskLayer], model: nn.Module) -> dict[str, Tensor]:
        """Each mask's signal; on a coupled mask, each kept channel's joint increment (never
        below its signal) in the order of the signal. Pruned channels keep their signal."""
        out: dict[str, Tensor] = {}
        for name, m in masks.items():
            score = m.signal.detach().double().cpu()
            g = self._corrected.get(name)
            out[name] = joint_increments(score, g, m.mask) if g is not None else score.clone()
        return out

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "joint": self.joint}

    def __repr__(self) -> str:
        return f"FisherMean(joint={self.joint!r})"
