"""Repeated blocks: which masks ``uniform=True`` prunes together.

A transformer (or a ResNet stage) repeats one block; a Hugging Face configuration describes
every copy with one set of widths (``intermediate_size``, ``num_attention_heads``...). To stay
describable, the copies of one mask in each block must keep the same count. Masks are copies
of one another when their names differ only in numeric path components (the index of a block
in a ``ModuleList`` or ``Sequential``: ``layer_0_mlp:out`` and ``layer_11_mlp:out``) and they
have the same width.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from fisherprune.masks import MaskLayer

__all__ = ["copies_of", "plan_uniform", "register_uniform_refiner", "uniform_classes"]

#: a numeric path component: digits between separators (module paths use "." and apply_masks'
#: names "_"; ":" starts the place of the mask)
_INDEX = re.compile(r"(?<![^._:])\d+(?![^._:])")


def uniform_classes(masks: Mapping[str, MaskLayer]) -> list[list[str]]:
    """Masks grouped into classes of copies (in the order of ``masks``; a mask with no copy is
    a class of its own): same name up to numeric path components, same width."""
    classes: dict[tuple[str, int], list[str]] = {}
    for name, m in masks.items():
        classes.setdefault((_INDEX.sub("#", name), m.num_channels), []).append(name)
    return list(classes.values())


def copies_of(names: set[str], classes: list[list[str]]) -> set[str]:
    """``names`` with every mask that shares a class of ``classes`` with one of them: what
    must stay whole with them for the copies to keep one width."""
    return names.union(*(c for c in classes if names.intersection(c)))


#: refines the classes of copies for a model: returns the classes to prune together (merged when
#: one setting of the model governs several) and the masks to leave whole, with the reason;
#: it must leave the model as it found it
UniformRefiner = Callable[
    [nn.Module, Any, list[list[str]], Mapping[str, MaskLayer], int],
    "tuple[list[list[str]], dict[str, str]]",
]
_REFINERS: list[UniformRefiner] = []


def register_uniform_refiner(refine: UniformRefiner) -> UniformRefiner:
    """Add a step that refines the classes ``uniform=True`` prunes together (the export layer
    registers one that keeps a Hugging Face config describable); returns ``refine``.

    Raises:
        ValueError: ``refine`` is already registered.
    """
    if refine in _REFINERS:
        raise ValueError(f"{getattr(refine, '__name__', refine)!r} is already registered")
    _REFINERS.append(refine)
    return refine


def plan_uniform(
    model: nn.Module, example_inputs: Any, masks: Mapping[str, MaskLayer], round_to: int = 1
) -> tuple[list[list[str]], dict[str, str]]:
    """The classes of masks that ``uniform=True`` prunes together in ``model``, and the masks
    it must leave whole with the reason (e.g. a Hugging Face config with no field for that
    width): ``uniform_classes`` refined by every registered refiner, which judge a prune of
    one block of ``round_to`` channels."""
    classes, whole = uniform_classes(masks), {}
    for refine in _REFINERS:
        classes, more = refine(model, example_inputs, classes, masks, round_to)
        whole.update(more)
    return [c for c in classes if not any(n in whole for n in c)], whole
