"""MaskLayer: buffers, exact identity when all ones, channel zeroing, buffer identity, errors."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import fisherprune as fp
from fisherprune import MaskLayer
from tests.zoo import ARCHS

C = 6  # channels of every masked tensor below


def _case(name: str) -> tuple[nn.Module, nn.Module, torch.Tensor, int]:
    """A (head, tail, input, mask dim) triple whose head output has C channels on ``dim``."""
    torch.manual_seed(0)
    if name == "NC":
        return nn.Linear(4, C), nn.Linear(C, 3), torch.randn(5, 4), 1
    if name == "NCL":
        return nn.Conv1d(2, C, 3), nn.Conv1d(C, 2, 3), torch.randn(3, 2, 9), 1
    if name == "NCHW":
        return nn.Conv2d(2, C, 3), nn.Conv2d(C, 2, 3), torch.randn(3, 2, 7, 6), 1
    if name == "NCDHW":
        return nn.Conv3d(2, C, 3), nn.Conv3d(C, 2, 3), torch.randn(2, 2, 5, 6, 5), 1
    if name == "NLC":
        return nn.Linear(4, C), nn.Linear(C, 3), torch.randn(3, 7, 4), -1
    raise AssertionError(name)


CASES = ["NC", "NCL", "NCHW", "NCDHW", "NLC"]


def test_buffers_in_state_dict() -> None:
    """``mask`` (ones) and ``signal`` (zeros) are buffers of shape (C,) saved in state_dict."""
    m = MaskLayer(C)
    sd = m.state_dict()
    assert set(sd) == {"mask", "signal"}
    assert torch.equal(sd["mask"], torch.ones(C))
    assert torch.equal(sd["signal"], torch.zeros(C))
    assert dict(m.named_buffers()).keys() == {"mask", "signal"}
    assert list(m.parameters()) == []


@pytest.mark.parametrize("collecting", [True, False])
@pytest.mark.parametrize("name", CASES)
def test_all_ones_mask_is_exact_identity_forward_and_backward(name: str, collecting: bool) -> None:
    """An all-ones mask changes neither the output nor any gradient, bit for bit."""
    head, tail, x0, dim = _case(name)
    mask = MaskLayer(C, dim=dim)
    mask.collecting = collecting
    with_mask = nn.Sequential(head, mask, tail)
    without = nn.Sequential(head, tail)

    def run(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        out = model(x)
        gen = torch.Generator().manual_seed(1)
        out.backward(torch.randn(out.shape, generator=gen))
        return out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]

    out_a, gx_a, gp_a = run(with_mask)
    out_b, gx_b, gp_b = run(without)
    assert torch.equal(out_a, out_b)
    assert torch.equal(gx_a, gx_b)
    assert len(gp_a) == len(gp_b)
    for a, b in zip(gp_a, gp_b, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", CASES)
def test_zeroed_entries_zero_exactly_those_channels(name: str) -> None:
    """Zeroed mask entries zero exactly their channels (value and gradient); others pass as is."""
    _, _, _, dim = _case(name)
    shape = {"NC": (5, C), "NCL": (3, C, 4), "NCHW": (3, C, 4, 5), "NCDHW": (2, C, 3, 4, 2)}.get(
        name, (3, 7, C)
    )
    torch.manual_seed(0)
    x = torch.randn(shape, requires_grad=True)
    mask = MaskLayer(C, dim=dim)
    zeroed = [1, 4]
    with torch.no_grad():
        mask.mask[zeroed] = 0.0
    y = mask(x)
    gout = torch.randn(y.shape)
    y.backward(gout)
    d = dim % x.dim()
    for k in range(C):
        yk, xk, gk = y.select(d, k), x.select(d, k), x.grad.select(d, k)
        if k in zeroed:
            assert torch.equal(yk, torch.zeros_like(yk))
            assert torch.equal(gk, torch.zeros_like(gk))
        else:
            assert torch.equal(yk, xk.detach())
            assert torch.equal(gk, gout.select(d, k))


def _prune_once(m: MaskLayer) -> None:
    fp.prune({"m": m}, {"m": torch.arange(C, dtype=torch.float64)})


def _in_place(m: MaskLayer) -> None:
    with torch.no_grad():
        m.mask[2] = 0.0
        m.mask.mul_(1.0)


def _load_state(m: MaskLayer) -> None:
    sd = {"mask": torch.tensor([1.0, 0, 1, 1, 0, 1]), "signal": torch.arange(C, dtype=torch.float)}
    m.load_state_dict(sd)


def _signal_update(m: MaskLayer) -> None:
    x = torch.randn(4, C, requires_grad=True)
    m(x).pow(2).sum().backward()
    fp.update_pruning_signals([m], decay=0.5)


@pytest.mark.parametrize("operation", [_prune_once, _in_place, _load_state, _signal_update])
def test_buffer_identity_survives_updates(operation) -> None:
    """The ``mask`` and ``signal`` tensors stay the same objects with the same storage."""
    torch.manual_seed(0)
    m = MaskLayer(C)
    mask_obj, mask_ptr = m.mask, m.mask.data_ptr()
    sig_obj, sig_ptr = m.signal, m.signal.data_ptr()
    before = (m.mask.clone(), m.signal.clone())
    operation(m)
    assert m.mask is mask_obj and m.mask.data_ptr() == mask_ptr
    assert m.signal is sig_obj and m.signal.data_ptr() == sig_ptr
    assert dict(m.named_buffers())["mask"] is mask_obj
    assert m.mask.shape == (C,) and m.signal.shape == (C,)
    # the operation did change something, so identity was really put to the test
    assert not (torch.equal(before[0], m.mask) and torch.equal(before[1], m.signal))


def test_prune_zeroes_exactly_one_entry() -> None:
    """``prune`` zeroes the lowest-scored entry of the mask and nothing else."""
    m = MaskLayer(C)
    fp.prune({"m": m}, {"m": torch.tensor([5.0, 3.0, 0.5, 9.0, 1.0, 2.0])})
    assert torch.equal(m.mask, torch.tensor([1.0, 1, 0, 1, 1, 1]))


def test_wrong_channel_count_raises() -> None:
    """An input whose channel dim does not have num_channels entries is a ValueError naming both."""
    with pytest.raises(ValueError, match=r"num_channels=5.*has 4 channels"):
        MaskLayer(5)(torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"num_channels=5, dim=-1.*has 3 channels"):
        MaskLayer(5, dim=-1)(torch.randn(2, 5, 3))


@pytest.mark.parametrize(("dim", "shape"), [(2, (3, 4)), (-3, (3, 4)), (4, (2, 3, 4, 5))])
def test_dim_out_of_range_raises(dim: int, shape: tuple[int, ...]) -> None:
    """A dim outside the input's dimensions is a ValueError that says it is out of range."""
    with pytest.raises(ValueError, match=rf"dim={dim}\).*out of range"):
        MaskLayer(4, dim=dim)(torch.randn(shape))


def test_dim_zero_raises_at_construction() -> None:
    """dim=0 (the batch dimension) is refused when the layer is built, naming the batch."""
    with pytest.raises(ValueError, match=r"dim=0 is invalid: dimension 0 is the batch"):
        MaskLayer(4, dim=0)


def test_negative_dim_reaching_batch_raises() -> None:
    """A negative dim that resolves to dimension 0 of the input is a ValueError naming the batch."""
    with pytest.raises(ValueError, match=r"dim=-2\) resolves to the batch dimension"):
        MaskLayer(3, dim=-2)(torch.randn(3, 3))


@pytest.mark.parametrize("n", [0, -1, 2.0])
def test_num_channels_not_a_positive_int_raises(n) -> None:
    """num_channels must be an int >= 1; the message names the requirement and the bad value."""
    with pytest.raises(ValueError, match=rf"num_channels >= 1, got {n!r}"):
        MaskLayer(n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_deep_copy_written_as_often_as_its_original_masks_what_it_holds(
    dtype: torch.dtype,
) -> None:
    """A deep copy's mask buffer starts its version count again: written as many times as
    the original had been when the layer last looked, it must still be read for what it
    holds, not taken for the original's all-ones (the forward would skip the mask). The
    reference: the input times the mask, computed by hand."""
    layer = MaskLayer(4, dim=1)
    layer.collecting = False
    for _ in range(3):
        layer.mask.fill_(1.0)
    x = torch.randn(2, 4, dtype=dtype)
    torch.testing.assert_close(layer(x), x)  # the layer has seen the original all ones
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.mask.fill_(1.0)
        twin.mask[0] = 0.0
    while twin.mask._version < layer.mask._version:
        twin.mask.mul_(1.0)
    assert twin.mask._version == layer.mask._version
    assert not twin.is_all_ones()
    torch.testing.assert_close(twin(x), x * twin.mask.to(dtype), rtol=0, atol=0)


def _saved_and_loaded(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _one_step_signals(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    masks = fp.find_masks(model)
    model.zero_grad(set_to_none=True)
    out = model(x)
    out = out if isinstance(out, torch.Tensor) else out.last_hidden_state
    out.double().pow(2).sum().backward()
    fp.update_pruning_signals(masks, decay=0.0)
    return {n: m.signal.clone() for n, m in masks.items()}


@pytest.mark.parametrize("name", ["resnet_bottleneck", "densenet", "transformer_sdpa"])
def test_a_whole_masked_model_saves_and_loads_as_it_runs(name: str) -> None:
    """``torch.save`` of the whole model with its masks (after a step, with products
    remembered), then ``torch.load``: the loaded model gives the same outputs, part pruned,
    and its next collecting step the same signals, in float64 (it failed to pickle: the
    remembered products are weak references)."""
    arch = ARCHS[name]
    model, x = arch.build().double(), arch.example_input(3)
    x = x.double() if x.is_floating_point() else x
    masks = fp.apply_masks(model, x[:1])
    with torch.no_grad():
        for m in masks.values():
            if m.num_channels > 2:
                m.mask[0] = 0.0
    _one_step_signals(model, x)
    back = _saved_and_loaded(model)
    want, got = _one_step_signals(model, x), _one_step_signals(back, x)
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=0, msg=n)
    model.eval()
    back.eval()
    with torch.no_grad():
        torch.testing.assert_close(back(x), model(x), rtol=0, atol=0)
