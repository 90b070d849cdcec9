"""Model builders for the CLI tests' ``--model tests._user_model:<function>`` (the seed's
``build_graph_fn``): plain modules with no MaskLayer, so ``apply_masks`` places the masks."""

from __future__ import annotations

import math
import time

from torch import Tensor, nn


def build_sequential(
    input_shape: tuple[int, ...], num_outputs: int, width: int = 16
) -> nn.Sequential:
    """Flatten -> Linear(width) -> ReLU -> Linear(num_outputs): one prunable group of ``width``,
    as a bare ``nn.Sequential`` (what many users' builders return)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), width),
        nn.ReLU(),
        nn.Linear(width, num_outputs),
    )


class MLP(nn.Module):
    """``build_sequential``'s network inside a module of its own."""

    def __init__(self, input_shape: tuple[int, ...], num_outputs: int, width: int) -> None:
        super().__init__()
        self.net = build_sequential(input_shape, num_outputs, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def build(input_shape: tuple[int, ...], num_outputs: int, width: int = 16) -> nn.Module:
    return MLP(input_shape, num_outputs, width)


class SlowMLP(MLP):
    """``MLP``, sleeping 10 ms per training forward so that a test can kill the run at a chosen
    step (the sleep changes no number)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            time.sleep(0.01)
        return self.net(x)


def slow(input_shape: tuple[int, ...], num_outputs: int, width: int = 16) -> nn.Module:
    return SlowMLP(input_shape, num_outputs, width)


class CountingMLP(MLP):
    """``MLP`` whose graph changes from one call to the next (a Python call counter decides
    whether an extra op runs), so ``torch.jit.trace``'s own check rejects it; every output is
    that of ``MLP``."""

    def __init__(self, input_shape: tuple[int, ...], num_outputs: int, width: int) -> None:
        super().__init__(input_shape, num_outputs, width)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        y = self.net(x)
        return y * 1.0 if self.calls % 2 else y


def untraceable(input_shape: tuple[int, ...], num_outputs: int, width: int = 16) -> nn.Module:
    return CountingMLP(input_shape, num_outputs, width)
