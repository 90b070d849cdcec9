"""Finding the masks of a model by their qualified module names."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn

from fisherprune.masks.layer import MaskLayer

__all__ = ["MaskSet", "as_mask_dict", "find_masks"]

MaskSet = Mapping[str, MaskLayer] | Iterable[MaskLayer]


def find_masks(model: nn.Module) -> dict[str, MaskLayer]:
    """Return every MaskLayer of ``model`` keyed by its qualified name, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MaskLayer)}


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
