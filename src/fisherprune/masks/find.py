"""Finding the masks of a model by their qualified module names."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from fisherprune.masks.layer import MaskLayer

__all__ = ["MaskSet", "as_mask_dict", "find_masks", "masks_kept"]

MaskSet = Mapping[str, MaskLayer] | Iterable[MaskLayer]


def find_masks(model: nn.Module) -> dict[str, MaskLayer]:
    """Return every MaskLayer of ``model`` keyed by its qualified name, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MaskLayer)}


@contextmanager
def masks_kept(model: nn.Module, kept: Mapping[str, int]) -> Iterator[None]:
    """For the block, every mask of ``model`` at one except those named in ``kept``, which keep
    their first ``kept[name]`` channels (``{}``: the dense model); the masks are given back
    after, also on an error."""
    masks = find_masks(model)
    saved = {n: m.mask.detach().clone() for n, m in masks.items()}
    try:
        with torch.no_grad():
            for name, m in masks.items():
                m.mask.fill_(1.0)
                if name in kept:
                    m.mask[kept[name] :] = 0.0
        yield
    finally:
        with torch.no_grad():
            for name, m in masks.items():
                m.mask.copy_(saved[name])


def as_mask_dict(masks: MaskSet) -> dict[str, MaskLayer]:
    """Normalise a mapping or sequence of masks to an ordered ``{name: MaskLayer}`` dict.

    A sequence gets the names ``"0"``, ``"1"``, ... in its order.

    Raises:
        TypeError: an entry is not a MaskLayer.
    """
    items = list(masks.items()) if isinstance(masks, Mapping) else list(enumerate(masks))
    out: dict[str, MaskLayer] = {}
    for key, m in items:
        if not isinstance(m, MaskLayer):
            raise TypeError(f"mask {key!r} is a {type(m).__name__}, not a fisherprune.MaskLayer")
        out[str(key)] = m
    return out
