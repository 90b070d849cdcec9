"""The rows of a layer's least-squares repair, per layer type (``REPAIRABLE``).

A reader takes the layer, one call's input ``x`` and the target output ``y``, the indices of
the kept input channels, a sampler of output positions and the batch's token mask, and gives
``(rows, kept features)`` inputs and ``(rows, outputs)`` targets: every token of a linear
layer (those the token mask marks as padding left out), and the patches at a few sampled
output positions per image of a conv (He et al. 2017 sample 10).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "REPAIRABLE",
    "TRANSPOSED_LINEARS",
    "Sampler",
    "conv_rows",
    "linear_rows",
    "out_in_weight",
    "rows_reader",
    "transposed",
]

#: ``sample(n)``: the indices of the output positions (of ``n``) that a batch's fit reads
Sampler = Callable[[int], Tensor]


def linear_rows(
    mod: nn.Module, x: Tensor, y: Tensor, kept: Tensor, sample: Sampler, tokens: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(rows, kept in-features) inputs and (rows, out-features) outputs: every token, or with
    ``tokens`` (a boolean (N, T) mask, e.g. a tokenizer's ``attention_mask``) matching the
    leading dims of ``x``, the tokens it marks (padding carries nothing the model uses, and
    its activations are not the text's)."""
    if tokens is not None and tuple(x.shape[:-1]) == tuple(tokens.shape):
        return x[tokens][:, kept], y[tokens]
    return x.reshape(-1, x.shape[-1])[:, kept], y.reshape(-1, y.shape[-1])


def _conv_padding(mod: nn.Module) -> list[tuple[int, int]]:
    """(before, after) zero padding of each spatial dim of a conv."""
    kernel, dil = mod.kernel_size, mod.dilation
    if mod.padding == "valid":
        return [(0, 0)] * len(kernel)
    if mod.padding == "same":
        total = [d * (k - 1) for k, d in zip(kernel, dil, strict=True)]
        return [(t // 2, t - t // 2) for t in total]
    return [(p, p) for p in mod.padding]


def conv_rows(
    mod: nn.Module, x: Tensor, y: Tensor, kept: Tensor, sample: Sampler, tokens: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Patches at ``sample(H_out * W_out)`` output positions (the same for every image of the
    batch): (N * P, kept channels * kernel) inputs, (N * P, out channels) outputs. Only the
    sampled patches are gathered, so the cost per image is ``P x k`` whatever the image size."""
    if x.dim() == 3:  # Conv1d: a 2-d conv of height 1
        x, y = x.unsqueeze(2), y.unsqueeze(2)
        kernel, stride, dil = (1, *mod.kernel_size), (1, *mod.stride), (1, *mod.dilation)
        pad = [(0, 0), *_conv_padding(mod)]
    else:
        kernel, stride, dil, pad = mod.kernel_size, mod.stride, mod.dilation, _conv_padding(mod)
    xp = F.pad(x[:, kept], (*pad[1], *pad[0]))  # (N, k, H + pads, W + pads)
    oh_, ow_ = y.shape[2], y.shape[3]
    pick = sample(oh_ * ow_).to(x.device)
    oh, ow = pick // ow_, pick % ow_  # (P,)
    rows = oh[:, None] * stride[0] + torch.arange(kernel[0], device=x.device) * dil[0]
    cols = ow[:, None] * stride[1] + torch.arange(kernel[1], device=x.device) * dil[1]
    patches = xp[:, :, rows[:, :, None], cols[:, None, :]]  # (N, k, P, kh, kw)
    xs = patches.permute(0, 2, 1, 3, 4).reshape(-1, kept.numel() * kernel[0] * kernel[1])
    ys = y[:, :, oh, ow].permute(0, 2, 1).reshape(-1, y.shape[1])  # (N * P, out)
    return xs, ys


#: how to read one layer type's fitting rows (inputs on its kept channels, outputs)
REPAIRABLE: dict[type[nn.Module], Callable[..., Any]] = {
    nn.Linear: linear_rows,
    nn.Conv1d: conv_rows,
    nn.Conv2d: conv_rows,
}

#: linear layers that store their weight transposed, (in, out), by qualified class name (an
#: optional package's class, matched without importing it): Hugging Face's ``Conv1D`` (GPT-2)
TRANSPOSED_LINEARS: frozenset[str] = frozenset({"transformers.pytorch_utils.Conv1D"})


def transposed(mod: nn.Module) -> bool:
    """Whether ``mod`` is a linear layer whose weight is stored (in, out): its class or a base
    class is named in ``TRANSPOSED_LINEARS``."""
    return any(f"{c.__module__}.{c.__qualname__}" in TRANSPOSED_LINEARS for c in type(mod).__mro__)


def rows_reader(mod: nn.Module) -> Callable[..., Any] | None:
    """The reader of ``mod``'s fitting rows: its class's, or its nearest registered base
    class's (Falcon's ``FalconLinear`` is an ``nn.Linear``; a subclass whose forward computes
    something else is caught by the repair's check of each stage's real output error), or
    None when it has no repair."""
    if transposed(mod):
        return linear_rows
    return next((REPAIRABLE[c] for c in type(mod).__mro__ if c in REPAIRABLE), None)


def out_in_weight(mod: nn.Module) -> Tensor:
    """``mod.weight`` as (out, in, *kernel): the parameter itself, or for a transposed linear
    a view of it, so that in-place writes change the parameter."""
    return mod.weight.T if transposed(mod) else mod.weight
