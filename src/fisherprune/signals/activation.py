"""``Activation``: activation-weighted weight magnitude, structured (after Wanda and FLAP).

Wanda (Sun et al. 2023, "A Simple and Effective Pruning Approach for Large Language Models")
scores one weight ``W[i, j]`` of a layer by ``|W[i, j]| * ||X_j||_2``, the weight's size times
the norm of the input feature it reads over the calibration tokens; FLAP (An et al. 2024,
"Fluctuation-based Adaptive Structured Pruning for Large Language Models") scores a whole
input channel of a layer by the channel's activation statistics times the squared norm of the
weight column that reads it. Here a channel ``k`` of a group scores

    importance[k] = sum over consumers c, over the input columns j of c that carry k, of
                    ||W_c[:, j]||_2 * RMS_c(x_j)

with ``RMS_c(x_j) = sqrt(mean over every calibration row and position of x_j^2)``, measured
on the input of consumer ``c`` as the model is masked now (pruned channels read 0); a recurrent
layer's ``W_c`` is its first layer's input weights, each direction's. Each term
is the root-mean-square size of what column ``j`` adds to ``c``'s output, ``||W_c[:, j] x_j||``,
so a channel is worth what it writes into the layers that read it. Rows of ``W_c`` that make an
already pruned channel of another group are left out of the norm, as in ``L1``.

The statistics come from forward passes only (no gradient): ``observing`` hooks the inputs of
the modules ``apply_masks`` masks, and ``prune_to_target`` runs the calibration batches under
it before every round. A consumer whose weight has no input dim (dim 1) as wide as its masked
input (a depthwise or grouped conv) adds nothing.

A whole block (entry ``i`` of a ``BlockGate``) scores in the same unit: the root-mean-square
size of what it writes into the residual stream, ``sqrt(mean over rows of ||block_i(x) -
x||_2^2)`` (rows: every calibration example and position), from a forward hook on the block,
so that blocks rank against channels in one budget (``blocks=True``); after ShortGPT's block
influence (Men et al. 2024), which measures the same change as one minus a cosine. Experts
(``ExpertGate``) have no such score here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from fisherprune.masks import MaskLayer
from fisherprune.masks.blocks import BlockGate, block_input, block_output
from fisherprune.masks.points import MaskPoint, find_holder
from fisherprune.signals.criteria import (
    Criterion,
    alive_along,
    groups_of,
    register_criterion,
)

__all__ = ["Activation", "hook_points"]

#: elements of a half-precision activation widened to float32 at a time by ``_sum_squares``
WIDEN_CHUNK = 1 << 16


def _sum_squares(x: Tensor, keep: int | None = None) -> Tensor:
    """The sum of ``x ** 2`` over every dim but ``keep`` (over all of them with None).

    Float32 and float64 are squared and summed as they are. Half precision is summed in
    float32 and widened a slice at a time (along the largest dim other than ``keep``, about
    ``WIDEN_CHUNK`` elements each): no float32 copy of the whole activation is made, and a
    float16 value past 256, whose square float16 cannot hold, still counts."""
    keep = None if keep is None else keep % x.dim()
    others = [d for d in range(x.dim()) if d != keep]
    if x.dtype in (torch.float32, torch.float64):
        return x.square().sum(dim=others)
    if x.numel() <= WIDEN_CHUNK:
        return x.float().square().sum(dim=others)
    along = max(others, key=lambda d: x.shape[d], default=0)
    step = max(1, WIDEN_CHUNK * x.shape[along] // max(1, x.numel()))
    parts = (c.float().square().sum(dim=others) for c in x.split(step, dim=along))
    return torch.stack(list(parts)).sum(0)


class _InputSquares:
    """The per-position sum of squares of one mask point's module input, and how many rows
    (elements per position) went into it."""

    def __init__(self, point: MaskPoint) -> None:
        self.point = point
        self.sum: Tensor | None = None  # (size,) on the input's device, never read back there
        self.rows = 0

    def __call__(self, module: nn.Module, args: tuple) -> None:
        x = args[self.point.arg].detach()
        part = _sum_squares(x, self.point.dim)
        self.sum = part if self.sum is None else self.sum + part
        self.rows += x.numel() // self.point.size

    def rms(self) -> Tensor:
        """The root-mean-square of each position over every row seen (float64, CPU)."""
        assert self.sum is not None, "no forward pass was observed"
        return (self.sum.double().cpu() / self.rows).sqrt()


class _BlockChanges:
    """The summed squared size of what one block writes into the residual stream, and how
    many rows (example positions) went into it: a forward hook (``with_kwargs``) on the block,
    registered after its gate's, so a block gated off adds 0."""

    def __init__(self) -> None:
        self.sum: Tensor | None = None  # () on the output's device, never read back there
        self.rows = 0

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        x, (y, _) = block_input(args, kwargs), block_output(out)
        if x is None or y is None or x.shape != y.shape:
            return  # a block whose hidden state this cannot find: its gate is left unscored
        d = y.detach() - x.detach()  # in the activations' dtype: no widened copy of them
        part = _sum_squares(d)
        self.sum = part if self.sum is None else self.sum + part
        self.rows += d.numel() // max(1, d.shape[-1])

    def rms(self) -> float:
        """``sqrt(mean over rows of ||change||^2)`` (0 before any forward pass)."""
        return 0.0 if self.sum is None else float((self.sum.double().cpu() / self.rows).sqrt())


H = TypeVar("H", bound=Callable[[nn.Module, tuple], None])


def hook_points(
    model: nn.Module, make: Callable[[MaskPoint], H], criterion: str
) -> tuple[list[H], list[RemovableHandle]]:
    """One forward pre-hook ``make(point)`` on every module input ``apply_masks`` masks: it
    sees that input as masked now (pruned channels read 0), after the mask's own hook.

    Changes: adds the hooks; the caller removes them through the returned handles.

    Raises:
        ValueError: the model has no masks placed by ``apply_masks`` (``criterion`` names who
            needs them).
    """
    found = find_holder(model)
    if found is None or not found[1].points:
        raise ValueError(
            f"the {criterion} criterion reads the inputs of the layers apply_masks masks: "
            "call fisherprune.apply_masks(model, example_inputs) first"
        )
    modules = dict(model.named_modules())
    points = found[1].points
    hooks = [make(p) for p in points]
    pairs = zip(points, hooks, strict=True)
    return hooks, [modules[p.module_name].register_forward_pre_hook(h) for p, h in pairs]


@register_criterion("activation")
class Activation(Criterion):
    """Activation-weighted magnitude (module docstring): ``sum_c sum_j ||W_c[:, j]||_2 *
    RMS(x_j)`` over the consumers of each channel, from forward statistics only.

    Args:
        normalize: default ``"none"``: the importances are in one unit everywhere (the size
            of what a channel writes into its readers), so groups rank against each other as
            they are. ``"mean"`` (as ``L1``'s default) scaled each group to mean 1 and, weighed
            against the cost, pruned the most expensive channels first whatever they carry:
            held-out perplexity 76.3 against 54.4 at 65% of a decoder's parameters
            (benchmarks/lm_quality.py).
    """

    uses_activations: ClassVar[bool] = True

    def __init__(self, normalize: str = "none") -> None:
        super().__init__(normalize)
        self._squares: list[_InputSquares] = []
        self._blocks: dict[str, list[_BlockChanges]] = {}  # per BlockGate name, per block

    @contextmanager
    def observing(self, model: nn.Module, masks: Mapping[str, MaskLayer]) -> Iterator[None]:
        """Within the ``with`` block, every forward of ``model`` adds its consumers' input
        statistics and, for a ``BlockGate`` among ``masks``, the size of each gated block's
        change (those of earlier ``with`` blocks are dropped on entry). Changes: adds one
        forward pre-hook per masked consumer and one forward hook per gated block, removed on
        exit; the model's outputs are unchanged.

        Raises:
            ValueError: the model has no masks placed by ``apply_masks``.
        """
        self._squares, handles = hook_points(model, _InputSquares, "activation")
        modules = dict(model.named_modules())
        gates = {n: m for n, m in masks.items() if isinstance(m, BlockGate)}
        self._blocks = {n: [_BlockChanges() for _ in g.block_names()] for n, g in gates.items()}
        for n, g in gates.items():
            for block, hook in zip(g.block_names(), self._blocks[n], strict=True):
                handles.append(modules[block].register_forward_hook(hook, with_kwargs=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def importance(self, masks: Mapping[str, MaskLayer], model: nn.Module) -> dict[str, Tensor]:
        if not any(s.rows for s in self._squares):
            raise ValueError(
                "the activation criterion has seen no forward pass: run the calibration data "
                "under criterion.observing(model, masks), as prune_to_target does"
            )
        channels = {n: m for n, m in masks.items() if n not in self._blocks}
        groups = groups_of(channels, model)
        kept_rows = alive_along(channels, groups)
        params = dict(model.named_parameters())
        name_of = {id(m): n for n, m in masks.items()}
        out = {n: torch.zeros(m.num_channels, dtype=torch.float64) for n, m in masks.items()}
        scored: set[str] = set()
        for s in self._squares:
            wnames = [
                n
                for n in _input_weights(s.point.module_name, params)
                if params[n].dim() >= 2 and params[n].shape[1] == s.point.size
            ]
            if not s.rows or not wnames:
                continue
            norms = sum(_column_norms(params[n], n, kept_rows) for n in wnames)
            contrib = norms * s.rms()  # (size,)
            for mask, pos, idx in s.point.parts:
                name = name_of.get(id(mask))
                if name is not None:
                    out[name].index_add_(0, idx, contrib[pos])
                    scored.add(name)
        for name, changes in self._blocks.items():
            if name in out and all(c.rows for c in changes):  # an unrun block is not 0
                out[name] = torch.tensor([c.rms() for c in changes], dtype=torch.float64)
                scored.add(name)
        missing = [n for n in masks if n not in scored]
        if missing:
            raise ValueError(
                f"mask(s) {missing} have no consumer with a weight that reads them along dim 1 "
                "(an expert gate, a depthwise conv, a block no forward ran or whose hidden state "
                "was not found): the activation criterion cannot score them; use fisher, taylor "
                "or random there"
            )
        return out


#: the weights of a recurrent layer that read its input (its first layer's, both directions)
_RECURRENT_INPUT_WEIGHTS = ("weight_ih_l0", "weight_ih_l0_reverse")


def _input_weights(module: str, params: Mapping[str, Tensor]) -> list[str]:
    """The weights of ``module`` that read its input along dim 1: its ``weight``, or a
    recurrent layer's first input weights (each direction's)."""
    if f"{module}.weight" in params:
        return [f"{module}.weight"]
    return [n for w in _RECURRENT_INPUT_WEIGHTS if (n := f"{module}.{w}") in params]


def _column_norms(w: Tensor, wname: str, kept_rows: Mapping[tuple[str, int], Any]) -> Tensor:
    """``||w[:, j]||_2`` for every input column ``j``, in float64, leaving out the slices of
    the other dims that make an already pruned channel."""
    w = w.detach().double().cpu()
    for (other, odim), keep in kept_rows.items():
        if other == wname and odim != 1 and keep.numel() == w.shape[odim]:
            shape = [1] * w.dim()
            shape[odim] = -1
            w = w * keep.to(w.dtype).view(shape)
    return w.movedim(1, 0).flatten(1).norm(dim=1)
