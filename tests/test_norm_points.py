"""A norm whose width is masked normalises the kept channels once, in place of its forward: one
norm computation per call (not the full norm and then a correction), the shrunk model's output
and gradients, and the module's own forward back once the masks are removed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fisherprune as fp
from tests.zoo import build_transformer_sdpa, token_input


def _pruned_transformer() -> tuple[nn.Module, fp.AppliedMasks, torch.Tensor]:
    model = build_transformer_sdpa().double()
    x = token_input(3).double()
    masks = fp.apply_masks(model, x[:1])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in masks.values():
            m.mask[torch.randperm(m.num_channels, generator=g)[: m.num_channels // 3]] = 0.0
            m.collecting = False
    return model, masks, x


def test_a_masked_norm_runs_one_norm_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """With hidden channels pruned, a forward computes F.layer_norm once per LayerNorm."""
    model, _, x = _pruned_transformer()
    norms = sum(isinstance(m, nn.LayerNorm) for m in model.modules())
    calls = []
    real = F.layer_norm

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(F, "layer_norm", counting)
    model(x)
    assert len(calls) == norms > 0


def test_masked_norm_gives_the_shrunk_models_outputs_and_gradients() -> None:
    """Float64: the masked model's output and the kept weights' gradients of every LayerNorm
    equal the shrunk model's."""
    model, _, x = _pruned_transformer()
    small = fp.shrink(model, x[:1])
    out, ref = model(x), small(x)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    out.sum().backward()
    ref.sum().backward()
    big = {n: m for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)}
    for name, m in small.named_modules():
        if isinstance(m, nn.LayerNorm):
            full = big[name]
            kept = full.weight.grad.abs() > 0  # pruned entries get no gradient
            assert int(kept.sum()) == m.weight.numel()
            torch.testing.assert_close(full.weight.grad[kept], m.weight.grad, rtol=1e-10, atol=0)


def test_remove_masks_gives_the_norms_their_forward_back() -> None:
    """After remove_masks no norm has an instance forward and outputs are the dense ones."""
    model, _, x = _pruned_transformer()
    fp.remove_masks(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    dense = build_transformer_sdpa().double()
    dense.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x), dense(x), rtol=0, atol=0)
