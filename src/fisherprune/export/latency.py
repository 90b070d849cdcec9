"""CPU latency of a model, measured the same way everywhere (trainer report, benchmarks)."""

from __future__ import annotations

import ctypes
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fisherprune.allocator import glibc as _glibc
from fisherprune.export.files import traced
from fisherprune.export.latency_stats import LatencyComparison, LatencyDistribution
from fisherprune.export.layout import serving_copy, to_channels_last
from fisherprune.inputs import Inputs
from fisherprune.modes import eval_mode

__all__ = [
    "allocator_state",
    "compare_latency",
    "frozen_for_serving",
    "measure_latency",
    "retain_freed_memory",
]

log = logging.getLogger("fisherprune")

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
#: freed heap memory up to this size stays in the process (glibc's default trims at 128 KiB)
RETAIN_BYTES = 1 << 30
#: the limits ``retain_freed_memory`` applied in this process, in order (empty: never)
_retained: list[int] = []


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

    ``allocator_state()`` says from then on that freed memory is retained.

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
    if no_mmap and no_trim:
        _retained.append(limit_bytes)
    return no_mmap and no_trim


def allocator_state() -> str:
    """The memory allocator latency is timed under in this process, in words for a report.

    ``"freed memory retained"`` once ``retain_freed_memory()`` has applied its settings
    (with the limit when it is not the default); else ``"glibc malloc defaults"`` or
    ``"the platform's malloc (not glibc)"``. A preloaded allocator (``LD_PRELOAD``, e.g.
    jemalloc) and glibc's tunables set in the environment (``MALLOC_*``, ``GLIBC_TUNABLES``)
    are named after it.

    Changes: nothing.
    """
    if _retained:
        limit = _retained[-1]
        state = "freed memory retained" + (f" (up to {limit} bytes)" * (limit != RETAIN_BYTES))
    else:
        state = "glibc malloc defaults" if _glibc() else "the platform's malloc (not glibc)"
    env = [
        f"{k}={v}"
        for k, v in sorted(os.environ.items())
        if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"
    ]
    if os.environ.get("LD_PRELOAD"):
        env.insert(0, f"LD_PRELOAD={os.environ['LD_PRELOAD']}")
    return state + (f" ({', '.join(env)})" if env else "")


#: how the timed blocks of a model are summarised
STATISTICS = {"median": statistics.median, "min": min}
#: most calls per block when ``compare_latency`` chooses the number
_MAX_REPEATS = 1000


def measure_latency(
    models: dict[str, Callable[..., Any]],
    inputs: Any,
    repeats: int = 20,
    warmup: int = 3,
    rounds: int = 5,
    statistic: str = "median",
) -> dict[str, float]:
    """Seconds per forward pass of each model, in eval mode and without autograd: one number
    each, with no spread. Reports use ``compare_latency``, which gives the distribution.

    The models are timed side by side, as in ``compare_latency``: ``warmup`` untimed calls
    each, then ``rounds`` rounds of one block of ``repeats`` calls per model, every other
    round in reverse order, so that all of them see the same machine load; each model's blocks
    are summarised by ``statistic``. The process's allocator is used as it is: under glibc's
    defaults large activations are page-faulted in at every call, which hides part of what
    pruning saves; call ``retain_freed_memory()`` first to time as a serving process should run.

    Args:
        models: what to time, by name: ``nn.Module`` s, TorchScript modules (frozen ones too),
            loaded AOTInductor packages, or any callable taking ``inputs``.
        inputs: one tensor, a tuple or list of the positional arguments of every model, or a
            dict of their keyword arguments (``model(**inputs)``).
        repeats: calls per timed block.
        warmup: untimed calls per model before the first round.
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
    with eval_mode(*models.values()), torch.inference_mode():
        clock = _Clock(given)
        clock.warm_up(models, warmup)
        times = clock.rounds(models, repeats, rounds, rounds, math.inf)
    summary = STATISTICS[statistic]
    return {name: summary(ts) for name, ts in times.items()}


def compare_latency(
    models: dict[str, Callable[..., Any]],
    inputs: Any,
    *,
    repeats: int | None = None,
    warmup: int = 3,
    rounds: int = 9,
    min_rounds: int = 5,
    budget_seconds: float = 10.0,
    block_seconds: float = 0.005,
) -> LatencyComparison:
    """Time models side by side and return each one's distribution, with the conditions.

    What is run, in eval mode and without autograd: ``warmup`` calls of each model, in turn
    (timed one by one, to choose ``repeats``, and otherwise not counted); then up to
    ``rounds`` rounds, each a block of ``repeats`` calls per model, with the models in the
    order given in even rounds (0, 2, ...) and in reverse order in odd ones, so that neither
    of two models always goes first. No round starts once ``budget_seconds`` have passed since
    the first one began, provided ``min_rounds`` are done: a slow model gets ``min_rounds``.
    ``result.speedup("dense", "pruned")`` pairs the blocks of each round.

    Args:
        models: what to time, by name (at least one): ``nn.Module`` s, TorchScript modules,
            loaded AOTInductor packages, or any callable taking ``inputs``.
        inputs: one tensor, a tuple or list of the positional arguments of every model, or a
            dict of their keyword arguments (``model(**inputs)``). On an accelerator, the
            device is synchronised before every reading of the clock.
        repeats: calls per block; None: as many as make a block of the fastest model last
            ``block_seconds`` by the median of its warm-up calls (1 to 1000; the median, not
            the fastest call, so that a machine slowed by other work gets fewer calls).
        warmup: untimed calls per model first, at least 1.
        rounds: the most rounds; min_rounds: the fewest (at least 3, at most ``rounds``).
        budget_seconds: time after which no more rounds start (see above).
        block_seconds: how long a block should last when ``repeats`` is None.

    Returns:
        The distribution of every model (seconds per call in each round's block), the threads
        (``torch.get_num_threads()``), the allocator (``allocator_state()``), the device, and
        the load average and CPUs of the machine.

    Changes: nothing lasting. Every module is put in eval mode while timing and given back its
    own train/eval flag afterwards.

    Raises:
        ValueError: no model, ``repeats`` or ``warmup`` below 1, ``min_rounds`` below 3 or
            above ``rounds``, or a ``budget_seconds`` or ``block_seconds`` that is not a
            positive number.

    Example:
        >>> cmp = compare_latency({"dense": dense, "pruned": small}, x)
        >>> cmp.speedup().text()  # "1.73x (IQR 1.68-1.80x)", or "no resolvable speed-up: ..."
    """
    if not models:
        raise ValueError("compare_latency needs at least one model to time")
    if (repeats is not None and repeats < 1) or warmup < 1:
        raise ValueError(f"repeats and warmup must be at least 1, got {repeats} and {warmup}")
    if not 3 <= min_rounds <= rounds:
        raise ValueError(
            f"min_rounds must be at least 3 and at most rounds (a spread needs 3 rounds), "
            f"got min_rounds={min_rounds}, rounds={rounds}"
        )
    if not (budget_seconds > 0 and block_seconds > 0):
        raise ValueError(
            f"budget_seconds and block_seconds must be positive, got {budget_seconds} and "
            f"{block_seconds}"
        )
    given = Inputs.of(inputs)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with eval_mode(*models.values()), torch.inference_mode():
        clock = _Clock(given)
        warm = clock.warm_up(models, warmup)
        if repeats is None:
            typical = min(statistics.median(times) for times in warm.values())
            repeats = math.ceil(block_seconds / max(typical, block_seconds / _MAX_REPEATS))
        times = clock.rounds(models, repeats, rounds, min_rounds, budget_seconds)
    return LatencyComparison(
        models={n: LatencyDistribution(tuple(ts), repeats) for n, ts in times.items()},
        warmup=warmup,
        threads=torch.get_num_threads(),
        allocator=allocator_state(),
        device=str(clock.device),
        load=load,
        cpus=len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count() or 1,
    )


class _Clock:
    """Calls models on one set of inputs and reads the clock around the calls, waiting for
    the inputs' accelerator (if any) before each reading."""

    def __init__(self, given: Inputs) -> None:
        self.given = given
        tensors = given.tensors()
        self.device = tensors[0][0].device if tensors else torch.device("cpu")

    def now(self) -> float:
        """``time.perf_counter()`` once the device has finished what it was given."""
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
        return time.perf_counter()

    def block(self, model: Callable[..., Any], calls: int) -> float:
        """Seconds per call of ``calls`` calls in a row."""
        t0 = self.now()
        for _ in range(calls):
            self.given.call(model)
        return (self.now() - t0) / calls

    def warm_up(self, models: dict[str, Callable[..., Any]], calls: int) -> dict[str, list[float]]:
        """``calls`` calls of each model in turn; the seconds each call took, by model."""
        times: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(calls):
            for name, model in models.items():
                times[name].append(self.block(model, 1))
        return times

    def rounds(
        self,
        models: dict[str, Callable[..., Any]],
        repeats: int,
        most: int,
        fewest: int,
        budget: float,
    ) -> dict[str, list[float]]:
        """Seconds per call of each model's block in each round: up to ``most`` rounds, odd
        ones in reverse order, and none started after ``budget`` seconds once ``fewest``
        are done."""
        times: dict[str, list[float]] = {name: [] for name in models}
        order = list(models.items())
        start = self.now()
        for r in range(most):
            if r >= fewest and self.now() - start > budget:
                break
            for name, model in order if r % 2 == 0 else order[::-1]:
                times[name].append(self.block(model, repeats))
        return times


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
