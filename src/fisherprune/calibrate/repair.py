"""Repair without retraining: refit the layers that read removed channels by least squares.

After channels are chosen, every ``nn.Linear`` / ``nn.Conv1d`` / ``nn.Conv2d`` (``groups=1``)
or Hugging Face ``Conv1D`` (GPT-2's transposed linear; ``repair_rows.TRANSPOSED_LINEARS``)
whose input a mask thins has its weights on the kept input features (and its bias, when it has
one) refitted so that its output on the calibration data matches the dense model's output
(He et al. 2017, "Channel Pruning"; Kwon et al. 2022's "mask tuning" fits per-channel scales,
this fits the whole kept weight, or the scales when the data are few: ``calibrate.repair_fit``
says how big each solve is).

Sequential (the default): the layers are fitted in the order the forward runs them, each on
the input it gets in the PRUNED model whose earlier layers are already repaired, towards the
DENSE model's output of that layer (``sequential=False``: every layer on the dense inputs from
one pass, which fits the wrong problem in a residual network). A layer whose output the
forward adds straight to a residual stream (a transformer's attention and FFN output
projections) is fitted so that the SUM matches the dense sum: its target is the dense output
plus the dense residual less the pruned residual (``calibrate.repair_residual``; Kwon et al.
2022 fit to this target), so it also takes up the drift the removed channels left in the
stream. Only the outputs the pruned model keeps are fitted (its ``PruningPlan``); the others
are removed downstream and stay as they are. Consecutive layers reading the
same input tensor (query, key and value; a ResNet block's first conv and its shortcut) form
one stage (``calibrate.repair_plan``).

Passes: the stages are split, in forward order, into ``passes`` groups of consecutive stages
(near-equal counts). A group costs one pass over the fitting batches, two forwards per batch
cut short after the group's last layer: the dense one (the masks set to ``dense_masks``, each
layer an earlier group refitted given its original weights back from disk for its own call:
``repair_store``, so that no second copy of the fitted weights stays in memory; a layer not
yet refitted computes with its own, the same) gives the targets, the pruned
one the inputs, of every layer of the group at once. So each layer is fitted on the pruned
model as repaired by the EARLIER groups; within its group the layers before it are not yet
refitted. A pass reaching depth ``d`` of the network costs ``2 d`` forwards of the fitting
batches, so ``P`` groups cost about ``P + 1`` full forwards per fitting example: with ``S``
stages one per pass (``passes=None``, the default), about ``S + 1``, quadratic in depth (~49
on a ResNet-50, ~14 CPU-s per 224x224 image on 2 cores). Grouping costs quality: on a small
ResNet trained on digits, pruned to 50%, 8 passes for 8-21 stages kept the accuracy of the
stage-by-stage repair for Fisher and Taylor but lost up to 5 points with the label-free Fisher
and 32 with random channels; reading 250 of the 1,000 examples cost more than grouping (up to
47 points with Fisher: fewer layers get enough rows for the full refit). So ``budget`` (in
forwards of one example) bounds the cost by first grouping, down to ``MIN_PASSES`` passes,
then cutting the examples read; ``prune_to_target`` sets it from the network's FLOPs.
``max_examples`` caps the examples read. Rows: every token of a linear
layer, except those a batch's ``attention_mask`` (inputs given as a dict, as a tokenizer makes
them) marks as padding; ``positions`` seeded random output positions per image for a conv, so
a conv's cost per image does not grow with its resolution.

Two guards keep the repair from making things worse. A share ``holdout`` of the calibration
batches is not fitted on. Their rows choose each layer's ridge (``calibrate.repair_fit``: the
most conservative one that keeps nearly all of the best held-out gain), and a layer's refit is
kept only if it lowers its error on both the fitting and the held-out rows. And after each
group the model's outputs on those batches are compared with the dense model's, and the
group's refits are kept if that error went down; else its stages are tried one at a time, in
forward order, each kept only if it lowers the error (with one stage per group: each stage on
its own). A layer-wise fit can lower every layer's own error while the model's output drifts
(MiniLM, before the residual target: the FFN output layers fitted their dense outputs and the
sentence embeddings got worse), and this check is what notices: it costs one forward of the
held-out batches per group, plus one per stage of a group that raised the error.

Memory: one group's sums and one micro-batch's activations at a time, the original weights on
disk (``repair_store``); before each pass and before its solves, the free pages of glibc's
heaps go back to the OS (``fisherprune.allocator.trim_freed_memory``), or else what the passes
free below a live block stays resident, pass after pass.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from fisherprune.allocator import trim_freed_memory
from fisherprune.calibrate.repair_fit import LayerFit
from fisherprune.calibrate.repair_plan import (
    Stop,
    forward_until,
    layer_fits,
    stage_stop,
    stages,
    stop_point,
)
from fisherprune.calibrate.repair_residual import ResidualWatch
from fisherprune.calibrate.repair_rows import REPAIRABLE
from fisherprune.calibrate.repair_store import LayerStore
from fisherprune.calibrate.repair_sums import widened
from fisherprune.cost.model import CostModel
from fisherprune.inputs import as_pair, batch_size, call_model
from fisherprune.masks import MaskLayer
from fisherprune.masks.points import no_fold
from fisherprune.modes import eval_mode
from fisherprune.settings import check_int

__all__ = ["MIN_PASSES", "REPAIRABLE", "RepairReport", "check_passes", "repair_consumers"]

#: the ``LayerStore`` keys of the fitted layers' original weights, of a group's refits and of
#: the dense outputs on the held-out batches
ORIGINAL, REFITTED, REFERENCE = "original", "refitted", "reference"

#: the fewest passes (groups of stages) a ``budget`` groups the stages into before it cuts
#: the examples read
MIN_PASSES = 8


@dataclass
class RepairReport:
    """What ``repair_consumers`` changed.

    Attributes:
        layers: per repaired module, ``(kept input features, relative error before, after)``:
            the squared error of its output against the dense output on the fitting data,
            over the dense output's sum of squares, with the original kept weights and with
            the refitted ones.
        skipped: modules that read removed channels but were left as they are, and why.
        examples: calibration examples read (fitted on and held out).
        modes: per repaired module, ``"weights"`` (every kept weight refitted) or ``"scales"``
            (one scale per kept input channel).
        held_out: the relative squared error of the model's outputs against the dense
            model's on the held-out batches, unrepaired and repaired (None: nothing held out).
        ridges: per repaired module, the ridge of its fit (given, or chosen by the held-out
            rows).
        residual: the fitted modules whose output is added to a residual stream, fitted so
            that the sum matches the dense sum.
        passes: passes run over the fitting batches (one per group of stages).
        nonfinite: per module, the rows left out of its fit for holding NaN or inf (in its
            input or the dense output); held-out batches whose dense outputs hold them are
            not used to check the refits.
    """

    layers: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    examples: int = 0
    modes: dict[str, str] = field(default_factory=dict)
    held_out: tuple[float, float] | None = None
    ridges: dict[str, float] = field(default_factory=dict)
    residual: list[str] = field(default_factory=list)
    passes: int = 0
    nonfinite: dict[str, int] = field(default_factory=dict)


def check_passes(
    passes: int | None,
    max_examples: int | None,
    budget: float | None,
    names: tuple[str, str, str] = ("passes", "max_examples", "budget"),
) -> None:
    """Raise ValueError, naming the setting (as ``names`` call them), unless ``passes`` and
    ``max_examples`` are None or integers >= 1 and ``budget`` None or > 0."""
    for name, value in zip(names, (passes, max_examples), strict=False):
        if value is not None:
            check_int(name, value, 1)
    if budget is not None and not budget > 0:
        raise ValueError(f"{names[2]} must be > 0 or None, got {budget!r}")


def _tokens(inputs: Any) -> Tensor | None:
    """The boolean token mask of a tokenizer's batch (``attention_mask``), or None."""
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    return mask.bool() if isinstance(mask, Tensor) and mask.dim() == 2 else None


def _outputs(model: Callable[..., Any], inputs: Any) -> list[Tensor]:
    return [t for t in tree_flatten(call_model(model, inputs))[0] if isinstance(t, Tensor)]


def _split(batches: list[Any], holdout: float) -> tuple[list[Any], list[Any]]:
    """(fitting, held-out) batches: every ``round(1 / holdout)``-th batch held out, if at least
    one batch is left to fit on."""
    step = max(2, round(1 / holdout)) if holdout > 0 else 0
    if step == 0 or len(batches) < step:
        return batches, []
    held = set(range(step - 1, len(batches), step))
    return [b for i, b in enumerate(batches) if i not in held], [batches[i] for i in held]


def _first(batches: Iterable[tuple[Any, Any]], max_examples: int | None) -> list[Any]:
    """The first batches holding at most ``max_examples`` examples (at least one batch; None:
    all). An iterator is read no further than that."""
    data, seen = [], 0
    for batch in batches:
        inputs, targets = as_pair(batch)
        seen += batch_size(inputs)
        if data and max_examples is not None and seen > max_examples:
            break
        data.append((inputs, targets))
    return data


def _within(budget: float, examples: int, stages: int, passes: int | None) -> tuple[int, int]:
    """``(passes, examples)`` whose cost, about ``examples x (passes + 1)`` forwards of one
    example, stays within ``budget``: ``passes`` (None: one per stage) as long as it fits, else
    the most passes that fit but at least ``MIN_PASSES``, and then as many examples as fit (at
    least one)."""
    want = stages if passes is None else min(passes, stages)
    fit = int(budget // max(examples, 1)) - 1
    passes = max(1, min(want, max(fit, MIN_PASSES)))
    return passes, max(1, min(examples, int(budget // (passes + 1))))


def _groups(order: list[list[str]], passes: int | None) -> list[list[list[str]]]:
    """``order``'s stages in ``passes`` groups of consecutive stages, the sizes differing by at
    most one (None, or ``passes`` >= the stages: one stage per group)."""
    n = len(order) if passes is None else min(passes, len(order))
    size, extra = divmod(len(order), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [order[a:b] for a, b in pairwise(bounds)]


def repair_consumers(
    model: nn.Module,
    batches: Iterable[tuple[Any, Any]],
    dense_masks: dict[str, Tensor],
    *,
    ridge: float | None = None,
    positions: int = 10,
    max_features: int = 6144,
    rows_per_weight: float = 20.0,
    sequential: bool = True,
    residual: bool = True,
    passes: int | None = None,
    holdout: float = 0.25,
    max_examples: int | None = None,
    budget: float | None = None,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
    cost_model: CostModel | None = None,
) -> RepairReport:
    """Refit every layer that reads a removed channel so that, on the calibration inputs, its
    output matches the dense model's (module docstring: what is solved, in which order, how
    big, and the guards).

    Changes: the ``weight`` (and ``bias``) of each repaired layer, in place: the kept input
    columns are refitted, the removed ones set to 0 (so ``shrink`` gives the same outputs as
    the masked model). The masks are set to ``dense_masks`` during the dense forwards and
    given back as they were; masks never fold into weights during the passes; train/eval
    flags are given back; nothing else changes. A layer whose fit would not lower its error,
    or whose group and stage would not lower the held-out output error, is left as it was.

    Args:
        model: a model masked by ``apply_masks``, with its channels chosen and not run since
            (a forward pass of a model whose masks no longer collect zeroes the weight columns
            of removed channels, and the dense outputs with them: such layers are skipped).
        batches: ``(inputs, targets)`` pairs (targets are ignored) or dicts of keyword inputs
            (``fisherprune.inputs.as_pair``); read once per pass (an iterator is read into a
            list first).
        dense_masks: the mask values of the dense model, by mask name (``find_masks``).
        ridge: ``lambda`` relative to the mean diagonal of the system; None: per layer, the
            value of ``calibrate.repair_fit.RIDGES`` whose fit has the least error on the
            held-out batches' rows (0.1 when nothing is held out).
        positions: output positions sampled per image and batch for a conv.
        max_features: layers with more kept input features are skipped (memory ``8 k^2``).
        rows_per_weight: refit every kept weight of a layer when the pass saw at least this
            many rows per feature; else fit one scale per kept input channel.
        sequential: fit each group of stages on the inputs of the pruned model as the earlier
            groups repaired it; False: every layer on the dense inputs from one pass.
        residual: with ``sequential``, a layer whose output is added to a residual stream
            is fitted so that the sum matches the dense sum (``calibrate.repair_residual``);
            False: so that its own output matches the dense output.
        passes: with ``sequential``, the groups of consecutive stages, one pass each (None, or
            at least the number of stages: one stage per pass, each fitted on the model with
            every earlier stage repaired; module docstring: the cost).
        holdout: share of the batches (every ``round(1 / holdout)``-th) not fitted on but used
            to accept or undo each group (or stage); 0, or too few batches: no such check.
        max_examples: read only the first batches holding at most this many examples (at
            least one batch), fitted on and held out; None: every batch.
        budget: with ``sequential``, the most the passes may cost, in forwards of one example
            through the whole network (about ``examples x (passes + 1)``); over it, the stages
            are grouped into fewer passes, down to ``MIN_PASSES``, and then fewer examples are
            read (``RepairReport.passes`` and ``examples`` say what ran); None: no limit.
        progress: wraps the passes (a progress bar), or None.
        cost_model: a cost model built on ``model`` (``prune_to_target`` passes its own): the
            outputs each layer keeps are read off its trace; None: the model is traced again.
            One built on another model (a copy) is refused.

    Returns:
        The ``RepairReport``.

    Raises:
        ValueError: ``ridge`` < 0, ``positions`` < 1, ``passes`` or ``max_examples`` < 1,
            ``budget`` <= 0, ``holdout`` outside [0, 1), masks missing from ``dense_masks``, or
            a ``cost_model`` of another model.
    """
    if ridge is not None and not ridge >= 0:
        raise ValueError(f"ridge must be >= 0, got {ridge!r}")
    if positions < 1:
        raise ValueError(f"positions must be >= 1, got {positions!r}")
    if not 0 <= holdout < 1:
        raise ValueError(f"holdout must lie in [0, 1), got {holdout!r}")
    check_passes(passes, max_examples, budget)
    masks = {n: m for n, m in model.named_modules() if isinstance(m, MaskLayer)}
    missing = sorted(set(masks) - set(dense_masks))
    if missing:
        raise ValueError(f"dense_masks has no values for mask(s) {missing}")
    report = RepairReport()
    trim_freed_memory()  # what the selection and its cost reports freed, before the plan's trace
    fits = layer_fits(model, positions, max_features, report.skipped, cost_model)
    if not fits:
        return report
    data = _first(batches, max_examples)
    with eval_mode(model), torch.no_grad(), no_fold(model):
        *order, sequence = stages(model, fits, data[0][0])
    for fit in fits.values():
        fit.residual = fit.residual and sequential and residual
        fit.cross_if_smaller()
    report.residual = [n for n, fit in fits.items() if fit.residual]
    if budget is not None and sequential:
        examples = sum(batch_size(inputs) for inputs, _ in data)
        passes, most = _within(budget, examples, len(order), passes)
        data = _first(data, most)
    report.examples = sum(batch_size(inputs) for inputs, _ in data)
    fitting, held = _split(data, holdout)
    chosen = {n: m.mask.detach().clone() for n, m in masks.items()}
    layers = {n: fit.mod for n, fit in fits.items()}
    store = LayerStore()  # the original weights, on disk: read back one layer at a time
    refitted: dict[str, nn.Module] = {}  # the layers an earlier group may have changed

    def dense(*args: Any, **kwargs: Any) -> Any:
        with store.swapped(ORIGINAL, refitted):  # the others hold their original weights
            return model(*args, **kwargs)

    def set_masks(values: dict[str, Tensor]) -> None:
        for n, m in masks.items():
            m.mask.copy_(values[n])

    def two_forwards(
        inputs: Any, stage: list[LayerFit], stop: Stop, watch: ResidualWatch | None
    ) -> None:
        """The dense forward (targets), then, sequential, the pruned one (inputs)."""
        tokens = _tokens(inputs)
        set_masks(dense_masks)
        for fit in stage:
            fit.pruned, fit.tokens = False, tokens
        forward_until(dense, inputs, stop, watch)
        for fit in stage:
            fit.end_forward()
        if sequential:
            set_masks(chosen)
            for fit in stage:
                fit.pruned = True
            forward_until(model, inputs, stop, watch)
            for fit in stage:
                fit.end_forward()
        for fit in stage:
            fit.targets.clear()

    def held_error() -> float:
        set_masks(chosen)
        sq = sum(
            _squared_gap(_outputs(model, inputs), store.tensors(REFERENCE, i))
            for i, (inputs, _) in enumerate(held)
        )
        return sq / max(norm, 1e-300)

    with eval_mode(model), torch.no_grad(), no_fold(model), store:
        try:
            trim_freed_memory()  # what the plan's trace and the stages' forward freed
            store.put(ORIGINAL, layers)
            set_masks(dense_masks)
            held, norm = _store_references(dense, held, store)
            groups = _groups(order, passes) if sequential else [order]
            best = start = held_error() if held else 0.0
            for group in progress(groups) if progress else groups:
                names = [n for st in group for n in st]
                trim_freed_memory()  # what the last pass and solves freed (``allocator``)
                _fit_group(names, fits, fitting, held, sequence, sequential, two_forwards)
                trim_freed_memory()
                for name in names:
                    _solve(name, fits[name], ridge, rows_per_weight, report)
                    refitted[name] = layers[name]
                report.passes += 1
                if held:
                    best = _guard(group, layers, store, report, held_error, best)
            report.held_out = (start, best) if held else None
        finally:
            set_masks(chosen)
    for name in set(fits) - set(report.layers) - set(report.skipped):
        report.skipped[name] = "the forward does not call it"
    if report.nonfinite:
        warnings.warn(
            "the repair left out rows holding NaN or inf: "
            + ", ".join(f"{n} ({k} rows)" for n, k in report.nonfinite.items())
            + "; check the calibration data",
            RuntimeWarning,
            stacklevel=2,
        )
    return report


def _store_references(
    dense: Callable[..., Any], held: list[tuple[Any, Any]], store: LayerStore
) -> tuple[list[tuple[Any, Any]], float]:
    """Write the dense model's outputs on each ``held``-out batch to ``store`` (under
    ``REFERENCE`` and the batch's place among those kept), one batch's in memory at a time (an
    LM's are its logits, the tokens times the vocabulary). Returns the batches whose outputs
    are finite, and the outputs' sum of squares."""
    kept, norm = [], 0.0
    for batch in held:
        ref = _outputs(dense, batch[0])
        if all(bool(t.isfinite().all()) for t in ref):
            store.put_tensors(REFERENCE, len(kept), ref)
            norm += sum(float(t.double().square().sum()) for t in ref)
            kept.append(batch)
    return kept, norm


def _squared_gap(outputs: list[Tensor], references: list[Tensor]) -> float:
    """The squared difference of ``outputs`` and ``references`` (read back on the CPU),
    summed in float64."""
    return sum(
        float((widened(o) - widened(r.to(o.device))).double().square().sum())
        for o, r in zip(outputs, references, strict=True)
    )


def _fit_group(
    names: list[str],
    fits: dict[str, LayerFit],
    batches: list[tuple[Any, Any]],
    held: list[tuple[Any, Any]],
    sequence: list[str],
    sequential: bool,
    two_forwards: Callable[[Any, list[LayerFit], Stop, ResidualWatch | None], None],
) -> None:
    """Stream the sums of one group's layers over the fitting ``batches`` and the ``held``-out
    ones: one pass, the forwards cut short after the group's last layer, or after its residual
    add (hooks on the group's layers only)."""
    end, calls = stop_point(names, sequence)
    stop = Stop(calls)
    handles, watch = stage_stop([fits[n] for n in names], fits[end], stop)
    try:
        for name in names:
            fits[name].dense_inputs = not sequential
        for held_out, part in ((False, batches), (True, held)):
            for name in names:
                fits[name].held = held_out
            for inputs, _ in part:
                two_forwards(inputs, [fits[n] for n in names], stop, watch)
    finally:
        for h in handles:
            h.remove()


def _guard(
    group: list[list[str]],
    layers: dict[str, nn.Module],
    store: LayerStore,
    report: RepairReport,
    held_error: Callable[[], float],
    best: float,
) -> float:
    """Keep the group's refits if they lower the held-out error below ``best``; else put its
    stages back one at a time, in forward order, each kept only if it lowers the error.
    Returns the held-out error of what is kept. Changes: the weights of undone layers (read
    back from ``store``, where a group of several stages also leaves its refits)."""
    error = held_error()
    if error < best:
        return error
    if len(group) == 1:
        _undo(group[0], layers, store, report, f"{best:.4g} -> {error:.4g}")
        return best
    store.put(REFITTED, {n: layers[n] for st in group for n in st})
    for stage in group:
        store.load(ORIGINAL, {n: layers[n] for n in stage})
    for stage in group:
        store.load(REFITTED, {n: layers[n] for n in stage})
        error = held_error()
        if error < best:
            best = error
        else:
            _undo(stage, layers, store, report, f"{best:.4g} -> {error:.4g}")
    return best


def _solve(
    name: str, fit: LayerFit, ridge: float | None, rows_per_weight: float, report: RepairReport
) -> None:
    """Solve one layer's fit (or say why not) and record it in ``report``."""
    if fit.nonfinite:
        report.nonfinite[name] = fit.nonfinite
    if fit.invalid is not None or fit.count == 0:
        every = "every row of its fit holds NaN or inf" if fit.nonfinite else None
        report.skipped[name] = fit.invalid or every or "the forward does not call it"
        return
    mode, before, after, report.ridges[name] = fit.solve_and_set(ridge, rows_per_weight)
    report.layers[name] = (fit.features, before, after)
    report.modes[name] = mode


def _undo(
    stage: list[str],
    layers: dict[str, nn.Module],
    store: LayerStore,
    report: RepairReport,
    change: str,
) -> None:
    """Give a stage's layers their original weights back and report them as skipped."""
    store.load(ORIGINAL, {n: layers[n] for n in stage})
    for name in stage:
        if name in report.layers:
            del report.layers[name], report.modes[name], report.ridges[name]
            report.skipped[name] = f"its stage's refit raised the held-out output error ({change})"
