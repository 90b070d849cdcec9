"""Norms written by others are recognised by what they compute (``detect_norms``): each
Hugging Face family has its own ``XxxRMSNorm`` class, and none needs ``register_norm``. The
reference is the masked model's own output in float64: the shrunk model must equal it."""

from __future__ import annotations

import pytest
import torch
from test_hidden_width import ATOL_F64, TinyLlama, _out, _prune_thirds
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.norms import detect_norms, norm_spec


class GemmaStyleRMSNorm(nn.Module):
    """Gemma's: in float32, scaled by (1 + weight), weight initialised at zero."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.rand(d) - 0.5)

    def forward(self, x: Tensor) -> Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class PhiStyleRMSNorm(nn.Module):
    """Phi-3's (and most decoder families'): LLaMA's computation under another class name."""

    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.variance_epsilon = eps

    def forward(self, h: Tensor) -> Tensor:
        dtype = h.dtype
        h = h.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class HandLayerNorm(nn.Module):
    """A layer norm written out, with a bias and its epsilon in ``epsilon``."""

    def __init__(self, d: int, epsilon: float = 1e-5) -> None:
        super().__init__()
        self.epsilon = epsilon
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.bias = nn.Parameter(torch.rand(d) - 0.5)

    def forward(self, x: Tensor) -> Tensor:
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + self.epsilon) * self.weight + self.bias


NORMS = [GemmaStyleRMSNorm, PhiStyleRMSNorm, HandLayerNorm]


@pytest.mark.parametrize("norm", NORMS, ids=lambda c: c.__name__)
def test_detected_norm_makes_the_width_prunable_and_shrunk_equals_masked(norm) -> None:
    torch.manual_seed(0)
    model = TinyLlama(norm=norm).double().eval()
    ids = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(1))
    masks = fp.apply_masks(model, ids[:1])
    width = [n for n, g in masks.groups.items() if g.producers[0] == "embed_tokens"]
    assert width, [s.reason for s in masks.skipped]
    _prune_thirds(masks, 0)
    small = fp.shrink(model, ids[:1])
    assert small.norm.weight.shape[0] < 24
    torch.testing.assert_close(_out(small, ids), _out(model, ids), rtol=0, atol=ATOL_F64)


def test_detection_leaves_the_parameters_as_they_were() -> None:
    model = nn.Sequential(nn.Linear(4, 6), GemmaStyleRMSNorm(6))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    detect_norms(model)
    assert norm_spec(model[1]).weight_offset == 1.0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_a_module_named_norm_that_is_not_one_is_not_detected() -> None:
    class ScaleNorm(nn.Module):  # a per-channel scale: no statistics across the width
        def __init__(self) -> None:
            super().__init__()
            self.eps = 1e-6
            self.weight = nn.Parameter(torch.rand(6) + 0.5)

        def forward(self, x: Tensor) -> Tensor:
            return x * self.weight

    mod = ScaleNorm()
    assert detect_norms(nn.Sequential(mod)) == {}
    assert norm_spec(mod) is None
