"""Serving forms: channels-last layout (the layout oneDNN computes convolutions in on CPU) and
inputs taken positionally by the graphs that exporters capture."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ServedInputs", "serving_copy", "to_channels_last"]


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


class ServedInputs(nn.Module):
    """Runs ``model`` on inputs given positionally: as they are, or, with ``names``, as the
    keyword arguments of those names in that order.

    Exporters capture a graph of positional inputs more reliably than of keyword ones
    (``torch.export`` cannot give dynamic shapes to a ``**kwargs`` forward, and torch's
    TorchScript-based ONNX exporter passes keyword-only parameters positionally), so a model
    that takes keyword inputs is exported behind this module, and the loader maps keywords to
    positions. With ``channels_last``, every 4-D floating-point input is put in channels-last
    layout first, so that a package compiled from it takes ordinary (contiguous) inputs while
    its convolutions run in the layout oneDNN computes fastest on CPU.
    """

    def __init__(self, model: nn.Module, channels_last: bool, names: list[str] | None) -> None:
        super().__init__()
        self.model = model
        self.channels_last = channels_last
        self.names = names

    def forward(self, *args: Tensor) -> Any:
        if self.channels_last:
            args = tuple(to_channels_last(a) for a in args)
        if self.names is None:
            return self.model(*args)
        return self.model(**dict(zip(self.names, args, strict=True)))
