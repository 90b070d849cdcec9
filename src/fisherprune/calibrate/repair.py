"""Repair without retraining: refit the layers that read removed channels by least squares.

After channels are chosen, every ``nn.Linear`` / ``nn.Conv1d`` / ``nn.Conv2d`` (``groups=1``)
whose input a mask thins has its weights on the kept input features (and its bias, when it has
one) refitted so that its output on the calibration data matches the dense model's output
(He et al. 2017, "Channel Pruning"; Kwon et al. 2022's "mask tuning" fits per-channel scales,
this fits the whole kept weight, or the scales when the data are few).

Sequential (the default): the layers are fitted in the order the forward runs them, each on
the input it gets in the PRUNED model whose earlier layers are already repaired, towards the
DENSE model's output of that layer. In a residual network the error of the pruned layers is
carried by the residual stream, so a later layer's real input differs from its dense input: a
fit on dense inputs (``sequential=False``, every layer from one pass) then fits the wrong
problem and can make a transformer worse (MiniLM: benchmarks/post_training.py). The layers are
grouped into stages: consecutive layers (in forward order) reading the same input tensor (the
query, key and value of an attention block; a ResNet block's first conv and its shortcut) form
one stage. Each stage costs one pass over the batches, two forwards per batch cut short after
the stage's last layer: the dense one (the masks set to ``dense_masks``, the repaired layers'
original weights swapped in by ``torch.func.functional_call``) gives the targets, the pruned
one the inputs. So a pass per repaired depth: MiniLM (6 blocks, heads and FFN thinned) has 12
stages, about 12 forwards' worth of compute in all.

The solve, per layer: with ``k`` kept input features (kept channels x kernel size for a conv,
+1 for the bias), the pass streams ``X^T X`` (k x k) and ``X^T Y`` (k x outputs) over the
batches (rows: every token of a linear layer; ``positions`` random output positions per image
for a conv: He et al. sample 10), each batch's products in the layer's dtype and their sum in
float64. Then, from those sums alone:

* with at least ``rows_per_weight`` rows per feature, every kept weight and the bias:
  ``(X^T X + lambda I) W = X^T Y``;
* else one scale per kept input channel and the bias (Kwon et al.'s mask tuning): ``k``
  unknowns instead of ``k x outputs``, which a few hundred calibration sentences cannot overfit.

Both by ``torch.linalg.solve`` in float64 with ``lambda = ridge * mean diagonal``, the ridge
pulling towards the unrepaired layer (weights: ``(X^T X + lambda I) W = X^T Y + lambda W_0``;
scales: towards 1), not towards 0, so that with a few calibration examples, or text unlike
what the model will see, the fit stays near the trained weights (a singular
system, possible only with ``ridge=0``, gets the minimum-norm solution). A refit is kept only if
it lowers the layer's error on the calibration data below that of its unrepaired weights (on
the same inputs), so the repair never makes a layer worse there. Memory ``8 k^2`` bytes per
layer of the stage being fitted (a ResNet-50 3x3 conv reading 512 channels: k = 4608, 170 MB),
one batch of the stage's dense outputs, and a copy of the repaired layers' original weights;
layers with more than ``max_features`` kept features are left as they are and reported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fisherprune.inputs import batch_size, call_model
from fisherprune.masks import MaskLayer
from fisherprune.masks.points import MaskPoint, find_holder, no_fold
from fisherprune.modes import eval_mode

__all__ = ["REPAIRABLE", "RepairReport", "repair_consumers"]


@dataclass
class RepairReport:
    """What ``repair_consumers`` changed.

    Attributes:
        layers: per repaired module, ``(kept input features, relative error before, after)``:
            the squared error of its output against the dense output on the calibration data,
            over the dense output's sum of squares, with the original kept weights and with
            the refitted ones.
        skipped: modules that read removed channels but were left as they are, and why.
        modes: per repaired module, ``"weights"`` (every kept weight refitted) or ``"scales"``
            (one scale per kept input channel).
        examples: calibration examples the fit saw.
    """

    layers: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    examples: int = 0
    modes: dict[str, str] = field(default_factory=dict)


# ----------------------------------------------------------- rows of the fit, per layer type
#: ``sample(n)``: the indices of the output positions (of ``n``) that a batch's fit reads
Sampler = Callable[[int], Tensor]


def _linear_rows(mod: nn.Module, x: Tensor, y: Tensor, kept: Tensor, sample: Sampler) -> Any:
    """(rows, kept in-features) inputs and (rows, out-features) outputs: every token."""
    return x.reshape(-1, x.shape[-1])[:, kept], y.reshape(-1, y.shape[-1])


def _conv_padding(mod: nn.Module) -> list[tuple[int, int]]:
    """(before, after) zero padding of each spatial dim of a conv."""
    kernel, dil = mod.kernel_size, mod.dilation
    if mod.padding == "valid":
        return [(0, 0)] * len(kernel)
    if mod.padding == "same":
        total = [d * (k - 1) for k, d in zip(kernel, dil, strict=True)]
        return [(t // 2, t - t // 2) for t in total]
    return [(p, p) for p in mod.padding]


def _conv_rows(mod: nn.Module, x: Tensor, y: Tensor, kept: Tensor, sample: Sampler) -> Any:
    """Patches at ``sample(H_out * W_out)`` output positions (the same for every image of the
    batch): (N * P, kept channels * kernel) inputs, (N * P, out channels) outputs."""
    if x.dim() == 3:  # Conv1d: a 2-d conv of height 1
        x, y = x.unsqueeze(2), y.unsqueeze(2)
        kernel, stride, dil = (1, *mod.kernel_size), (1, *mod.stride), (1, *mod.dilation)
        pad = [(0, 0), *_conv_padding(mod)]
    else:
        kernel, stride, dil, pad = mod.kernel_size, mod.stride, mod.dilation, _conv_padding(mod)
    xp = F.pad(x[:, kept], (*pad[1], *pad[0]))  # (N, k, H + pads, W + pads)
    oh_, ow_ = y.shape[2], y.shape[3]
    pick = sample(oh_ * ow_).to(x.device)
    oh, ow = pick // ow_, pick % ow_  # (P,)
    rows = oh[:, None] * stride[0] + torch.arange(kernel[0], device=x.device) * dil[0]
    cols = ow[:, None] * stride[1] + torch.arange(kernel[1], device=x.device) * dil[1]
    patches = xp[:, :, rows[:, :, None], cols[:, None, :]]  # (N, k, P, kh, kw)
    xs = patches.permute(0, 2, 1, 3, 4).reshape(-1, kept.numel() * kernel[0] * kernel[1])
    ys = y[:, :, oh, ow].permute(0, 2, 1).reshape(-1, y.shape[1])  # (N * P, out)
    return xs, ys


#: how to read one layer type's fitting rows (inputs on its kept channels, outputs)
REPAIRABLE: dict[type[nn.Module], Callable[..., Any]] = {
    nn.Linear: _linear_rows,
    nn.Conv1d: _conv_rows,
    nn.Conv2d: _conv_rows,
}


# ---------------------------------------------------------------------------- the fit
class _Fit:
    """The streamed sums of one layer's least-squares problem."""

    def __init__(self, mod: nn.Module, kept: Tensor, dim: int, positions: int) -> None:
        self.mod, self.kept, self.dim, self.positions = mod, kept, dim, positions
        self.generator = torch.Generator().manual_seed(0)  # its own stream: global RNG untouched
        #: why the layer turned out not to be fittable during the pass (None: it is)
        self.invalid: str | None = None
        self.rows = REPAIRABLE[type(mod)]
        w = mod.weight
        self.kernel = int(w[0, 0].numel())
        self.features = kept.numel() * self.kernel + (mod.bias is not None)
        # allocated by the first call and released by the solve: one stage's sums at a time
        self.xtx = self.xty = torch.empty(0, dtype=torch.float64)
        self.yty = 0.0
        self.count = 0  # rows seen
        #: fit on the dense pass's own inputs (the one-pass repair)
        self.dense_inputs = False
        #: dense outputs of the current batch's calls, waiting for the pruned pass's inputs
        self.targets: list[Tensor] = []
        #: the forward running is the pruned model's
        self.pruned = False

    def hook(self, mod: nn.Module, args: tuple, out: Tensor) -> None:
        """Forward hook. Dense pass: keep this call's output as a target (with
        ``dense_inputs``, fit it on this call's input at once). Pruned pass (``pruned``): fit
        the dense target of the same call on this call's input."""
        x = args[0].detach()
        if self.dense_inputs:
            self.add(x, out.detach())
        elif not self.pruned:
            self.targets.append(out.detach())
        elif self.targets:
            self.add(x, self.targets.pop(0))
        else:
            self.invalid = "the pruned model calls it more often than the dense one"

    def add(self, x: Tensor, y: Tensor) -> None:
        """Add one call's rows (input ``x``, target output ``y``) to the sums."""
        if isinstance(self.mod, nn.Linear) and self.dim != x.dim() - 1:
            self.invalid = "the mask is not on the features (last) dim"
        if self.invalid is not None:
            return
        x, y = self.rows(self.mod, x, y, self.kept, self.sample)
        if self.mod.bias is not None:
            x = torch.cat([x, x.new_ones(x.shape[0], 1)], 1)
        if self.count == 0:
            self.xtx = x.new_zeros(x.shape[1], x.shape[1], dtype=torch.float64)
            self.xty = x.new_zeros(x.shape[1], y.shape[1], dtype=torch.float64)
        # one batch's products in the layer's dtype (float64 matmuls are several times slower
        # on CPU), summed over batches in float64
        self.xtx += (x.T @ x).double()
        self.xty += (x.T @ y).double()
        self.yty += float(y.double().square().sum())
        self.count += x.shape[0]

    def sample(self, n: int) -> Tensor:
        """``positions`` of ``n`` output positions, at random without replacement."""
        return torch.randperm(n, generator=self.generator)[: self.positions]

    def current(self) -> Tensor:
        """The layer's weights as the fit's unknowns: (features, out)."""
        w = self.mod.weight.detach().double()
        cols = w[:, self.kept].reshape(w.shape[0], -1)
        if self.mod.bias is not None:
            cols = torch.cat([cols, self.mod.bias.detach().double()[:, None]], 1)
        return cols.T

    def error(self, coef: Tensor) -> float:
        """``||Y - X coef||^2 / ||Y||^2`` from the streamed sums."""
        sq = self.yty - 2 * float((coef * self.xty).sum()) + float((coef * (self.xtx @ coef)).sum())
        return max(sq, 0.0) / max(self.yty, 1e-300)

    def _solve(self, a: Tensor, b: Tensor, ridge: float, prior: Tensor) -> Tensor:
        """``(a + lambda I)^-1 (b + lambda prior)`` with ``lambda = ridge * mean diagonal of
        a``: the least-squares solution pulled towards ``prior`` (the unrepaired layer)."""
        lam = ridge * float(torch.diagonal(a).mean())
        a = a + lam * torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
        b = b + lam * prior
        x, info = torch.linalg.solve_ex(a, b)
        if int(info) != 0:  # singular (a dead input with ridge 0): the minimum-norm solution
            x = torch.linalg.lstsq(a.cpu(), b.cpu(), driver="gelsd").solution.to(a.device)
        return x

    def weights_coef(self, ridge: float) -> Tensor:
        """Every kept weight (and the bias) refitted: (features, out)."""
        return self._solve(self.xtx, self.xty, ridge, self.current())

    def scales_coef(self, ridge: float) -> Tensor:
        """One scale per kept input channel (all its kernel taps) times the current weights,
        and the bias refitted (Kwon et al.'s mask tuning): (features, out). With ``Z_c`` the
        output contribution of channel c, ``Z_c^T Z_d`` is read off the streamed sums as the
        block sums of ``X^T X * (W^T W)`` over the taps, so no more data is needed."""
        k, taps = self.kept.numel(), self.kernel
        n_w = k * taps
        w = self.current()[:n_w]  # (n_w, out)
        xtx, xty = self.xtx[:n_w, :n_w], self.xty[:n_w]
        if self.mod.bias is not None:  # centre: the bias absorbs the means
            n = self.xtx[n_w, n_w]
            mu, nu = self.xtx[:n_w, n_w] / n, self.xty[n_w] / n
            xtx = xtx - n * torch.outer(mu, mu)
            xty = xty - n * torch.outer(mu, nu)
        gram = (xtx * (w @ w.T)).view(k, taps, k, taps).sum((1, 3))  # (k, k)
        rhs = (xty * w).sum(1).view(k, taps).sum(1)  # (k,)
        scale = self._solve(gram, rhs[:, None], ridge, torch.ones_like(rhs[:, None]))[:, 0]
        coef = w * scale.repeat_interleave(taps)[:, None]
        if self.mod.bias is not None:
            coef = torch.cat([coef, (nu - coef.T @ mu)[None]])
        return coef

    def solve_and_set(self, ridge: float, rows_per_weight: float) -> tuple[str, float, float]:
        """Refit the kept weights and bias (``"weights"``) when the pass saw at least
        ``rows_per_weight`` rows per feature, else one scale per kept channel (``"scales"``:
        ``k`` unknowns, which a small calibration set cannot overfit as it can ``k x out``);
        zero the removed columns. Returns the mode and the relative errors before and after.
        Changes the module's ``weight`` (and ``bias``) in place, unless the fit is no better;
        releases the sums."""
        before = self.error(self.current())
        full = self.count >= rows_per_weight * self.features
        coef = self.weights_coef(ridge) if full else self.scales_coef(ridge)
        mode = "weights" if full else "scales"
        after = self.error(coef)
        self.xtx = self.xty = torch.empty(0, dtype=torch.float64)
        if not after < before:  # the ridge fit can only lose on nearly singular data
            return mode, before, before
        w = self.mod.weight
        n_w = self.kept.numel() * self.kernel
        with torch.no_grad():
            new = coef[:n_w].T.reshape(w.shape[0], self.kept.numel(), *w.shape[2:])
            w.zero_()  # removed columns stay zero, as the mask has them
            w[:, self.kept] = new.to(w.dtype)
            if self.mod.bias is not None:
                self.mod.bias.copy_(coef[n_w].to(self.mod.bias.dtype))
        return mode, before, after


def _kept_positions(point: MaskPoint) -> Tensor:
    """Indices along the masked dim of ``point`` that no mask removes."""
    keep = torch.ones(point.size, dtype=torch.bool)
    for m, pos, idx in point.parts:
        keep[pos] = m.mask.detach().cpu()[idx] > 0.5
    return torch.nonzero(keep).flatten()


def _fits(
    model: nn.Module, positions: int, max_features: int, report: RepairReport
) -> dict[str, _Fit]:
    found = find_holder(model)
    points = found[1].points if found else []
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    fits: dict[str, _Fit] = {}
    for point in points:
        kept = _kept_positions(point)
        if kept.numel() == point.size:
            continue
        name = point.module_name
        mod = model.get_submodule(name) if name != "<model>" else model
        why = _unrepairable(mod, point, counts, kept)
        if why is None and kept.numel() * mod.weight[0, 0].numel() + 1 > max_features:
            why = f"{kept.numel() * mod.weight[0, 0].numel()} kept features > max_features"
        if why is not None:
            report.skipped[name] = why
            continue
        if name not in fits:  # a module masked on several inputs: its first one
            fits[name] = _Fit(mod, kept.to(mod.weight.device), point.dim, positions)
    return fits


def _unrepairable(
    mod: nn.Module, point: MaskPoint, counts: dict[int, int], kept: Tensor
) -> str | None:
    """Why ``mod`` cannot be refitted on the kept inputs of ``point``, or None."""
    if type(mod) not in REPAIRABLE:
        return f"{type(mod).__name__} has no least-squares repair"
    if point.arg != 0:
        return "the mask is not on its first input"
    if not isinstance(mod, nn.Linear) and (point.dim != 1 or mod.groups != 1):
        return "a grouped conv, or a mask off the channel dim"
    if getattr(mod, "padding_mode", "zeros") != "zeros":
        return f"padding_mode {mod.padding_mode!r}"
    if any(counts[id(p)] > 1 for p in mod.parameters(recurse=False)):
        return "its weights are shared with another module"
    if kept.numel() == 0:
        return "every input channel is removed"
    removed = torch.ones(point.size, dtype=torch.bool)
    removed[kept] = False
    if not bool(mod.weight.detach()[:, removed.to(mod.weight.device)].any()):
        return (
            "the weights reading the removed channels are already zero (a forward pass of the "
            "pruned model folded the masks into them), so the dense outputs are gone: repair "
            "before running the pruned model"
        )
    return None


class _StageDone(Exception):
    """Raised by a forward hook to cut a forward short after the stage's last layer."""


class _Stop:
    """Forward hook that ends the forward at the ``calls``-th call of its module."""

    def __init__(self, calls: int) -> None:
        self.calls, self.seen = calls, 0

    def __call__(self, mod: nn.Module, args: tuple, out: Tensor) -> None:
        self.seen += 1
        if self.seen >= self.calls:
            raise _StageDone


def _stages(model: nn.Module, fits: dict[str, _Fit], inputs: Any) -> list[list[str]]:
    """The fitted layers in the order one forward of ``inputs`` calls them (each by its first
    call), consecutive ones reading the same input tensor grouped into a stage."""
    order: list[tuple[str, Tensor]] = []
    handles = [
        fit.mod.register_forward_hook(lambda mod, a, o, n=n: order.append((n, a[0])))
        for n, fit in fits.items()
    ]
    try:
        call_model(model, inputs)
    finally:
        for h in handles:
            h.remove()
    stages: list[list[str]] = []
    seen: set[str] = set()
    prev: Tensor | None = None
    for name, x in order:
        if name not in seen:
            seen.add(name)
            if stages and x is prev:
                stages[-1].append(name)
            else:
                stages.append([name])
            prev = x
    stages.append([n for n, _ in order])  # the call sequence, for the stop points
    return stages


def _stop(stage: list[str], sequence: list[str]) -> tuple[str, int]:
    """The layer of ``stage`` called last in ``sequence`` and how often it is called."""
    end = max(stage, key=lambda n: len(sequence) - sequence[::-1].index(n))
    return end, sequence.count(end)


def _forward(model: Callable[..., Any], inputs: Any, stop: _Stop) -> None:
    """One forward, ended early by ``stop``."""
    stop.seen = 0
    with contextlib.suppress(_StageDone):
        call_model(model, inputs)


def repair_consumers(
    model: nn.Module,
    batches: Iterable[tuple[Any, Any]],
    dense_masks: dict[str, Tensor],
    *,
    ridge: float = 1e-3,
    positions: int = 10,
    max_features: int = 6144,
    rows_per_weight: float = 20.0,
    sequential: bool = True,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
) -> RepairReport:
    """Refit every layer that reads a removed channel so that, on the calibration inputs, its
    output matches the dense model's (module docstring: what is solved, in which order, and
    how big).

    Changes: the ``weight`` (and ``bias``) of each repaired layer, in place: the kept input
    columns are refitted, the removed ones set to 0 (so ``shrink`` gives the same outputs as
    the masked model). The masks are set to ``dense_masks`` during the dense forwards and
    given back as they were; masks never fold into weights during the passes; train/eval
    flags are given back; nothing else changes. A layer whose fit would not lower its error
    is left as it was.

    Args:
        model: a model masked by ``apply_masks``, with its channels chosen and not run since
            (a forward pass of a model whose masks no longer collect zeroes the weight columns
            of removed channels, and the dense outputs with them: such layers are skipped).
        batches: ``(inputs, targets)`` pairs (targets are ignored); read once per stage (an
            iterator is read into a list first).
        dense_masks: the mask values of the dense model, by mask name (``find_masks``).
        ridge: ``lambda`` relative to the mean diagonal of ``X^T X``.
        positions: output positions sampled per image and batch for a conv.
        max_features: layers with more kept input features are skipped (memory ``8 k^2``).
        rows_per_weight: refit every kept weight of a layer when the pass saw at least this
            many rows per feature; else fit one scale per kept input channel.
        sequential: fit each stage on the pruned, already repaired model's inputs (one pass
            per stage); False: every layer on the dense inputs from one pass (wrong for
            residual networks, kept for comparison).
        progress: wraps the stages (a progress bar), or None.

    Returns:
        The ``RepairReport``.

    Raises:
        ValueError: ``ridge`` < 0, ``positions`` < 1, or masks missing from ``dense_masks``.
    """
    if not ridge >= 0:
        raise ValueError(f"ridge must be >= 0, got {ridge!r}")
    if positions < 1:
        raise ValueError(f"positions must be >= 1, got {positions!r}")
    masks = {n: m for n, m in model.named_modules() if isinstance(m, MaskLayer)}
    missing = sorted(set(masks) - set(dense_masks))
    if missing:
        raise ValueError(f"dense_masks has no values for mask(s) {missing}")
    report = RepairReport()
    fits = _fits(model, positions, max_features, report)
    if not fits:
        return report
    if iter(batches) is batches:
        batches = list(batches)
    chosen = {n: m.mask.detach().clone() for n, m in masks.items()}
    originals = {
        f"{'' if name == '<model>' else name + '.'}{k}": p.detach().clone()
        for name, fit in fits.items()
        for k, p in fit.mod.named_parameters(recurse=False)
    }

    def dense(*args: Any, **kwargs: Any) -> Any:
        return functional_call(model, originals, args, kwargs)

    def set_masks(values: dict[str, Tensor]) -> None:
        for n, m in masks.items():
            m.mask.copy_(values[n])

    def two_forwards(inputs: Any, stage: list[_Fit], stop: _Stop) -> None:
        """The dense forward (targets), then, sequential, the pruned one (inputs)."""
        set_masks(dense_masks)
        for fit in stage:
            fit.pruned = False
        _forward(dense, inputs, stop)
        if sequential:
            set_masks(chosen)
            for fit in stage:
                fit.pruned = True
            _forward(model, inputs, stop)
        for fit in stage:
            fit.targets.clear()

    handles = [fit.mod.register_forward_hook(fit.hook) for fit in fits.values()]
    with eval_mode(model), torch.no_grad(), no_fold(model):
        try:
            set_masks(dense_masks)
            *stages, sequence = _stages(model, fits, next(iter(batches))[0])
            if not sequential:
                stages = [[n for st in stages for n in st]]
            for st in progress(stages) if progress else stages:
                end, calls = _stop(st, sequence)
                stop = _Stop(calls)
                handles.append(fits[end].mod.register_forward_hook(stop))
                for name in st:
                    fits[name].dense_inputs = not sequential
                report.examples = 0
                for inputs, _ in batches:
                    two_forwards(inputs, [fits[n] for n in st], stop)
                    report.examples += batch_size(inputs)
                handles.pop().remove()
                for name in st:
                    _solve(name, fits[name], ridge, rows_per_weight, report)
        finally:
            for h in handles:
                h.remove()
            set_masks(chosen)
    for name in set(fits) - set(report.layers) - set(report.skipped):
        report.skipped[name] = "the forward does not call it"
    return report


def _solve(
    name: str, fit: _Fit, ridge: float, rows_per_weight: float, report: RepairReport
) -> None:
    """Solve one layer's fit (or say why not) and record it in ``report``."""
    if fit.invalid is not None or fit.count == 0:
        report.skipped[name] = fit.invalid or "the forward does not call it"
        return
    mode, before, after = fit.solve_and_set(ridge, rows_per_weight)
    report.layers[name] = (fit.features, before, after)
    report.modes[name] = mode
