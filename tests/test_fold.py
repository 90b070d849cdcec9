"""Once pruning is over, masks act through the layers' weights instead of the activations.

The reference is the same model with its masks still multiplying activations (collecting on):
outputs, gradients and parameter updates must be identical.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fisherprune as fp
from fisherprune.train.models import build_model

MODELS = ["mlp", "cnn", "resnet", "densenet"]


def _pair(name: str) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(name, (1, 8, 8), 10)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    masks = fp.apply_masks(model, x[:1])
    for m in masks.values():
        m.mask[torch.randperm(m.num_channels)[: m.num_channels // 2]] = 0.0
    ref = copy.deepcopy(model)
    for m in masks.values():
        m.collecting = False  # pruning over: folded into weights
    return model.train(), ref.train(), x, y


@pytest.mark.parametrize("name", MODELS)
def test_folded_masks_give_identical_outputs_and_gradients(name: str) -> None:
    """Folded and activation masks agree exactly on outputs and on every parameter gradient."""
    model, ref, x, y = _pair(name)
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=1e-6)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", MODELS)
def test_folded_masks_survive_optimizer_steps(name: str) -> None:
    """Momentum SGD steps on the folded model track the activation-masked model step by step."""
    model, ref, x, y = _pair(name)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    for _ in range(3):
        for m, opt in zip((model, ref), opts, strict=True):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), ref.eval()(x), rtol=1e-5, atol=1e-5)


def test_remove_masks_drops_the_gradient_hooks() -> None:
    """After remove_masks no gradient is filtered: pruned weight columns get gradients again."""
    model, _, x, y = _pair("mlp")
    model(x)  # folds
    fp.remove_masks(model)
    F.cross_entropy(model(x), y).backward()
    w = model.net[3].weight
    assert bool((w.grad.abs().sum(0) > 0).all())
