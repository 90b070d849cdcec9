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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fisherprune._version import __version__
from fisherprune.cost import CostModel
from fisherprune.export.modules import update_metadata
from fisherprune.export.storage import atomic_write_bytes
from fisherprune.masks import MaskLayer
from fisherprune.masks.points import find_holder

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
        mask_modules: hand-placed MaskLayer modules, replaced by ``nn.Identity``.
        convention: cost convention of the recorded costs.
        cost: ``{"dense": ..., "pruned": ...}`` per example, when known.
        version: fisherprune version that made the plan.
    """

    modules: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    mask_modules: list[str] = field(default_factory=list)
    convention: str = "flops"
    cost: dict[str, float] = field(default_factory=dict)
    version: str = __version__

    # ------------------------------------------------------------ building
    @classmethod
    def from_model(
        cls, model: nn.Module, example_inputs: Any = None, convention: str = "flops"
    ) -> PruningPlan:
        """Read the plan off a masked model (traces it once).

        Args:
            model: a model with masks (from ``apply_masks`` or placed by hand).
            example_inputs: inputs to trace with; defaults to those ``apply_masks`` kept.
            convention: cost convention recorded in the plan.

        Raises:
            ValueError: no example inputs, no masks, or a zeroed mask entry whose
                channel cannot be removed physically (the message says why).
        """
        example_inputs = _example_inputs(model, example_inputs)
        cm = CostModel(model, example_inputs, convention)
        if not cm.masks:
            raise ValueError("the model has no masks: nothing to shrink (apply_masks first)")
        graph, trace = cm.graph, cm.trace
        entries = cm.entries()
        removed = graph.removed(entries)
        _check_removable(cm, entries, removed)
        plan = cls(convention=convention)
        plan.cost = {"dense": cm.dense_total(), "pruned": cm.total(entries)}
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
        holder = find_holder(model)
        applied = holder[0] + "." if holder else None
        plan.mask_modules = [
            n
            for n, m in model.named_modules()
            if isinstance(m, MaskLayer) and not (applied and n.startswith(applied))
        ]
        return plan

    # ------------------------------------------------------------- applying
    def apply(self, model: nn.Module) -> nn.Module:
        """Shrink ``model`` in place to the planned architecture and return it.

        Slices every listed parameter and buffer (new ``nn.Parameter`` objects for
        parameters), updates module metadata through the shrink-rule registry,
        replaces hand-placed MaskLayers by ``nn.Identity`` and removes masks added
        by ``apply_masks``. The model's class and forward code are kept.
        Idempotent: applying to an already shrunk model changes nothing.

        Raises:
            PlanMismatchError: naming the first module or tensor that does not match.
        """
        modules = dict(model.named_modules())
        todo: list[tuple[nn.Module, str, str, dict[str, Any]]] = []
        for mname, tensors in self.modules.items():
            mod = modules.get(mname)
            if mod is None:
                raise PlanMismatchError(f"the model has no module {mname!r} that the plan names")
            for tname, spec in tensors.items():
                t = _get_tensor(mod, tname)
                if t is None:
                    raise PlanMismatchError(
                        f"module {mname!r} has no parameter or buffer {tname!r}"
                    )
                shrunk = [
                    len(spec["kept"][d]) if str(i) in spec["kept"] else s
                    for i, s in enumerate(spec["shape"])
                    for d in [str(i)]
                ]
                if list(t.shape) == shrunk:
                    continue  # already shrunk
                if list(t.shape) != list(spec["shape"]):
                    raise PlanMismatchError(
                        f"{mname}.{tname} has shape {list(t.shape)}; the plan was made for "
                        f"{spec['shape']}: a different architecture or width"
                    )
                todo.append((mod, mname, tname, spec))
        for mname in self.mask_modules:
            if mname not in modules:
                raise PlanMismatchError(
                    f"the model has no mask module {mname!r} that the plan names"
                )
        _remove_masks(model, self.mask_modules)
        changed: dict[int, tuple[nn.Module, dict[str, tuple[int, ...]]]] = {}
        with torch.no_grad():
            for mod, _mname, tname, spec in todo:
                t = _get_tensor(mod, tname)
                old_shape = tuple(t.shape)
                new = t
                for d, kept in spec["kept"].items():
                    idx = torch.as_tensor(kept, dtype=torch.long, device=t.device)
                    new = new.index_select(int(d), idx)
                _set_tensor(mod, tname, new.contiguous())
                changed.setdefault(id(mod), (mod, {}))[1][tname] = old_shape
        for mod, old in changed.values():
            update_metadata(mod, old)
        return model

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "fisherprune_version": self.version,
            "convention": self.convention,
            "cost": self.cost,
            "mask_modules": self.mask_modules,
            "modules": self.modules,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PruningPlan:
        """Raises ValueError for data that is not a fisherprune plan."""
        if not isinstance(data, dict) or data.get("format") != FORMAT or "modules" not in data:
            raise ValueError("not a fisherprune pruning plan (format 1)")
        return cls(
            modules=data["modules"],
            mask_modules=list(data.get("mask_modules", [])),
            convention=data.get("convention", "flops"),
            cost=dict(data.get("cost", {})),
            version=data.get("fisherprune_version", "?"),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PruningPlan:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON, atomically (no partial file on failure)."""
        atomic_write_bytes(Path(path), self.to_json().encode())

    @classmethod
    def load(cls, path: str | os.PathLike) -> PruningPlan:
        return cls.from_json(Path(path).read_text())


# ------------------------------------------------------------------ helpers
def _example_inputs(model: nn.Module, example_inputs: Any) -> Any:
    if example_inputs is not None:
        return example_inputs
    found = find_holder(model)
    kept = getattr(found[1], "_fp_example", None) if found else None
    if kept is None:
        raise ValueError(
            "example_inputs are needed to trace this model (only masks added by apply_masks "
            "remember theirs)"
        )
    return kept


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
    # a zeroed entry that removes nothing changes the output: shrinking would not be exact
    c = graph.consumers
    zero_entries = set(np.flatnonzero(entries < 0.5).tolist())
    if not zero_entries:
        return
    live = ~removed[c.roots] & (c.cover >= 0)
    hit = set(c.cover[live].tolist()) & zero_entries
    if hit:
        e = min(hit)
        name = next(
            n for n, s in cm.trace.entry_starts().items() if s <= e < s + cm.masks[n].num_channels
        )
        k = e - cm.trace.entry_starts()[name]
        raise ValueError(
            f"mask {name!r} zeroes channel {k}, but that channel stays alive elsewhere (a "
            "BatchNorm, a gate or an add with an unmasked tensor lies after the mask), so it "
            "cannot be removed exactly; use apply_masks, or place masks after normalisation"
        )


def _get_tensor(mod: nn.Module, name: str) -> torch.Tensor | None:
    if name in mod._parameters:
        return mod._parameters[name]
    if name in mod._buffers:
        return mod._buffers[name]
    return None


def _set_tensor(mod: nn.Module, name: str, value: torch.Tensor) -> None:
    if name in mod._parameters:
        old = mod._parameters[name]
        mod._parameters[name] = nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        mod._buffers[name] = value


def _remove_masks(model: nn.Module, mask_modules: list[str]) -> None:
    from fisherprune.masks.points import remove_mask_points

    remove_mask_points(model)
    for name in mask_modules:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(getattr(parent, child, None), MaskLayer):
            setattr(parent, child, nn.Identity())
