"""Channels-last layout for serving: the layout oneDNN computes convolutions in on CPU."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["serving_copy", "to_channels_last"]


def serving_copy(model: nn.Module, channels_last: bool) -> nn.Module:
    """A deep copy of ``model`` in eval mode, with its 4-D weights in channels-last layout if
    ``channels_last`` (``model`` is not changed)."""
    copied = copy.deepcopy(model).eval()
    return copied.to(memory_format=torch.channels_last) if channels_last else copied


def to_channels_last(a: Any) -> Any:
    """``a`` in channels-last layout if it is a 4-D floating-point tensor, else ``a`` as it is."""
    if isinstance(a, torch.Tensor) and a.dim() == 4 and a.is_floating_point():
        return a.contiguous(memory_format=torch.channels_last)
    return a
