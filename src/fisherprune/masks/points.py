"""Mask points: masks applied at a module's input by a forward pre-hook.

``apply_masks`` does not touch the model's class or ``forward``: it adds one
submodule, ``fisherprune_masks`` (a ``ModuleDict`` of MaskLayers, so masks and
signals are in ``state_dict``), and one forward pre-hook per consuming module
that multiplies the module's input channels by the masks. ``remove_hooks_and_masks``
removes exactly those, restoring the original model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from fisherprune.masks import _trace_hook
from fisherprune.masks.layer import MaskLayer, _MaskMultiply

__all__ = [
    "MASKS_ATTR",
    "MaskPoint",
    "find_holder",
    "install_mask_points",
    "remove_mask_points",
]

MASKS_ATTR = "fisherprune_masks"


class MaskPoint:
    """Multiplies positional input ``arg`` of a module, along ``dim``, by one or more masks.

    ``parts``: for each mask, the positions of ``dim`` it covers and which of
    its channels each position uses; positions no mask covers are left as they are.
    """

    def __init__(
        self,
        module_name: str,
        arg: int,
        dim: int,
        size: int,
        parts: Sequence[tuple[MaskLayer, np.ndarray, np.ndarray]],
    ) -> None:
        self.module_name = module_name
        self.arg, self.dim, self.size = arg, dim, size
        self.parts = [
            (m, torch.as_tensor(p, dtype=torch.long), torch.as_tensor(i, dtype=torch.long))
            for m, p, i in parts
        ]
        self._np_parts = [(m, np.asarray(p), np.asarray(i)) for m, p, i in parts]
        m0, p0, i0 = self.parts[0]
        self._direct = (
            len(self.parts) == 1
            and p0.numel() == size
            and i0.numel() == m0.num_channels
            and bool((p0 == torch.arange(size)).all())
            and bool((i0 == torch.arange(m0.num_channels)).all())
        )
        self._masks = list(dict.fromkeys(m for m, _, _ in self.parts))
        self._versions: tuple[int, ...] | None = None
        self._all_ones = True

    def multiplier(self, x: Tensor) -> Tensor:
        """The (broadcastable) multiplier for input ``x``."""
        if self._direct:
            mult = self.parts[0][0].mask.to(dtype=x.dtype, device=x.device)
        else:
            mult = torch.ones(self.size, dtype=x.dtype, device=x.device)
            for m, pos, idx in self.parts:
                mult[pos.to(x.device)] = m.mask[idx.to(m.mask.device)].to(dtype=x.dtype)
        shape = [1] * x.dim()
        shape[self.dim] = self.size
        return mult.view(shape)

    def _nothing_pruned(self) -> bool:
        versions = tuple(m.mask._version for m in self._masks)
        if versions != self._versions:
            self._versions = versions
            self._all_ones = all(bool((m.mask > 0.5).all()) for m in self._masks)
        return self._all_ones

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        if len(args) <= self.arg or not isinstance(args[self.arg], Tensor):
            raise RuntimeError(
                f"fisherprune mask on {self.module_name!r} expects a tensor as positional input "
                f"{self.arg}, as when the masks were applied; got {len(args)} positional inputs"
            )
        x = args[self.arg]
        if x.dim() <= self.dim or x.shape[self.dim] != self.size:
            raise RuntimeError(
                f"fisherprune mask on {self.module_name!r}: input of shape {tuple(x.shape)} has "
                f"no dim {self.dim} of size {self.size}, as traced; call apply_masks again"
            )
        return (*args[: self.arg], self.apply(x), *args[self.arg + 1 :])

    def apply(self, x: Tensor) -> Tensor:
        """Return ``x`` times the masks; gathers per-example gradients while collecting."""
        tracer = _trace_hook.active()
        if tracer is not None:
            with tracer.suspended():
                out = x * self.multiplier(x)
            tracer.record_mask(x, out, self.dim, self._np_parts)
            return out
        if torch.is_grad_enabled() and any(m.collecting for m in self._masks):
            for m in self._masks:
                m._start_pass()
            mult = self.multiplier(x).detach().requires_grad_()  # backward runs even if x is frozen
            return _MaskMultiply.apply(x, mult, self, None, self.dim)
        if self._nothing_pruned():
            return x
        return x * self.multiplier(x)

    def _accumulate(self, g: Tensor, index: Tensor | None) -> None:
        for m, pos, idx in self.parts:
            if m.collecting:
                m._accumulate(g[:, pos.to(g.device)], idx)


def find_holder(model: nn.Module) -> tuple[str, nn.ModuleDict] | None:
    """Where ``apply_masks`` put its masks: ``(qualified name, ModuleDict)``, or None."""
    for name, mod in model.named_modules():
        holder = mod._modules.get(MASKS_ATTR)
        if holder is not None:
            return (f"{name}.{MASKS_ATTR}" if name else MASKS_ATTR), holder  # type: ignore[return-value]
    return None


def _holder_parent(model: nn.Module, consumers: Sequence[str]) -> nn.Module:
    """The module to hold the masks: the model itself, unless its forward runs every child
    (a root ``nn.Sequential``); then the first consuming layer, whose forward does not."""
    if not isinstance(model, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        return model
    modules = dict(model.named_modules())
    for name in consumers:
        mod = modules[name]
        if not isinstance(mod, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            return mod
    raise ValueError("cannot find a module to hold the masks of this container model")


def install_mask_points(
    model: nn.Module,
    masks: dict[str, MaskLayer],
    points: Sequence[tuple[str, int, int, int, list[tuple[str, np.ndarray, np.ndarray]]]],
) -> str:
    """Add ``masks`` as a ``fisherprune_masks`` ModuleDict and hook each point's module.

    The ModuleDict goes on the model itself (on the first consuming layer when the model
    is an ``nn.Sequential``, whose forward would call it). Changes: adds one submodule and
    one forward pre-hook per point; on failure everything added is removed again.

    Returns:
        The qualified name of the ModuleDict (``"fisherprune_masks"`` usually).

    Raises:
        ValueError: the model already has ``fisherprune_masks``.
    """
    if find_holder(model) is not None:
        raise ValueError(
            f"the model already has {MASKS_ATTR!r}: call fisherprune.remove_masks(model) first"
        )
    holder = nn.ModuleDict(masks)
    holder._fp_handles = []  # type: ignore[attr-defined]
    _holder_parent(model, [p[0] for p in points]).add_module(MASKS_ATTR, holder)
    modules = dict(model.named_modules())
    try:
        for name, arg, dim, size, parts in points:
            mp = MaskPoint(name, arg, dim, size, [(holder[k], p, i) for k, p, i in parts])
            holder._fp_handles.append(modules[name].register_forward_pre_hook(mp))
    except Exception:
        remove_mask_points(model)
        raise
    found = find_holder(model)
    assert found is not None
    return found[0]


def remove_mask_points(model: nn.Module) -> bool:
    """Remove the hooks and the ``fisherprune_masks`` submodule; return whether there were any."""
    found = find_holder(model)
    if found is None:
        return False
    name, holder = found
    for h in getattr(holder, "_fp_handles", []):
        h.remove()
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    delattr(parent, MASKS_ATTR)
    return True
