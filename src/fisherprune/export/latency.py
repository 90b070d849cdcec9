"""CPU latency of a model, measured the same way everywhere (trainer report, benchmarks)."""

from __future__ import annotations

import ctypes
import logging
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fisherprune.export.files import traced
from fisherprune.export.layout import serving_copy, to_channels_last
from fisherprune.inputs import Inputs
from fisherprune.modes import eval_mode

__all__ = ["frozen_for_serving", "measure_latency", "retain_freed_memory"]

log = logging.getLogger("fisherprune")

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
#: freed heap memory up to this size stays in the process (glibc's default trims at 128 KiB)
RETAIN_BYTES = 1 << 30


def _glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc (it has ``gnu_get_libc_version``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded into this process: its libc
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version")):
        return None
    return libc


def retain_freed_memory(limit_bytes: int = RETAIN_BYTES) -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the OS.

    glibc serves a large allocation with a fresh ``mmap`` and unmaps it when it is freed, so a
    forward pass that allocates and frees its activation buffers page-faults them back in on
    every call. Which buffers count as large depends on the process's history: the threshold
    starts at 128 KiB and rises (up to 32 MiB) as mapped buffers are freed, and the heap's free
    top is trimmed back to the OS once it exceeds twice that. Measured in a fresh process on
    a 2-CPU VM (``benchmarks/allocator.py``): about 13k minor faults per forward pass of a
    32x32 VGG at batch 64 and none after this call. The cost is proportional to activation
    memory, not FLOPs, so it hides part of what removing channels saves. PyTorch's CPU
    performance guide addresses it with jemalloc or tcmalloc; here glibc is told
    (``mallopt``) to serve every allocation from its heap (``M_MMAP_MAX = 0``) and to keep up
    to ``limit_bytes`` of freed memory at the top of each heap (``M_TRIM_THRESHOLD``). The
    same without code: ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1073741824 python serve.py``.

    Changes: the allocator settings of the whole process (every malloc arena; a process with
    many threads has several arenas, each of which may then keep up to ``limit_bytes``), for
    the rest of its life (glibc's adaptive defaults cannot be restored). Resident memory stays
    at its peak. Meant for serving and benchmark processes; call it before the first forward
    pass.

    Returns:
        True if both settings were applied. False when the C library is not glibc (macOS,
        Windows, musl): nothing changed then. False also if glibc refused a setting, which is
        logged as a warning naming which one took effect.

    Raises:
        TypeError: ``limit_bytes`` is not an int (a bool is not accepted either).
        ValueError: ``limit_bytes`` is outside [1, 2**31), the range of a C int.
    """
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int):
        raise TypeError(f"limit_bytes must be an int, got {type(limit_bytes).__name__}")
    if not 0 < limit_bytes < 2**31:
        raise ValueError(f"limit_bytes must be in [1, 2**31), got {limit_bytes}")
    libc = _glibc()
    if libc is None:
        log.info("retain_freed_memory: the C library is not glibc; allocator left as it is")
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    no_mmap = mallopt(_M_MMAP_MAX, 0) == 1
    no_trim = mallopt(_M_TRIM_THRESHOLD, limit_bytes) == 1
    if not (no_mmap and no_trim):
        log.warning(
            "retain_freed_memory: glibc refused a mallopt setting (M_MMAP_MAX=0 %s, "
            "M_TRIM_THRESHOLD=%d %s)",
            "applied" if no_mmap else "refused",
            limit_bytes,
            "applied" if no_trim else "refused",
        )
    return no_mmap and no_trim


#: how the timed blocks of a model are summarised
STATISTICS = {"median": statistics.median, "min": min}


def measure_latency(
    models: dict[str, Callable[..., Any]],
    inputs: Any,
    repeats: int = 20,
    warmup: int = 3,
    rounds: int = 5,
    statistic: str = "median",
) -> dict[str, float]:
    """Seconds per forward pass of each model, in eval mode and without autograd.

    The models are timed round-robin (``rounds`` rounds of ``repeats`` calls each) so
    that all of them see the same machine load; each model's blocks are summarised by
    ``statistic``. The process's allocator is used as it is: under glibc's defaults large
    activations are page-faulted in at every call, which hides part of what pruning saves;
    call ``retain_freed_memory()`` first to time as a serving process should run.

    Args:
        models: what to time, by name: ``nn.Module`` s, TorchScript modules (frozen ones too),
            loaded AOTInductor packages, or any callable taking ``inputs``.
        inputs: one tensor, a tuple or list of the positional arguments of every model, or a
            dict of their keyword arguments (``model(**inputs)``).
        repeats: calls per timed block; ``warmup`` untimed calls per model come first.
        rounds: timed blocks per model.
        statistic: ``"median"`` of the blocks, or ``"min"``: the fastest block, the better
            estimate of a model's own cost on a shared machine, where other load only ever adds
            time (use many short blocks, e.g. ``repeats=1, rounds=40``).

    Returns:
        Seconds per call, by the names of ``models``.

    Changes: nothing lasting. Every module is put in eval mode while timing and given back its
    own train/eval flag afterwards (modules without one, e.g. a frozen TorchScript module,
    are left as they are).

    Raises:
        ValueError: an unknown ``statistic``, or ``repeats`` or ``rounds`` below 1.
    """
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}, got {statistic!r}")
    if repeats < 1 or rounds < 1:
        raise ValueError(f"repeats and rounds must be at least 1, got {repeats} and {rounds}")
    given = Inputs.of(inputs)
    times: dict[str, list[float]] = {name: [] for name in models}
    with eval_mode(*models.values()), torch.inference_mode():
        for model in models.values():
            for _ in range(warmup):
                given.call(model)
        for _ in range(rounds):
            for name, model in models.items():
                t0 = time.perf_counter()
                for _ in range(repeats):
                    given.call(model)
                times[name].append((time.perf_counter() - t0) / repeats)
    summary = STATISTICS[statistic]
    return {name: summary(ts) for name, ts in times.items()}


def frozen_for_serving(
    model: nn.Module, inputs: Any, channels_last: bool | None = None
) -> tuple[torch.jit.ScriptModule, tuple[Any, ...] | dict[str, Any]]:
    """``model`` as it is best served on CPU: frozen TorchScript (what
    ``export_model(format="torchscript", freeze=True)`` writes), with its weights in
    channels-last layout when the inputs are images.

    A deep copy of ``model`` in eval mode is put in channels-last layout (its 4-D weights) when
    ``channels_last`` is True, or when it is None and the first input is 4-D; then traced on
    ``inputs`` and frozen (parameters become constants, batch norm is folded into the convs).

    Args:
        model: an ``nn.Module`` (a shrunk one, or the dense one to compare against).
        inputs: one tensor, a tuple or list of the positional arguments, or a dict of the
            keyword arguments (traced with ``example_kwarg_inputs``; the frozen module takes
            them by keyword); with channels-last, every 4-D floating-point input tensor is put
            in that layout.
        channels_last: the layout; None chooses by the first input's dimensions.

    Returns:
        The frozen module and the inputs in its layout: a tuple of positional arguments, or a
        dict of keyword arguments if ``inputs`` was a dict.
        ``measure_latency({"dense": d, "pruned": p}, args)`` then times what serving costs.

    Changes: nothing; ``model`` is copied.

    Raises:
        ValueError: ``inputs`` is None.
        TypeError: ``model`` cannot be deep-copied.
        Exception: what ``torch.jit.trace`` raises for a model it cannot trace
            (``RuntimeError``, ``torch.jit.TracingCheckError``, ...), unchanged.
    """
    if inputs is None:
        raise ValueError("frozen_for_serving needs example inputs to trace the model with")
    given = Inputs.of(inputs)
    if channels_last is None:
        first = given.arguments()[0][1] if given.arguments() else None
        channels_last = isinstance(first, torch.Tensor) and first.dim() == 4
    if channels_last:
        given = given.map(to_channels_last)
    frozen = traced(serving_copy(model, channels_last), given, freeze=True)
    return frozen, given.packed()
