"""Standard-size networks for the benchmarks, in plain PyTorch (no torchvision, no downloads).

* ``resnet50``: ResNet-50 (He et al. 2016; bottleneck blocks 3-4-6-3, widths 64-128-256-512
  times 4, stride on the 3x3 conv as in torchvision's v1.5), input (N, 3, 224, 224);
* ``bert_base``: a BERT-base-sized encoder (12 post-LN blocks, hidden 768, 12 heads of 64, MLP
  3072, token + position embeddings, a classifier on the first token), input token ids (N, 128);
* ``vit_b16``: a ViT-B/16-sized encoder (16x16 patches of a 224x224 image -> 196 tokens plus a
  class token, 12 pre-LN blocks, hidden 768, 12 heads, MLP 3072), input (N, 3, 224, 224);
* ``mobilenet_v3_large``: MobileNetV3-Large (Howard et al. 2019, table 1: a 3x3/2 stem of 16,
  15 inverted residuals with 3x3 or 5x5 depthwise convolutions, squeeze-and-excitation and
  hard-swish where the table has them, a 1x1 conv to 960, average pool, 1280 hidden units),
  input (N, 3, 224, 224).

The attention is written as users write it: q / k / v ``nn.Linear`` layers, heads split by
``view``, ``F.scaled_dot_product_attention``, an output ``nn.Linear``. ``apply_masks`` finds
on the encoders the heads of every block, the MLP units of every block and the hidden width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "Encoder",
    "MobileNetV3Large",
    "ResNet50",
    "build_bert_base",
    "build_mobilenet_v3_large",
    "build_resnet50",
    "build_vit_b16",
]

NUM_CLASSES = 10


# ------------------------------------------------------------------ ResNet-50
class Bottleneck(nn.Module):
    """1x1 - 3x3 (stride) - 1x1 convs with BN; a projection shortcut where the shape changes."""

    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = 4 * mid
        self.conv1 = nn.Conv2d(cin, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    """stem 7x7/2 + maxpool, four stages of bottlenecks (3, 4, 6, 3), average pool, fc."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        blocks: list[nn.Module] = []
        cin = 64
        for i, (mid, count) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
            for j in range(count):
                blocks.append(Bottleneck(cin, mid, 2 if i > 0 and j == 0 else 1))
                cin = 4 * mid
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: Tensor) -> Tensor:  # (N, 3, 224, 224)
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)  # (N, 64, 56, 56)
        x = self.blocks(x)  # (N, 2048, 7, 7)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_resnet50(seed: int = 0) -> ResNet50:
    torch.manual_seed(seed)
    return ResNet50()


# ------------------------------------------------------------------ encoders
class Attention(nn.Module):
    """Multi-head self-attention: q / k / v / out Linear layers and SDPA."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:  # (N, L, d)
        n, length, _ = x.shape

        def split(t: Tensor) -> Tensor:  # (N, L, H*Dh) -> (N, H, L, Dh)
            return t.view(n, length, self.heads, self.head_dim).transpose(1, 2)

        o = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.out(o.transpose(1, 2).reshape(n, length, self.heads * self.head_dim))


class Block(nn.Module):
    """One encoder block; ``pre_norm`` (ViT) or post-norm (BERT)."""

    def __init__(self, d: int, heads: int, hidden: int, pre_norm: bool) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        self.attn = Attention(d, heads)
        self.ln1 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.ln2 = nn.LayerNorm(d)

    def mlp(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def forward(self, x: Tensor) -> Tensor:
        if self.pre_norm:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class Encoder(nn.Module):
    """Token (``vocab``) or 16x16-patch (``vocab=None``) embedding, ``layers`` blocks, a
    classifier on the first token."""

    def __init__(
        self,
        *,
        vocab: int | None,
        length: int,
        d: int = 768,
        heads: int = 12,
        hidden: int = 3072,
        layers: int = 12,
        num_classes: int = NUM_CLASSES,
    ) -> None:
        super().__init__()
        self.pre_norm = vocab is None
        if vocab is None:
            self.patch = nn.Conv2d(3, d, 16, 16)
            self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        else:
            self.tokens = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, length, d) * 0.02)
        self.ln_in = nn.LayerNorm(d)
        self.blocks = nn.Sequential(
            *(Block(d, heads, hidden, self.pre_norm) for _ in range(layers))
        )
        self.head = nn.Linear(d, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        if self.pre_norm:  # (N, 3, 224, 224) -> (N, 197, d)
            p = self.patch(x).flatten(2).transpose(1, 2)
            h = torch.cat([self.cls.expand(p.shape[0], -1, -1), p], dim=1) + self.pos
            h = self.ln_in(self.blocks(h))
        else:  # (N, L) token ids -> (N, L, d)
            h = self.blocks(self.ln_in(self.tokens(x) + self.pos))
        return self.head(h[:, 0])


def build_bert_base(seed: int = 0, length: int = 128, layers: int = 12) -> Encoder:
    torch.manual_seed(seed)
    return Encoder(vocab=30522, length=length, layers=layers)


def build_vit_b16(seed: int = 0, layers: int = 12) -> Encoder:
    torch.manual_seed(seed)
    return Encoder(vocab=None, length=197, layers=layers)


# ------------------------------------------------------------------ MobileNetV3-Large
#: (kernel, expansion, output, squeeze-and-excitation, hard-swish, stride): the paper's table 1
MOBILENET_V3_LARGE = (
    (3, 16, 16, False, False, 1),
    (3, 64, 24, False, False, 2),
    (3, 72, 24, False, False, 1),
    (5, 72, 40, True, False, 2),
    (5, 120, 40, True, False, 1),
    (5, 120, 40, True, False, 1),
    (3, 240, 80, False, True, 2),
    (3, 200, 80, False, True, 1),
    (3, 184, 80, False, True, 1),
    (3, 184, 80, False, True, 1),
    (3, 480, 112, True, True, 1),
    (3, 672, 112, True, True, 1),
    (5, 672, 160, True, True, 2),
    (5, 960, 160, True, True, 1),
    (5, 960, 160, True, True, 1),
)


def _divisible(c: float, by: int = 8) -> int:
    """``c`` rounded to a multiple of ``by``, never below 90% of it (the paper's widths)."""
    rounded = max(by, int(c + by / 2) // by * by)
    return rounded + by if rounded < 0.9 * c else rounded


class SqueezeExcitation(nn.Module):
    """Average pool, 1x1 to a quarter of the width (ReLU), 1x1 back, hard sigmoid, scale."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(c, _divisible(c / 4), 1)
        self.expand = nn.Conv2d(_divisible(c / 4), c, 1)

    def forward(self, x: Tensor) -> Tensor:
        scale = self.expand(F.relu(self.reduce(F.adaptive_avg_pool2d(x, 1))))
        return x * F.hardsigmoid(scale)


class InvertedResidual(nn.Module):
    """1x1 expansion (when wider), kxk depthwise (stride), squeeze-and-excitation
    (``squeeze(width)``), 1x1 projection; the input added back where the shape is kept."""

    def __init__(
        self,
        cin: int,
        spec: tuple[int, int, int, bool, bool, int],
        squeeze: Callable[[int], nn.Module] = SqueezeExcitation,
    ) -> None:
        super().__init__()
        k, hidden, cout, se, hs, stride = spec
        act = nn.Hardswish if hs else nn.ReLU
        layers: list[nn.Module] = []
        if hidden != cin:
            layers += [nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), act()]
        layers += [
            nn.Conv2d(hidden, hidden, k, stride, k // 2, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            act(),
        ]
        if se:
            layers.append(squeeze(hidden))
        layers += [nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        out = self.block(x)
        return x + out if self.residual else out


class MobileNetV3Large(nn.Module):
    """Stem, ``MOBILENET_V3_LARGE``'s blocks, 1x1 conv to 960, pool, 1280 hidden, classes."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish()
        )
        blocks: list[nn.Module] = []
        cin = 16
        for spec in MOBILENET_V3_LARGE:
            blocks.append(InvertedResidual(cin, spec))
            cin = spec[2]
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(
            nn.Conv2d(cin, 960, 1, bias=False), nn.BatchNorm2d(960), nn.Hardswish()
        )
        self.classifier = nn.Sequential(
            nn.Linear(960, 1280), nn.Hardswish(), nn.Linear(1280, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:  # (N, 3, 224, 224)
        x = self.head(self.blocks(self.stem(x)))  # (N, 960, 7, 7)
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_mobilenet_v3_large(seed: int = 0) -> MobileNetV3Large:
    torch.manual_seed(seed)
    return MobileNetV3Large()
