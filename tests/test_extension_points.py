"""The extension points used the way a user would, from outside the package: a module whose
weight layout shrink does not know (``register_shrink_rule``) and an operator defined with
``torch.library`` that has no channel rule (``register_channel_rule``). Without the user's
rule the channels are blocked and reported, or shrink raises its documented error; with it
the channels are pruned, the shrunk network gives the masked outputs in float64 and its
FlopCounterMode FLOPs equal ``fp.computational_cost`` of the masked one."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import fisherprune as fp
from fisherprune.graph.trace import RuleContext, TensorInfo

OUTPUT_ATOL = 1e-12  # relative to the output's scale; both networks run in float64
ZEROED = [1, 3]  # channels of conv1 zeroed in the mask of its group


# ----------------------------------------------------------------- helpers
def _input() -> Tensor:
    return torch.randn(2, 3, 8, 8, dtype=torch.float64)


def _out(model: nn.Module, x: Tensor) -> Tensor:
    with torch.no_grad():
        return model(x)


def _assert_close(actual: Tensor, expected: Tensor) -> None:
    assert actual.shape == expected.shape
    scale = max(1.0, float(expected.abs().max()))
    assert float((actual - expected).abs().max()) <= OUTPUT_ATOL * scale


def _flop_counter(model: nn.Module, x: Tensor, mapping: dict[Any, Any] | None = None) -> float:
    """FLOPs per example by PyTorch's counter (with extra formulas in ``mapping``)."""
    with FlopCounterMode(display=False, custom_mapping=mapping or {}) as counter, torch.no_grad():
        model(x)
    return counter.get_total_flops() / x.shape[0]


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _masked(model: nn.Module, x: Tensor) -> fp.AppliedMasks:
    """Apply masks and zero ``ZEROED`` in the group conv1 produces."""
    masks = fp.apply_masks(model, x, strict=True)
    [name] = [n for n, g in masks.groups.items() if g.producers == ["conv1"]]
    masks[name].mask[ZEROED] = 0.0
    return masks


def _group_params(masks: fp.AppliedMasks, producer: str) -> set[tuple[str, int]]:
    return {p for g in masks.groups.values() if g.producers == [producer] for p in g.params}


# ======================================================= a user's module
class ChannelAffine(nn.Module):
    """A per-channel scale and shift kept in one (2, C) weight, channels on dim 1, with the
    channel count as an attribute its forward reshapes by: shrink slices the weight but
    knows nothing of ``channels``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.channels = channels
        self.weight = nn.Parameter(torch.randn(2, channels))  # row 0 scale, row 1 shift

    def forward(self, x: Tensor) -> Tensor:  # x: (N, C, H, W)
        scale = self.weight[0].view(1, self.channels, 1, 1)
        shift = self.weight[1].view(1, self.channels, 1, 1)
        return x * scale + shift


class NoisyAffine(ChannelAffine):
    """A subclass with no rule of its own."""


def _affine_rule(module: nn.Module, old_shapes: dict[str, tuple[int, ...]]) -> None:
    """The user's shrink rule: the channel count follows the sliced weight."""
    module.channels = module.weight.shape[1]


class AffineNet(nn.Module):
    def __init__(self, affine: type[ChannelAffine] = ChannelAffine) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.affine = affine(6)
        self.act = nn.ReLU()
        self.conv2 = nn.Conv2d(6, 4, 3)

    def forward(self, x: Tensor) -> Tensor:  # x: (N, 3, 8, 8)
        return self.conv2(self.act(self.affine(self.conv1(x))))


def _affine_net(affine: type[ChannelAffine] = ChannelAffine) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    return AffineNet(affine).double().eval(), _input()


@pytest.fixture
def affine_rule() -> Iterator[None]:
    """Register the user's shrink rule for ChannelAffine for one test, then remove it."""
    fp.register_shrink_rule(ChannelAffine)(_affine_rule)
    try:
        yield
    finally:
        fp.unregister_shrink_rule(ChannelAffine)


@pytest.mark.usefixtures("affine_rule")  # without it the group is kept whole (next test)
def test_the_custom_layout_is_traced_without_any_rule() -> None:
    """The tracer follows the module's ops, not its type (no channel rule): dim 1 of the
    (2, C) weight is in the group conv1 produces."""
    model, x = _affine_net()
    masks = fp.apply_masks(model, x, strict=True)
    assert ("affine.weight", 1) in _group_params(masks, "conv1")


def test_without_shrink_rule_apply_masks_keeps_the_group_whole_and_says_why() -> None:
    """Without the rule the stale ``channels`` would break the shrunk forward: apply_masks
    keeps conv1's group whole (its trial shrink fails), in one line naming the module with no
    shrink rule, and leaves the model as it was. (A hand-placed mask's ShrinkError is
    test_rules_transformers'.)"""
    model, x = _affine_net()
    before = _out(model, x)
    masks = fp.apply_masks(model, x)
    assert not _group_params(masks, "conv1")
    [skip] = [s for s in masks.skipped if ("affine.weight", 1) in s.params]
    assert "\n" not in skip.reason and "affine (ChannelAffine)" in skip.reason
    assert "register_shrink_rule" in skip.reason
    _assert_close(_out(model, x), before)
    assert model.affine.channels == 6


@pytest.mark.usefixtures("affine_rule")
def test_with_shrink_rule_the_shrunk_model_gives_the_masked_outputs() -> None:
    """With the user's rule, shrink removes the zeroed channels from the custom weight and
    the attribute follows; outputs equal the masked model's in float64, parameters drop."""
    model, x = _affine_net()
    _masked(model, x)
    small = fp.shrink(model, x)
    kept = 6 - len(ZEROED)
    assert small.affine.channels == kept
    assert small.affine.weight.shape == (2, kept)
    _assert_close(_out(small, x), _out(model, x))
    assert _n_params(small) < _n_params(model)


@pytest.mark.usefixtures("affine_rule")
def test_with_shrink_rule_flops_equal_flop_counter_on_shrunk_model() -> None:
    """computational_cost of the masked model = FlopCounterMode on the shrunk one, per example
    (and below the unpruned model's, so the check is not vacuous)."""
    model, x = _affine_net()
    dense = _flop_counter(model, x)
    _masked(model, x)
    cost = fp.computational_cost(model, x).total
    assert cost == _flop_counter(fp.shrink(model, x), x)
    assert cost < dense


@pytest.mark.usefixtures("affine_rule")
def test_a_subclass_follows_its_base_class_rule() -> None:
    """A module whose type has no rule uses its nearest registered base class's rule."""
    model, x = _affine_net(NoisyAffine)
    _masked(model, x)
    small = fp.shrink(model, x)
    assert small.affine.channels == 6 - len(ZEROED)
    _assert_close(_out(small, x), _out(model, x))


@pytest.mark.usefixtures("affine_rule")
def test_register_shrink_rule_rejects_a_duplicate() -> None:
    """A second rule for a type that has one is a ValueError."""
    with pytest.raises(ValueError, match="ChannelAffine already has a shrink rule"):
        fp.register_shrink_rule(ChannelAffine)(_affine_rule)


def test_unregister_shrink_rule_of_a_type_without_one_is_refused() -> None:
    """Unregistering a type with no rule of its own is a ValueError, nothing removed."""
    fp.register_shrink_rule(ChannelAffine)(_affine_rule)
    try:
        with pytest.raises(ValueError, match="NoisyAffine has no shrink rule"):
            fp.unregister_shrink_rule(ChannelAffine, NoisyAffine)
        with pytest.raises(ValueError, match="already has a shrink rule"):
            fp.register_shrink_rule(ChannelAffine)(_affine_rule)  # ChannelAffine's stayed
    finally:
        fp.unregister_shrink_rule(ChannelAffine)


# ==================================================== a user's operator
@torch.library.custom_op("fpext::channel_scale", mutates_args=())
def channel_scale(x: Tensor, w: Tensor) -> Tensor:
    """Scale channel c of x (N, C, H, W) by w[c]: an op fisherprune knows nothing about."""
    return x * w.view(1, -1, 1, 1)


@channel_scale.register_fake
def _channel_scale_fake(x: Tensor, w: Tensor) -> Tensor:
    return torch.empty_like(x)


CHANNEL_SCALE = torch.ops.fpext.channel_scale


def _channel_scale_rule(ctx: RuleContext) -> list[TensorInfo]:
    """The user's channel rule: x's channel c and w[c] are one channel; the output keeps x's
    labels, and a zeroed channel stays zero (x * w), so its mask cover passes through."""
    x, w = (ctx.info(t) for t in ctx.in_tensors)
    if x.labels[1] is not None and w.labels[0] is not None:
        ctx.atoms.union(x.labels[1], w.labels[0])
    return [TensorInfo(x.shape, list(x.labels), list(x.cover))]


def _one_per_element(*_args: Any, out_shape: Any = None, **_kw: Any) -> float:
    """A FLOP formula for channel_scale: one multiply per output element."""
    return float(math.prod(out_shape))


class Scale(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(channels) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return channel_scale(x, self.weight)


class ScaleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.scale = Scale(6)
        self.act = nn.ReLU()
        self.conv2 = nn.Conv2d(6, 4, 3)

    def forward(self, x: Tensor) -> Tensor:  # x: (N, 3, 8, 8)
        return self.conv2(self.act(self.scale(self.conv1(x))))


def _scale_net() -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    return ScaleNet().double().eval(), _input()


@pytest.fixture
def scale_rule() -> Iterator[None]:
    """Register the user's channel rule for fpext::channel_scale for one test, then remove it."""
    fp.register_channel_rule(CHANNEL_SCALE)(_channel_scale_rule)
    try:
        yield
    finally:
        fp.unregister_channel_rule(CHANNEL_SCALE)


def test_without_channel_rule_the_channels_are_skipped_and_named() -> None:
    """Without a rule, conv1's channels reaching the op are not masked; the reason names the
    op in its own namespace, and strict=True refuses the model."""
    model, x = _scale_net()
    masks = fp.apply_masks(model, x)
    assert not _group_params(masks, "conv1")
    [hit] = [s for s in masks.skipped if ("conv1.weight", 0) in s.params]
    assert "fpext" in hit.reason and "no channel rule" in hit.reason
    fp.remove_masks(model)
    with pytest.raises(ValueError, match="no channel rule"):
        fp.apply_masks(model, x, strict=True)


@pytest.mark.usefixtures("scale_rule")
def test_with_channel_rule_the_channels_are_one_group_with_the_ops_weight() -> None:
    """With the rule, conv1's output channels, the op's weight and conv2's input are one group
    masked at conv2, and nothing is skipped unexpectedly."""
    model, x = _scale_net()
    masks = fp.apply_masks(model, x, strict=True)
    assert _group_params(masks, "conv1") == {
        ("conv1.weight", 0), ("conv1.bias", 0), ("scale.weight", 0), ("conv2.weight", 1)
    }  # fmt: skip
    assert not [s for s in masks.skipped if not s.expected]


@pytest.mark.usefixtures("scale_rule")
def test_with_channel_rule_the_shrunk_model_gives_the_masked_outputs() -> None:
    """Pruned channels leave conv1, the op's weight and conv2; outputs equal in float64."""
    model, x = _scale_net()
    _masked(model, x)
    small = fp.shrink(model, x)
    kept = 6 - len(ZEROED)
    assert small.scale.weight.shape == (kept,) and small.conv2.in_channels == kept
    _assert_close(_out(small, x), _out(model, x))


@pytest.mark.usefixtures("scale_rule")
def test_with_channel_rule_flops_equal_flop_counter_on_shrunk_model() -> None:
    """computational_cost of the masked model = FlopCounterMode on the shrunk one; both price
    the custom op at 0 (neither has a formula for it)."""
    model, x = _scale_net()
    dense = _flop_counter(model, x)
    _masked(model, x)
    cost = fp.computational_cost(model, x).total
    assert cost == _flop_counter(fp.shrink(model, x), x)
    assert cost < dense


@pytest.mark.usefixtures("scale_rule")
def test_with_a_cost_formula_too_flops_equal_flop_counter_with_that_formula() -> None:
    """Registering a flops formula for the custom op (1 per element) prices it on pruned
    shapes: the cost equals FlopCounterMode given the same formula, on the shrunk model, and
    exceeds the cost without it by one FLOP per kept channel and pixel."""
    model, x = _scale_net()
    _masked(model, x)
    without = fp.computational_cost(model, x).total
    fp.register_cost_formula("flops", CHANNEL_SCALE)(_one_per_element)
    try:
        cost = fp.computational_cost(model, x).total
    finally:
        fp.unregister_cost_formula("flops", CHANNEL_SCALE)
    small = fp.shrink(model, x)
    assert cost == _flop_counter(small, x, {CHANNEL_SCALE: _one_per_element})
    assert cost - without == (6 - len(ZEROED)) * 8 * 8


@pytest.mark.usefixtures("scale_rule")
def test_register_channel_rule_rejects_a_duplicate() -> None:
    """A second channel rule for an op that has one is a ValueError."""
    with pytest.raises(ValueError, match="already has a channel rule"):
        fp.register_channel_rule(CHANNEL_SCALE)(_channel_scale_rule)


def test_unregister_channel_rule_of_an_op_without_one_is_refused() -> None:
    """Unregistering an op with no rule is a ValueError; a non-operator is a TypeError."""
    with pytest.raises(ValueError, match="channel_scale has no channel rule"):
        fp.unregister_channel_rule(CHANNEL_SCALE)
    with pytest.raises(TypeError, match="expects ATen operators"):
        fp.unregister_channel_rule(torch.relu)


def test_no_rule_is_left_registered() -> None:
    """Outside the fixtures the user's rules are gone: the op blocks again and shrink rules
    are not registered."""
    assert CHANNEL_SCALE not in fp.graph.registered_ops()
    with pytest.raises(ValueError, match="has no shrink rule"):
        fp.unregister_shrink_rule(ChannelAffine)


class _OwnLinear(nn.Module):
    """A linear layer of its own, holding its widths as ``nn.Linear`` does (I-BERT's
    ``QuantLinear``), with no shrink rule."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / in_features**0.5)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


def test_a_linear_layer_without_a_rule_has_its_widths_follow_its_sliced_weight() -> None:
    """A layer with no shrink rule whose 2-D weight is ``(out_features, in_features)`` gets
    those two attributes from the sliced weight (they kept the dense widths, which a Hugging
    Face config reads the model's widths from), and the shrunk model gives the masked one's
    outputs."""
    torch.manual_seed(0)
    model = nn.Sequential(_OwnLinear(6, 8), nn.ReLU(), _OwnLinear(8, 3))
    x = torch.randn(5, 6)
    (mask,) = fp.apply_masks(model, x[:1]).values()
    with torch.no_grad():
        mask.mask[[0, 5]] = 0.0
        small = fp.shrink(model, x)
        torch.testing.assert_close(small(x), model(x))
    assert (small[0].out_features, small[0].in_features) == tuple(small[0].weight.shape) == (6, 6)
    assert (small[2].out_features, small[2].in_features) == (3, 6)
