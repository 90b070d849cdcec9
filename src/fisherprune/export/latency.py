"""CPU latency of a model, measured the same way everywhere (trainer report, benchmarks)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

__all__ = ["measure_latency"]


def measure_latency(
    models: dict[str, nn.Module], inputs: Any, repeats: int = 20, warmup: int = 3, rounds: int = 5
) -> dict[str, float]:
    """Median seconds per forward pass of each model, in eval mode and without autograd.

    The models are timed round-robin (``rounds`` rounds of ``repeats`` calls each) so
    that all of them see the same machine load; the median over rounds is returned.
    """
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    flags = {m: m.training for model in models.values() for m in model.modules()}
    for model in models.values():
        model.eval()
    times: dict[str, list[float]] = {name: [] for name in models}
    try:
        with torch.inference_mode():
            for model in models.values():
                for _ in range(warmup):
                    model(*args)
            for _ in range(rounds):
                for name, model in models.items():
                    t0 = time.perf_counter()
                    for _ in range(repeats):
                        model(*args)
                    times[name].append((time.perf_counter() - t0) / repeats)
    finally:
        for m, f in flags.items():
            m.training = f
    return {name: statistics.median(ts) for name, ts in times.items()}
