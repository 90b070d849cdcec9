"""PruningPlan: which channels each module keeps, as plain JSON.

A plan lists, for every parameter and buffer that loses channels, the indices
it keeps along each pruned dimension, per module name, together with the
original shapes (to recognise the architecture), the cost convention and the
library version. ``plan.apply(fresh_model)`` shrinks a newly constructed model
to the pruned architecture, so a shrunk ``state_dict`` loads into it without
pickling any class.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fisherprune._version import __version__
from fisherprune.cost import CostModel
from fisherprune.export.blocks import check_blocks, remove_blocks, removed_blocks
from fisherprune.export.experts import expert_count_attributes
from fisherprune.export.hf_config import update_config
from fisherprune.export.manifest import check_exported_file
from fisherprune.export.modules import replacement, update_metadata
from fisherprune.export.output_fill import FilledOutput, install_output_fill
from fisherprune.export.safe_load import PickledObjectsError, looks_pickled
from fisherprune.export.storage import atomic_write_bytes
from fisherprune.export.untraced import recorded_params, recorded_slices
from fisherprune.graph.groups import find_groups
from fisherprune.graph.heads import HEADS_WIDTH_ATTRIBUTES
from fisherprune.graph.unrun import unrun_copies, unrun_copy_reasons
from fisherprune.masks import MaskLayer
from fisherprune.masks.points import find_holder, remembered_inputs, remove_mask_points

__all__ = ["PlanMismatchError", "PruningPlan"]

FORMAT = 1


class PlanMismatchError(ValueError):
    """A plan does not fit the model it is applied to."""


@dataclass
class PruningPlan:
    """Kept channel indices per module.

    Attributes:
        modules: ``{module name: {tensor name: {"shape": [...], "kept": {dim: [indices]}}}}``;
            only tensors that lose channels are listed, with their original shape.
        shapes: original shape of every parameter and buffer of the model (masks excluded),
            to recognise the architecture it was made for.
        mask_modules: hand-placed MaskLayer modules, replaced by ``nn.Identity``.
        attributes: ``{module name: {attribute: value}}``: integer attributes set after
            slicing, such as the head count of an attention module that lost heads, or the
            expert count of a router that lost experts (``fisherprune.export.experts``); or
            lists of integers: the sizes a module splits a width at (timm's
            ``MixedConv2d.splits``), set to the channels each piece keeps.
        outputs: ``[{"path", "dim", "size", "kept"}]``: the model's output tensors (by pytree
            key path) whose width lost channels; the shrunk model zero-fills them back to
            ``size`` (``fisherprune.export.output_fill``).
        blocks: ``{ModuleList name: {"count", "removed"}}``: repeated blocks whose
            ``BlockGate`` entry is 0, dropped after slicing (``fisherprune.export.blocks``).
        convention: cost convention of the recorded costs.
        cost: ``{"dense": ..., "pruned": ...}`` per example, when known.
        version: fisherprune version that made the plan.
    """

    modules: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    shapes: dict[str, list[int]] = field(default_factory=dict)
    mask_modules: list[str] = field(default_factory=list)
    attributes: dict[str, dict[str, int | list[int]]] = field(default_factory=dict)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    blocks: dict[str, dict[str, Any]] = field(default_factory=dict)
    convention: str = "flops"
    cost: dict[str, float] = field(default_factory=dict)
    version: str = __version__

    # ------------------------------------------------------------ building
    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        example_inputs: Any = None,
        convention: str = "flops",
        *,
        cost_model: CostModel | None = None,
    ) -> PruningPlan:
        """Read the plan off a masked model (traces it once, unless ``cost_model`` is given).

        Args:
            model: a model with masks (from ``apply_masks`` or placed by hand).
            example_inputs: inputs to trace with (a tensor, a tuple of positional inputs or a
                dict of keyword inputs); defaults to those ``apply_masks`` kept.
            convention: cost convention recorded in the plan.
            cost_model: a ``CostModel`` of ``model`` already built (a ``PruningOptimizer``'s):
                its trace and convention are used, and nothing is traced or timed again (a
                ``latency`` cost model would time the model once more).

        Raises:
            ValueError: no example inputs, no masks, a zeroed mask entry whose
                channel cannot be removed physically (the message says why), or a layer
                that would keep no channels.
        """
        if cost_model is None:
            cost_model = CostModel(model, remembered_inputs(model, example_inputs), convention)
        cm, convention = cost_model, cost_model.convention
        if not cm.masks:
            raise ValueError("the model has no masks: nothing to shrink (apply_masks first)")
        graph, trace = cm.graph, cm.trace
        entries = cm.entries()
        _check_removable(cm, entries, graph.removed(entries))
        removed = cm.removed(entries)  # with the components of removed experts
        _check_reached(model, cm, removed)
        traced = {b.name for b in trace.atoms.blocks if b.kind == "param"}
        plan = cls(convention=convention)
        plan.cost = {"dense": cm.dense_total(), "pruned": cm.total(entries)}
        plan.blocks = removed_blocks(cm.masks)
        plan.attributes = expert_count_attributes(model, cm.masks)
        for b in trace.atoms.blocks:
            if b.kind != "param":
                continue
            gone = removed[graph.roots[b.start : b.start + b.size]]
            if not gone.any():
                continue
            module, _, tname = b.name.rpartition(".")
            entry = plan.modules.setdefault(module, {}).setdefault(
                tname, {"shape": list(trace.param_infos[b.name].shape), "kept": {}}
            )
            entry["kept"][str(b.dim)] = np.flatnonzero(~gone).tolist()
            if gone.all():
                raise ValueError(
                    f"{b.name} would keep none of its {b.size} channels along dim {b.dim}: a "
                    "layer with no channels cannot be built or exported; prune with "
                    "min_channels >= 1 (or restore one channel of that mask)"
                )
        tensors = dict(_all_tensors(model))
        for name, dims in recorded_slices(model, traced, cm.masks).items():
            module, _, tname = name.rpartition(".")
            shape = list(tensors[name].shape)
            entry = plan.modules.setdefault(module, {}).setdefault(
                tname, {"shape": shape, "kept": {}}
            )
            for d, gone in dims.items():
                entry["kept"][str(d)] = np.flatnonzero(~gone).tolist()
        for split in trace.head_splits:
            kept = int((~removed[graph.roots[split.labels]]).sum())
            if kept != split.count:
                module = "" if split.module == "<model>" else split.module
                for attr in split.attributes:
                    width = attr in HEADS_WIDTH_ATTRIBUTES
                    value = kept * split.head_size if width else kept
                    plan.attributes.setdefault(module, {})[attr] = value
        for sizes in trace.size_splits:
            kept = [int((~removed[graph.roots[p]]).sum()) for p in sizes.pieces]
            if kept != [p.size for p in sizes.pieces]:
                module = "" if sizes.module == "<model>" else sizes.module
                for attr in sizes.attributes:
                    plan.attributes.setdefault(module, {})[attr] = kept
        for cp in trace.consumers:
            gone = removed[graph.roots[cp.labels]] if cp.output is not None else None
            if gone is not None and gone.any():
                path, dim = cp.output  # type: ignore[misc]
                kept = np.flatnonzero(~gone).tolist()
                plan.outputs.append({"path": path, "dim": dim, "size": gone.size, "kept": kept})
        holder = find_holder(model)
        applied = holder[0] + "." if holder else None
        plan.shapes = {
            n: list(t.shape)
            for n, t in _all_tensors(model)
            if not (applied and n.startswith(applied)) and not _is_mask_tensor(model, n)
        }
        plan.mask_modules = [
            n
            for n, m in model.named_modules()
            if isinstance(m, MaskLayer) and not (applied and n.startswith(applied))
        ]
        return plan

    # ------------------------------------------------------------- applying
    def apply(self, model: nn.Module, *, views: bool = False) -> nn.Module:
        """Shrink ``model`` in place to the planned architecture and return it.

        Slices every listed parameter and buffer (new ``nn.Parameter`` objects for parameters; with
        ``views``, a tensor whose kept indices form one run along every sliced dim becomes a view of
        the original, narrowed, instead of a copy: for a model thrown away after a check,
        ``shrink_dry_run``, since a view keeps the whole original storage alive and may not be
        contiguous), updates module metadata through the shrink-rule registry, replaces hand-placed
        MaskLayers by ``nn.Identity`` and removes masks added by ``apply_masks``. An output whose
        width lost channels is zero-filled back to its full width by a forward hook
        (``fisherprune.export.output_fill``; one, however often the plan is applied). The model's
        class and forward code are kept; a sliced module whose class cannot hold its new widths
        (``nn.MultiheadAttention``) is replaced by one that can
        (``fisherprune.export.mha.PrunedMultiheadAttention``, same parameters). A Hugging Face
        model's ``config`` gets the new widths when one config can describe them
        (``fisherprune.export.hf_config``; a warning says why not).
        Idempotent: applying to an already shrunk model changes nothing.

        Raises:
            PlanMismatchError: naming the first module or tensor that does not match.
        """
        modules = dict(model.named_modules())
        for mname in self.modules:
            if mname not in modules:
                raise PlanMismatchError(f"the model has no module {mname!r} that the plan names")
        for mname in self.mask_modules:
            if mname not in modules:
                raise PlanMismatchError(
                    f"the model has no mask module {mname!r} that the plan names"
                )
        for mname, values in self.attributes.items():
            for attr, value in values.items():
                if not _settable(getattr(modules.get(mname), attr, None), value):
                    kind = (
                        "an integer"
                        if isinstance(value, int)
                        else f"{len(value)} sizes at least {value}"
                    )
                    raise PlanMismatchError(
                        f"the model has no attribute {attr!r} holding {kind} on module "
                        f"{mname!r} that the plan sets"
                    )
        todo: list[tuple[nn.Module, str, str, dict[str, Any]]] = []
        owners: dict[int, list[tuple[nn.Module, str]]] = {}  # tied tensors: every holder
        planned: set[int] = set()
        for mname, mod in modules.items():
            for tname, t in _own_tensors(mod):
                owners.setdefault(id(t), []).append((mod, tname))
                if tname in self.modules.get(mname, {}):
                    planned.add(id(t))
        for mname, mod in modules.items():  # in the model's order: the first mismatch is named
            for tname, t in _own_tensors(mod):
                full = f"{mname}.{tname}" if mname else tname
                spec = self.modules.get(mname, {}).get(tname)
                original = self.shapes.get(full)
                if spec is None and id(t) in planned:
                    continue  # tied to a planned tensor (an output layer sharing the embedding)
                if spec is None:
                    if original is not None and list(t.shape) != list(original):
                        raise PlanMismatchError(
                            f"{full} has shape {list(t.shape)}; the plan was made for "
                            f"{original}: a different architecture or width"
                        )
                    continue
                shrunk = [
                    len(spec["kept"][str(i)]) if str(i) in spec["kept"] else s
                    for i, s in enumerate(spec["shape"])
                ]
                if list(t.shape) == shrunk:
                    continue  # already shrunk
                if list(t.shape) != list(spec["shape"]):
                    raise PlanMismatchError(
                        f"{full} has shape {list(t.shape)}; the plan was made for "
                        f"{spec['shape']}: a different architecture or width"
                    )
                todo.append((mod, mname, tname, spec))
        for mname, tensors in self.modules.items():
            for tname in tensors:
                if _get_tensor(modules[mname], tname) is None:
                    raise PlanMismatchError(
                        f"module {mname!r} has no parameter or buffer {tname!r}"
                    )
        _remove_masks(model, self.mask_modules)
        changed: dict[int, tuple[nn.Module, dict[str, tuple[int, ...]]]] = {}
        with torch.no_grad():
            for mod, _mname, tname, spec in todo:
                t = _get_tensor(mod, tname)
                old_shape = tuple(t.shape)
                new = t
                for d, kept in spec["kept"].items():
                    if views and _one_run(kept):
                        new = new.narrow(int(d), kept[0], len(kept))
                    else:
                        idx = torch.as_tensor(kept, dtype=torch.long, device=t.device)
                        new = new.index_select(int(d), idx)
                _set_tensor(mod, tname, new if views else new.contiguous())
                made = _get_tensor(mod, tname)
                for other, oname in owners.get(id(t), [(mod, tname)]):
                    store = other._parameters if oname in other._parameters else other._buffers
                    store[oname] = made  # tied tensors stay one object
                    changed.setdefault(id(other), (other, {}))[1][oname] = old_shape
        for mod, old in changed.values():
            update_metadata(mod, old)
        for mname, values in self.attributes.items():
            for attr, value in values.items():
                held = getattr(modules[mname], attr)
                setattr(
                    modules[mname], attr, type(held)(value) if isinstance(value, list) else value
                )
        install_output_fill(
            model,
            [FilledOutput(o["path"], o["dim"], o["size"], tuple(o["kept"])) for o in self.outputs],
        )
        for mod, _old in changed.values():
            new = replacement(mod)
            if new is not None:
                _replace_module(model, mod, new)
        for path, spec in self.blocks.items():
            remove_blocks(model, path, spec["count"], spec["removed"])
        problem = update_config(model)
        if problem:
            warnings.warn(
                f"the model's Hugging Face config still describes the dense model: {problem}; "
                "fisherprune.save_hf_folder saves it as a folder with modelling code of its own "
                "(from_pretrained with trust_remote_code=True)",
                stacklevel=2,
            )
        return model

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "fisherprune_version": self.version,
            "convention": self.convention,
            "cost": self.cost,
            "mask_modules": self.mask_modules,
            "attributes": self.attributes,
            "outputs": self.outputs,
            "blocks": self.blocks,
            "modules": self.modules,
            "shapes": self.shapes,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PruningPlan:
        """Raises ValueError for data that is not a well-formed fisherprune plan."""
        if not isinstance(data, dict) or data.get("format") != FORMAT or "modules" not in data:
            raise ValueError("not a fisherprune pruning plan (format 1)")
        _validate_modules(data["modules"])
        shapes = data.get("shapes", {})
        if not isinstance(shapes, dict) or not all(_int_list(v) for v in shapes.values()):
            raise ValueError("pruning plan: 'shapes' must map tensor names to lists of sizes")
        masks = data.get("mask_modules", [])
        if not isinstance(masks, list) or not all(isinstance(m, str) for m in masks):
            raise ValueError("pruning plan: 'mask_modules' must be a list of module names")
        attributes = data.get("attributes", {})
        if not isinstance(attributes, dict) or not all(
            isinstance(v, dict) and all(isinstance(a, str) and _count(n) for a, n in v.items())
            for v in attributes.values()
        ):
            raise ValueError(
                "pruning plan: 'attributes' must map module names to {attribute: integer or "
                "list of integers}"
            )
        outputs = data.get("outputs", [])
        if not isinstance(outputs, list) or not all(_filled_output(o) for o in outputs):
            raise ValueError(
                "pruning plan: 'outputs' must be a list of {path, dim, size, kept} with kept "
                "sorted, unique and in [0, size)"
            )
        return cls(
            modules=data["modules"],
            outputs=[dict(o) for o in outputs],
            blocks={k: dict(v) for k, v in check_blocks(data.get("blocks", {})).items()},
            shapes=dict(shapes),
            mask_modules=list(masks),
            attributes={m: dict(v) for m, v in attributes.items()},
            convention=str(data.get("convention", "flops")),
            cost=dict(data.get("cost", {})),
            version=str(data.get("fisherprune_version", "?")),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)  # keeps the model's module order

    @classmethod
    def from_json(cls, text: str) -> PruningPlan:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON, atomically (no partial file on failure)."""
        atomic_write_bytes(Path(path), self.to_json().encode())

    @classmethod
    def load(cls, path: str | os.PathLike) -> PruningPlan:
        """Read a plan written by ``save``: JSON only, never unpickled.

        Raises:
            FileNotFoundError: no file at ``path``.
            PickledObjectsError: (a ValueError) the file is a pickle naming Python objects, not
                a JSON plan; it was only parsed, nothing from it ran.
            ValueError: the file is not JSON or not a well-formed fisherprune plan.
            ExportMismatchError: (a ValueError) the manifest of its folder (a ``fisherprune
                train`` export) records other bytes for it (``check_exported_file``).
        """
        path = Path(path)
        check_exported_file(path)
        try:
            data = json.loads(path.read_bytes())
        except ValueError as e:  # also UnicodeDecodeError
            if looks_pickled(path):
                raise PickledObjectsError.for_file(
                    "plan",
                    path,
                    "a plan is the JSON that PruningPlan.save writes: make it again with "
                    "PruningPlan.from_model(model).save(path)",
                ) from None
            raise ValueError(f"plan {path} is not JSON: {e}") from None
        return cls.from_dict(data)


# ------------------------------------------------------------------ helpers
_REACH_EVERY_COPY = (
    "pass shrink (or the plan) example inputs that reach every copy (a larger batch: each "
    "expert needs a row its router sends it)"
)


def _check_reached(model: nn.Module, cm: CostModel, removed: np.ndarray) -> None:
    """Refuse a plan its trace cannot make whole: a mask that removes channels where the
    traced inputs never reach it (an expert its router sent none of them: the shrunk copy
    would keep them), or removed channels of a width a copy of a module shares with it while
    that copy did not run (its weights would keep that width: ``graph.unrun``).

    Raises:
        ValueError: naming the mask or the copies, and what inputs to trace with instead.
    """
    recorded = recorded_params(model)
    unseen = [
        n
        for n, m in cm.masks.items()
        if n not in cm.entry_start and not m.is_all_ones() and not _recorded(model, n)
    ]
    if unseen:
        raise ValueError(
            f"mask {unseen[0]!r} removes channels, but the example inputs never reach it (a "
            f"module a router sent no row to?), so the shrunk model would keep them: "
            f"{_REACH_EVERY_COPY}"
        )
    # copies whose every parameter a recorded group follows are sliced from the groups
    params = dict(model.named_parameters())
    copies = {
        ran: left
        for ran, idle in unrun_copies(model, cm.trace).items()
        if (left := [c for c in idle if not _within(params, c) <= recorded])
    }
    if not copies:  # (the common case: no groups to find)
        return
    groups = find_groups(cm.trace, cm.graph)[0]
    for gi, why in unrun_copy_reasons(model, cm.trace, groups, copies).items():
        if removed[groups[gi].roots].any():
            raise ValueError(
                f"channels of {groups[gi].name} are removed, but {why.split(': ')[0]}, so "
                f"their weights would keep them: {_REACH_EVERY_COPY}"
            )


def _within(params: dict[str, object], module: str) -> set[str]:
    """The names of ``params`` inside ``module``."""
    return {n for n in params if n.startswith(module + ".")}


def _recorded(model: nn.Module, mask: str) -> bool:
    """Whether ``apply_masks`` recorded the group of ``mask`` (so its parameters are sliced
    from it where the trace does not see them: ``export.untraced``)."""
    found = find_holder(model)
    return found is not None and mask in getattr(found[1], "groups", {})


def _check_removable(cm: CostModel, entries: np.ndarray, removed: np.ndarray) -> None:
    graph = cm.graph
    blocked = cm.trace.atoms.blocked_reasons(graph.roots)
    for r in np.flatnonzero(removed).tolist():
        reason = blocked.get(r)
        if reason is not None:
            raise ValueError(
                f"a zeroed mask entry removes a channel that cannot be removed physically: "
                f"{reason}. Unprune it (set the mask entry back to 1) or move the mask"
            )
    # a zeroed entry must only zero channels that are removed; one that zeroes a live
    # channel (or whose zeros never reach a consumer, e.g. lost at a BatchNorm) changes the
    # output in a way the shrunk model cannot reproduce
    c = graph.consumers
    traced = entries[: graph.n_entries]  # block gates (after them) remove whole blocks
    zero_entries = set(np.flatnonzero(traced < 0.5).tolist())
    if not zero_entries:
        return
    covered = (c.cover >= 0) & ~c.derived  # a follower's derived uses zero nothing
    live_hit = set(c.cover[covered & ~removed[c.roots]].tolist()) & zero_entries
    used = set(c.cover[covered & removed[c.roots]].tolist())
    bad = sorted(live_hit | (zero_entries - used))
    if bad:
        e = bad[0]
        starts = cm.trace.entry_starts()
        name = next(n for n, s in starts.items() if s <= e < s + cm.masks[n].num_channels)
        raise ValueError(
            f"mask {name!r} zeroes channel {e - starts[name]}, but that does not remove the "
            "channel (a BatchNorm, a gate or an add with an unmasked tensor lies after the "
            "mask), so the shrunk model could not give the same output; use apply_masks, or "
            "place masks after normalisation and activation"
        )


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)


def _filled_output(o: Any) -> bool:
    """Whether ``o`` is a well-formed entry of a plan's ``outputs``."""
    if not isinstance(o, dict) or not isinstance(o.get("path"), str):
        return False
    dim, size, kept = o.get("dim"), o.get("size"), o.get("kept")
    return (
        _int_list([dim, size])
        and _int_list(kept)
        and dim >= 0
        and bool(kept)
        and kept == sorted(set(kept))
        and kept[0] >= 0
        and kept[-1] < size
    )


def _validate_modules(modules: Any) -> None:
    """Check ``{module: {tensor: {"shape": [...], "kept": {dim: [indices]}}}}``."""
    bad = "pruning plan: "
    if not isinstance(modules, dict):
        raise ValueError(bad + "'modules' must be an object keyed by module name")
    for mname, tensors in modules.items():
        if not isinstance(tensors, dict):
            raise ValueError(bad + f"module {mname!r} must map tensor names to specs")
        for tname, spec in tensors.items():
            where = f"{mname}.{tname}"
            if not isinstance(spec, dict) or not _int_list(spec.get("shape")):
                raise ValueError(bad + f"{where} needs a 'shape' list of sizes")
            kept = spec.get("kept")
            if not isinstance(kept, dict):
                raise ValueError(bad + f"{where} needs a 'kept' object of dims")
            shape = spec["shape"]
            for d, idx in kept.items():
                if not (isinstance(d, str) and d.isdigit() and int(d) < len(shape)):
                    raise ValueError(bad + f"{where}: dim {d!r} is not a dim of {shape}")
                size = shape[int(d)]
                if (
                    not _int_list(idx)
                    or any(i < 0 or i >= size for i in idx)
                    or (idx != sorted(set(idx)))
                ):
                    raise ValueError(
                        bad
                        + f"{where} dim {d}: kept indices must be sorted, unique, in [0, {size})"
                    )
                if not idx:
                    raise ValueError(
                        bad + f"{where} dim {d}: the kept list is empty (a layer with no "
                        "channels cannot be built); keep at least one index"
                    )


def _own_tensors(mod: nn.Module) -> list[tuple[str, torch.Tensor]]:
    own = [(n, t) for n, t in mod._parameters.items() if t is not None]
    return own + [(n, t) for n, t in mod._buffers.items() if t is not None]


def _all_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = []
    for mname, mod in model.named_modules():
        for tname, t in _own_tensors(mod):
            out.append((f"{mname}.{tname}" if mname else tname, t))
    return out


def _is_mask_tensor(model: nn.Module, name: str) -> bool:
    owner = name.rpartition(".")[0]
    try:
        return isinstance(model.get_submodule(owner), MaskLayer) if owner else False
    except AttributeError:
        return False


def _get_tensor(mod: nn.Module, name: str) -> torch.Tensor | None:
    if name in mod._parameters:
        return mod._parameters[name]
    if name in mod._buffers:
        return mod._buffers[name]
    return None


def _one_run(kept: list[int]) -> bool:
    """Whether ``kept`` (sorted indices, at least one) is one run of consecutive indices."""
    return bool(kept) and kept[-1] - kept[0] == len(kept) - 1


def _set_tensor(mod: nn.Module, name: str, value: torch.Tensor) -> None:
    if name in mod._parameters:
        old = mod._parameters[name]
        mod._parameters[name] = nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        mod._buffers[name] = value


def _replace_module(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put ``new`` wherever ``model`` holds ``old``."""
    for parent in model.modules():
        for key, child in parent._modules.items():
            if child is old:
                parent._modules[key] = new


def _remove_masks(model: nn.Module, mask_modules: list[str]) -> None:

    remove_mask_points(model)
    for name in mask_modules:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(getattr(parent, child, None), MaskLayer):
            setattr(parent, child, nn.Identity())


def _count(n: Any) -> bool:
    """A plan's attribute value: an integer >= 0, or a non-empty list of them."""
    if isinstance(n, list):
        return bool(n) and all(type(e) is int and e >= 0 for e in n)
    return type(n) is int and n >= 0


def _settable(held: Any, value: int | list[int]) -> bool:
    """Whether a model's attribute ``held`` takes the plan's ``value``: an integer for an
    integer; for a list, a list or tuple of as many integers, none smaller than the size the
    plan gives it (a piece only loses channels; a shrunk model's sizes equal the plan's)."""
    if isinstance(value, list):
        return (
            type(held) in (list, tuple)
            and len(held) == len(value)
            and all(type(h) is int and h >= v for h, v in zip(held, value, strict=True))
        )
    return isinstance(held, int)
