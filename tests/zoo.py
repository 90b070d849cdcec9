"""A zoo of tiny, width-parameterised architectures for testing channel grouping and masking.

Every architecture ``<name>`` has

* ``build_<name>(widths=None, seed=0) -> nn.Module``: ``widths`` overrides any of the
  architecture's ``DEFAULT_WIDTHS[<name>]`` entries, so the same architecture can be built with
  fewer channels (the reduced reference of a pruned model); unknown keys are errors. Weights are
  drawn from ``torch.manual_seed(seed)``; normalisation layers get random affine parameters and
  running statistics, so that eval mode does not hide them.
* ``example_input(batch)``: a deterministic input (seed 0), as ``ARCHS[<name>].example_input``
  and as the attribute ``build_<name>.example_input``.

Module names are explicit so that tests can refer to them (``l1.conv1``, ``dense2.conv``...).
Inputs are 3x8x8 images, or 16 tokens x 16 features for the MLP and the transformer.
Classifier heads have ``NUM_CLASSES`` outputs; those channels reach the model output.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ARCHS",
    "DEFAULT_WIDTHS",
    "NUM_CLASSES",
    "Arch",
    "build_densenet",
    "build_mlp_skip",
    "build_mobilenetv2",
    "build_resnet_basic",
    "build_resnet_bottleneck",
    "build_se",
    "build_transformer",
    "build_transformer_sdpa",
    "build_vgg",
    "image_input",
    "randomise_norms",
    "token_input",
    "vector_input",
]

NUM_CLASSES = 5
IMAGE = (3, 8, 8)  # (C, H, W) of image inputs
TOKENS, FEATURES = 16, 16  # (L, D) of token inputs

DEFAULT_WIDTHS: dict[str, dict[str, int]] = {
    # s1: stem / l1 residual stream; s2: l2 / l3 residual stream; *_mid: inner conv widths
    "resnet_basic": {"s1": 8, "l1_mid": 6, "l2_mid": 10, "s2": 12, "l3_mid": 7},
    # l*_a: conv1 out, l*_b: conv2 out; s1: l1 out stream; s2: l2 / l3 out stream
    "resnet_bottleneck": {
        "stem": 6,
        "l1_a": 4,
        "l1_b": 5,
        "s1": 10,
        "l2_a": 6,
        "l2_b": 7,
        "s2": 12,
        "l3_a": 5,
        "l3_b": 4,
    },
    # g1, g2: growth of the two dense layers; trans: transition conv out
    "densenet": {"stem": 6, "g1": 4, "g2": 5, "trans": 7},
    # s1: stem / b1 stream; b*_hidden: expanded width; s2: b2 / b3 stream; head: last 1x1 conv
    "mobilenetv2": {"s1": 6, "b1_hidden": 12, "b2_hidden": 14, "s2": 8, "b3_hidden": 10, "head": 9},
    "vgg": {"c1": 6, "c2": 7, "c3": 5, "fc1": 11},
    # d: residual stream; h1, h2: hidden units of the two residual blocks
    "mlp_skip": {"d": 12, "h1": 20, "h2": 18},
    # d: model width (residual stream); heads x head_dim = attention width; hidden: MLP units
    "transformer": {"d": 16, "heads": 2, "head_dim": 8, "hidden": 24},
    "transformer_sdpa": {"d": 16, "heads": 2, "head_dim": 8, "hidden": 24},
    # r: squeeze width of the SE block
    "se": {"stem": 6, "c1": 10, "r": 4, "c2": 8},
}


def _widths(name: str, widths: dict[str, int] | None) -> dict[str, int]:
    w = dict(DEFAULT_WIDTHS[name])
    for k, v in (widths or {}).items():
        if k not in w:
            raise KeyError(f"{name}: unknown width {k!r}; known: {sorted(w)}")
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: width {k!r} must be an int >= 1, got {v!r}")
        w[k] = v
    return w


def randomise_norms(model: nn.Module, seed: int) -> None:
    """Give every BatchNorm / LayerNorm random affine parameters and running statistics."""
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
                n = m.weight.numel()
                m.weight.copy_(0.5 + torch.rand(n, generator=gen))
                m.bias.copy_(0.2 * torch.randn(n, generator=gen))
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.running_mean.copy_(0.1 * torch.randn(n, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(n, generator=gen))


def _finish(model: nn.Module, seed: int) -> nn.Module:
    randomise_norms(model, seed)
    return model.eval()


# --------------------------------------------------------------------- inputs
def image_input(batch: int) -> Tensor:
    """(batch, 3, 8, 8) standard normal, seed 0."""
    return torch.randn(batch, *IMAGE, generator=torch.Generator().manual_seed(0))


def token_input(batch: int) -> Tensor:
    """(batch, 16, 16) standard normal tokens, seed 0."""
    return torch.randn(batch, TOKENS, FEATURES, generator=torch.Generator().manual_seed(0))


def vector_input(batch: int) -> Tensor:
    """(batch, 16) standard normal, seed 0."""
    return torch.randn(batch, FEATURES, generator=torch.Generator().manual_seed(0))


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)
    )


# ------------------------------------------------------------ ResNet (basic)
class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN + shortcut (1x1 conv-BN when the shape changes), ReLU."""

    def __init__(self, cin: int, mid: int, cout: int, stride: int, project: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, mid, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = _conv_bn(cin, cout, 1, stride) if project else None

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))  # (N, mid, H', W')
        out = self.bn2(self.conv2(out))  # (N, cout, H', W')
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNetBasic(nn.Module):
    """stem conv-BN-ReLU (s1); l1: identity block on s1; l2: s1 -> s2, stride 2; l3: identity."""

    def __init__(self, w: dict[str, int]) -> None:
        super().__init__()
        self.stem = _conv_bn(3, w["s1"], 3)
        self.l1 = BasicBlock(w["s1"], w["l1_mid"], w["s1"], 1, project=False)
        self.l2 = BasicBlock(w["s1"], w["l2_mid"], w["s2"], 2, project=True)
        self.l3 = BasicBlock(w["s2"], w["l3_mid"], w["s2"], 1, project=False)
        self.fc = nn.Linear(w["s2"], NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.stem(x))  # (N, s1, 8, 8)
        x = self.l3(self.l2(self.l1(x)))  # (N, s2, 4, 4)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_resnet_basic(widths: dict[str, int] | None = None, seed: int = 0) -> nn.Module:
    """ResNet with basic blocks: an identity block, a downsampling block, an identity block."""
    torch.manual_seed(seed)
    return _finish(ResNetBasic(_widths("resnet_basic", widths)), seed)


# -------------------------------------------------------- ResNet (bottleneck)
class Bottleneck(nn.Module):
    """1x1 (a) - 3x3 stride (b) - 1x1 (cout), each with BN; projection shortcut when needed."""

    def __init__(self, cin: int, a: int, b: int, cout: int, stride: int, project: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, a, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(a)
        self.conv2 = nn.Conv2d(a, b, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(b)
        self.conv3 = nn.Conv2d(b, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        # fixed by the architecture, not by the widths: a reduced copy keeps the same layers
        self.down = _conv_bn(cin, cout, 1, stride) if project else None

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNetBottleneck(nn.Module):
    """stem; l1: stem -> s1 (projection, stride 1); l2: s1 -> s2 (stride 2); l3: identity on s2."""

    def __init__(self, w: dict[str, int]) -> None:
        super().__init__()
        self.stem = _conv_bn(3, w["stem"], 3)
        self.l1 = Bottleneck(w["stem"], w["l1_a"], w["l1_b"], w["s1"], 1, project=True)
        self.l2 = Bottleneck(w["s1"], w["l2_a"], w["l2_b"], w["s2"], 2, project=True)
        self.l3 = Bottleneck(w["s2"], w["l3_a"], w["l3_b"], w["s2"], 1, project=False)
        self.fc = nn.Linear(w["s2"], NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.stem(x))
        x = self.l3(self.l2(self.l1(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_resnet_bottleneck(widths: dict[str, int] | None = None, seed: int = 0) -> nn.Module:
    """ResNet with bottleneck blocks, projection shortcuts and a stride-2 block."""
    torch.manual_seed(seed)
    return _finish(ResNetBottleneck(_widths("resnet_bottleneck", widths)), seed)


# ------------------------------------------------------------------ DenseNet
class DenseLayer(nn.Module):
    """BN-ReLU-conv3x3 producing ``growth`` channels, concatenated after its input."""

    def __init__(self, cin: int, growth: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(cin)
        self.conv = nn.Conv2d(cin, growth, 3, 1, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([x, self.conv(F.relu(self.bn(x)))], 1)  # (N, cin + growth, H, W)


class DenseNet(nn.Module):
    """stem conv-BN-ReLU; dense1, dense2 (concat); transition BN-ReLU-conv1x1-avgpool; head."""

    def __init__(self, w: dict[str, int]) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, w["stem"], 3, 1, 1, bias=False)
        self.stem_bn = nn.BatchNorm2d(w["stem"])
        self.dense1 = DenseLayer(w["stem"], w["g1"])
        self.dense2 = DenseLayer(w["stem"] + w["g1"], w["g2"])
        cat = w["stem"] + w["g1"] + w["g2"]
        self.trans_bn = nn.BatchNorm2d(cat)
        self.trans_conv = nn.Conv2d(cat, w["trans"], 1, bias=False)
        self.head_bn = nn.BatchNorm2d(w["trans"])
        self.fc = nn.Linear(w["trans"], NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.stem_bn(self.stem(x)))  # (N, stem, 8, 8)
        x = self.dense2(self.dense1(x))  # (N, stem + g1 + g2, 8, 8)
        x = F.avg_pool2d(self.trans_conv(F.relu(self.trans_bn(x))), 2)  # (N, trans, 4, 4)
        x = F.relu(self.head_bn(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_densenet(widths: dict[str, int] | None = None, seed: int = 0) -> nn.Module:
    """DenseNet: two dense layers that concatenate their growth channels, then a transition."""
    torch.manual_seed(seed)
    return _finish(DenseNet(_widths("densenet", widths)), seed)


# --------------------------------------------------------------- MobileNetV2
class InvertedResidual(nn.Module):
    """expand 1x1-BN-ReLU6, depthwise 3x3-BN-ReLU6, project 1x1-BN; residual if shapes match."""

    def __init__(self, cin: int, hidden: int, cout: int, stride: int, residual: bool) -> None:
        super().__init__()
        self.expand = nn.Conv2d(cin, hidden, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(hidden)
        self.dw = nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False)
        self.bn2 = nn.BatchNorm2d(hidden)
        self.project = nn.Conv2d(hidden, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.residual = residual

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu6(self.bn1(self.expand(x)))
        out = F.relu6(self.bn2(self.dw(out)))
        out = self.bn3(self.project(out))
        return x + out if self.residual else out


class MobileNetV2(nn.Module):
    """stem (s1); b1: s1 -> s1 residual; b2: s1 -> s2 stride 2; b3: s2 -> s2 residual; head."""

    def __init__(self, w: dict[str, int]) -> None:
        super().__init__()
        self.stem = _conv_bn(3, w["s1"], 3)
        self.b1 = InvertedResidual(w["s1"], w["b1_hidden"], w["s1"], 1, residual=True)
        self.b2 = InvertedResidual(w["s1"], w["b2_hidden"], w["s2"], 2, residual=False)
        self.b3 = InvertedResidual(w["s2"], w["b3_hidden"], w["s2"], 1, residual=True)
        self.head = _conv_bn(w["s2"], w["head"], 1)
        self.fc = nn.Linear(w["head"], NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu6(self.stem(x))
        x = self.b3(self.b2(self.b1(x)))
        x = F.relu6(self.head(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_mobilenetv2(widths: dict[str, int] | None = None, seed: int = 0) -> nn.Module:
    """MobileNetV2-style inverted residual blocks (two residual, one downsampling)."""
    torch.manual_seed(seed)
    return _finish(MobileNetV2(_widths("mobilenetv2", widths)), seed)


# ----------------------------------------------------------------------- VGG
class VGG(nn.Module):
    """conv-BN-ReLU x2, maxpool, conv-BN-ReLU, maxpool, flatten (c3 x 2 x 2) -> fc1-ReLU-fc2."""

    def __init__(self, w: dict[str, int]) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, w["c1"], 3, 1, 1), nn.BatchNorm2d(w["c1"])
        self.conv2, self.bn2 = nn.Conv2d(w["c1"], w["c2"], 3, 1, 1), nn.BatchNorm2d(w["c2"])
        self.conv3, self.bn3 = nn.Conv2d(w["c2"], w["c3"], 3, 1, 1), nn.BatchNorm2d(w["c3"])
        self.fc1 = nn.Linear(w["c3"] * 4, w["fc1"])
        self.fc2 = nn.Linear(w["fc1"], NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)  # (N, c2, 4, 4)
        x = F.max_pool2d(F.relu(self.bn3(self.conv3(x))), 2)  # (N, c3, 2, 2)
        x = torch.flatten(x, 1)  # (N, c3 * 4): column 4c + p is channel c, position p
        return self.fc2(F.relu(self.fc1(x)))


def build_vgg(widths: dict[str, int] | None = None, seed: int = 0) -> nn.Module:
    """VGG-style CNN with BatchNorm and a flatten -> Linear classifier (no global pooling)."""
    torch.manual_seed(seed)
    return _finish(VGG(_widths("vgg", widths)), seed)


# ------------------------------------------------------------------ MLP skip
class ResidualMLPBlock(nn.Module):
    """x + fc2(ReLU(fc1(x)))."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.relu(self.fc1(x)))


class MLPSkip(nn.Module):
    """fc_in-ReLU (d), two residual MLP blocks on d, ReLU, fc_out."""

    def __init__(self, w: dict[str, int]) -> None:
        super().__init__()
        self.fc_in = nn.Linear(FEATURES, w["d"])
        self.block1 = ResidualMLPBlock(w["d"], w["h1"])
        self.block2 = ResidualMLPBlock(w["d"], w["h2"])
        self.fc_out = nn.Linear(w["d"], NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.fc_in(x))  # (N, d)
        x = self.block2(self.block1(x))
        return self.fc_out(F.relu(x))


def build_mlp_skip(widths: dict[str, int] | None = None, seed: int = 0) -> nn.Module:
    """An MLP on 16 features with two residual (skip) blocks."""
    torch.manual_seed(seed)
    return _finish(MLPSkip(_widths("mlp_skip", widths)), seed)


# --------------------------------------------------------------- Transformer
class SelfAttention(nn.Module):
    """Multi-head self-attention with separate q / k / v / out Linear layers."""

    def __init__(self, d: int, heads: int, head_dim: int, sdpa: bool) -> None:
        super().__init__()
        self.heads, self.head_dim, self.sdpa = heads, head_dim, sdpa
        inner = heads * head_dim
        self.q = nn.Linear(d, inner)
        self.k = nn.Linear(d, inner)
        self.v = nn.Linear(d, inner)
        self.out = nn.Linear(inner, d)

    def forward(self, x: Tensor) -> Tensor:
        n, length, _ = x.shape

        def heads(t: Tensor) -> Tensor:  # (N, L, H*Dh) -> (N, H, L, Dh)
            return t.view(n, length, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        if self.sdpa:
            o = F.scaled_dot_product_attention(q, k, v)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (N, H, L, L)
            o = att.softmax(-1) @ v  # (N, H, L, Dh)
        o = o.transpose(1, 2).reshape(n, length, self.heads * self.head_dim)
        return self.out(o)


class TransformerMLP(nn.Module):
    """fc1-GELU-fc2; the hidden units are prunable."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Transformer(nn.Module):
    """embed Linear; pre-LN encoder block (attn, mlp); final LN; mean over tokens; head."""

    def __init__(self, w: dict[str, int], sdpa: bool) -> None:
        super().__init__()
        d = w["d"]
        self.embed = nn.Linear(FEATURES, d)
        self.ln1 = nn.LayerNorm(d)
        self.attn = SelfAttention(d, w["heads"], w["head_dim"], sdpa)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = TransformerMLP(d, w["hidden"])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x)  # (N, L, d)
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return self.head(self.ln_f(x).mean(1))


def build_transformer(
    widths: dict[str, int] | None = None, seed: int = 0, *, sdpa: bool = False
) -> nn.Module:
    """A pre-LN transformer encoder block written by hand (explicit softmax attention, or SDPA)."""
    torch.manual_seed(seed)
    name = "transformer_sdpa" if sdpa else "transformer"
    return _finish(Transformer(_widths(name, widths), sdpa), seed)


def build_transformer_sdpa(widths: dict[str, int] | None = None, seed: int = 0) -> nn.Module:
    """The same transformer block with ``F.scaled_dot_product_attention``."""
    return build_transformer(widths, seed, sdpa=True)


# ------------------------------------------------------- squeeze-excitation
class SqueezeExcite(nn.Module):
    """x * sigmoid(fc2(ReLU(fc1(avgpool(x))))), gate per channel."""

    def __init__(self, c: int, r: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(c, r)
        self.fc2 = nn.Linear(r, c)

    def forward(self, x: Tensor) -> Tensor:
        s = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)  # (N, C)
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s))))  # (N, C)
        return x * s.view(x.shape[0], -1, 1, 1)


class SENet(nn.Module):
    """stem conv-BN-SiLU; conv1-BN-SiLU; SE gate; conv2-BN-SiLU; avgpool; fc."""

    def __init__(self, w: dict[str, int]) -> None:
        super().__init__()
        self.stem = _conv_bn(3, w["stem"], 3)
        self.conv1 = _conv_bn(w["stem"], w["c1"], 3)
        self.se = SqueezeExcite(w["c1"], w["r"])
        self.conv2 = _conv_bn(w["c1"], w["c2"], 3, 2)
        self.fc = nn.Linear(w["c2"], NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = F.silu(self.stem(x))
        x = self.se(F.silu(self.conv1(x)))  # (N, c1, 8, 8), gated
        x = F.silu(self.conv2(x))  # (N, c2, 4, 4)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_se(widths: dict[str, int] | None = None, seed: int = 0) -> nn.Module:
    """A CNN with a squeeze-and-excitation block gating its features, SiLU activations."""
    torch.manual_seed(seed)
    return _finish(SENet(_widths("se", widths)), seed)


# ------------------------------------------------------------------ registry
@dataclass(frozen=True)
class Arch:
    """One zoo entry: its builder and its input maker."""

    name: str
    build: Callable[..., nn.Module]
    example_input: Callable[[int], Tensor]


ARCHS: dict[str, Arch] = {
    a.name: a
    for a in [
        Arch("resnet_basic", build_resnet_basic, image_input),
        Arch("resnet_bottleneck", build_resnet_bottleneck, image_input),
        Arch("densenet", build_densenet, image_input),
        Arch("mobilenetv2", build_mobilenetv2, image_input),
        Arch("vgg", build_vgg, image_input),
        Arch("mlp_skip", build_mlp_skip, vector_input),
        Arch("transformer", build_transformer, token_input),
        Arch("transformer_sdpa", build_transformer_sdpa, token_input),
        Arch("se", build_se, image_input),
    ]
}


for _arch in ARCHS.values():  # each builder also carries its input maker: build_x.example_input(2)
    _arch.build.example_input = _arch.example_input  # type: ignore[attr-defined]
