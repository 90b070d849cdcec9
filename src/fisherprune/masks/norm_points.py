"""Norm points: a registered norm whose width has a mask takes its statistics over the kept
channels only (``fisherprune.norms``), by a forward hook that recomputes its output.

With nothing pruned the hook returns nothing, so the norm's own output stands bit for bit;
while a tracer runs it does the same, so the trace sees the norm's own operators.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fisherprune.masks import tracing
from fisherprune.masks.layer import MaskLayer, all_ones
from fisherprune.norms import norm_spec, normalise_kept

__all__ = ["NormPoint"]


class NormPoint:
    """The forward hook of one registered norm whose input dim ``dim`` (of size ``size``)
    carries masked channels: ``parts`` holds, for each mask, the positions it covers and the
    mask entry each uses (positions no mask covers are always kept)."""

    def __init__(
        self,
        module_name: str,
        dim: int,
        size: int,
        parts: Sequence[tuple[MaskLayer, np.ndarray, np.ndarray]],
    ) -> None:
        self.module_name = module_name
        self.dim, self.size = dim, size
        self.parts = [
            (m, torch.as_tensor(p, dtype=torch.long), torch.as_tensor(i, dtype=torch.long))
            for m, p, i in parts
        ]
        self._masks = list(dict.fromkeys(m for m, _, _ in self.parts))
        self._ones_cache: dict[str, Any] = {}
        self._kept: tuple[tuple[Any, ...], Tensor] | None = None

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

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if tracing.active() is not None or all_ones(self._masks, self._ones_cache):
            return None
        spec = norm_spec(module)
        x = args[0] if args else None
        if spec is None or not isinstance(x, Tensor) or not isinstance(output, Tensor):
            raise RuntimeError(
                f"fisherprune norm hook on {self.module_name!r} expects a registered norm called "
                "on one tensor, as when the masks were applied; call apply_masks again"
            )
        if x.dim() <= self.dim or x.shape[self.dim] != self.size:
            raise RuntimeError(
                f"fisherprune norm hook on {self.module_name!r}: input of shape "
                f"{tuple(x.shape)} has no dim {self.dim} of size {self.size}, as traced"
            )
        return normalise_kept(module, spec, x, self.dim, self.kept(x.device), output)
