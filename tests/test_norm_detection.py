"""Norms written by others are recognised by what they compute (``detect_norms``): each
Hugging Face family has its own ``XxxRMSNorm`` class, and none needs ``register_norm``. The
reference is the masked model's own output in float64: the shrunk model must equal it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_hidden_width import ATOL_F64, TinyLlama, _flops, _out, _prune_thirds
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.norms import NormSpec, detect_norms, norm_spec, normalise_kept, normalise_masked


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


def _shrinks_exactly(
    model: nn.Module, masks: fp.AppliedMasks, x: Any, one: Any, seed: int
) -> nn.Module:
    """Prune a third of every mask (``seed``): the shrunk model gives the masked model's
    outputs on ``x`` (float64) and, on ``one``, the FLOPs the cost model gave
    (``FlopCounterMode``). Returns the shrunk model."""
    _prune_thirds(masks, seed)
    cost = fp.computational_cost(model, one).total
    small = fp.shrink(model, one)
    torch.testing.assert_close(_out(small, x), _out(model, x), rtol=0, atol=ATOL_F64)
    assert _flops(small, one) == cost
    return small


class LayerNorm2d(nn.LayerNorm):
    """A layer norm over the channels of (N, C, H, W) maps as ConvNeXt's code writes one
    (Hugging Face's ``ConvNextLayerNorm`` with ``data_format``, timm's ``LayerNorm2d``): the
    channels moved last, normalised, moved back; channels last, a plain layer norm."""

    def __init__(self, d: int, channels_first: bool = True) -> None:
        super().__init__(d, eps=1e-6)
        self.channels_first = channels_first

    def forward(self, x: Tensor) -> Tensor:
        if not self.channels_first:
            return super().forward(x)
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class TinyConvNeXt(nn.Module):
    """A patch stem with a channels-first norm, one ConvNeXt block (depthwise conv, a
    channels-last norm, an MLP, a residual add) and a pooled head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 2, stride=2)
        self.stem_norm = LayerNorm2d(8)
        self.dwconv = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.norm = LayerNorm2d(8, channels_first=False)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem_norm(self.stem(x))
        y = self.norm(self.dwconv(h).permute(0, 2, 3, 1))
        h = h + self.fc2(F.gelu(self.fc1(y))).permute(0, 3, 1, 2)
        return self.head(h.mean((2, 3)))


def test_channels_first_norms_of_maps_and_of_sequences_are_detected() -> None:
    """A layer norm over dim 1 of (N, C, H, W) maps (ConvNeXt's) and of (N, C, L) sequences
    (SqueezeBERT's: permuted to (N, L, C) and back) is found by what it computes."""

    class MapLayerNorm(LayerNorm2d):  # (classes of its own: detection is kept per class)
        pass

    class SequenceLayerNorm(nn.LayerNorm):
        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x.permute(0, 2, 1)).permute(0, 2, 1)

    found = detect_norms(nn.Sequential(MapLayerNorm(6), SequenceLayerNorm(6)))
    assert found == {"MapLayerNorm": "layer", "SequenceLayerNorm": "layer"}


def test_a_channels_first_norm_keeps_the_width_it_normalises_prunable() -> None:
    """Both layouts of one norm class are detected as a layer norm; the residual width they
    normalise is masked with them, and with a third of every mask pruned the shrunk network
    gives the masked one's outputs and the FLOPs the cost model gave (``FlopCounterMode``)."""
    torch.manual_seed(0)
    model = TinyConvNeXt().double().eval()
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    masks = fp.apply_masks(model, x[:1])
    stream = [g for g in masks.groups.values() if g.producers[0] == "stem"]
    assert stream and set(stream[0].norms) == {"stem_norm", "norm"}, masks.summary()
    small = _shrinks_exactly(model, masks, x, x[:1], 0)
    assert small.stem_norm.weight.shape[0] < 8


def _grn(x: Tensor, w: Tensor, b: Tensor, eps: float = 1e-6) -> Tensor:
    """The global response norm of channels-last ``x`` (N, H, W, C), as ConvNeXt-V2 writes it."""
    g = torch.norm(x, p=2, dim=(1, 2), keepdim=True)
    return w * (x * (g / (g.mean(dim=-1, keepdim=True) + eps))) + b + x


@pytest.mark.parametrize("kind", ["layer", "rms", "grn"])
def test_a_norm_over_a_leading_dim_normalises_the_kept_channels_there(kind: str) -> None:
    """Over dim 1 of an (N, C, H, W) input, the compiled form (sums weighted by the kept
    channels) and the gathered one agree, and the kept channels are what a norm of only
    them computes (a global response norm's statistics too are over the kept channels)."""
    norm = LayerNorm2d(6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    spec = NormSpec(kind, lambda _m: 1)
    x = torch.randn(2, 6, 3, 4, dtype=torch.float64)
    norm.double()
    keep = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.float64)
    idx = keep.nonzero().flatten()
    got = normalise_kept(norm, spec, x, 1, idx)
    torch.testing.assert_close(normalise_masked(norm, spec, x, 1, keep), got)
    assert torch.equal(got[:, keep == 0], torch.zeros_like(got[:, keep == 0]))
    w, b = norm.weight[idx], norm.bias[idx]
    xs = x[:, idx].movedim(1, -1)
    if kind == "layer":
        want = F.layer_norm(xs, (idx.numel(),), w, b, norm.eps)
    elif kind == "grn":
        want = _grn(xs, w, b, norm.eps)
    else:
        want = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + norm.eps) * w + b
    torch.testing.assert_close(got[:, idx], want.movedim(-1, 1))


def test_hugging_face_convnext_prunes_its_stage_widths_exactly() -> None:
    """Hugging Face's ConvNeXt from its config: each stage's width (normalised by
    ``ConvNextLayerNorm`` channels first at the stem and the downsampling, channels last in
    the blocks) is masked, and the shrunk model gives the masked model's logits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ConvNextConfig(
        hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3
    )
    model = transformers.ConvNextForImageClassification(config).double().eval()
    for p in model.parameters():  # (its init gives logits near zero: nothing to compare)
        nn.init.normal_(p, std=0.3)
    x = {"pixel_values": torch.randn(2, 3, 16, 16, dtype=torch.float64)}
    masks = fp.apply_masks(model, {"pixel_values": x["pixel_values"][:1]})
    normed = [g for g in masks.groups.values() if g.norms]
    assert len(normed) == 2, masks.summary()
    _prune_thirds(masks, 1)
    small = fp.shrink(model, {"pixel_values": x["pixel_values"][:1]})
    torch.testing.assert_close(_out(small, x), _out(model, x), rtol=0, atol=ATOL_F64)


def test_hugging_face_convnext_v2_prunes_the_widths_its_global_response_norms_normalise() -> None:
    """Hugging Face's ConvNeXt-V2 from its config: besides each stage's width, each block's
    MLP units are masked though its global response norm (``ConvNextV2GRN``) divides them by
    their mean across the units; with a third of every mask pruned the shrunk model gives the
    masked model's logits and the FLOPs the cost model gave (``FlopCounterMode``)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ConvNextV2Config(
        hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3
    )
    model = transformers.ConvNextV2ForImageClassification(config).double().eval()
    for p in model.parameters():  # (its init gives logits near zero, and GRN weights zero)
        nn.init.normal_(p, std=0.3)
    x = {"pixel_values": torch.randn(2, 3, 16, 16, dtype=torch.float64)}
    one = {"pixel_values": x["pixel_values"][:1]}
    masks = fp.apply_masks(model, one)
    grn = {g.producers[0]: g.norms for g in masks.groups.values() if "pwconv1" in g.producers[0]}
    assert len(grn) == 2 and all(n[0].endswith(".grn") for n in grn.values()), masks.summary()
    _shrinks_exactly(model, masks, x, one, 2)


def test_detection_leaves_a_batch_norm_subclass_in_training_as_it_was() -> None:
    """A batch norm subclass is a candidate by its name; probing it, in training mode, must
    not move its running statistics (the probe runs in eval mode, buffers restored)."""

    class UserBatchNorm2d(nn.BatchNorm2d):
        pass

    class UserBatchNorm1d(nn.BatchNorm1d):
        pass

    model = nn.Sequential(UserBatchNorm2d(6), UserBatchNorm1d(6)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    detect_norms(model)
    assert all(m.training for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_norm_named_module_whose_output_has_another_shape_is_not_detected() -> None:
    """A candidate that pools its input is refused by its output's shape, without raising."""

    class PoolingLayerNorm(nn.LayerNorm):
        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x).mean(1)

    mod = PoolingLayerNorm(6)
    assert detect_norms(nn.Sequential(mod)) == {}
    assert norm_spec(mod) is None


def test_a_norm_over_two_dims_that_permutes_its_input_keeps_the_width_whole() -> None:
    """A norm registered over two trailing dims that moves the channels last first normalises
    (W, C) of its permuted input: the channels of its input are not what it normalises
    trailing, so the width stays unmasked, for that reason (only a norm over one dim is
    followed to the dim of its input that holds the channels)."""

    class WidthChannelRMSNorm(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.rand(c) + 0.5)
            self.eps = 1e-5

        def forward(self, x: Tensor) -> Tensor:
            y = x.permute(0, 2, 3, 1)
            y = y * torch.rsqrt(y.pow(2).mean((-2, -1), keepdim=True) + self.eps) * self.weight
            return y.permute(0, 3, 1, 2)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.n, self.b = nn.Conv2d(3, 6, 1), WidthChannelRMSNorm(6), nn.Conv2d(6, 2, 1)

        def forward(self, x: Tensor) -> Tensor:
            return self.b(torch.relu(self.n(self.a(x))))

    fp.register_norm(WidthChannelRMSNorm, kind="rms", trailing=2)
    try:
        masks = fp.apply_masks(Net().double().eval(), torch.randn(1, 3, 4, 5).double())
    finally:
        fp.unregister_norm(WidthChannelRMSNorm)
    assert not any(g.norms for g in masks.groups.values())
    assert any("not its first input" in s.reason for s in masks.skipped)


def test_the_compiled_global_response_norm_stays_finite_in_float16() -> None:
    """A ConvNeXt-V2-T stage-4 sized map (3072 units, 7x7) in float16: the sum of the units'
    norms overflows float16, so the keep-weighted form takes its statistics in float32 and
    gives what the gathered form gives in float32, to float16's precision."""
    g = torch.Generator().manual_seed(0)
    norm = LayerNorm2d(3072)
    with torch.no_grad():
        norm.weight.uniform_(-1, 1, generator=g)
        norm.bias.uniform_(-1, 1, generator=g)
    spec = NormSpec("grn", lambda _m: 1)
    x = 4 * torch.randn(1, 7, 7, 3072, generator=g)
    keep = torch.ones(3072)
    keep[:5] = 0
    want = normalise_kept(norm, spec, x, -1, keep.nonzero().flatten())
    got = normalise_masked(norm.half(), spec, x.half(), -1, keep.half())
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=5e-2)


class ResponseNorm(nn.Module):
    """A global response norm as timm writes it: over channels-first (N, C, H, W) maps or
    channels-last (N, H, W, C) ones, the dim it normalises across in ``channel_dim``."""

    def __init__(self, dim: int, channels_last: bool) -> None:
        super().__init__()
        self.eps = 1e-6
        self.spatial_dim, self.channel_dim = ((1, 2), -1) if channels_last else ((2, 3), 1)
        self.wb_shape = (1, 1, 1, -1) if channels_last else (1, -1, 1, 1)
        self.weight, self.bias = nn.Parameter(torch.randn(dim)), nn.Parameter(torch.randn(dim))

    def forward(self, x: Tensor) -> Tensor:
        g = x.norm(p=2, dim=self.spatial_dim, keepdim=True)
        n = g / (g.mean(dim=self.channel_dim, keepdim=True) + self.eps)
        return x + torch.addcmul(
            self.bias.view(self.wb_shape), self.weight.view(self.wb_shape), x * n
        )


class ResponseNormBlock(nn.Module):
    """A ConvNeXt-V2 MLP: 1x1 convolutions on channels-first maps around the GRN, or linear
    layers on channels-last ones (timm's ``conv_mlp`` and not)."""

    def __init__(self, channels_last: bool) -> None:
        super().__init__()
        self.channels_last = channels_last
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        layer = (
            (lambda i, o: nn.Linear(i, o)) if channels_last else (lambda i, o: nn.Conv2d(i, o, 1))
        )
        self.fc1, self.grn, self.fc2 = layer(8, 24), ResponseNorm(24, channels_last), layer(24, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        y = h.permute(0, 2, 3, 1) if self.channels_last else h
        y = self.fc2(self.grn(F.gelu(self.fc1(y))))
        y = y.permute(0, 3, 1, 2) if self.channels_last else y
        return self.head((h + y).mean((2, 3)))


@pytest.mark.parametrize("channels_last", [False, True], ids=["channels_first", "channels_last"])
def test_a_response_norm_over_the_dim_its_module_names_prunes_its_units_exactly(
    channels_last: bool,
) -> None:
    """A GRN registered with ``channel_dim`` (as timm's is) leaves the units it normalises
    prunable on channels-first maps too (the mean across dim 1 of (N, C, H, W) was taken for
    a reduction across channels and blocked them: timm's ConvNeXt-V2 kept 4 of its 16 groups):
    with a third pruned the shrunk model gives the masked one's outputs and the cost model's
    FLOPs (``FlopCounterMode``)."""
    fp.register_norm(ResponseNorm, kind="grn", channel_dim="channel_dim")
    try:
        torch.manual_seed(0)
        model = ResponseNormBlock(channels_last).double().eval()
        x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
        masks = fp.apply_masks(model, x[:1])
        [units] = [g for g in masks.groups.values() if g.producers == ["fc1"]]
        assert units.norms == ["grn"]
        small = _shrinks_exactly(model, masks, x, x[:1], 0)
        assert small.fc1.weight.shape[0] < 24
    finally:
        fp.unregister_norm(ResponseNorm)


def test_a_norm_registered_with_a_channel_dim_it_lacks_is_refused_naming_the_attribute() -> None:
    """A registration naming an attribute the norm does not hold is refused with a message
    that names it (not an AttributeError from inside the trace); the model keeps no masks."""
    fp.register_norm(ResponseNorm, kind="grn", channel_dim="axis")
    try:
        model = ResponseNormBlock(channels_last=False).eval()
        with pytest.raises(ValueError, match=r"attribute 'axis'.*channel_dim"):
            fp.apply_masks(model, torch.randn(1, 3, 6, 6))
        assert not hasattr(model, "fisherprune_masks")
    finally:
        fp.unregister_norm(ResponseNorm)
