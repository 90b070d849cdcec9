"""Built-in architectures for the trainer, and loading a user's model builder.

Every built-in is a plain ``nn.Module`` whose channels ``apply_masks`` finds by
itself: no MaskLayer is written into them.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MODELS", "build_model", "register_model"]

Builder = Callable[..., nn.Module]
MODELS: dict[str, Builder] = {}


def register_model(name: str) -> Callable[[Builder], Builder]:
    """Register a built-in builder ``fn(input_shape, num_outputs, width, depth) -> nn.Module``."""

    def deco(fn: Builder) -> Builder:
        if name in MODELS:
            raise ValueError(f"model {name!r} is already registered")
        MODELS[name] = fn
        return fn

    return deco


@register_model("mlp")
class MLP(nn.Module):
    """``depth`` hidden layers of ``width`` units with ReLU (for tables or flattened images)."""

    def __init__(
        self, input_shape: tuple[int, ...], num_outputs: int, width: int = 128, depth: int = 2
    ) -> None:
        super().__init__()
        n_in = 1
        for s in input_shape:
            n_in *= s
        layers: list[nn.Module] = [nn.Flatten()]
        for _ in range(depth):
            layers += [nn.Linear(n_in, width), nn.ReLU()]
            n_in = width
        layers.append(nn.Linear(n_in, num_outputs))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def _conv_bn(cin: int, cout: int, stride: int = 1, k: int = 3) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
    )


@register_model("cnn")
class SmallCNN(nn.Module):
    """``depth`` conv-BN-ReLU stages (widths ``width * 2**i``, max-pool between) and a
    flatten -> Linear classifier."""

    def __init__(
        self, input_shape: tuple[int, ...], num_outputs: int, width: int = 16, depth: int = 2
    ) -> None:
        super().__init__()
        c, h, w = _image_shape(input_shape)
        stages: list[nn.Module] = []
        for i in range(depth):
            stages.append(_conv_bn(c, width * 2**i))
            c = width * 2**i
            if min(h, w) >= 4:
                stages.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
        self.features = nn.Sequential(*stages)
        self.classifier = nn.Linear(c * h * w, num_outputs)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x).flatten(1))


class BasicBlock(nn.Module):
    """ResNet basic block; a 1x1 projection when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


@register_model("resnet")
class ResNet(nn.Module):
    """A CIFAR-style ResNet: 3 stages of ``depth`` basic blocks, widths ``width * (1, 2, 4)``."""

    def __init__(
        self, input_shape: tuple[int, ...], num_outputs: int, width: int = 16, depth: int = 1
    ) -> None:
        super().__init__()
        c, _, _ = _image_shape(input_shape)
        self.stem = _conv_bn(c, width)
        blocks: list[nn.Module] = []
        cin = width
        for stage, mult in enumerate((1, 2, 4)):
            for b in range(depth):
                stride = 2 if stage > 0 and b == 0 else 1
                blocks.append(BasicBlock(cin, width * mult, stride))
                cin = width * mult
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_outputs)

    def forward(self, x: Tensor) -> Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class DenseLayer(nn.Module):
    """BN-ReLU-conv3x3 producing ``growth`` channels, concatenated to its input."""

    def __init__(self, cin: int, growth: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(cin)
        self.conv = nn.Conv2d(cin, growth, 3, 1, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([x, self.conv(F.relu(self.bn(x)))], 1)


@register_model("densenet")
class DenseNet(nn.Module):
    """Two dense blocks of ``depth`` layers (growth ``width // 2``) with a transition between."""

    def __init__(
        self, input_shape: tuple[int, ...], num_outputs: int, width: int = 16, depth: int = 3
    ) -> None:
        super().__init__()
        c, _, _ = _image_shape(input_shape)
        growth = max(1, width // 2)
        self.stem = nn.Conv2d(c, width, 3, 1, 1, bias=False)
        c = width
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers.append(DenseLayer(c, growth))
            c += growth
        self.block1 = nn.Sequential(*layers)
        self.transition = nn.Sequential(
            nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c // 2, 1, bias=False), nn.AvgPool2d(2)
        )
        c //= 2
        layers = []
        for _ in range(depth):
            layers.append(DenseLayer(c, growth))
            c += growth
        self.block2 = nn.Sequential(*layers)
        self.norm = nn.BatchNorm2d(c)
        self.fc = nn.Linear(c, num_outputs)

    def forward(self, x: Tensor) -> Tensor:
        x = self.block2(self.transition(self.block1(self.stem(x))))
        return self.fc(F.adaptive_avg_pool2d(F.relu(self.norm(x)), 1).flatten(1))


class RecurrentNet(nn.Module):
    """Each example read as a sequence: features of shape (T, F) as T steps of F values, an
    image (C, H, W) as its H rows (C * W values each), a flat vector (F,) as F steps of one
    value. A linear layer with ReLU (``width`` units: the width the recurrence reads), a
    ``depth``-layer bidirectional ``cell`` (``nn.LSTM`` or ``nn.GRU``) of ``width`` hidden
    units, a classifier on its outputs' mean over the steps. Both widths are prunable."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_outputs: int,
        width: int = 64,
        depth: int = 1,
        cell: type[nn.RNNBase] = nn.LSTM,
    ) -> None:
        super().__init__()
        if len(input_shape) not in (1, 2, 3):
            raise ValueError(
                f"a recurrent model reads features of shape (T, F), (C, H, W) or (F,), got "
                f"{input_shape}"
            )
        self.image = len(input_shape) == 3
        features = input_shape[0] * input_shape[2] if self.image else math.prod(input_shape[1:])
        self.embed = nn.Linear(features, width)
        self.rnn = cell(width, width, num_layers=depth, batch_first=True, bidirectional=True)
        self.classifier = nn.Linear(2 * width, num_outputs)

    def forward(self, x: Tensor) -> Tensor:
        if self.image:  # (N, C, H, W) -> (N, H, C * W): the rows are the steps
            x = x.permute(0, 2, 1, 3).flatten(2)
        elif x.dim() == 2:  # (N, F) -> (N, F, 1)
            x = x.unsqueeze(-1)
        return self.classifier(self.rnn(F.relu(self.embed(x)))[0].mean(1))


@register_model("lstm")
def _lstm(
    input_shape: tuple[int, ...], num_outputs: int, width: int = 64, depth: int = 1
) -> nn.Module:
    """``RecurrentNet`` with a bidirectional ``nn.LSTM``."""
    return RecurrentNet(input_shape, num_outputs, width, depth, nn.LSTM)


@register_model("gru")
def _gru(
    input_shape: tuple[int, ...], num_outputs: int, width: int = 64, depth: int = 1
) -> nn.Module:
    """``RecurrentNet`` with a bidirectional ``nn.GRU``."""
    return RecurrentNet(input_shape, num_outputs, width, depth, nn.GRU)


def _image_shape(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ValueError(
            f"this model needs image inputs (C, H, W), got features of shape {input_shape}; "
            "use --model mlp for tables, or set image_shape in the data spec"
        )
    return input_shape  # type: ignore[return-value]


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_outputs: int,
    width: int | None = None,
    depth: int | None = None,
) -> nn.Module:
    """A built-in model by name, or a user's from ``"package.module:function"``.

    A user's function is called as ``fn(input_shape=..., num_outputs=...)`` with
    only the keywords it accepts (the seed's ``build_graph_fn``); it must return
    an ``nn.Module``.

    Raises:
        ValueError: unknown name, or a user function that does not return a module.
        ImportError: the user's module cannot be imported.
    """
    kw: dict[str, Any] = {}
    if width is not None:
        kw["width"] = width
    if depth is not None:
        kw["depth"] = depth
    if ":" in name:
        mod_name, _, fn_name = name.partition(":")
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as e:
            raise ImportError(f"cannot import {mod_name!r} for --model {name!r}: {e}") from e
        fn = getattr(mod, fn_name, None)
        if fn is None or not callable(fn):
            raise ValueError(f"{mod_name!r} has no callable {fn_name!r} (from --model {name!r})")
        offered = {"input_shape": input_shape, "num_outputs": num_outputs, **kw}
        params = inspect.signature(fn).parameters
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        model = fn(**{k: v for k, v in offered.items() if takes_all or k in params})
        if not isinstance(model, nn.Module):
            raise ValueError(f"--model {name!r} returned {type(model).__name__}, not an nn.Module")
        return model
    if name not in MODELS:
        raise ValueError(
            f"unknown model {name!r}; built-ins: {', '.join(sorted(MODELS))}, "
            "or 'package.module:function'"
        )
    return MODELS[name](input_shape, num_outputs, **kw)
