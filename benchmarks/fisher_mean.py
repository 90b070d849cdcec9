"""``FisherMean``: the Fisher signal of replacing a channel by its mean, not by 0 (a candidate
default for issue 31, point 2; ``one_shot_defaults.py``'s ``fisher_mean``).

``prune_to_target``'s repair refits each consumer of a removed channel with its bias, so the
channel is in effect replaced by its mean activation ``abar_k`` (as the consumer reads it),
not by 0. To first order the loss change of example ``n`` is then

    g'[n, k] = sum over positions of (x[n, k, pos] - abar_k) * dL/dx[n, k, pos]
             = g[n, k] - abar_k * s[n, k],

with ``g`` the mask gradient ``criteria.Fisher`` squares and ``s[n, k]`` the per-example sum
over positions of the loss gradient w.r.t. the masked input (the gradient of an additive shift
of the channel). The importance is ``1/2 mean_n g'[n, k]^2``. A mask read at several places
sums ``g'`` over them, each place with its own mean (each consumer gets its own bias).

``observing`` (``prune_to_target`` runs a gradient criterion's signal passes in it) adds one
forward pre-hook per masked consumer input, after the mask's (``activation.hook_points``): it
sums the masked input for ``abar`` and hooks the input's gradient for ``s``. ``abar`` is the
mean over every pass of the ``with`` block, i.e. of the current round's whole calibration
set: ``s`` is kept per pass and the correction is made in ``update``, after every pass. An
input several consumers share (one product of identical mask points) counts once. Masks placed
elsewhere than at a consumer's input (at a norm, at a module output) get no correction there.
One process only: the corrections of other ranks are not gathered.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fisherprune.criteria import Fisher
from fisherprune.masks import MaskLayer, MaskSet, as_mask_dict
from fisherprune.masks.points import MaskPoint
from fisherprune.masks.row_tracker import to_examples
from fisherprune.signals.activation import hook_points


class _Passes:
    """The forward passes seen under ``observing``: their count, and the masked inputs hooked
    in the current one (so that an input several consumers share is hooked once)."""

    def __init__(self) -> None:
        self.count = -1
        self.hooked: dict[int, Tensor] = {}  # id -> tensor, kept alive for the pass

    def start(self, module: nn.Module, args: tuple) -> None:
        self.count += 1
        self.hooked = {}


class _Place:
    """One masked consumer input: the sum of its values per position of the masked dim (for
    ``abar``) and, per pass, the per-example sum of its gradient per position (``s``)."""

    def __init__(self, point: MaskPoint, passes: _Passes) -> None:
        self.point, self.passes = point, passes
        self.sum: Tensor | None = None  # (size,) float64
        self.rows = 0
        self.shift: dict[int, Tensor] = {}  # pass -> (N, size) float64

    def __call__(self, module: nn.Module, args: tuple) -> None:
        x = args[self.point.arg]
        if not torch.is_grad_enabled() or not x.requires_grad or id(x) in self.passes.hooked:
            return
        self.passes.hooked[id(x)] = x
        d = self.point.dim % x.dim()
        part = x.detach().double().sum([i for i in range(x.dim()) if i != d])
        self.sum = part if self.sum is None else self.sum + part
        self.rows += x.numel() // self.point.size
        reduce = to_examples(self.point.rows.kind, x, self.point.probe, self.point.scope)
        x.register_hook(self._gradient_hook(self.passes.count, reduce or None))

    def _gradient_hook(self, at: int, reduce: Any) -> Any:
        def hook(grad: Tensor) -> None:
            b, d = self.point.rows.dim % grad.dim(), self.point.dim % grad.dim()
            others = [i for i in range(grad.dim()) if i not in (b, d)]
            s = grad.detach().double()
            s = s.sum(others) if others else s  # (an empty list would sum every dim)
            s = s if b < d else s.t()  # (rows, size)
            s = s if reduce is None else reduce(s)  # (N, size)
            self.shift[at] = s if at not in self.shift else self.shift[at] + s

        return hook

    def mean(self) -> Tensor:
        """``abar`` per position (float64, CPU)."""
        assert self.sum is not None
        return self.sum.cpu() / self.rows


class FisherMean(Fisher):
    """``1/2 mean_n (g[n,k] - abar_k s[n,k])^2``: the Fisher signal of replacing each channel
    by its mean (module docstring). Changes nothing but its own record of the last
    ``observing`` block's means and gradient sums."""

    def __init__(self) -> None:
        super().__init__()
        self._places: list[_Place] = []
        self._corrections: list[Tensor] = []  # of the mask being folded, per pass

    @contextmanager
    def observing(self, model: nn.Module, masks: Mapping[str, MaskLayer]) -> Iterator[None]:
        """Within the ``with`` block, every forward with gradients adds each masked consumer
        input's sums and hooks its gradient (those of earlier blocks are dropped on entry).
        Changes: adds one forward pre-hook per masked consumer and one on ``model``, removed
        on exit, and one gradient hook per masked input; outputs and gradients are unchanged.
        """
        passes = _Passes()
        self._places, handles = hook_points(model, lambda p: _Place(p, passes), "fisher_mean")
        handles.append(model.register_forward_pre_hook(passes.start))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _corrections_of(self, mask: MaskLayer) -> list[Tensor]:
        """Per pass: ``sum over places of abar * s`` in the mask's channels, (N, C) float64."""
        out: dict[int, Tensor] = {}
        for place in self._places:
            parts = [(pos, idx) for m, pos, idx in place.point.parts if m is mask]
            if not parts or not place.shift:
                continue
            abar = place.mean()
            for at, s in place.shift.items():
                t = s.cpu() * abar  # (N, size)
                c = out.setdefault(at, t.new_zeros(t.shape[0], mask.num_channels))
                for pos, idx in parts:
                    c.index_add_(1, idx, t[:, pos])
        return [out[at] for at in sorted(out)]

    def statistic(self, g: Tensor) -> Tensor:
        """``Fisher.statistic`` of ``g - abar * s`` for this pass."""
        if self._corrections:
            c = self._corrections.pop(0)
            if c.shape != g.shape:
                raise ValueError(f"fisher_mean: pass of shape {tuple(g.shape)}, shift {c.shape}")
            g = g - c.to(g)
        return super().statistic(g)

    def update(
        self,
        masks: MaskSet,
        decay: float = 0.96,
        *,
        loss_reduction: str = "mean",
        process_group: dist.ProcessGroup | None = None,
    ) -> Tensor | None:
        """``Fisher.update`` one mask at a time, each pass's ``g`` corrected first; the
        gradient sums are then dropped (the means are kept for the block).

        Raises:
            ValueError: ``torch.distributed`` runs more than one process, or a mask's passes
                do not match the gradient sums recorded under ``observing``.
        """
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("fisher_mean corrects this process's gradients only: one process")
        skipped = None
        for name, m in as_mask_dict(masks).items():
            self._corrections = self._corrections_of(m)
            got = super().update({name: m}, decay, loss_reduction=loss_reduction,
                                 process_group=process_group)  # fmt: skip
            if self._corrections:
                raise ValueError(f"fisher_mean: mask {name!r} got fewer passes than shifts")
            if got is not None:
                skipped = got if skipped is None else skipped + got
        for place in self._places:
            place.shift = {}
        return skipped
