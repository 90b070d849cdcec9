"""What the repair fits and in which order: the layers that read removed channels
(``layer_fits``), grouped into stages by the input they read (``stages``, which also finds the
layers whose output is added to a residual), and forwards cut short after a stage's last layer,
or after its residual add (``Stop``, ``stage_stop``, ``forward_until``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from fisherprune.calibrate.repair_fit import LayerFit
from fisherprune.calibrate.repair_residual import ResidualWatch
from fisherprune.calibrate.repair_rows import linear_rows, out_in_weight, rows_reader, transposed
from fisherprune.cost.model import CostModel
from fisherprune.export.plan import PruningPlan
from fisherprune.inputs import call_model
from fisherprune.masks import find_masks
from fisherprune.masks.points import MaskPoint, find_holder, remembered_inputs

__all__ = [
    "StageDone",
    "Stop",
    "forward_until",
    "layer_fits",
    "stage_stop",
    "stages",
    "stop_point",
]


def kept_positions(point: MaskPoint) -> Tensor:
    """Indices along the masked dim of ``point`` that no mask removes."""
    keep = torch.ones(point.size, dtype=torch.bool)
    for m, pos, idx in point.parts:
        keep[pos] = m.mask.detach().cpu()[idx] > 0.5
    return torch.nonzero(keep).flatten()


def layer_fits(
    model: nn.Module,
    positions: int,
    max_features: int,
    skipped: dict[str, str],
    cost_model: CostModel | None = None,
) -> dict[str, LayerFit]:
    """A ``LayerFit`` for every layer that reads a removed channel and can be refitted (with
    the outputs the pruned model keeps, read off its ``PruningPlan``: from ``cost_model``, a
    cost model built on ``model``, when given, else from a trace of its own); the others that
    read one go into ``skipped`` with the reason."""
    found = find_holder(model)
    points = found[1].points if found else []
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    fits: dict[str, LayerFit] = {}
    for point in points:
        kept = kept_positions(point)
        if kept.numel() == point.size:
            continue
        name = point.module_name
        mod = model.get_submodule(name) if name != "<model>" else model
        why = _unrepairable(mod, point, counts, kept)
        taps = out_in_weight(mod)[0, 0].numel() if why is None else 0
        if why is None and kept.numel() * taps + 1 > max_features:
            why = f"{kept.numel() * taps} kept features > max_features"
        if why is not None:
            skipped[name] = why
            continue
        if name not in fits:  # a module masked on several inputs: its first one
            fits[name] = LayerFit(mod, kept.to(mod.weight.device), point.dim, positions)
    if fits:
        for name, rows in _kept_outputs(model, cost_model).items():
            if name in fits:
                fits[name].outputs = torch.as_tensor(rows, device=fits[name].mod.weight.device)
    return fits


def _kept_outputs(model: nn.Module, cost_model: CostModel | None) -> dict[str, list[int]]:
    """The outputs (dim 0 of the weight; dim 1 of a transposed linear's) each module keeps,
    for those that lose some. A model whose zeroed channels cannot all be removed physically
    has no plan: every output is then fitted (correct for the masked model, only less tight),
    as ``shrink`` will say why. With ``cost_model``, its trace is read (a second cost model of
    a 24-layer decoder beside the selection's held ~100 MiB more)."""
    if cost_model is not None and any(
        cost_model.masks.get(n) is not m for n, m in find_masks(model).items()
    ):
        raise ValueError(
            "repair_consumers' cost_model was built on another model (its masks are not this "
            "model's): pass the cost model of the model being repaired, or none"
        )
    try:
        inputs = None if cost_model is not None else remembered_inputs(model, None)
        modules = PruningPlan.from_model(model, inputs, cost_model=cost_model).modules
    except ValueError:
        return {}
    kept_outputs = {}
    for name, tensors in modules.items():
        out_dim = "1" if transposed(model.get_submodule(name)) else "0"
        rows = tensors.get("weight", {}).get("kept", {}).get(out_dim)
        if rows is not None:
            kept_outputs["<model>" if name == "" else name] = rows
    return kept_outputs


def _unrepairable(
    mod: nn.Module, point: MaskPoint, counts: dict[int, int], kept: Tensor
) -> str | None:
    """Why ``mod`` cannot be refitted on the kept inputs of ``point``, or None."""
    reader = rows_reader(mod)
    if reader is None:
        return f"{type(mod).__name__} has no least-squares repair"
    if point.arg != 0:
        return "the mask is not on its first input"
    if reader is not linear_rows and (point.dim != 1 or mod.groups != 1):
        return "a grouped conv, or a mask off the channel dim"
    if getattr(mod, "padding_mode", "zeros") != "zeros":
        return f"padding_mode {mod.padding_mode!r}"
    if any(counts[id(p)] > 1 for p in mod.parameters(recurse=False)):
        return "its weights are shared with another module"
    if kept.numel() == 0:
        return "every input channel is removed"
    removed = torch.ones(point.size, dtype=torch.bool)
    removed[kept] = False
    weight = out_in_weight(mod).detach()
    if not bool(weight[:, removed.to(weight.device)].any()):
        return (
            "the weights reading the removed channels are already zero (a forward pass of the "
            "pruned model folded the masks into them), so the dense outputs are gone: repair "
            "before running the pruned model"
        )
    return None


class StageDone(Exception):
    """Raised by a forward hook to cut a forward short after the stage's last layer."""


class Stop:
    """Ends the forward (``StageDone``) at its ``calls``-th call: a forward hook of the stage's
    last layer, or called by the watch after that layer's residual add."""

    def __init__(self, calls: int) -> None:
        self.calls, self.seen = calls, 0

    def __call__(self, *args: Any) -> None:
        self.seen += 1
        if self.seen >= self.calls:
            raise StageDone


def stage_stop(
    stage: list[LayerFit], end: LayerFit, stop: Stop
) -> tuple[list[Any], ResidualWatch | None]:
    """Hook ``stage``'s layers for their rows and ``stop`` after ``end``'s output, or, when
    ``end`` is added to a residual, after that add. Returns the hook handles and the watch of
    the residual adds (None when no layer of the stage has one); sets each fit's ``watch``."""
    watch = None
    if any(f.residual for f in stage):

        def seen(fit: LayerFit, other: Tensor) -> None:
            fit.residual_seen(other)
            if fit is end:
                stop()

        watch = ResidualWatch(seen)
    handles = []
    for fit in stage:
        fit.watch = watch if fit.residual else None
        handles.append(fit.mod.register_forward_hook(fit.hook))
    if not end.residual:
        handles.append(end.mod.register_forward_hook(stop))  # after the end layer's own
    return handles, watch


def stages(model: nn.Module, fits: dict[str, LayerFit], inputs: Any) -> list[list[str]]:
    """The fitted layers in the order one forward of ``inputs`` calls them (each by its first
    call), consecutive ones reading the same input tensor grouped into a stage. Marks the fits
    whose output the forward adds to a residual (``LayerFit.residual``)."""
    sequence: list[str] = []
    seen: set[str] = set()
    stages: list[list[str]] = []
    prev: list[Tensor] = []  # the input of the layer last called first: the only one held
    watch = ResidualWatch(lambda name, other: setattr(fits[name], "residual", True))

    def record(name: str, args: tuple, out: Any) -> None:
        if name not in seen:  # grouped on its first call, while its input is alive
            seen.add(name)
            if stages and prev and args[0] is prev[0]:
                stages[-1].append(name)
            else:
                stages.append([name])
            prev[:] = [args[0]]
        sequence.append(name)
        if isinstance(out, Tensor):
            watch.watch(name, out)

    handles = [
        fit.mod.register_forward_hook(lambda mod, a, o, n=n: record(n, a, o))
        for n, fit in fits.items()
    ]
    try:
        with watch:
            call_model(model, inputs)
    finally:
        for h in handles:
            h.remove()
    stages.append(sequence)  # the call sequence, for the stop points
    return stages


def stop_point(stage: list[str], sequence: list[str]) -> tuple[str, int]:
    """The layer of ``stage`` called last in ``sequence`` and how often it is called."""
    end = max(stage, key=lambda n: len(sequence) - sequence[::-1].index(n))
    return end, sequence.count(end)


def forward_until(
    model: Callable[..., Any], inputs: Any, stop: Stop, watch: ResidualWatch | None = None
) -> None:
    """One forward, ended early by ``stop``, with ``watch`` (if any) active."""
    stop.seen = 0
    with contextlib.suppress(StageDone), watch if watch is not None else contextlib.nullcontext():
        call_model(model, inputs)
