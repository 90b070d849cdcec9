"""CPU latency of shrunk networks against their FLOPs: does removing channels make them faster?

What is measured
----------------
For four networks defined here (32x32x3 images, 10 classes, except the MLP):

* ``vgg``: VGG-style, conv-BN-ReLU x8 with max-pooling, flatten (256 x 2 x 2) -> fc-ReLU-fc;
* ``resnet18``: ResNet-18 layout (CIFAR stem, 4 stages x 2 basic blocks, widths 16-32-64-128);
* ``mobilenetv2``: MobileNetV2 layout (inverted residuals, depthwise 3x3, width 0.5, CIFAR
  strides);
* ``mlp``: 512-1024-1024-512-10 with ReLU,

each is pruned to 50% and to 25% of its FLOPs, shrunk with ``fisherprune.shrink``, and the CPU
latency of one forward pass (eval mode, inference mode) of the dense and the shrunk networks is
measured at batch 1 and batch 64 with ``fisherprune.export.latency.measure_latency``: single
calls of all the networks interleaved, round-robin, so that all of them see the same machine
load, and the fastest call of each network taken as its latency (``statistic="min"``). On a
shared machine other load only ever adds time, so the fastest call is the stable estimate of a
network's own cost; medians of blocks moved the narrow ResNet-18's efficiency at 25% between
0.57 and 0.69 from run to run, the fastest call by about 0.02. Every figure reported is a
ratio taken inside one such run.

How the networks are pruned
---------------------------
Greedy Fisher pruning without the SGD updates in between: ``apply_masks`` masks every prunable
channel group, and ``fisherprune.prune`` zeroes, one prune at a time, the channel (or, with
``round_to``, the block of channels) with the lowest ``"auto"`` score ``signal / marginal cost``
(``fisherprune.score``), with exact marginal costs from a ``fisherprune.CostModel``, until the
cost reaches the target. This is the selection ``PruningOptimizer(prune_every=1,
flops_weight="auto")`` makes, minus its weight updates: weights do not change latency, and a real
optimizer run costs one training step per prune (thousands of steps, many minutes per network
on this machine). To keep it quick the costs are re-evaluated after every chunk of prunes (about
``chunks`` evaluations in all, a few tenths of a percent of the channels per chunk whatever
``round_to``), and after every single prune once the estimate reaches the target. Pruning
runs on one thread (it is not timed, and one thread is immune to the contention described
below). Two signal sources, each a row of the table:

* ``fisher``: Fisher signals of the masks (``update_pruning_signals``) from backward passes in
  train mode, cross-entropy on a synthetic 10-class task (a fixed random low-frequency template
  per class, shifted by up to 4 pixels, plus noise), refreshed every ``refresh`` evaluations.
  The network is first trained ``--train-steps`` SGD steps on that task (default 150; the
  held-out accuracy is printed and stored), because the signals of an untrained network span
  orders of magnitude across depth and thin the deep layers to a few channels, a pattern real
  use does not produce (``--train-steps 0`` reproduces it);
* ``random``: fixed i.i.d. log-normal signals, so that the choice is driven by the marginal
  FLOPs: pruning spreads over the layers, most where a channel costs most.

Trained Fisher signals lie between these; the kept fraction per mask
(min / median / max) is printed so that the pattern behind each latency figure is visible.

Two selection costs, also each a row (``--selection``): ``flops`` weighs each signal against
the channel's marginal FLOPs, as above; ``memory`` against the activation elements it removes
(``convention="memory"``), Group Fisher Pruning's memory-normalised selection, which the library
offers as ``PruningOptimizer(score_convention="memory")``. The targets are FLOPs in both, so the
rows compare what each selection does to latency at the same FLOPs.

Figures
-------
``FLOPs ratio``: shrunk / dense, both from ``torch.utils.flop_counter.FlopCounterMode``.
``speed-up``: dense latency / shrunk latency. ``eff``: speed-up / FLOPs reduction, i.e. speed-up
x FLOPs ratio (1.0 means latency falls exactly as FLOPs do). The issue's target, for the conv
nets at batch 64, is ``eff >= 0.7``; whether each row meets it is printed and stored as measured.

Channel rounding
----------------
``--round-to`` (default ``1 8``) adds a row per value: pruning with ``prune(round_to=k)`` keeps
every mask at a multiple of ``k`` channels. oneDNN's AVX2 kernels work on channels in blocks of
8 floats, so a conv with 9 or 12 channels runs about as slowly as one with 16 (measured here
per layer); with ``k = 8`` the FLOPs removed are FLOPs the CPU no longer spends.

Serving form
------------
``--serve`` times the modules as they are (``eager``, the default), as frozen TorchScript
(``torchscript``: what ``export_model(format="torchscript", freeze=True)`` writes) or as
AOTInductor packages (``aoti``: ``export_model(format="aoti")`` loaded with
``load_aoti_export``; compiled ahead of time, batch norm folded, conv nets in channels-last
inside). The published run is ``--threads 1 --serve aoti`` (``THREADS=1 benchmarks/run_all``);
``benchmarks/serve_forms.py``
compares the forms side by side.

Allocator and layout
--------------------
By default the process first calls ``fisherprune.export.retain_freed_memory()``: with glibc's
malloc defaults a forward pass can map its large activation buffers afresh and page-fault them
in at every call, a cost proportional to activation memory rather than FLOPs, which a serving
process avoids with jemalloc, tcmalloc or these settings. How many faults it takes depends on
what the process allocated before (glibc adapts its thresholds), so each row records the minor
page faults per forward pass of the dense and the shrunk network at batch 64
(``faults_per_forward``); ``benchmarks/allocator.py`` measures the defaults in fresh
processes. ``--allocator glibc-default`` measures without the call. ``--channels-last`` times
every conv net, dense and shrunk alike, in channels-last layout: oneDNN then computes in
that layout directly, where in NCHW every conv reorders its input and output to a blocked
layout and back, a memory-bound cost that does not shrink with the FLOPs. The layout and
allocator are in the JSON.

Run ``python benchmarks/export_speed.py`` (a few minutes on a quiet machine; with
``--serve aoti`` add 15-20 s of compiling per network timed, about 20 min in all) or ``--quick``
(half-width networks, fewer calls; under a minute on an idle machine). The table is printed,
the JSON goes to ``--out`` (default ``benchmarks/results/export_speed.json``) and the plot to
``--plot`` (default ``docs/export_speed.png``); a quick run writes
``benchmarks/results/export_speed_quick.json`` and ``.png`` instead, so that it never
overwrites the full run's results. Threads are pinned
(``--threads``, default 2). This machine is shared: the load average is recorded before and
after, noisy rows are flagged by the spread (the speed-ups from the first and the second half
of the calls, max/min - 1), and a thread check times
each dense network with ``--threads`` threads against one thread: on a 2-CPU machine with
another busy process, 2 threads can be many times slower than 1 (every op waits for its second
worker to get a CPU), and then latency counts ops, not FLOPs; the script says so, and
``--threads 1`` gives the meaningful figures.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import add_allocator_option, apply_allocator, counted_flops, write_json
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.export import load_aoti_export
from fisherprune.export.latency import frozen_for_serving, measure_latency
from fisherprune.export.layout import to_channels_last
from fisherprune.settings import check_min_channels

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks/results/export_speed.json"
DEFAULT_PLOT = ROOT / "docs/export_speed.png"
QUICK_OUT = ROOT / "benchmarks/results/export_speed_quick"  # .json and .png
NUM_CLASSES = 10
TARGETS = (0.50, 0.25)  # FLOPs targets, fractions of the dense network's FLOPs
BATCHES = (1, 64)
CONV_NETS = ("vgg", "resnet18", "mobilenetv2")  # the issue's target applies to these
EFF_TARGET = 0.7  # latency speed-up >= 0.7 x FLOPs reduction, at batch 64
SIGNAL_BATCH = 16  # batch of the backward passes that gather Fisher signals
TRAIN_BATCH = 32  # batch of the brief training on the synthetic task (--train-steps)
TASK_NOISE = 0.8  # noise added to the class templates of the synthetic task
DECAY = 0.96  # signal EMA factor (the library's default)


# ===================================================================== models
def conv_bn(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)
    )


class VGG(nn.Module):
    """conv-BN-ReLU stages (2 convs each) with max-pooling, flatten 2x2, fc-ReLU-fc."""

    def __init__(self, w: float = 1.0) -> None:
        super().__init__()
        widths = [int(c * w) for c in (32, 64, 128, 256)]
        layers: list[nn.Module] = []
        cin = 3
        for c in widths:
            layers += [conv_bn(cin, c), nn.ReLU(), conv_bn(c, c), nn.ReLU(), nn.MaxPool2d(2)]
            cin = c
        self.features = nn.Sequential(*layers)  # (N, c, 2, 2)
        self.fc1 = nn.Linear(cin * 4, int(256 * w))
        self.fc2 = nn.Linear(int(256 * w), NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.flatten(self.features(x), 1)
        return self.fc2(F.relu(self.fc1(x)))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = conv_bn(cin, cout, 3, stride), conv_bn(cout, cout, 3)
        project = stride != 1 or cin != cout
        self.down = conv_bn(cin, cout, 1, stride) if project else None

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv2(F.relu(self.conv1(x)))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """CIFAR ResNet-18 layout: 3x3 stem, 4 stages of 2 basic blocks, strides 1-2-2-2."""

    def __init__(self, w: float = 1.0) -> None:
        super().__init__()
        widths = [int(c * w) for c in (16, 32, 64, 128)]
        self.stem = conv_bn(3, widths[0])
        blocks: list[nn.Module] = []
        cin = widths[0]
        for i, c in enumerate(widths):
            blocks += [BasicBlock(cin, c, 1 if i == 0 else 2), BasicBlock(c, c, 1)]
            cin = c
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.blocks(F.relu(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.expand = conv_bn(cin, hidden, 1) if expand != 1 else None
        self.dw = conv_bn(hidden, hidden, 3, stride, groups=hidden)
        self.project = conv_bn(hidden, cout, 1)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        out = x if self.expand is None else F.relu6(self.expand(x))
        out = self.project(F.relu6(self.dw(out)))
        return x + out if self.residual else out


class MobileNetV2(nn.Module):
    """MobileNetV2 (t, c, n, s) layout at width ``0.5 * w``, CIFAR strides (stem stride 1)."""

    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1))
    SETTINGS += ((6, 160, 3, 2), (6, 320, 1, 1))

    def __init__(self, w: float = 1.0) -> None:
        super().__init__()
        mult = 0.5 * w
        cin = int(32 * mult)
        self.stem = conv_bn(3, cin)
        blocks: list[nn.Module] = []
        for t, c, n, s in self.SETTINGS:
            cout = max(8, int(c * mult))
            for i in range(n):
                blocks.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = conv_bn(cin, int(1280 * mult), 1)
        self.fc = nn.Linear(int(1280 * mult), NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu6(self.head(self.blocks(F.relu6(self.stem(x)))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class MLP(nn.Module):
    """512 - 1024 - 1024 - 512 - 10 (ReLU)."""

    def __init__(self, w: float = 1.0) -> None:
        super().__init__()
        h = [int(c * w) for c in (1024, 1024, 512)]
        self.fc1, self.fc2 = nn.Linear(512, h[0]), nn.Linear(h[0], h[1])
        self.fc3, self.out = nn.Linear(h[1], h[2]), nn.Linear(h[2], NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))))
        return self.out(x)


@dataclass(frozen=True)
class Spec:
    build: Callable[[float], nn.Module]
    input_shape: tuple[int, ...]  # one example


MODELS: dict[str, Spec] = {
    "vgg": Spec(VGG, (3, 32, 32)),
    "resnet18": Spec(ResNet18, (3, 32, 32)),
    "mobilenetv2": Spec(MobileNetV2, (3, 32, 32)),
    "mlp": Spec(MLP, (512,)),
}


# ==================================================================== pruning
@dataclass(frozen=True)
class Config:
    """How much work a run does (full or ``--quick``)."""

    width: float  # width multiplier of the networks
    timing_seconds: float  # time spent in the dense network's timed calls, per batch size
    chunks: int  # about this many cost re-evaluations while pruning to the last target
    refresh: int  # Fisher signals are re-gathered every ``refresh`` re-evaluations
    passes: int  # backward passes per gathering
    min_channels: int | float = 1  # floor per mask: a count (int) or a fraction of its channels
    train_steps: int = 150  # SGD steps on the synthetic task before signals are gathered


@dataclass
class Pruned:
    """The shrunk networks of one model, by target, and how pruning went."""

    shrunk: dict[float, nn.Module] = field(default_factory=dict)
    cost_ratio: dict[float, float] = field(default_factory=dict)  # fisherprune's cost model
    prunes: dict[float, int] = field(default_factory=dict)
    kept: dict[float, dict[str, float]] = field(default_factory=dict)  # kept fraction per mask
    seconds: float = 0.0


def task_batch(spec: Spec, n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """``n`` examples of a synthetic 10-class task: a fixed random low-frequency template per
    class (for images, shifted by up to 4 pixels), plus Gaussian noise. Learnable in a few
    hundred steps, so that a briefly trained network has the signals of a trained one."""
    fixed = torch.Generator().manual_seed(7)
    if len(spec.input_shape) == 3:  # images: 4x4 random patterns, upsampled
        coarse = torch.randn(NUM_CLASSES, spec.input_shape[0], 4, 4, generator=fixed)
        templates = F.interpolate(coarse, size=spec.input_shape[1:], mode="bilinear")
    else:
        templates = torch.randn(NUM_CLASSES, *spec.input_shape, generator=fixed)
    y = torch.randint(0, NUM_CLASSES, (n,), generator=gen)
    x = templates[y]
    if x.dim() == 4:
        dy, dx = torch.randint(-4, 5, (2,), generator=gen).tolist()
        x = torch.roll(x, shifts=(dy, dx), dims=(2, 3))
    return x + TASK_NOISE * torch.randn(x.shape, generator=gen), y


def train_briefly(model: nn.Module, spec: Spec, steps: int, gen: torch.Generator) -> float:
    """``steps`` SGD steps on the synthetic task (changes the weights); held-out accuracy."""
    if steps == 0:
        return float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for _ in range(steps):
        x, y = task_batch(spec, TRAIN_BATCH, gen)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        x, y = task_batch(spec, 256, gen)
        return float((model(x).argmax(1) == y).float().mean())


def gather_signals(
    model: nn.Module, masks: dict[str, fp.MaskLayer], spec: Spec, passes: int, gen: torch.Generator
) -> None:
    """``passes`` backward passes on the synthetic task, folded into the masks' Fisher signals."""
    model.train()
    for _ in range(passes):
        x, y = task_batch(spec, SIGNAL_BATCH, gen)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        fp.update_pruning_signals(masks, DECAY)
    model.zero_grad(set_to_none=True)
    model.eval()


def prune_to_targets(
    model: nn.Module,
    spec: Spec,
    signals: str,
    cfg: Config,
    selection: str = "flops",
    round_to: int = 1,
) -> Pruned:
    """Prune ``model`` (masked, in place) to every target in ``TARGETS``; shrink a copy at each.

    ``signals="fisher"``: Fisher signals gathered from backward passes, refreshed as pruning
    goes; ``"random"``: fixed i.i.d. log-normal signals, so that the choice is driven by the
    marginal costs. Channels are zeroed one at a time by ``fisherprune.prune`` (lowest
    ``signal / marginal cost`` first, the cost in the ``selection`` convention: ``flops`` or
    ``memory``); the targets are in FLOPs. With ``round_to > 1`` every mask keeps a multiple
    of ``round_to`` channels (``prune(round_to=...)``). The exact costs are re-evaluated after every
    ``chunk`` prunes, and after every single prune once the estimate reaches the target.
    """
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    x1 = torch.randn(1, *spec.input_shape, generator=gen)
    masks = dict(fp.apply_masks(model, x1))
    cost_model = fp.CostModel(model, x1)
    score_model = cost_model if selection == "flops" else fp.CostModel(model, x1, selection)
    start = cost_model.total()
    if signals == "random":
        for m in masks.values():
            m.collecting = False
            m.signal.copy_(torch.randn(m.num_channels, generator=gen).exp())
    channels = sum(m.num_channels for m in masks.values())
    # prunes per cost evaluation: the same number of channels per evaluation (and so per
    # signal refresh) whatever round_to, a prune removing up to round_to channels
    full_chunk = max(1, round(channels * (1 - min(TARGETS) ** 0.5) / cfg.chunks / round_to))
    chunk = full_chunk
    result = Pruned()
    n = evaluations = 0
    for target in sorted(TARGETS, reverse=True):
        while True:
            report = cost_model.report()
            if report.total <= target * start:
                break
            if signals == "fisher" and evaluations % cfg.refresh == 0:
                gather_signals(model, masks, spec, cfg.passes, gen)
            evaluations += 1
            weigh = report if score_model is cost_model else score_model.report()
            scores = {k: fp.score(m.signal, weigh.marginal[k], "auto") for k, m in masks.items()}
            estimate, stuck = report.total, False
            for _ in range(chunk):
                event = fp.prune(
                    masks, scores, min_channels=cfg.min_channels, cost=report, round_to=round_to
                )
                if event is None:
                    stuck = True
                    break
                n += 1
                estimate -= event.cost_before - event.cost_after
                if estimate <= target * start:
                    chunk = 1  # near the target: re-evaluate after every prune
                    break
            if stuck:
                warnings.warn(f"{signals}: cannot reach {target:.0%} of the FLOPs", stacklevel=1)
                break
        result.shrunk[target] = fp.shrink(model, x1)  # a copy; checks outputs against the masks
        result.cost_ratio[target] = cost_model.total() / start
        result.prunes[target] = n
        result.kept[target] = {k: float(m.mask.mean()) for k, m in masks.items()}
        chunk = full_chunk
    result.seconds = time.perf_counter() - t0
    return result


# ==================================================================== timing
def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def calibrate_calls(
    model: nn.Module, x: Tensor, seconds: float, bounds: tuple[int, int] = (2, 400)
) -> int:
    """How many calls of ``model`` take about ``seconds``, within ``bounds`` (``model`` is in
    eval mode already)."""
    with torch.inference_mode():
        model(x)
        t0 = time.perf_counter()
        model(x)
        one = time.perf_counter() - t0
    return max(bounds[0], min(bounds[1], round(seconds / max(one, 1e-6))))


def time_interleaved(
    models: dict[str, nn.Module], x: Tensor, calls: int
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """The fastest of ``calls`` single calls of each model, the models' calls interleaved
    (``measure_latency(repeats=1, statistic="min")``; the second half in reverse order), and
    the fastest of each half of the calls, for the spread."""
    orders = [models, dict(reversed(models.items()))]
    halves = [
        measure_latency(
            orders[h], x, repeats=1, warmup=2 if h == 0 else 0, rounds=calls // 2, statistic="min"
        )
        for h in range(2)
    ]
    return {n: min(h[n] for h in halves) for n in models}, {
        n: [h[n] for h in halves] for n in models
    }


def spread(dense: list[float], small: list[float]) -> float:
    """Relative spread (max/min - 1) of the speed-ups measured on each half of the calls: a
    noise indicator."""
    ratios = [d / s for d, s in zip(dense, small, strict=True)]
    return max(ratios) / min(ratios) - 1.0


# ====================================================================== main
@dataclass
class Row:
    model: str
    signals: str
    selection: str  # the cost convention signals were weighed against: flops or memory
    round_to: int  # every mask kept a multiple of this many channels (1: any count)
    target: float
    flops_ratio: float
    cost_model_ratio: float
    params_ratio: float
    prunes: int
    kept_min: float
    kept_median: float
    kept_max: float
    kept_per_mask: dict[str, float]
    latency_dense: dict[str, float]
    latency_shrunk: dict[str, float]
    speedup: dict[str, float]
    efficiency: dict[str, float]
    spread: dict[str, float]
    target_met: bool | None  # None: not a conv net, the issue's target does not apply
    # minor page faults per forward pass at the largest batch (getrusage), dense and shrunk
    faults_per_forward: dict[str, float] = field(default_factory=dict)


def faults_per_forward(model: nn.Module, x: Tensor, calls: int = 3) -> float:
    """Minor page faults of this process per forward pass of ``model`` on ``x`` (after one
    warm-up call): near 0 when the allocator reuses freed memory, thousands per pass when
    every activation buffer is mapped afresh."""
    import resource

    with torch.inference_mode():
        model(x)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(calls):
            model(x)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    return (after - before) / calls


def variant(signals: str, selection: str, round_to: int) -> str:
    """How a network was pruned, as the table shows it: ``fisher/flops``, ``fisher/flops/r8``."""
    return f"{signals}/{selection}" + (f"/r{round_to}" if round_to > 1 else "")


def thread_check(model: nn.Module, x: Tensor, threads: int, rounds: int = 5) -> float:
    """Latency with ``threads`` threads over latency with one thread (median of per-round
    ratios, alternating). Below 1 on an idle machine; above 1 when the CPUs are shared and the
    worker threads of each op wait for a CPU, which makes multi-thread timings meaningless."""
    if threads == 1:
        return 1.0
    repeats = calibrate_calls(model, x, 0.05)
    ratios: list[float] = []
    try:
        for _ in range(rounds):
            t: dict[int, float] = {}
            for n in (1, threads):
                torch.set_num_threads(n)
                t[n] = measure_latency({"m": model}, x, repeats=repeats, warmup=1, rounds=1)["m"]
            ratios.append(t[threads] / t[1])
    finally:
        torch.set_num_threads(threads)
    return statistics.median(ratios)


def as_format(x: Tensor, channels_last: bool) -> Tensor:
    """``x`` in channels-last layout when asked and 4-D, else as it is."""
    return to_channels_last(x) if channels_last else x


def _eager(key: str, m: nn.Module, x1: Tensor, channels_last: bool, tmp: Path) -> nn.Module:
    return m


def _frozen_torchscript(
    key: str, m: nn.Module, x1: Tensor, channels_last: bool, tmp: Path
) -> nn.Module:
    """What ``export_model(format="torchscript", freeze=True)`` writes."""
    return frozen_for_serving(m, x1, channels_last and x1.dim() == 4)[0]


def _aoti(key: str, m: nn.Module, x1: Tensor, channels_last: bool, tmp: Path) -> nn.Module:
    """``export_model(format="aoti")`` written to ``tmp`` and loaded back."""
    path = tmp / ("".join(c if c.isalnum() else "_" for c in key) + ".pt2")
    fp.export_model(m, path, x1, format="aoti")
    return load_aoti_export(path)


SERVE_NOTES = {
    "eager": "eager modules",
    "torchscript": "frozen TorchScript",
    "aoti": "AOTInductor packages",
}
#: how the networks are served while timed: (name, module, one example, channels_last, a
#: directory for files) -> what is timed
SERVE: dict[str, Callable[[str, nn.Module, Tensor, bool, Path], nn.Module]] = {
    "eager": _eager,
    "torchscript": _frozen_torchscript,
    "aoti": _aoti,
}


def run_model(
    name: str,
    spec: Spec,
    signal_modes: list[str],
    cfg: Config,
    channels_last: bool = False,
    selections: tuple[str, ...] = ("flops",),
    round_tos: tuple[int, ...] = (1,),
    serve: str = "eager",
) -> tuple[list[Row], dict[str, float], float, float]:
    """Train one network briefly on the synthetic task (``cfg.train_steps``), prune it with each
    signal mode, selection cost and channel rounding, then time the dense network and every
    shrunk one side by side (one interleaved run per batch size), all in channels-last layout
    with ``channels_last``, and all served as ``serve`` says (``SERVE``). Also returns
    the ``thread_check`` of the dense network at the largest batch and the trained network's
    held-out accuracy (NaN without training)."""
    torch.manual_seed(0)
    dense = spec.build(cfg.width)
    pruned: dict[tuple[str, str, int], Pruned] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # pruning is not timed; one thread does not suffer contention
    try:
        accuracy = train_briefly(dense, spec, cfg.train_steps, torch.Generator().manual_seed(1))
        dense.eval()
        for mode in signal_modes:
            for sel in selections:
                for k in round_tos:
                    net = copy.deepcopy(dense)
                    pruned[mode, sel, k] = prune_to_targets(net, spec, mode, cfg, sel, k)
    finally:
        torch.set_num_threads(threads)
    x1 = torch.randn(1, *spec.input_shape)
    f_dense, p_dense = counted_flops(dense, x1), n_params(dense)
    models: dict[str, nn.Module] = {"dense": dense}
    for (mode, sel, k), pr in pruned.items():
        models.update({f"{variant(mode, sel, k)} {t:.0%}": m.eval() for t, m in pr.shrunk.items()})
    if channels_last and len(spec.input_shape) == 3:
        for m in models.values():
            m.to(memory_format=torch.channels_last)  # 4-D weights; FLOPs are counted above
    with tempfile.TemporaryDirectory() as tmp:  # aoti packages live here while timed
        served = {k: SERVE[serve](k, m, x1, channels_last, Path(tmp)) for k, m in models.items()}
        rows, check = _time_rows(
            name, spec, cfg, channels_last, served, pruned, x1, (f_dense, p_dense)
        )
    seconds = {variant(*v): pr.seconds for v, pr in pruned.items()}
    return rows, seconds, check, accuracy


def _time_rows(
    name: str,
    spec: Spec,
    cfg: Config,
    channels_last: bool,
    models: dict[str, nn.Module],
    pruned: dict[tuple[str, str, int], Pruned],
    x1: Tensor,
    dense_size: tuple[float, int],
) -> tuple[list[Row], dict[str, float], float]:
    """Time the served ``models`` (the dense one and every shrunk one); the rows, and the
    ``thread_check`` of the dense one."""
    f_dense, p_dense = dense_size
    lat: dict[int, dict[str, float]] = {}
    halves_lat: dict[int, dict[str, list[float]]] = {}
    for b in BATCHES:
        x = as_format(torch.randn(b, *spec.input_shape), channels_last)
        calls = calibrate_calls(models["dense"], x, cfg.timing_seconds, (20, 1000))
        lat[b], halves_lat[b] = time_interleaved(models, x, calls)
    faults = {n: faults_per_forward(m, x) for n, m in models.items()}  # at the largest batch
    rows = [
        make_row(name, (mode, sel, k), t, small, pr, (f_dense, p_dense), x1, lat, halves_lat)
        for (mode, sel, k), pr in pruned.items()
        for t, small in pr.shrunk.items()
    ]
    for r in rows:
        key = f"{variant(r.signals, r.selection, r.round_to)} {r.target:.0%}"
        r.faults_per_forward = {"dense": faults["dense"], "shrunk": faults[key]}
    x = as_format(torch.randn(BATCHES[-1], *spec.input_shape), channels_last)
    return rows, thread_check(models["dense"], x, torch.get_num_threads())


def make_row(
    name: str,
    how: tuple[str, str, int],
    t: float,
    small: nn.Module,
    pruned: Pruned,
    dense_size: tuple[float, int],
    x1: Tensor,
    lat: dict[int, dict[str, float]],
    halves_lat: dict[int, dict[str, list[float]]],
) -> Row:
    """One table row: a shrunk network (pruned ``how`` = signals, selection, round_to) against
    the dense one (``dense_size`` = its FLOPs and parameters)."""
    mode, sel, k = how
    f_dense, p_dense = dense_size
    key = f"{variant(mode, sel, k)} {t:.0%}"
    fr = counted_flops(small, x1) / f_dense
    speed = {str(b): lat[b]["dense"] / lat[b][key] for b in BATCHES}
    eff = {k: v * fr for k, v in speed.items()}
    kept = sorted(pruned.kept[t].values())
    return Row(
        model=name,
        signals=mode,
        selection=sel,
        round_to=k,
        target=t,
        flops_ratio=fr,
        cost_model_ratio=pruned.cost_ratio[t],
        params_ratio=n_params(small) / p_dense,
        prunes=pruned.prunes[t],
        kept_min=kept[0],
        kept_median=statistics.median(kept),
        kept_max=kept[-1],
        kept_per_mask=pruned.kept[t],
        latency_dense={str(b): lat[b]["dense"] for b in BATCHES},
        latency_shrunk={str(b): lat[b][key] for b in BATCHES},
        speedup=speed,
        efficiency=eff,
        spread={str(b): spread(halves_lat[b]["dense"], halves_lat[b][key]) for b in BATCHES},
        target_met=(eff[str(BATCHES[-1])] >= EFF_TARGET) if name in CONV_NETS else None,
    )


def print_table(rows: list[Row]) -> None:
    b1, b64 = (str(b) for b in BATCHES)
    head = (
        f"{'model':<12}{'signals/sel.':<18}{'target':>7}{'FLOPs':>8}{'params':>8}{'kept/mask':>16}"
        f"{'speed-up':>10}{'speed-up':>10}{'eff':>7}{'eff':>7}{'spread':>8}  target"
    )
    sub = (
        f"{'':<12}{'':<18}{'':>7}{'ratio':>8}{'ratio':>8}{'min/med/max':>16}"
        f"{'b=' + b1:>10}{'b=' + b64:>10}{'b=' + b1:>7}{'b=' + b64:>7}{'b=' + b64:>8}  "
        f"eff>={EFF_TARGET} @b={b64}"
    )
    print(head)
    print(sub)
    print("-" * len(sub))
    for r in rows:
        kept = f"{r.kept_min:.2f}/{r.kept_median:.2f}/{r.kept_max:.2f}"
        met = "n/a (MLP)" if r.target_met is None else ("met" if r.target_met else "NOT met")
        print(
            f"{r.model:<12}{variant(r.signals, r.selection, r.round_to):<18}{r.target:>7.0%}"
            f"{r.flops_ratio:>8.3f}{r.params_ratio:>8.3f}{kept:>16}"
            f"{r.speedup[b1]:>9.2f}x{r.speedup[b64]:>9.2f}x{r.efficiency[b1]:>7.2f}"
            f"{r.efficiency[b64]:>7.2f}{r.spread[b64]:>7.0%}  {met}"
        )


def plot(rows: list[Row], path: Path, threads: int, note: str = "") -> None:
    """Speed-up against FLOPs reduction, with the lines y = x and y = 0.7 x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 5.4))
    colours = dict(zip(MODELS, ("C0", "C1", "C2", "C3"), strict=True))
    markers = {("fisher", "flops", 1): "o", ("fisher", "memory", 1): "D"}
    markers |= {("random", "flops", 1): "^", ("random", "memory", 1): "v"}
    markers |= {("fisher", "flops", 8): "P", ("fisher", "memory", 8): "X"}
    markers |= {("random", "flops", 8): "*", ("random", "memory", 8): "h"}
    top = 1.0
    for r in rows:
        red = 1.0 / r.flops_ratio
        top = max(top, red, *r.speedup.values())
        for b in BATCHES:
            ax.scatter(
                red,
                r.speedup[str(b)],
                marker=markers.get((r.signals, r.selection, r.round_to), "s"),
                s=50,
                facecolors=colours[r.model] if b == BATCHES[-1] else "none",
                edgecolors=colours[r.model],
            )
    xs = [1.0, top * 1.1]
    ax.plot(xs, xs, "k-", lw=1, label="y = x (latency falls as FLOPs do)")
    ax.plot(xs, [EFF_TARGET * v for v in xs], "k--", lw=1, label=f"y = {EFF_TARGET}x (target)")
    for name in sorted({r.model for r in rows}, key=list(MODELS).index):
        ax.scatter([], [], marker="s", color=colours[name], label=name)
    for mode in sorted({(r.signals, r.selection, r.round_to) for r in rows}):
        label = f"{mode[0]} signals / {mode[1]}" + (f" / round to {mode[2]}" * (mode[2] > 1))
        ax.scatter([], [], marker=markers.get(mode, "s"), color="grey", label=label)
    ax.scatter([], [], marker="o", facecolors="none", edgecolors="k", label=f"batch {BATCHES[0]}")
    ax.scatter([], [], marker="o", color="k", label=f"batch {BATCHES[-1]} (filled)")
    ax.set_xlabel("FLOPs reduction (dense / shrunk, FlopCounterMode)")
    ax.set_ylabel("latency speed-up (dense / shrunk, CPU)")
    ax.set_title(
        f"fisherprune.shrink: CPU latency vs FLOPs ({threads} thread{'s' * (threads > 1)})"
        + (f"\n{note}" if note else ""),
        fontsize=10,
    )
    ax.set_xlim(0.9, top * 1.1)
    ax.set_ylim(0, top * 1.1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


FULL = Config(width=1.0, timing_seconds=3.0, chunks=150, refresh=10, passes=2)
QUICK = Config(width=0.5, timing_seconds=0.2, chunks=20, refresh=10, passes=1, train_steps=50)


def _count_or_fraction(text: str) -> int | float:
    """``--min-channels``: an integer count (``3``) or a fraction in (0, 1) (``0.25``)."""
    try:
        value: int | float = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    try:
        check_min_channels(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--quick", action="store_true", help="half-width nets, fewer calls")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument(
        "--signals",
        nargs="*",
        default=None,
        choices=["fisher", "random"],
        help="signal sources to prune with (default: fisher random; quick: fisher)",
    )
    ap.add_argument(
        "--timing-seconds",
        type=float,
        default=None,
        help="seconds of timed calls of the dense network per batch size, the shrunk ones "
        "getting as many calls (default 3; quick 0.2; at least 20 calls, at most 1000)",
    )
    ap.add_argument(
        "--width",
        type=float,
        default=None,
        help="width multiplier of the networks (default 1: VGG 32-256 channels, ResNet-18 "
        "16-128, MobileNetV2 at 0.5x; quick 0.5). 4 gives ResNet-18 its standard 64-512",
    )
    ap.add_argument(
        "--min-channels",
        type=_count_or_fraction,
        default=1,
        help="channels each mask keeps at least: a count (1, default) or a fraction (0.25)",
    )
    ap.add_argument(
        "--train-steps",
        type=int,
        default=None,
        help="SGD steps on the synthetic task before Fisher signals are gathered "
        "(default 150; quick 50; 0: the untrained network)",
    )
    ap.add_argument(
        "--selection",
        nargs="+",
        default=["flops", "memory"],
        choices=["flops", "memory"],
        help="cost each channel's signal is weighed against when choosing: flops (signal per "
        "marginal FLOP) and/or memory (per activation element, Group Fisher Pruning's "
        "memory-normalised selection); the targets are in FLOPs either way (default: both)",
    )
    ap.add_argument(
        "--round-to",
        nargs="+",
        type=int,
        default=[1, 8],
        help="prune with every mask keeping a multiple of this many channels, one row per "
        "value (default: 1 8; 1 = any count; 8 = the AVX2 vector width in float32)",
    )
    add_allocator_option(ap)
    ap.add_argument(
        "--channels-last",
        action="store_true",
        help="time the conv nets (dense and shrunk alike) in channels-last memory layout",
    )
    ap.add_argument(
        "--serve",
        choices=list(SERVE),
        default="eager",
        help="time the modules as they are (eager, default) or, dense and shrunk alike, as "
        "frozen TorchScript: torch.jit.freeze(torch.jit.trace(...)), what "
        "export_model(format='torchscript', freeze=True) writes (batch norm folded into convs), "
        "or as AOTInductor packages: export_model(format='aoti') loaded with load_aoti_export "
        "(compiled ahead of time, batch norm folded, conv nets in channels-last inside; "
        "15-20 s of compiling per network)",
    )
    ap.add_argument("--out", type=Path, default=None, help=f"JSON (default {DEFAULT_OUT})")
    ap.add_argument("--plot", type=Path, default=None, help=f"PNG (default {DEFAULT_PLOT})")
    args = ap.parse_args(argv)
    if args.serve == "aoti" and args.channels_last:
        ap.error(
            "--serve aoti computes the conv nets in channels-last layout already and takes "
            "contiguous inputs; drop --channels-last"
        )
    cfg = QUICK if args.quick else FULL
    if args.timing_seconds is not None:
        if not args.timing_seconds > 0:
            ap.error(f"--timing-seconds must be > 0, got {args.timing_seconds}")
        cfg = dataclasses.replace(cfg, timing_seconds=args.timing_seconds)
    if args.width is not None:
        if not args.width > 0:
            ap.error(f"--width must be > 0, got {args.width}")
        cfg = dataclasses.replace(cfg, width=args.width)
    cfg = dataclasses.replace(cfg, min_channels=args.min_channels)
    if args.train_steps is not None:
        if args.train_steps < 0:
            ap.error("--train-steps must be >= 0")
        cfg = dataclasses.replace(cfg, train_steps=args.train_steps)
    signal_modes = args.signals or (["fisher"] if args.quick else ["fisher", "random"])
    selections = tuple(args.selection)
    if min(args.round_to) < 1:
        ap.error("--round-to values must be >= 1")
    round_tos = tuple(dict.fromkeys(args.round_to))
    if args.quick:  # a quick run does not overwrite the full run's results
        args.out = args.out or QUICK_OUT.with_suffix(".json")
        args.plot = args.plot or QUICK_OUT.with_suffix(".png")
    args.out, args.plot = args.out or DEFAULT_OUT, args.plot or DEFAULT_PLOT
    torch.set_num_threads(args.threads)
    with contextlib.suppress(RuntimeError):  # already set in this process
        torch.set_num_interop_threads(1)
    logging.getLogger("fisherprune").setLevel(logging.ERROR)
    retained, alloc_note = apply_allocator(args.allocator)
    layout = "channels-last" if args.channels_last or args.serve == "aoti" else "contiguous (NCHW)"
    serve_note = SERVE_NOTES[args.serve]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    rows: list[Row] = []
    prune_seconds: dict[str, dict[str, float]] = {}
    checks: dict[str, float] = {}
    accuracy: dict[str, float] = {}
    for name in args.models:
        print(f"{name}: pruning and timing...", file=sys.stderr, flush=True)
        r, secs, checks[name], accuracy[name] = run_model(
            name,
            MODELS[name],
            signal_modes,
            cfg,
            args.channels_last,
            selections,
            round_tos,
            args.serve,
        )
        rows += r
        prune_seconds[name] = secs
    load_after = os.getloadavg()
    print(
        f"\nfisherprune.shrink latency, torch {torch.__version__}, {args.threads} threads, "
        f"{'quick' if args.quick else 'full'} run (fastest of interleaved calls), "
        f"{time.perf_counter() - t0:.0f} s; load average before {load_before[0]:.2f}, "
        f"after {load_after[0]:.2f} ({os.cpu_count()} CPUs); {layout} layout; {alloc_note}; "
        f"{serve_note}"
    )
    print_table(rows)
    if cfg.train_steps:
        print(
            f"\nafter {cfg.train_steps} training steps, held-out accuracy on the synthetic task: "
            + ", ".join(f"{n} {a:.2f}" for n, a in accuracy.items())
        )
    print(
        "\neff = speed-up / FLOPs reduction = speed-up x FLOPs ratio; spread = max/min - 1 of "
        "the speed-ups at batch 64 from each half of the calls (noise).\nkept/mask: the kept "
        "fraction of each mask's channels (min/median/max over masks)."
    )
    if args.threads > 1:
        print(
            f"thread check (dense, batch {BATCHES[-1]}): latency with {args.threads} threads / "
            "with 1 thread: " + ", ".join(f"{n} {v:.2f}" for n, v in checks.items())
        )
        if max(checks.values()) > 1.0:
            print(
                f"WARNING: {args.threads} threads are slower than 1 on this machine now: the CPUs "
                "are shared and each op's worker threads wait for a CPU, so latency follows the "
                "number of ops, not FLOPs. These figures are not meaningful; rerun with "
                "--threads 1 or on a quiet machine."
            )
    if max(load_before[0], load_after[0]) > args.threads:
        print(
            "NOTE: the load average exceeded the thread count: other processes shared the CPUs; "
            "ratios are side by side, but expect noise (see spread)."
        )
    result: dict[str, Any] = {
        "benchmark": "export_speed",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "fisherprune": fp.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": args.threads,
        "quick": args.quick,
        "memory_format": "channels_last"
        if args.channels_last or args.serve == "aoti"
        else "contiguous",
        "serve": args.serve,
        "allocator": "retain_freed_memory" if retained else "default",
        "config": asdict(cfg),
        "batches": list(BATCHES),
        "targets": list(TARGETS),
        "efficiency_target": EFF_TARGET,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "thread_check": checks,
        "task_accuracy_after_training": accuracy,
        "pruning": {
            "method": "fisherprune.prune on signal / exact marginal cost ('auto'; the cost in "
            f"FLOPs or activation elements: selection {list(selections)}; every mask kept at a "
            f"multiple of round_to {list(round_tos)}), FLOPs targets, costs "
            f"re-evaluated about {cfg.chunks} times; fisher: Fisher signals of the network "
            f"trained {cfg.train_steps} SGD steps on a synthetic 10-class task, from "
            f"{cfg.passes} backward pass(es) on {SIGNAL_BATCH}-example batches of it every "
            f"{cfg.refresh} re-evaluations (decay {DECAY}); random: i.i.d. log-normal signals",
            "seconds": prune_seconds,
        },
        "rows": [asdict(r) for r in rows],
    }
    write_json(args.out, result)
    contended = args.threads > 1 and max(checks.values()) > 1.0
    note = f"{layout}, {alloc_note}, {serve_note}"
    if contended:
        note += "; CONTENDED: more threads were slower than 1; not meaningful"
    plot(rows, args.plot, args.threads, note)
    print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
