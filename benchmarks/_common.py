"""Helpers shared by the benchmark scripts (imported as a sibling module when run as a script)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from fisherprune.cost.formulas import SAME_AS_TORCH
from fisherprune.export.latency import retain_freed_memory


def counted_flops(
    model: nn.Module, x: Tensor | Mapping[str, Tensor], autograd: bool = False
) -> float:
    """FLOPs per example by ``FlopCounterMode`` (2 per multiply-accumulate) of ``model(x)``,
    or ``model(**x)`` for keyword inputs (the batch size read off the first), in eval mode;
    the model's training flag is restored afterwards. CPU's fused attention kernel is counted
    as PyTorch counts its flash kernel (``SAME_AS_TORCH``): left to itself the counter counts
    0 for it, and a pruned transformer's FLOPs reduction would leave its attention out.
    Without gradients unless ``autograd`` (the counter's module tracker asserts on some
    models' outputs, timm's PiT and CaiT, when no gradient function is set)."""
    was = model.training
    model.eval()
    try:
        with (
            torch.set_grad_enabled(autograd),
            FlopCounterMode(display=False, custom_mapping=dict(SAME_AS_TORCH)) as counter,
        ):
            model(**x) if isinstance(x, Mapping) else model(x)
    finally:
        model.train(was)
    batch = next(iter(x.values())) if isinstance(x, Mapping) else x
    return float(counter.get_total_flops()) / batch.shape[0]


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write a benchmark's results to ``path`` (creating its directory), one JSON document."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def machine_info() -> dict[str, Any]:
    """What the figures were measured on: platform, CPU model and count, load average."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    if hasattr(os, "sched_getaffinity"):
        info["cpus_available"] = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, AttributeError):
        info["load_average"] = list(os.getloadavg())
    return info


#: how ``--allocator`` leaves glibc's malloc for the timed forward passes
ALLOCATORS = ("retain", "glibc-default")


def add_allocator_option(parser: argparse.ArgumentParser, default: str = "retain") -> None:
    """Add ``--allocator`` (one of ``ALLOCATORS``, ``default``) to a benchmark's ``parser``."""
    parser.add_argument(
        "--allocator",
        choices=ALLOCATORS,
        default=default,
        help="retain: fisherprune.export.retain_freed_memory() before timing, so activations "
        "are not page-faulted in at every pass (what docs/usage.md recommends for serving); "
        f"glibc-default: leave malloc as it is (default: {default})",
    )


def apply_allocator(choice: str) -> tuple[bool, str]:
    """Apply ``--allocator`` to this process's malloc; return (retained, how it was left).

    Changes: with ``retain``, glibc's settings for the rest of the process (see
    ``retain_freed_memory``); prints a note to stderr when the C library is not glibc.
    """
    if choice == "glibc-default":
        return False, "glibc malloc defaults"
    if retain_freed_memory():
        return True, "freed memory retained"
    print("NOTE: not glibc; the allocator is left as it is", file=sys.stderr)
    return False, "allocator left as it is (not glibc)"
