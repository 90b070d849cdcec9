"""The model-level call flags (``fisherprune.masks.points.ModelCall``): a call of the whole
model whose masks are all idle skips every mask point, and nothing of that leaks out of the
call: not after it ends, not after it raises, not into a submodule called on its own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fisherprune as fp


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if fail:
            raise RuntimeError("boom")
        return self.fc3(torch.relu(self.fc2(h)))


@pytest.fixture
def masked() -> tuple[_Net, dict[str, fp.MaskLayer]]:
    torch.manual_seed(0)
    net = _Net()
    fp.apply_masks(net, torch.randn(1, 4))
    masks = fp.find_masks(net)
    for m in masks.values():
        m.collecting = False  # idle: all ones and not collecting
    return net, masks


def test_idle_call_equals_the_unmasked_model(masked) -> None:
    """All-ones masks, no collecting: the call skips every point and gives the unmasked outputs."""
    net, _ = masked
    x = torch.randn(5, 4)
    with torch.no_grad():
        got = net(x)
    fp.remove_masks(net)
    with torch.no_grad():
        assert torch.equal(got, net(x))


def test_a_call_that_raised_leaves_no_idle_flag(masked) -> None:
    """An idle call raises halfway; a submodule then called on its own with a zeroed mask
    entry still applies the mask (the flags were cleared by the always-called hook): its output
    is the layer's on the masked input (a skipped point would give the unmasked one)."""
    net, masks = masked
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        net(torch.randn(2, 4), fail=True)
    m = masks["fisherprune_masks.fc1:out"]  # what fc2 reads
    weight, bias = net.fc2.weight.detach().clone(), net.fc2.bias.detach().clone()
    with torch.no_grad():
        m.mask[0] = 0.0
    h = torch.ones(2, 8)
    with torch.no_grad():
        got = net.fc2(h)
    want = nn.functional.linear(h * m.mask.detach(), weight, bias)
    assert torch.allclose(got, want)
    assert not torch.allclose(got, nn.functional.linear(h, weight, bias))


def test_collecting_after_idle_calls_gathers_the_signal(masked) -> None:
    """Idle calls first, then a collecting step: every mask gathers a non-zero signal."""
    net, masks = masked
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    with torch.no_grad():
        net(x)
    for m in masks.values():
        m.collecting = True
    nn.functional.cross_entropy(net(x), y).backward()
    fp.update_pruning_signals(masks, decay=0.0)
    assert all(float(m.signal.abs().sum()) > 0 for m in masks.values())
