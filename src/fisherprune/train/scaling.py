"""The data's standardisation as modules of the model: the built model takes features as the
data file holds them and returns regression targets in their own units.

``with_scaling(model, scaling)`` wraps a model as ``Sequential(scale_in, model, scale_out)``:
``scale_in`` standardises the features with the training rows' mean and standard deviation,
``scale_out`` maps the model's standardised targets back to the data's units. Both are fixed
buffers (nothing to train, nothing to prune), so they travel with every export (state_dict,
TorchScript, ONNX, AOTInductor).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor, nn

from fisherprune.train.data import Scaling
from fisherprune.train.models import build_model

__all__ = ["Standardize", "Unstandardize", "model_from_meta", "with_scaling"]


class Standardize(nn.Module):
    """``(x - mean) / std`` per feature of a flat ``(N, F)`` input."""

    def __init__(self, mean: list[float], std: list[float]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32))

    def forward(self, x: Tensor) -> Tensor:
        return (x - self.mean) / self.std


class Unstandardize(nn.Module):
    """``y * std + mean``: a standardised target back in the data's units."""

    def __init__(self, mean: float, std: float) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32))

    def forward(self, y: Tensor) -> Tensor:
        return y * self.std + self.mean


def with_scaling(model: nn.Module, scaling: Scaling | None) -> nn.Module:
    """``model`` between the modules ``scaling`` calls for, or ``model`` itself when it calls
    for none. Does not change ``model``.

    Returns:
        ``Sequential(scale_in=Standardize, model=model, scale_out=Unstandardize)`` with only
        the parts that apply.
    """
    if scaling is None:
        return model
    parts: OrderedDict[str, nn.Module] = OrderedDict()
    if scaling.feature_mean is not None and scaling.feature_std is not None:
        parts["scale_in"] = Standardize(scaling.feature_mean, scaling.feature_std)
    parts["model"] = model
    if scaling.target_mean is not None and scaling.target_std is not None:
        parts["scale_out"] = Unstandardize(scaling.target_mean, scaling.target_std)
    return model if len(parts) == 1 else nn.Sequential(parts)


def model_from_meta(meta: dict[str, Any]) -> nn.Module:
    """A fresh (unmasked) model as a training checkpoint's ``model_meta`` describes it: the
    built-in or user builder, between the scaling modules it was trained with.

    Raises:
        ValueError: an unknown model name (from ``build_model``).
    """
    model = build_model(
        meta["name"],
        tuple(meta["input_shape"]),
        meta["num_outputs"],
        meta.get("width"),
        meta.get("depth"),
    )
    scaling = meta.get("scaling")
    return with_scaling(model, None if scaling is None else Scaling.from_dict(scaling))
