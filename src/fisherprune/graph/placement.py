"""apply_masks / remove_masks: find every prunable channel group of a model and mask it."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from fisherprune.allocator import trim_freed_memory
from fisherprune.graph.channels import ChannelGraph
from fisherprune.graph.groups import ChannelGroup, MaskPointSpec, Skipped, find_groups
from fisherprune.graph.module_forwards import ModuleForward, module_forward, share_inputs_hooks
from fisherprune.graph.row_layouts import layouts
from fisherprune.graph.trace import Trace, trace_model
from fisherprune.graph.unrun import unrun_copy_reasons
from fisherprune.inputs import Inputs
from fisherprune.masks import MaskLayer, find_masks
from fisherprune.masks.blocks import GATE_KEY, find_block_list, install_block_gate
from fisherprune.masks.compile_guard import mark_hooked
from fisherprune.masks.ddp_sync import BroadcastExclusion
from fisherprune.masks.experts import GATE_SUFFIX, find_moe_layers, install_expert_gates
from fisherprune.masks.points import (
    MaskPoint,
    find_holder,
    install_mask_points,
    remove_mask_points,
)
from fisherprune.masks.recurrent_units import RecurrentUnits, Units
from fisherprune.masks.rows import UNKNOWN

__all__ = ["AppliedMasks", "TrialProblem", "apply_masks", "register_group_trial", "remove_masks"]

log = logging.getLogger("fisherprune")


@dataclasses.dataclass(frozen=True)
class TrialProblem:
    """Why a group trial failed.

    Attributes:
        reason: one line, kept as the reason of the groups it blames.
        module: the innermost module the failure arose in, when known (the search tries the
            groups that live there first), else None.
    """

    reason: str
    module: str | None = None


#: a group trial, prepared once per ``apply_masks`` from the masked model, its example inputs
#: and their trace (the masks' places are fixed by then and only their values change between
#: runs, so that trace stands for every run); the prepared call says why shrinking or costing
#: the model as its masks now stand (some entries zeroed) fails, or None.
#: ``fisherprune.export.width_probe`` registers its dry run, since ``graph`` cannot import
#: ``export``
GroupTrial = Callable[[nn.Module, Any, Trace], Callable[[], "TrialProblem | None"]]
_TRIALS: list[GroupTrial] = []
#: how many of the groups a failure's module holds are tried alone before halving instead
_BLAMED_TRIED = 2


def register_group_trial(trial: GroupTrial) -> GroupTrial:
    """Run ``trial`` when masks are applied: prepared once on the masked model, then run with
    one channel of each group removed: a group some trial fails on is left unmasked, with the
    trial's reason. A trial registered twice (a module reloaded) runs once.

    Changes: adds ``trial`` to the registry, for every later ``apply_masks``."""
    if trial.__qualname__ not in {t.__qualname__ for t in _TRIALS}:
        _TRIALS.append(trial)
    return trial


class AppliedMasks(dict[str, MaskLayer]):
    """``{qualified mask name: MaskLayer}``, plus what was found.

    Attributes:
        groups: the ``ChannelGroup`` of each mask, by the same names.
        skipped: channels left unmasked, each with the reason (which module or op, and why).
    """

    def __init__(
        self, masks: dict[str, MaskLayer], groups: dict[str, ChannelGroup], skipped: list[Skipped]
    ) -> None:
        super().__init__(masks)
        self.groups = groups
        self.skipped = skipped

    def summary(self) -> str:
        """A readable table of groups and skipped channels."""
        lines = [f"{len(self)} channel group(s) masked:"]
        for name, g in self.groups.items():
            lines.append(
                f"  {name}: {g.num_channels} ch; produced by {', '.join(g.producers) or '-'}; "
                f"masked at {', '.join(g.consumers)}"
                + (f"; normalised by {', '.join(g.norms)}" if g.norms else "")
            )
        if self.skipped:
            lines.append("not masked:")
            lines += [f"  {s}" for s in self.skipped]
        return "\n".join(lines)


def _key(name: str, taken: set[str]) -> str:
    base = re.sub(r"[^0-9A-Za-z_:]", "_", name) or "group"
    key, i = base, 1
    while key in taken:
        i += 1
        key = f"{base}_{i}"
    taken.add(key)
    return key


def apply_masks(
    model: nn.Module,
    example_inputs: Any,
    *,
    strict: bool = False,
    blocks: bool = False,
    experts: bool = False,
) -> AppliedMasks:
    """Find every set of coupled prunable channels in ``model`` and give each one mask.

    Traces one forward pass with ``example_inputs`` (eval mode; the model's
    state is left as it was), groups the channels that must be removed together
    (residual adds, concatenation, depthwise and grouped convs, flatten into
    Linear, normalisation layers), and masks each group at the input of every
    module that reads it. A width the model returns and also reads inside (the hidden
    width of a base model) is masked in the returned tensor too: a removed channel reads
    0 there (``shrink`` puts zeros back in its place). Channels that cannot be removed
    safely (only the output reads them, as a classifier's classes, or an op with no
    channel rule, or a reshape that mixes them with another dim) stay unmasked and are
    listed in ``.skipped``; so does a width that an expert the example inputs do not reach
    shares with the rest of the model (an ``nn.ModuleList`` of experts a router picks from:
    ``fisherprune.graph.unrun``): give inputs that reach every expert to prune it.

    Changes: adds the submodule ``model.fisherprune_masks`` (MaskLayers, in
    ``state_dict``), forward pre-hooks on the consuming modules and, when a returned
    width is prunable, a forward hook on the model that masks that output, and on each
    hooked submodule an instance ``forward`` that runs the class's (so that
    ``torch.compile``, which does not guard hooks, never runs a graph traced without them:
    ``fisherprune.masks.compile_guard``). The model's class, code and parameters are
    untouched; ``remove_masks`` undoes it. With
    ``blocks``, also a ``BlockGate`` (key ``blocks`` of the holder) and one forward hook per
    repeated block (``fisherprune.masks.blocks``). With ``experts``, also an ``ExpertGate``
    per mixture-of-experts layer (key ``<layer>:experts``) and hooks on the layer and its
    router (``fisherprune.masks.experts``).

    Args:
        model: any ``nn.Module``.
        example_inputs: a tensor, a tuple of positional inputs or a dict of keyword inputs
            (``model(**example_inputs)``); the batch is read as ``fisherprune.inputs`` says.
        strict: raise instead of skipping channels for a reason other than
            reaching the model's input or output.
        blocks: also make the repeated blocks (decoder layers) prunable units: one
            ``BlockGate`` whose entry ``i`` gates block ``i``'s residual branches, ranked with
            the channels by its own Fisher signal and the block's cost; ``shrink`` removes the
            blocks whose entry is 0.
        experts: also make the experts of every mixture-of-experts layer prunable units: one
            ``ExpertGate`` per layer whose entry ``e`` removes expert ``e`` (its router row and
            its weights; routing then picks among the others), ranked with the channels by
            its own Fisher signal and its cost; never below ``top_k`` experts a layer.

    Returns:
        ``AppliedMasks``: ``{name: MaskLayer}`` with ``.groups`` and ``.skipped``.

    Raises:
        ValueError: the model already has masks; or, with ``strict``, some
            channels cannot be pruned safely (the message lists them); or, with ``blocks``,
            the model has no chain of repeated blocks, or, with ``experts``, no
            mixture-of-experts layer or one that cannot be gated (nothing is added then).

    Example:
        >>> masks = fisherprune.apply_masks(resnet, torch.randn(1, 3, 32, 32))
        >>> print(masks.summary())
    """
    if find_masks(model):
        raise ValueError(
            "the model already has MaskLayers (placed by hand or by an earlier apply_masks); "
            "call fisherprune.remove_masks(model) or use them as they are"
        )
    if blocks:
        find_block_list(model, example_inputs)  # refused before anything is added
    moe = find_moe_layers(model, example_inputs) if experts else []  # refused up front too
    trace = trace_model(model, example_inputs)
    graph = ChannelGraph(trace)
    groups, specs, skipped = find_groups(trace, graph)
    doubled = _doubled_trace(model, example_inputs, trace, specs)
    keys = _install(model, groups, specs, trace, doubled)
    # check by a second trace that each mask really removes its channels: a module may
    # read its input through a BatchNorm or a gate before the layer that contracts it
    masked_trace = trace_model(model, example_inputs) if keys else None
    unsafe = {
        gi: _UNSAFE.format(", ".join(groups[gi].consumers))
        for gi in sorted(_ineffective(model, masked_trace, keys))
    }
    # experts the example inputs reach no row of: the widths they share are not followed
    unsafe.update(unrun_copy_reasons(model, trace, groups))
    # never leave a model whose cost or shrink then raises: a width the trace cannot follow
    # (code that reads it off a shape, a per-head table viewed to a shape held in the code)
    # keeps its group whole
    holder = find_holder(model)[1] if keys else None
    tried = [
        gi for gi, g in enumerate(groups) if gi not in unsafe and (g.num_channels > 1 or g.norms)
    ]
    hidden = {gi for gi in tried if groups[gi].norms}
    masks = [holder[keys[gi]] for gi in tried]  # type: ignore[index]
    homes = [_modules(groups[gi]) for gi in tried]
    unsafe.update(_failing_groups(model, example_inputs, masked_trace, masks, tried, hidden, homes))
    if unsafe:
        remove_mask_points(model)
        for gi, why in sorted(unsafe.items()):
            g = groups[gi]
            skipped.append(Skipped(g.params, g.num_channels, why, expected=False))
        keep = [gi for gi in range(len(groups)) if gi not in unsafe]
        renumber = {old: new for new, old in enumerate(keep)}
        specs = [
            MaskPointSpec(
                sp.module,
                sp.arg,
                sp.dim,
                sp.size,
                [(renumber[gi], p, c) for gi, p, c in sp.parts if gi in renumber],
                sp.norm,
                sp.output,
            )
            for sp in specs
        ]
        specs = [sp for sp in specs if sp.parts]
        groups = [groups[gi] for gi in keep]
        keys = _install(model, groups, specs, trace, doubled)
    skipped = _gated_rows(skipped, {f"{m.router}.weight" for m in moe})
    problems = [s for s in skipped if not s.expected]
    if strict and problems:
        remove_mask_points(model)
        raise ValueError(
            "some channels cannot be pruned safely (strict=True):\n"
            + "\n".join(f"  {s}" for s in problems)
        )
    for s in problems:
        log.warning("apply_masks: not masked: %s", s)
    _warn_unknown_rows(model)
    holder_name, holder = find_holder(model)  # type: ignore[misc]
    # a detached batch-of-one copy, in the form given, kept for shrink and export
    holder.example_inputs = Inputs.of(example_inputs).batch_of_one().value()
    prefix = holder_name + "."
    holder.groups = {prefix + k: g for k, g in zip(keys, groups, strict=True)}
    if blocks:
        gate, handles = install_block_gate(model, example_inputs)
        keys.append(_key(GATE_KEY, set(holder.keys())))
        holder[keys[-1]] = gate
        holder.handles.extend(handles)
    if moe:
        gates, handles = install_expert_gates(model, moe)
        for g in gates:
            keys.append(_key(g.layer_path + GATE_SUFFIX, set(holder.keys())))
            holder[keys[-1]] = g
        holder.handles.extend(handles)
    holder.handles.extend(mark_hooked(model))  # last: after every hook (masks.compile_guard)
    holder.handles.append(BroadcastExclusion(model))  # (masks.ddp_sync)
    return AppliedMasks({prefix + k: holder[k] for k in keys}, dict(holder.groups), skipped)


def _gated_rows(skipped: list[Skipped], routers: set[str]) -> list[Skipped]:
    """``skipped`` with the rows of gated routers (one per expert) marked expected: each
    layer's ``ExpertGate`` removes them, with the expert."""
    return [
        dataclasses.replace(s, expected=True, reason=f"{s.reason} (removed by the ExpertGate)")
        if s.params and all(p in routers and d == 0 for p, d in s.params)
        else s
        for s in skipped
    ]


_UNSAFE = (
    "masking the input of {} would not remove these channels (a BatchNorm, a gate or an "
    "add inside the module, before the layer that reads them, keeps them alive)"
)


def _failing_groups(
    model: nn.Module,
    example_inputs: Any,
    trace: Trace | None,
    masks: list[MaskLayer],
    groups: list[int],
    must_clear: set[int],
    homes: list[set[str]],
) -> dict[int, str]:
    """The groups (of ``groups``, whose masks are ``masks`` and whose modules are ``homes``)
    that some registered trial fails on, each with the trial's reason. The trials are prepared
    once, on ``trace`` (the masked model's: no trial traces again), and run first with the
    first channel of every group removed, so a model whose groups all work costs one trial,
    not one per group. When that fails in a module, the groups living most in it are tried
    alone (at most ``_BLAMED_TRIED``): the first that fails is kept whole and the rest tried
    together again, so ``f`` failing groups cost about ``2 f + 2`` trials; a failure no blamed
    group explains halves the groups instead, trying the halves apart. Where a trial fails
    with no channel removed as well, only the groups of ``must_clear`` (a hidden width, which
    code often reads off a shape) are reported. Every mask is left as it was. A model on the
    ``meta`` device has no values to run a trial on: nothing is tried (its masks land where
    the CPU's do unless a trial would keep a group whole)."""
    if (
        trace is None
        or not _TRIALS
        or not masks
        or any(m.mask.device.type == "meta" for m in masks)
    ):
        return {}
    saved = [(m.mask.detach().clone(), m.is_all_ones()) for m in masks]

    try:
        prepared = [t(model, example_inputs, trace) for t in _TRIALS]

        def trial(picked: list[int]) -> TrialProblem | None:
            removed = _distinct_removals([masks[i] for i in picked])
            with torch.no_grad():
                for m in masks:
                    m.mask.fill_(1.0)
                for i, n in zip(picked, removed, strict=True):
                    masks[i].mask[:n] = 0.0
            return next((p for t in prepared if (p := t()) is not None), None)

        def bisect(picked: list[int], problem: TrialProblem | None) -> dict[int, str]:
            if problem is None:
                return {}
            if len(picked) == 1:
                return {groups[picked[0]]: problem.reason}
            half = len(picked) // 2
            found = bisect(picked[:half], trial(picked[:half]))
            found |= bisect(picked[half:], trial(picked[half:]))
            # each half works alone and not together: keep them all whole, to be safe
            return found or {
                groups[i]: f"{problem.reason} (with other groups removed at once)" for i in picked
            }

        def search(pending: list[int]) -> dict[int, str]:
            found: dict[int, str] = {}
            while (problem := trial(pending)) is not None:
                blamed = _blamed(problem.module, pending, homes)[:_BLAMED_TRIED]
                culprit = next(((i, p) for i in blamed if (p := trial([i])) is not None), None)
                if culprit is None:
                    return found | bisect(pending, problem)
                found[groups[culprit[0]]] = culprit[1].reason
                pending = [i for i in pending if i != culprit[0]]
            return found

        found = search(list(range(len(masks))))
        if not found or trial([]) is None:
            return found
        # failing with no channel removed (a model deepcopy cannot copy), the trial tells
        # nothing of the groups: only those it had to clear are kept whole
        return {g: why for g, why in found.items() if g in must_clear}
    finally:
        with torch.no_grad():
            for m, (values, ones) in zip(masks, saved, strict=True):
                m.mask.copy_(values)
                m.record_values(ones)
        trim_freed_memory()  # what the trials' forwards freed (``allocator``)


def _distinct_removals(masks: list[MaskLayer]) -> list[int]:
    """How many channels of each of ``masks`` a trial removes at once: as few as ``prune`` may
    remove (a multiple of ``keep_multiple``, one at least), more where needed so that no two
    masks lose the same number of weight rows (channels times ``channel_width``) while a
    count is left that leaves one channel at least (the mask's ``min_kept`` where it has
    one). Two widths the code ties together (heads reshaped back to the hidden width read
    off the input's shape) would otherwise lose 32 rows each, still match, and the trial
    pass where an uneven prune fails."""
    taken: set[int] = set()
    counts = []
    for m in masks:
        step = m.keep_multiple
        first = m.num_channels % step or step
        options = range(first, m.num_channels - max(getattr(m, "min_kept", 0), 1) + 1, step)
        n = next((k for k in options if k * m.channel_width not in taken), first)
        taken.add(n * m.channel_width)
        counts.append(n)
    return counts


def _modules(group: ChannelGroup) -> set[str]:
    """The modules a group's channels live in: those of its parameters, producers and
    consumers."""
    return {p.rpartition(".")[0] for p, _ in group.params} | {*group.producers, *group.consumers}


def _blamed(module: str | None, pending: list[int], homes: list[set[str]]) -> list[int]:
    """The groups of ``pending`` with a module inside ``module`` (or it), those with the
    largest share of their modules there first (a group local to the failing module before
    a width that runs through the whole model); none when ``module`` is unknown."""
    if module is None:
        return []
    inside = {
        i: sum(m == module or m.startswith(module + ".") for m in homes[i]) / len(homes[i])
        for i in pending
        if homes[i]
    }
    return sorted((i for i, share in inside.items() if share > 0), key=lambda i: -inside[i])


def _warn_unknown_rows(model: nn.Module) -> None:
    """One warning naming the points whose input rows the trace could not tie to examples."""
    found = find_holder(model)
    holder = found[1] if found else None
    points = [*holder.points, *(p for ps in holder.outputs.values() for p in ps)] if holder else []
    unknown = sorted({mp.module_name for mp in points if mp.rows.kind == UNKNOWN})
    if unknown:
        log.warning(
            "apply_masks: the Fisher signal of the masks at %s is approximate: which example "
            "each row of their input belongs to could not be followed through the model's "
            "operators, so each row counts as one example (rows of one example are squared "
            "apart, not summed first)",
            ", ".join(unknown),
        )


def _doubled_trace(
    model: nn.Module, example_inputs: Any, trace: Trace, specs: list[MaskPointSpec]
) -> Trace | None:
    """Where ``trace`` ran a batch of one and left some point's rows unknown, a trace of that
    batch twice over, to read those points' layouts off (``row_layouts.layouts``); else None.
    With one example the batch dim cannot be told from another dim of size one (the
    sequence-first (L, 1, E) tensors XLNet makes of its (1, L, E) input: each of the L rows
    taken for an example, and a mask read both ways got rows of two sizes in one pass); with
    two it can. Inputs whose batch does not double (a list of examples) get none, and a model
    that refuses the doubled batch keeps the unknown layouts, with a warning that says why."""
    if trace.batch_size != 1:
        return None
    rows, outs = layouts(trace, specs)
    if all(r.kind != UNKNOWN for r in [*rows, *outs]):
        return None
    doubled = Inputs.of(example_inputs).repeated(2)
    if doubled.batch_size != 2:
        return None
    try:
        return trace_model(model, doubled.value())
    except Exception as e:  # (any error of the model's own code on a batch of two)
        log.warning(
            "apply_masks: a batch of two examples could not be traced (%s: %s), so which "
            "example each row belongs to is not known where one example could not tell",
            type(e).__name__,
            e,
        )
        return None


def _install(
    model: nn.Module,
    groups: list[ChannelGroup],
    specs: list[MaskPointSpec],
    trace: Trace,
    doubled: Trace | None = None,
) -> list[str]:
    """Add the masks of ``groups`` and their points (``specs``) to ``model``; the points' row
    layouts are read off ``trace`` (and ``doubled``: ``row_layouts.layouts``). Returns the
    masks' keys."""
    taken: set[str] = set()
    keys = [_key(g.name, taken) for g in groups]
    device = _model_device(model)
    masks = {k: MaskLayer(g.num_channels).to(device) for k, g in zip(keys, groups, strict=True)}
    for k, g in zip(keys, groups, strict=True):
        masks[k].channel_width = g.channel_width
        masks[k].keep_multiple = g.multiple
    points = [
        (sp.module, sp.arg, sp.dim, sp.size, [(keys[gi], pos, ch) for gi, pos, ch in sp.parts])
        for sp in specs
        if not sp.norm and sp.output is None
    ]
    norms = [
        (sp.module, sp.dim, sp.size, [(keys[gi], pos, ch) for gi, pos, ch in sp.parts])
        for sp in specs
        if sp.norm
    ]
    outputs = [
        (sp.output, sp.dim, sp.size, [(keys[gi], pos, ch) for gi, pos, ch in sp.parts])
        for sp in specs
        if sp.output is not None
    ]
    rows, output_rows = layouts(trace, specs, doubled)
    install_mask_points(model, masks, points, norms, outputs, rows, output_rows)
    _hook_module_forwards(model)
    _hook_recurrent_units(model, groups, [masks[k] for k in keys])
    return keys


def _model_device(model: nn.Module) -> torch.device:
    """Where the model's first parameter (or buffer) lives: its masks go there too, so that
    a step never copies a mask between host and device."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        return t.device
    return torch.device("cpu")


def _hook_module_forwards(model: nn.Module) -> None:
    """Hook the modules with a registered forward (``module_forwards``): a tensor passed in
    several inputs stays one after masking, and where inner submodules got mask points, the
    registered forward makes them act; the handles join the holder's, so ``remove_masks``
    removes them."""
    holder = find_holder(model)[1]  # type: ignore[index]
    for name, mod in model.named_modules():
        entry = module_forward(mod)
        if entry is not None:
            holder.handles += share_inputs_hooks(mod)
        inner = {f"{name}.{s}" if name else s for s in entry.inner} if entry else set()
        points = [mp for mp in holder.points if mp.module_name in inner]
        if entry is None or not points:
            continue
        hook = functools.partial(_masked_forward, entry, points, {})
        holder.handles.append(mod.register_forward_hook(hook, with_kwargs=True))


def _hook_recurrent_units(
    model: nn.Module, groups: list[ChannelGroup], masks: list[MaskLayer]
) -> None:
    """Stand in for the forward of each recurrent layer whose hidden units are a group (an
    LSTM's projected units, and its cells, where it has ``proj_size``): the masks act on every
    step (``fisherprune.masks.recurrent_units``); each joins the holder's handles, so that
    ``remove_masks`` gives the layer its forward back."""
    holder = find_holder(model)[1]  # type: ignore[index]
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.RNNBase) or module_forward(mod) is None:
            continue
        prefix = f"{name}." if name else ""
        units, cells = (
            _recurrent_part(prefix, f"{prefix}{w}", groups, masks)
            for w in ("weight_hh_l0", "weight_hr_l0")
        )
        if units is None and cells is None:
            continue
        if cells is not None:  # (PyTorch runs an LSTM only with fewer projected units than
            cells[0].min_kept = mod.proj_size + 1  # cells; projected units only ever go)
        rnn = RecurrentUnits(name, mod, units, cells)  # type: ignore[arg-type]
        rnn.mask_initial = not any(  # (a state passed positionally has its own point)
            mp.module_name == name and mp.arg == 1 for mp in holder.points
        )
        holder.recurrent.append(rnn)
        holder.handles.append(rnn)


def _recurrent_part(
    prefix: str, reader: str, groups: list[ChannelGroup], masks: list[MaskLayer]
) -> Units | None:
    """The mask of the group whose channels ``reader`` 's columns read (a recurrent layer's
    units), the mask entry of each, and of each column of the layer's weights that read them;
    None where no group holds them."""
    for group, mask in zip(groups, masks, strict=True):
        if (reader, 1) not in group.members:
            continue
        columns = {  # the module's weights whose columns read the units
            p[len(prefix) :]: ch
            for (p, dim), ch in group.members.items()
            if dim == 1 and p.startswith(prefix) and "." not in p[len(prefix) :]
        }
        return mask, group.members[(reader, 1)], columns
    return None


def _masked_forward(
    entry: ModuleForward,
    points: list[MaskPoint],
    cache: dict[str, Any],
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    _out: Any,
) -> Any:
    return entry.masked(module, args, kwargs, points, cache)


def _ineffective(model: nn.Module, trace: Trace | None, keys: list[str]) -> set[int]:
    """Indices (into ``keys``) of masks some of whose entries remove nothing, read off
    ``trace``, the masked model's."""
    if trace is None:
        return set()
    graph = ChannelGraph(trace)
    ones = np.ones(graph.n_entries)
    killer = graph.killers(ones, np.zeros(len(graph.roots), dtype=bool))
    effective = np.zeros(graph.n_entries, dtype=bool)
    effective[killer[killer >= 0]] = True
    starts = trace.entry_starts()
    holder_name, holder = find_holder(model)  # type: ignore[misc]
    bad: set[int] = set()
    for gi, k in enumerate(keys):
        name = f"{holder_name}.{k}"
        n = holder[k].num_channels
        start = starts.get(name)
        if start is None or not effective[start : start + n].all():
            bad.add(gi)
    return bad


def remove_masks(model: nn.Module) -> None:
    """Remove what ``apply_masks`` added (hooks and ``fisherprune_masks``); the model is
    then exactly as before: same parameters, buffers, ``state_dict`` keys and outputs.

    Hand-placed MaskLayer modules are part of the user's model and are not touched.
    A model without applied masks is left unchanged.
    """
    remove_mask_points(model)
