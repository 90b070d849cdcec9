"""Norm points: a registered norm whose width has a mask takes its statistics over the kept
channels only (``fisherprune.norms``), computed once, in place of the norm's own forward.

A forward hook cannot skip the forward it follows, and a norm run over the full width and then
corrected costs two norms forward and backward (measured 2.3x a plain LayerNorm's step on a
BERT-base activation). So the norm point is installed as the module's instance ``forward``
(``remove`` restores what was there): with nothing pruned, or while a tracer runs, it calls the
norm's own forward, so its output stands bit for bit and the trace sees the norm's operators;
once a channel is pruned it normalises the kept channels alone, exactly as the shrunk norm does.
The module's hooks run as before (``nn.Module.__call__`` calls whatever ``forward`` is).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fisherprune.masks import tracing
from fisherprune.masks.compile_guard import InstanceForward
from fisherprune.masks.compiled import compiling, covers_in_order
from fisherprune.masks.layer import CallFlags, MaskLayer, all_ones
from fisherprune.norms import norm_spec, normalise_kept, normalise_masked

__all__ = ["NormPoint"]


class NormPoint(InstanceForward):
    """Stands in for the ``forward`` of one registered norm ``module`` whose input dim ``dim``
    (of size ``size``) carries masked channels: ``parts`` holds, for each mask, the positions it
    covers and the mask entry each uses (positions no mask covers are always kept). ``flags``:
    the model's ``CallFlags`` (default: ones of its own, never set).

    Changes: sets ``module.forward`` (an instance attribute) to this point; ``remove`` puts
    back what was there before (the class's forward, or an instance ``forward`` another tool
    set, which is also what runs while nothing is pruned).
    """

    def __init__(
        self,
        module_name: str,
        module: nn.Module,
        dim: int,
        size: int,
        parts: Sequence[tuple[MaskLayer, np.ndarray, np.ndarray]],
        flags: CallFlags | None = None,
    ) -> None:
        self.module_name = module_name
        self.flags = CallFlags() if flags is None else flags
        self.module = module
        self.dim, self.size = dim, size
        self.parts = [
            (m, torch.as_tensor(p, dtype=torch.long), torch.as_tensor(i, dtype=torch.long))
            for m, p, i in parts
        ]
        self._masks = list(dict.fromkeys(m for m, _, _ in self.parts))
        #: one mask covering the dim in order: under ``torch.compile`` its values alone say
        #: which positions are kept (``fisherprune.masks.compiled``)
        self._direct = covers_in_order(self.parts, size)
        self._ones_cache: dict[str, Any] = {}
        self._kept: tuple[tuple[Any, ...], Tensor] | None = None
        #: set by ``remove``: the masks are gone, whoever still calls this point
        self.removed = False
        super().__init__(module, self)

    @property
    def __signature__(self) -> inspect.Signature:
        """The norm's own (``inspect.signature(norm.forward)`` reads what it read unmasked)."""
        return inspect.signature(self.forward_before())

    def kept(self, device: torch.device) -> Tensor:
        """The kept positions of the normalised dim (long, ascending), recomputed only when a
        mask changed: the forward pass pays no host sync for them."""
        key = (*(id(m.mask) for m in self._masks), *(m.mask._version for m in self._masks), device)
        if self._kept is not None and self._kept[0] == key:
            return self._kept[1]
        keep = torch.ones(self.size, dtype=torch.bool, device=device)
        for m, pos, idx in self.parts:
            keep[pos.to(device)] = (m.mask[idx.to(m.mask.device)] > 0.5).to(device)
        kept = torch.nonzero(keep).flatten()
        self._kept = (key, kept)
        return kept

    def remove(self) -> None:
        """As ``InstanceForward.remove``, and the point runs the norm's own forward from now on:
        a tool that wrapped the norm's ``forward`` after the masks came (Accelerate's hooks keep
        it as ``_old_forward``) still calls it, and the masks are gone."""
        self.removed = True
        super().remove()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.removed:
            return self.call_before(*args, **kwargs)
        compiled = compiling()
        if compiled and self._direct and len(args) == 1 and not kwargs:
            spec = norm_spec(self.module)
            if spec is not None and isinstance(args[0], Tensor):
                # (no version read, no index from the mask's values: see masks.compiled)
                keep = (self.parts[0][0].mask > 0.5).to(args[0].dtype)
                return normalise_masked(self.module, spec, args[0], self.dim, keep)
        if (
            (not compiled and self.flags.ones)  # (every mask all ones in this call of the model)
            or tracing.active() is not None
            or all_ones(self._masks, self._ones_cache)
        ):
            return self.call_before(*args, **kwargs)
        spec = norm_spec(self.module)
        x = args[0] if len(args) == 1 and not kwargs else None
        if spec is None or not isinstance(x, Tensor):
            raise RuntimeError(
                f"fisherprune masked norm {self.module_name!r} expects a registered norm called "
                "on one tensor, as when the masks were applied; call apply_masks again"
            )
        if x.dim() <= self.dim or x.shape[self.dim] != self.size:
            raise RuntimeError(
                f"fisherprune masked norm {self.module_name!r}: input of shape "
                f"{tuple(x.shape)} has no dim {self.dim} of size {self.size}, as traced"
            )
        return normalise_kept(self.module, spec, x, self.dim, self.kept(x.device))
