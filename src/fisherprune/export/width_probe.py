"""A dry run for a width normalised by registered norms: shrink the model with one of its
channels removed and check the result.

A width a norm normalises is the model's hidden width, and code often reads it back from a
tensor's shape (``b, t, c = x.shape`` then ``reshape(b, t, 3, heads, c // heads)``): a number
the trace cannot follow, which would make the shrunk model fail or differ. Such a group is not
offered: importing this module registers ``width_problem`` with
``fisherprune.graph.placement.register_width_check`` (``graph`` cannot import ``export``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from fisherprune._errors import first_line
from fisherprune.export.shrink import shrink
from fisherprune.graph.groups import ChannelGroup
from fisherprune.graph.placement import register_width_check
from fisherprune.masks.layer import MaskLayer

__all__ = ["width_problem"]


def width_problem(
    model: nn.Module, example_inputs: Any, group: ChannelGroup, mask: MaskLayer
) -> str | None:
    """Why ``shrink`` fails on the model with the group's first channel removed (``mask``'s
    entry 0 zeroed): the shrunk copy does not run, or does not give the masked model's
    outputs, or the model cannot be copied; None if it works.

    The model is left as it was: the mask is restored and ``shrink`` works on a copy.
    """
    del group  # the mask's entries are the group's channels
    saved, all_ones = mask.mask.detach().clone(), mask.is_all_ones()
    try:
        with torch.no_grad():
            mask.mask.fill_(1.0)
            mask.mask[0] = 0.0
        with warnings.catch_warnings():  # a config that cannot follow one channel is no problem
            warnings.simplefilter("ignore")
            shrink(model, example_inputs)
    except Exception as e:  # any failure is the reason this width is not offered
        return (
            f"shrinking the model with one of these channels removed fails ({first_line(e)}): "
            "its code probably reads this width from a tensor's shape"
        )
    finally:
        with torch.no_grad():
            mask.mask.copy_(saved)
        mask.record_values(all_ones)
    return None


register_width_check(width_problem)
