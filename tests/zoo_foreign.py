"""Seven tiny versions of well-known architectures that ``zoo.py`` does not cover.

They are written for testing from the published designs (ShuffleNetV2, MobileNetV3-small,
EfficientNet-B0, ConvNeXt, RegNetX, ViT, ResNet with GroupNorm), not copied from torchvision:
module names follow torchvision's where that helps reading, but depths and widths are cut down
to a few blocks of 8 to 64 channels so that tracing, shrinking and exporting them stays fast.
What each one exercises in the channel tracker is said in its builder's docstring.

Every architecture ``<name>`` has

* ``build_<name>(seed=0) -> nn.Module``: weights drawn from ``torch.manual_seed(seed)``, then
  ``randomise``: normalisation layers get random affine parameters, BatchNorms random running
  statistics near their inputs' own, and layer-scale, class token and positional embedding
  random values, so that eval mode and the published initialisations (layer-scale 1e-6, zero
  class token) hide nothing and the output stays sensitive to every layer. Returned in eval
  mode, float32.
* the input ``image_input(batch)``: a deterministic (batch, 3, 32, 32) image batch.

``ARCHS`` maps each name to its builder.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ARCHS",
    "IMAGE",
    "NUM_CLASSES",
    "build_convnext",
    "build_efficientnet",
    "build_gnresnet",
    "build_mobilenetv3",
    "build_regnetx",
    "build_shufflenetv2",
    "build_vit",
    "image_input",
    "randomise",
]

NUM_CLASSES = 10
IMAGE = (3, 32, 32)  # (C, H, W) of every architecture's input

Activation = Callable[[], nn.Module]


def image_input(batch: int, seed: int = 0) -> Tensor:
    """(batch, 3, 32, 32) standard normal float32 images drawn from ``seed``."""
    return torch.randn(batch, *IMAGE, generator=torch.Generator().manual_seed(seed))


def randomise(model: nn.Module, seed: int) -> nn.Module:
    """Give every BatchNorm / LayerNorm / GroupNorm random affine parameters, every layer-scale
    ``gamma``, ``cls_token`` and ``pos_embedding`` random values in [0.5, 1.5), and every
    BatchNorm random running statistics near those of its input on random images (so that
    activations keep their scale through the network, as in a trained one, and the output
    stays sensitive to every layer); return the model in eval mode."""
    gen = torch.Generator().manual_seed(seed + 1000)
    batch_norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)):
                n = m.weight.numel()
                m.weight.copy_((0.5 + torch.rand(n, generator=gen)).view_as(m.weight))
                m.bias.copy_((0.2 * torch.randn(n, generator=gen)).view_as(m.bias))
        for name, p in model.named_parameters():
            if name.endswith(("gamma", "cls_token", "pos_embedding")):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
        model.eval()
        for bn in batch_norms:  # cumulative statistics of one pass, the rest in eval mode
            bn.reset_running_stats()
            bn.momentum = None
            bn.train()
        model(image_input(16, seed=seed + 2000))
        for bn in batch_norms:
            n = bn.num_features
            std = bn.running_var.sqrt()
            bn.running_mean.add_(0.1 * std * torch.randn(n, generator=gen))
            bn.running_var.mul_(0.5 + torch.rand(n, generator=gen))
            bn.momentum = 0.1
    return model.eval()


def conv_bn(
    cin: int,
    cout: int,
    k: int,
    stride: int = 1,
    groups: int = 1,
    act: Activation | None = None,
) -> nn.Sequential:
    """Conv (no bias, 'same' padding) - BatchNorm [- activation]: indices 0, 1 [, 2]."""
    layers: list[nn.Module] = [
        nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


def stochastic_depth(x: Tensor, p: float, training: bool) -> Tensor:
    """Row-mode stochastic depth: in training, drop the residual branch of whole examples with
    probability ``p`` and rescale the rest; the identity in eval mode."""
    if not training or p == 0.0:
        return x
    keep = 1.0 - p
    noise = torch.empty((x.shape[0],) + (1,) * (x.dim() - 1), dtype=x.dtype, device=x.device)
    return x * noise.bernoulli_(keep).div_(keep)


class SqueezeExcite(nn.Module):
    """Squeeze-and-excitation: global average pool, 1x1 conv to ``squeeze`` units, activation,
    1x1 conv back to ``c``, gate; the gate multiplies the input channel by channel."""

    def __init__(
        self, c: int, squeeze: int, act: Activation = nn.ReLU, gate: Activation = nn.Hardsigmoid
    ) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(c, squeeze, 1)
        self.act = act()
        self.fc2 = nn.Conv2d(squeeze, c, 1)
        self.gate = gate()

    def forward(self, x: Tensor) -> Tensor:
        s = F.adaptive_avg_pool2d(x, 1)  # (N, c, 1, 1)
        return x * self.gate(self.fc2(self.act(self.fc1(s))))


# ------------------------------------------------------------------ ShuffleNetV2
def channel_shuffle(x: Tensor, groups: int) -> Tensor:
    """Interleave the channels of ``groups`` equal groups: view, transpose, reshape."""
    n, c, h, w = x.size()
    x = x.view(n, groups, c // groups, h, w).transpose(1, 2).contiguous()
    return x.reshape(n, c, h, w)


class ShuffleUnit(nn.Module):
    """ShuffleNetV2 unit. Stride 1: split the channels in two halves (chunk), transform the
    second (1x1, depthwise 3x3, 1x1), concatenate with the untouched first half, shuffle.
    Stride 2: both branches see the whole input (branch1: depthwise 3x3 then 1x1), concatenate,
    shuffle."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        half = cout // 2
        if stride > 1:
            self.branch1 = nn.Sequential(
                conv_bn(cin, cin, 3, stride, groups=cin), conv_bn(cin, half, 1, act=nn.ReLU)
            )
        else:
            if cin != cout:
                raise ValueError("a stride-1 shuffle unit keeps its width")
            self.branch1 = nn.Sequential()
        self.branch2 = nn.Sequential(
            conv_bn(cin if stride > 1 else half, half, 1, act=nn.ReLU),
            conv_bn(half, half, 3, stride, groups=half),
            conv_bn(half, half, 1, act=nn.ReLU),
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.stride == 1:
            a, b = x.chunk(2, dim=1)
            out = torch.cat((a, self.branch2(b)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


class ShuffleNetV2(nn.Module):
    """conv1 (stride 1 here: the input is 32x32) - maxpool - stage2 (3 units) - stage3 (2
    units) - conv5 1x1 - global average pool - fc."""

    def __init__(self, stem: int = 8, s2: int = 16, s3: int = 32, last: int = 48) -> None:
        super().__init__()
        self.conv1 = conv_bn(3, stem, 3, 1, act=nn.ReLU)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.stage2 = nn.Sequential(
            ShuffleUnit(stem, s2, 2), ShuffleUnit(s2, s2, 1), ShuffleUnit(s2, s2, 1)
        )
        self.stage3 = nn.Sequential(ShuffleUnit(s2, s3, 2), ShuffleUnit(s3, s3, 1))
        self.conv5 = conv_bn(s3, last, 1, act=nn.ReLU)
        self.fc = nn.Linear(last, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.conv1(x))  # (N, stem, 16, 16)
        x = self.stage3(self.stage2(x))  # (N, s3, 4, 4)
        return self.fc(self.conv5(x).mean([2, 3]))


def build_shufflenetv2(seed: int = 0) -> nn.Module:
    """ShuffleNetV2: channel split (chunk), concatenation and channel shuffle (view-transpose-
    reshape) in every unit; depthwise convs both before any shuffle (stage2.0.branch1, on the
    stem's channels) and after one (stage3.0.branch1, on a shuffled tensor)."""
    torch.manual_seed(seed)
    return randomise(ShuffleNetV2(), seed)


# ------------------------------------------------------------------ MobileNetV3-small
class V3Block(nn.Module):
    """Inverted residual: [1x1 expand -] depthwise kxk [- SE] - 1x1 project (no activation);
    residual add when stride 1 and the width is kept."""

    def __init__(
        self, cin: int, k: int, exp: int, cout: int, se: bool, act: Activation, stride: int
    ) -> None:
        super().__init__()
        self.residual = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if exp != cin:
            layers.append(conv_bn(cin, exp, 1, act=act))
        layers.append(conv_bn(exp, exp, k, stride, groups=exp, act=act))
        if se:
            layers.append(SqueezeExcite(exp, max(8, exp // 4)))  # ReLU, hardsigmoid gate
        layers.append(conv_bn(exp, cout, 1))
        self.block = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        out = self.block(x)
        return out + x if self.residual else out


class MobileNetV3Small(nn.Module):
    """stem 3x3/2 (hardswish) - five V3 blocks - 1x1 conv (hardswish) - pool - classifier
    (Linear - hardswish - dropout - Linear)."""

    # cin, kernel, expanded width, cout, SE, activation, stride
    CONFIG: tuple[tuple[int, int, int, int, bool, Activation, int], ...] = (
        (8, 3, 8, 8, True, nn.ReLU, 2),  # no expansion: the depthwise conv reads the stem
        (8, 3, 24, 12, False, nn.ReLU, 2),
        (12, 3, 32, 12, False, nn.ReLU, 1),  # residual
        (12, 5, 40, 16, True, nn.Hardswish, 2),
        (16, 5, 48, 16, True, nn.Hardswish, 1),  # residual
    )

    def __init__(self) -> None:
        super().__init__()
        self.stem = conv_bn(3, 8, 3, 2, act=nn.Hardswish)
        self.blocks = nn.Sequential(*[V3Block(*c) for c in self.CONFIG])
        self.last = conv_bn(16, 48, 1, act=nn.Hardswish)
        self.classifier = nn.Sequential(
            nn.Linear(48, 64), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(64, NUM_CLASSES)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.last(self.blocks(self.stem(x)))  # (N, 48, 2, 2)
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_mobilenetv3(seed: int = 0) -> nn.Module:
    """MobileNetV3-small: hardswish activations, squeeze-and-excitation with a hardsigmoid gate
    on the expanded (depthwise) channels, inverted residuals."""
    torch.manual_seed(seed)
    return randomise(MobileNetV3Small(), seed)


# ------------------------------------------------------------------ EfficientNet-B0 MBConv
class MBConv(nn.Module):
    """MBConv: [1x1 expand (SiLU) -] depthwise kxk (SiLU) - SE (SiLU, sigmoid gate, squeeze to
    a quarter of the block's input width) - 1x1 project; residual with stochastic depth."""

    def __init__(
        self, cin: int, cout: int, expand: int, k: int, stride: int, sd_prob: float
    ) -> None:
        super().__init__()
        self.residual = stride == 1 and cin == cout
        hidden = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(conv_bn(cin, hidden, 1, act=nn.SiLU))
        layers.append(conv_bn(hidden, hidden, k, stride, groups=hidden, act=nn.SiLU))
        layers.append(SqueezeExcite(hidden, max(1, cin // 4), act=nn.SiLU, gate=nn.Sigmoid))
        layers.append(conv_bn(hidden, cout, 1))
        self.block = nn.Sequential(*layers)
        self.sd_prob = sd_prob

    def forward(self, x: Tensor) -> Tensor:
        out = self.block(x)
        if self.residual:
            out = stochastic_depth(out, self.sd_prob, self.training) + x
        return out


class EfficientNetB0(nn.Module):
    """stem 3x3/2 (SiLU) - five MBConv blocks (stochastic depth rising linearly) - 1x1 head
    (SiLU) - pool - dropout - fc."""

    CONFIG: tuple[tuple[int, int, int, int, int], ...] = (  # cin, cout, expand, kernel, stride
        (8, 8, 1, 3, 1),  # no expansion, residual
        (8, 8, 6, 3, 2),
        (8, 8, 6, 3, 1),  # residual
        (8, 10, 6, 5, 2),
        (10, 10, 6, 5, 1),  # residual
    )

    def __init__(self) -> None:
        super().__init__()
        self.stem = conv_bn(3, 8, 3, 2, act=nn.SiLU)
        n = len(self.CONFIG)
        self.blocks = nn.Sequential(
            *[MBConv(*c, sd_prob=0.2 * i / n) for i, c in enumerate(self.CONFIG)]
        )
        self.head = conv_bn(10, 64, 1, act=nn.SiLU)
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(64, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.head(self.blocks(self.stem(x)))  # (N, 64, 4, 4)
        return self.fc(self.dropout(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)))


def build_efficientnet(seed: int = 0) -> nn.Module:
    """EfficientNet-B0-style MBConv network: SiLU, squeeze-and-excitation with a sigmoid gate,
    stochastic depth on the residual branches (the identity in eval mode)."""
    torch.manual_seed(seed)
    return randomise(EfficientNetB0(), seed)


# ------------------------------------------------------------------ ConvNeXt
class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor (permute to channels-last and back)."""

    def forward(self, x: Tensor) -> Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """depthwise 7x7 - permute to NHWC - LayerNorm - Linear 4x - GELU - Linear - layer-scale
    gamma - permute back - residual add with stochastic depth."""

    def __init__(self, dim: int, sd_prob: float = 0.0) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))
        self.sd_prob = sd_prob

    def forward(self, x: Tensor) -> Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)  # (N, H, W, dim)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        y = (self.gamma * y).permute(0, 3, 1, 2)  # (N, dim, H, W)
        return x + stochastic_depth(y, self.sd_prob, self.training)


class ConvNeXt(nn.Module):
    """patchify stem (4x4/4 conv - LayerNorm2d) - stage1 (2 blocks) - downsample (LayerNorm2d -
    2x2/2 conv) - stage2 (2 blocks) - pool - LayerNorm - head."""

    def __init__(self, dims: tuple[int, int] = (8, 16)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), LayerNorm2d(dims[0], eps=1e-6))
        self.stage1 = nn.Sequential(ConvNeXtBlock(dims[0]), ConvNeXtBlock(dims[0], 0.1))
        self.down = nn.Sequential(LayerNorm2d(dims[0], eps=1e-6), nn.Conv2d(dims[0], dims[1], 2, 2))
        self.stage2 = nn.Sequential(ConvNeXtBlock(dims[1], 0.1), ConvNeXtBlock(dims[1], 0.2))
        self.norm = nn.LayerNorm(dims[1], eps=1e-6)
        self.head = nn.Linear(dims[1], NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stage2(self.down(self.stage1(self.stem(x))))  # (N, dims[1], 4, 4)
        return self.head(self.norm(x.mean([-2, -1])))


def build_convnext(seed: int = 0) -> nn.Module:
    """ConvNeXt: depthwise 7x7 convs, permutes to channels-last, LayerNorm over the channels
    (the residual stream), Linear 4x expansion (the MLP hidden units) and layer-scale gamma."""
    torch.manual_seed(seed)
    return randomise(ConvNeXt(), seed)


# ------------------------------------------------------------------ RegNetX
GROUP_WIDTH = 8  # channels per group of every RegNetX grouped conv


class XBlock(nn.Module):
    """RegNet X block (bottleneck ratio 1): 1x1 (a) - grouped 3x3 with a fixed group width
    (b) - 1x1 (c), each with BatchNorm; projection shortcut when the shape changes; ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.a = conv_bn(cin, cout, 1, act=nn.ReLU)
        self.b = conv_bn(cout, cout, 3, stride, groups=cout // GROUP_WIDTH, act=nn.ReLU)
        self.c = conv_bn(cout, cout, 1)
        self.proj = conv_bn(cin, cout, 1, stride) if (stride != 1 or cin != cout) else None
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x if self.proj is None else self.proj(x)
        return self.relu(shortcut + self.c(self.b(self.a(x))))


class RegNetX(nn.Module):
    """stem 3x3/2 - s1 (24 wide: 3 groups) - s2 (48 wide: 6 groups) - pool - fc."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = conv_bn(3, 16, 3, 2, act=nn.ReLU)
        self.s1 = nn.Sequential(XBlock(16, 24, 2), XBlock(24, 24, 1))
        self.s2 = nn.Sequential(XBlock(24, 48, 2), XBlock(48, 48, 1))
        self.fc = nn.Linear(48, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.s2(self.s1(self.stem(x)))  # (N, 48, 2, 2)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_regnetx(seed: int = 0) -> nn.Module:
    """RegNetX: grouped 3x3 convs with a fixed group width (8), so a removed channel must take
    its whole group with it; residual streams tied by projection shortcuts."""
    torch.manual_seed(seed)
    return randomise(RegNetX(), seed)


# ------------------------------------------------------------------ ViT
class EncoderBlock(nn.Module):
    """Pre-LN transformer encoder block: LN - nn.MultiheadAttention - add; LN - MLP - add."""

    def __init__(self, d: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(d, heads, dropout=0.0, batch_first=True)
        self.dropout = nn.Dropout(0.0)
        self.ln_2 = nn.LayerNorm(d, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(d, mlp), nn.GELU(), nn.Dropout(0.0), nn.Linear(mlp, d), nn.Dropout(0.0)
        )

    def forward(self, x: Tensor) -> Tensor:
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + self.dropout(y)
        return x + self.mlp(self.ln_2(x))


class ViT(nn.Module):
    """patchify conv (8x8/8: 16 patches) - flatten to tokens - prepend class token - add
    positional embedding - encoder blocks - LayerNorm - head on the class token."""

    def __init__(
        self, image: int = 32, patch: int = 8, d: int = 16, heads: int = 2, mlp: int = 64
    ) -> None:
        super().__init__()
        self.conv_proj = nn.Conv2d(3, d, patch, patch)
        tokens = (image // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embedding = nn.Parameter(torch.empty(1, tokens + 1, d).normal_(std=0.02))
        self.dropout = nn.Dropout(0.0)
        self.layers = nn.Sequential(EncoderBlock(d, heads, mlp), EncoderBlock(d, heads, mlp))
        self.ln = nn.LayerNorm(d, eps=1e-6)
        self.head = nn.Linear(d, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        x = self.conv_proj(x)  # (N, d, 4, 4)
        x = x.reshape(n, x.shape[1], -1).permute(0, 2, 1)  # (N, 16, d)
        x = torch.cat([self.cls_token.expand(n, -1, -1), x], dim=1)  # (N, 17, d)
        x = self.ln(self.layers(self.dropout(x + self.pos_embedding)))
        return self.head(x[:, 0])


def build_vit(seed: int = 0) -> nn.Module:
    """Vision transformer: class token concatenated to the patch tokens, positional embedding,
    nn.MultiheadAttention (q/k/v split into heads), pre-LN residual stream, MLP hidden units."""
    torch.manual_seed(seed)
    return randomise(ViT(), seed)


# ------------------------------------------------------------------ GroupNorm ResNet
class GNBlock(nn.Module):
    """Basic ResNet block with GroupNorm of ``gsize`` channels per group in place of
    BatchNorm; projection shortcut (1x1 conv - GroupNorm) when the shape changes."""

    def __init__(self, cin: int, mid: int, cout: int, stride: int, gsize: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, mid, 3, stride, 1, bias=False)
        self.gn1 = nn.GroupNorm(mid // gsize, mid)
        self.conv2 = nn.Conv2d(mid, cout, 3, 1, 1, bias=False)
        self.gn2 = nn.GroupNorm(cout // gsize, cout)
        self.down = (
            nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(cout // gsize, cout)
            )
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class GNResNet(nn.Module):
    """stem (conv - GroupNorm(4, 16)) - l1 (16, groups of 4) - l2 (16 -> 32 stride 2, groups of
    4) - l3 (32, groups of 16: 2 groups) - pool - fc."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.GroupNorm(4, 16), nn.ReLU()
        )
        self.l1 = GNBlock(16, 16, 16, 1)
        self.l2 = GNBlock(16, 24, 32, 2)
        self.l3 = GNBlock(32, 32, 32, 1, gsize=16)
        self.fc = nn.Linear(32, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.l3(self.l2(self.l1(self.stem(x))))  # (N, 32, 16, 16)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_gnresnet(seed: int = 0) -> nn.Module:
    """ResNet with GroupNorm: channels normalised in groups (of 4, or of 16 in l3), so a removed
    channel must take its whole GroupNorm group with it; residual streams shared by blocks whose
    GroupNorms have different group sizes."""
    torch.manual_seed(seed)
    return randomise(GNResNet(), seed)


ARCHS: dict[str, Callable[[int], nn.Module]] = {
    "shufflenetv2": build_shufflenetv2,
    "mobilenetv3": build_mobilenetv3,
    "efficientnet": build_efficientnet,
    "convnext": build_convnext,
    "regnetx": build_regnetx,
    "vit": build_vit,
    "gnresnet": build_gnresnet,
}
