"""CPU latency of a model, measured the same way everywhere (trainer report, benchmarks)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

__all__ = ["measure_latency", "retain_freed_memory"]

log = logging.getLogger("fisherprune")

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
#: freed heap memory up to this size stays in the process (glibc's default trims at 128 KiB)
RETAIN_BYTES = 1 << 30


def retain_freed_memory(limit_bytes: int = RETAIN_BYTES) -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the OS.

    With glibc's defaults, buffers of more than a few MB (the activations of a conv net at
    batch 64) are mapped fresh by every forward pass and unmapped when freed, so each pass
    page-faults its activations back in. That cost is proportional to activation memory, not
    FLOPs; on a 2-CPU VM it was measured at 20-40% of a conv net's latency at batch 64, which
    hides most of what removing channels saves. This is the effect PyTorch's CPU performance
    guide addresses with jemalloc or tcmalloc; here glibc is told (``mallopt``) to serve every
    allocation from its heap (``M_MMAP_MAX = 0``) and to keep up to ``limit_bytes`` of freed
    memory (``M_TRIM_THRESHOLD``). The same effect without code:
    ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1073741824 python serve.py``.

    Changes: the allocator settings of the whole process, for the rest of its life (glibc's
    adaptive defaults cannot be restored). The process's resident memory then stays at its
    peak. Meant for serving and benchmark processes; call it before the first forward pass.

    Returns:
        True if the settings were applied; False (nothing changed) when the C library is not
        glibc, e.g. on macOS, Windows or musl.

    Raises:
        ValueError: ``limit_bytes`` is not a positive int that fits a C int.
    """
    if not isinstance(limit_bytes, int) or not 0 < limit_bytes < 2**31:
        raise ValueError(f"limit_bytes must be an int in [1, 2**31), got {limit_bytes!r}")
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 -- present in glibc only
    except (OSError, AttributeError):
        log.info("retain_freed_memory: the C library is not glibc; allocator left as it is")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, limit_bytes) == 1
    if not ok:
        log.warning("retain_freed_memory: glibc refused the mallopt settings")
    return ok


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
