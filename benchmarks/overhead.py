"""Training-step overhead of fisherprune's masks and Fisher signal, measured side by side.

What is measured
----------------
Wall-clock time of one training step -- ``zero_grad``, forward, cross-entropy loss,
``loss.backward()``, ``optimizer.step()`` (SGD, momentum 0.9) -- at batch 64 on CPU, for two
small models fed synthetic data of the right shape:

* ``mlp``: 784-512-256-10, a MaskLayer after each hidden ReLU;
* ``cnn``: 1x28x28 input, conv16-BN-ReLU-maxpool-mask, conv32-BN-ReLU-maxpool-mask, flatten,
  fc (the "small CNN, ~10 ms per step" of docs ENV.md). Each mask sits after the pool, on the
  smallest tensor its channels pass through, which is where ``apply_masks`` puts it (at the
  input of the next conv / of the flatten into fc) and where the MaskLayer docs advise placing
  one by hand;
* ``cnn_prepool`` (no target): the same CNN with each mask before the pool instead
  (conv-BN-ReLU-mask-maxpool). A 0/1 channel mask commutes with max pooling, so the signal and
  every channel's cost are the same (tests/test_signals.py checks both); only the collecting
  work grows with the 4x larger tensor. It shows what a less careful placement costs;
* ``cnn_digits`` (no target, not run by default): ``fisherprune train``'s built-in CNN on
  digits (1x8x8, default width), every mask ``apply_masks`` finds: ``c`` and ``f`` are its
  fine-tuning step masked (``--fine_tune_masked``) and shrunk (the default),

* ``lstm`` (no target, not run by default): ``LSTMTagger``, a 2-layer bidirectional
  ``nn.LSTM`` of 128 units over 100 steps at batch 32, every mask ``apply_masks`` finds (the
  width it reads, its hidden units). Its ``b`` runs the layer step by step, the mask on each
  step's state (``fisherprune.masks.recurrent_units``), in place of the fused kernel; ``c``
  folds the removed units into the weights and runs the fused kernel again,

each in the four variants of the issue, plus one to read them by:

* ``a`` plain: the same network without any MaskLayer (the reference);
* ``b`` collecting: MaskLayers with ``collecting = True``; each step also calls
  ``fisherprune.update_pruning_signals(masks, decay)``, so the per-example mask gradient is
  gathered inside the ordinary backward and folded into the signal EMA;
* ``c`` pruned: MaskLayers with half of each mask's channels zeroed and ``collecting = False``
  (pruning is over; masks only multiply, no signal work);
* ``d`` naive: the ordinary step of ``c`` with all-ones masks, plus the same signal computed the
  textbook way: per-example gradients of the loss with respect to the masks by
  ``torch.func.vmap(torch.func.grad(...))`` over ``functional_call``, then
  ``Delta = 1/2 * mean_n g^2`` folded into the EMA. BatchNorm is evaluated with its running
  statistics (eval mode) inside this per-example pass: in train mode the examples of a batch
  interact through the batch statistics, so "the gradient of one example's loss" is not defined;
* ``f`` (no target) ``c``'s model shrunk in place, as ``fisherprune.shrink(model,
  inplace=True, optimizer=opt)`` leaves a finished run to train on: masks that cost nothing
  once pruned (issue 30), and a step cheaper than ``a``'s by what the pruning saved;
* ``e`` (no target) all-ones MaskLayers with ``collecting = False``: such a mask returns its
  input unchanged, so ``e`` differs from ``a`` only by two module calls; its distance from 1.0 is
  a measure of this run's noise floor. In ``cnn_prepool``, ``c`` differs from ``a`` in its data
  as well: zeroed channels make some CPU kernels faster (``max_pool2d_with_indices`` has a
  data-dependent inner loop and was measured ~30% faster on half-zero input), which can hide the
  multiply's cost; in ``cnn`` the masks come after the pools, so that effect is absent.

Before timing, a check computes the signal of one batch both ways (fisherprune's in-backward
estimate and the ``vmap`` estimate, both models in eval mode so that they are the same function)
and stops if they disagree: ``d`` is a baseline for the same quantity, not a different one.

Method: ``torch.set_num_threads`` is pinned (``--threads``); every variant is warmed up; then,
for each model, ``--rounds`` rounds each run a block of ``--steps`` steps of every variant, in
round-robin order (rotated every round), with the garbage collector off inside a block. Each step
is timed on its own and a block is summarised by its median step, so a stall caused by another
process on this shared 2-core machine (seen here: single steps 10-30x slower) does not swamp the
block. A variant's figure is the median over rounds of its block medians; its ratio is that over
the plain variant's figure from the same run (``paired`` is the median over rounds of the
per-round ratio, a check against drift). The issue's targets on the CNN are ``b/a <= 1.10`` and
``c/a <= 1.02``; whether each is met is printed and stored as measured, with a 95% bootstrap
interval over rounds (when it spans the limit, the run cannot tell) and the number of rounds in
which Linux PSI saw other tasks waiting for a CPU (above 20% of rounds the verdict is flagged
unreliable). ``--wait-quiet SECONDS`` first waits for the machine to go quiet.

Standard sizes (issue 20): ``resnet50`` (224x224), ``bert_base`` (12 blocks, d 768, 12 heads,
128 tokens) and ``vit_b16`` (197 tokens), each with every mask ``apply_masks`` finds (heads,
MLP units and the hidden width on the encoders), at batch 16, timed in 6 rounds of one step
after one warm-up step, the naive baseline included. The variant ``c`` of these nets is what a
finished run trains: its masks fold into the conv / linear weights and its norms normalise the
kept channels once (``fisherprune.masks.norm_points``).

Run ``python benchmarks/overhead.py`` (the small models: about 4 minutes on a quiet machine),
``python benchmarks/overhead.py --standard`` (the standard-size nets alone, written to
``benchmarks/results/overhead_standard.json``: about 16 minutes on a quiet 2-core machine with
the default 2 threads, 11 without the naive baseline, ``--no-naive``), or ``--quick`` (well
under a minute); the table is printed and the JSON written to ``--out`` (default
``benchmarks/results/overhead.json``).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import matplotlib
import standard_nets as sn
import torch
import torch.nn.functional as F
from _common import add_allocator_option, apply_allocator, machine_info, write_json
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import fisherprune
from fisherprune import MaskLayer
from fisherprune.train.models import build_model

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the headless backend

BATCH = 64
NUM_CLASSES = 10
DECAY = 0.96
LR = 0.01
MOMENTUM = 0.9
NUM_BATCHES = 4  # distinct synthetic batches cycled through
SIGNAL_RTOL = 1e-3  # relative agreement required between the in-backward and vmap signals
QUIET_PSI = 5.0  # --wait-quiet: start once PSI cpu "some" avg10 and avg60 are below this (%)
MAX_STALL = 0.10  # a round in which tasks waited for a CPU more than this share is "contended"
MAX_CONTENDED_ROUNDS = 0.20  # a verdict is unreliable above this share of contended rounds
STANDARD = ("resnet50", "bert_base", "vit_b16")
TARGETS: tuple[tuple[str, str, float], ...] = (
    ("cnn", "b", 1.10),
    ("cnn", "c", 1.02),
    *((name, "b", 1.05) for name in STANDARD),
    *((name, "c", 1.01) for name in STANDARD),
)
MEMORY_TARGET = 1.10  # peak memory of a collecting step over a plain one
VARIANTS: dict[str, str] = {
    "a": "plain (no masks)",
    "b": "masks, collecting",
    "c": "masks, pruned 50%, not collecting",
    "d": "naive per-example (vmap)",
    "e": "masks all ones, not collecting (info)",
    "f": "pruned 50%, then shrunk in place (shrink(inplace=True, optimizer=))",
}
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "overhead.json"
STANDARD_OUT = DEFAULT_OUT.with_name("overhead_standard.json")

StepFn = Callable[[Tensor, Tensor], None]
#: ``make_step``'s signature: a model and optional hooks after backward / after the step
StepBuilder = Callable[..., StepFn]
InputFn = Callable[[int, torch.Generator], Tensor]


# ------------------------------------------------------------------ models
def build_mlp(masked: bool) -> nn.Sequential:
    """784-512-256-10 MLP; with ``masked`` a MaskLayer follows each hidden ReLU."""
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(784, 512), nn.ReLU()]
    if masked:
        layers.append(MaskLayer(512))
    layers += [nn.Linear(512, 256), nn.ReLU()]
    if masked:
        layers.append(MaskLayer(256))
    layers.append(nn.Linear(256, NUM_CLASSES))
    return nn.Sequential(*layers)


def _cnn(masked: bool, mask_before_pool: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for c_in, c_out in ((1, 16), (16, 32)):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]
        if masked and mask_before_pool:
            layers.append(MaskLayer(c_out))
        layers.append(nn.MaxPool2d(2))  # (N, C, 28, 28) -> (N, C, 14, 14) -> (N, C, 7, 7)
        if masked and not mask_before_pool:
            layers.append(MaskLayer(c_out))
    layers += [nn.Flatten(), nn.Linear(32 * 7 * 7, NUM_CLASSES)]
    return nn.Sequential(*layers)


def build_cnn(masked: bool) -> nn.Sequential:
    """conv16-BN-ReLU-pool-[mask], conv32-BN-ReLU-pool-[mask], fc; input (N, 1, 28, 28)."""
    return _cnn(masked, mask_before_pool=False)


def build_cnn_prepool(masked: bool) -> nn.Sequential:
    """conv16-BN-ReLU-[mask]-pool, conv32-BN-ReLU-[mask]-pool, fc: masks on the larger tensor."""
    return _cnn(masked, mask_before_pool=True)


class LSTMTagger(nn.Module):
    """Sequences of 100 steps of 64 features: a linear layer with ReLU (128 units, the width
    the LSTM reads), a 2-layer bidirectional ``nn.LSTM`` of 128 hidden units, a classifier on
    the outputs' mean over the steps."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 128)
        self.rnn = nn.LSTM(128, 128, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(256, NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(torch.relu(self.inp(x)))[0].mean(1))


def _images(batch: int, gen: torch.Generator) -> Tensor:
    return torch.randn(batch, 3, 224, 224, generator=gen)


def _tokens(batch: int, gen: torch.Generator) -> Tensor:
    return torch.randint(0, 30522, (batch, 128), generator=gen)


def found_masks(build: Callable[[], nn.Module], make_input: InputFn) -> Callable[[bool], nn.Module]:
    """A builder whose masked model has every mask ``apply_masks`` finds."""

    def masked_or_plain(masked: bool) -> nn.Module:
        model = build()
        if masked:
            fisherprune.apply_masks(model, make_input(1, torch.Generator().manual_seed(2)))
        return model

    return masked_or_plain


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    build: Callable[[bool], nn.Module]
    make_input: InputFn  # (batch, generator) -> a batch of inputs
    batch: int = BATCH
    standard: bool = False  # a standard-size network: fewer rounds and steps (see parse_args)


def _vectors(shape: tuple[int, ...]) -> InputFn:
    return lambda batch, gen: torch.randn((batch, *shape), generator=gen)


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec("mlp", "784-512-ReLU-mask-256-ReLU-mask-10", build_mlp, _vectors((784,))),
    "cnn": ModelSpec(
        "cnn",
        "1x28x28: conv16-BN-ReLU-pool-mask, conv32-BN-ReLU-pool-mask, fc10",
        build_cnn,
        _vectors((1, 28, 28)),
    ),
    "cnn_prepool": ModelSpec(
        "cnn_prepool",
        "1x28x28: conv16-BN-ReLU-mask-pool, conv32-BN-ReLU-mask-pool, fc10",
        build_cnn_prepool,
        _vectors((1, 28, 28)),
    ),
    "cnn_digits": ModelSpec(
        "cnn_digits",
        "fisherprune train's built-in CNN on digits (1x8x8, default width), every mask "
        "apply_masks finds: c / f are its fine-tuning step masked (--fine_tune_masked) / shrunk",
        found_masks(lambda: build_model("cnn", (1, 8, 8), NUM_CLASSES), _vectors((1, 8, 8))),
        _vectors((1, 8, 8)),
    ),
    "lstm": ModelSpec(
        "lstm",
        "LSTMTagger: 100 steps of 64 features, linear 128-ReLU, 2-layer bidirectional LSTM of "
        "128 units, classifier; every mask apply_masks finds (the width it reads, its units)",
        found_masks(LSTMTagger, _vectors((100, 64))),
        _vectors((100, 64)),
        batch=32,
    ),
    "resnet50": ModelSpec(
        "resnet50",
        "ResNet-50, 3x224x224, every mask apply_masks finds",
        found_masks(sn.build_resnet50, _images),
        _images,
        batch=16,
        standard=True,
    ),
    "bert_base": ModelSpec(
        "bert_base",
        "BERT-base-sized encoder (12 x post-LN, d 768, 12 heads, MLP 3072), 128 tokens, every "
        "mask apply_masks finds (heads, MLP units, hidden width)",
        found_masks(sn.build_bert_base, _tokens),
        _tokens,
        batch=16,
        standard=True,
    ),
    "vit_b16": ModelSpec(
        "vit_b16",
        "ViT-B/16-sized encoder (12 x pre-LN, d 768, 12 heads, MLP 3072), 3x224x224 (197 "
        "tokens), every mask apply_masks finds (heads, MLP units, hidden width)",
        found_masks(sn.build_vit_b16, _images),
        _images,
        batch=16,
        standard=True,
    ),
}


def make_model(spec: ModelSpec, masked: bool) -> nn.Module:
    """The same initial weights for every variant (MaskLayers hold no parameters)."""
    torch.manual_seed(0)
    return spec.build(masked)


def make_batches(spec: ModelSpec, count: int, batch: int) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (
            spec.make_input(batch, gen),
            torch.randint(0, NUM_CLASSES, (batch,), generator=gen),
        )
        for _ in range(count)
    ]


# ------------------------------------------------------------------ naive signal
class PerExampleSignal:
    """``Delta_k = 1/2 * mean_n g[n, k]^2`` from per-example mask gradients by vmap(grad(...)).

    The model's masks must not be collecting (``_MaskMultiply`` has no vmap rule); each mask
    buffer is swapped for a differentiated input through ``functional_call``.
    """

    def __init__(self, model: nn.Module, masks: dict[str, MaskLayer]) -> None:
        self.model = model
        self.masks = masks
        self.mask_keys = {name: f"{name}.mask" for name in masks}
        self.has_batchnorm = any(
            isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()
        )
        self._per_example_grad = vmap(grad(self._loss_one), in_dims=(None, None, 0, 0))

    def _loss_one(
        self, mask_values: dict[str, Tensor], rest: dict[str, Tensor], x: Tensor, y: Tensor
    ) -> Tensor:
        out = functional_call(self.model, {**rest, **mask_values}, (x.unsqueeze(0),))
        return F.cross_entropy(out, y.unsqueeze(0))

    def estimate(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """Per mask name, the batch estimate of shape (C,)."""
        mask_keys = set(self.mask_keys.values())
        state = {
            k: v.detach()
            for k, v in (*self.model.named_parameters(), *self.model.named_buffers())
            if k not in mask_keys
        }
        mask_values = {key: self.masks[name].mask for name, key in self.mask_keys.items()}
        was_training = self.model.training
        if self.has_batchnorm:
            self.model.eval()  # BN from running statistics: see the module docstring
        try:
            g = self._per_example_grad(mask_values, state, x, y)  # {key: (N, C)}
        finally:
            self.model.train(was_training)
        return {name: 0.5 * g[key].pow(2).mean(0) for name, key in self.mask_keys.items()}

    def update(self, x: Tensor, y: Tensor, decay: float) -> None:
        """Fold this batch's estimate into each ``mask.signal`` (same EMA as fisherprune)."""
        with torch.no_grad():
            for name, est in self.estimate(x, y).items():
                self.masks[name].signal.mul_(decay).add_(est, alpha=1.0 - decay)


def check_signal(spec: ModelSpec) -> dict[str, Any]:
    """Compare fisherprune's in-backward estimate with the vmap one on one batch (eval mode;
    a batch of 4 on the standard-size networks)."""
    model = make_model(spec, masked=True).eval()
    masks = fisherprune.find_masks(model)
    x, y = make_batches(spec, 1, 4 if spec.standard else spec.batch)[0]
    F.cross_entropy(model(x), y).backward()
    fisherprune.update_pruning_signals(masks, decay=0.0)  # signal = this batch's estimate
    ours = {n: m.signal.clone() for n, m in masks.items()}
    for m in masks.values():
        m.collecting = False
    naive = PerExampleSignal(model, masks).estimate(x, y)
    worst = 0.0
    for n in masks:
        scale = float(naive[n].abs().max().clamp_min(1e-30))
        worst = max(worst, float((ours[n] - naive[n]).abs().max()) / scale)
    return {"max_rel_diff": worst, "rtol": SIGNAL_RTOL, "ok": worst <= SIGNAL_RTOL}


# ------------------------------------------------------------------ variants
def make_step(
    model: nn.Module,
    after_backward: Callable[[Tensor, Tensor], None] | None = None,
    after_step: Callable[[], None] | None = None,
) -> StepFn:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    model.train()

    def step(x: Tensor, y: Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if after_backward is not None:
            after_backward(x, y)
        opt.step()
        if after_step is not None:
            after_step()

    return step


def _plain(spec: ModelSpec, decay: float, make_step: StepBuilder = make_step) -> StepFn:
    return make_step(make_model(spec, masked=False))


def _collecting(spec: ModelSpec, decay: float, make_step: StepBuilder = make_step) -> StepFn:
    model = make_model(spec, masked=True)
    masks = fisherprune.find_masks(model)
    return make_step(model, after_step=lambda: fisherprune.update_pruning_signals(masks, decay))


def _finished(spec: ModelSpec, decay: float, make_step: StepBuilder = make_step) -> StepFn:
    model = make_model(spec, masked=True)
    with torch.no_grad():
        for m in fisherprune.find_masks(model).values():
            m.mask[: m.num_channels // 2] = 0.0
            m.collecting = False
    return make_step(model)


def _shrunk(spec: ModelSpec, decay: float, make_step: StepBuilder = make_step) -> StepFn:
    """``c``'s model shrunk in place once pruning is over, as ``fisherprune.shrink(model,
    inplace=True, optimizer=opt)`` leaves it for the rest of training (the optimizer is built
    on the shrunk parameters here; the carried state makes no difference to a step's time)."""
    model = make_model(spec, masked=True)
    with torch.no_grad():
        for m in fisherprune.find_masks(model).values():
            m.mask[: m.num_channels // 2] = 0.0
            m.collecting = False
    # on the model's device: shrink runs the masked and the shrunk model on it (gpu.py builds
    # the variants on a GPU, where a CPU example fails the first layer)
    device = next(model.parameters()).device
    example = make_batches(spec, 1, 1)[0][0].to(device)
    fisherprune.shrink(model, example, inplace=True)
    return make_step(model)


def _naive(spec: ModelSpec, decay: float, make_step: StepBuilder = make_step) -> StepFn:
    model = make_model(spec, masked=True)
    masks = fisherprune.find_masks(model)
    for m in masks.values():
        m.collecting = False
    per_example = PerExampleSignal(model, masks)
    return make_step(model, after_backward=lambda x, y: per_example.update(x, y, decay))


def _all_ones(spec: ModelSpec, decay: float, make_step: StepBuilder = make_step) -> StepFn:
    model = make_model(spec, masked=True)
    for m in fisherprune.find_masks(model).values():
        m.collecting = False
    return make_step(model)


#: how each variant's step is built (a fresh model each, with the same initial weights), by
#: ``make_step`` or another step builder given as third argument (``gpu.py``: mixed precision)
VARIANT_STEPS: dict[str, Callable[..., StepFn]] = {
    "a": _plain,
    "b": _collecting,
    "c": _finished,
    "d": _naive,
    "e": _all_ones,
    "f": _shrunk,
}


def make_variants(spec: ModelSpec, decay: float, naive: bool) -> dict[str, StepFn]:
    """Every variant's step; ``naive`` False leaves out ``d``."""
    return {k: build(spec, decay) for k, build in VARIANT_STEPS.items() if naive or k != "d"}


# ------------------------------------------------------------------ timing
def time_block(
    step: StepFn, batches: Sequence[tuple[Tensor, Tensor]], steps: int
) -> tuple[list[float], list[float]]:
    """Wall-clock ms and this process's CPU ms of each of ``steps`` consecutive steps, garbage
    collector off. CPU time does not count the time spent waiting for a CPU that another
    process holds, so on a shared machine its ratios are the steadier ones (with one thread;
    with several, threads spinning at a barrier count too)."""
    gc.collect()
    gc.disable()
    wall: list[float] = []
    cpu: list[float] = []
    try:
        for i in range(steps):
            x, y = batches[i % len(batches)]
            t0, c0 = time.perf_counter(), time.process_time()
            step(x, y)
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
    finally:
        gc.enable()
    return wall, cpu


@dataclass(frozen=True)
class Schedule:
    """How one model is timed: rounds of blocks of ``steps`` steps at batch ``batch``."""

    rounds: int
    steps: int
    warmup: int
    batch: int


def schedule(spec: ModelSpec, args: argparse.Namespace) -> Schedule:
    """The small models' schedule from ``--rounds/--steps/--warmup``, the standard-size
    ones' from ``--std-rounds/--std-steps/--std-warmup/--std-batch``."""
    if spec.standard:
        return Schedule(args.std_rounds, args.std_steps, args.std_warmup, args.std_batch)
    return Schedule(args.rounds, args.steps, args.warmup, spec.batch)


@dataclass
class ModelResult:
    spec: ModelSpec
    sched: Schedule
    # variant -> one entry per round: the median / the mean of that block's per-step ms
    times: dict[str, list[float]] = field(default_factory=dict)
    means: dict[str, list[float]] = field(default_factory=dict)
    round_stall: list[float | None] = field(default_factory=list)  # CPU contention per round
    cpu: dict[str, list[float]] = field(default_factory=dict)  # as ``times``, in CPU ms

    def cpu_ratio(self, v: str) -> float:
        """The median CPU ms of ``v`` over the plain variant's."""
        return statistics.median(self.cpu[v]) / statistics.median(self.cpu["a"])

    def median(self, v: str) -> float:
        return statistics.median(self.times[v])

    def ratio(self, v: str) -> float:
        return self.median(v) / self.median("a")

    def paired_ratio(self, v: str) -> float:
        return statistics.median(t / a for t, a in zip(self.times[v], self.times["a"], strict=True))

    def contended_rounds(self) -> int:
        """Rounds in which tasks waited for a CPU more than ``MAX_STALL`` of the time."""
        return sum(1 for st in self.round_stall if st is not None and st > MAX_STALL)

    def ratio_ci(self, v: str, resamples: int = 2000) -> tuple[float, float]:
        """95% bootstrap interval of ``ratio(v)``, resampling whole rounds (keeps pairing)."""
        rng = random.Random(0)
        n = len(self.times["a"])
        ratios = []
        for _ in range(resamples):
            idx = [rng.randrange(n) for _ in range(n)]
            num = statistics.median(self.times[v][i] for i in idx)
            ratios.append(num / statistics.median(self.times["a"][i] for i in idx))
        ratios.sort()
        return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def run_model(spec: ModelSpec, args: argparse.Namespace) -> ModelResult:
    variants = make_variants(spec, DECAY, naive=not (spec.standard and args.no_naive))
    sched = schedule(spec, args)
    batches = make_batches(spec, NUM_BATCHES, sched.batch)
    for step in variants.values():
        time_block(step, batches, sched.warmup)
    keys = list(variants)
    result = ModelResult(spec, sched, {k: [] for k in keys}, {k: [] for k in keys})
    for r in range(sched.rounds):
        shift = r % len(keys)
        stall_start, t0 = cpu_stall_us(), time.perf_counter()
        for k in keys[shift:] + keys[:shift]:
            block, cpu = time_block(variants[k], batches, sched.steps)
            result.times[k].append(statistics.median(block))
            result.means[k].append(statistics.fmean(block))
            result.cpu.setdefault(k, []).append(statistics.median(cpu))
        result.round_stall.append(
            stall_fraction(stall_start, cpu_stall_us(), time.perf_counter() - t0)
        )
        if sys.stderr.isatty():
            print(f"  {spec.name}: round {r + 1}/{sched.rounds}", file=sys.stderr, end="\r")
    if sys.stderr.isatty():
        print(file=sys.stderr)
    return result


# ------------------------------------------------------------------ report
def quartiles(xs: Sequence[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def print_table(results: Sequence[ModelResult]) -> None:
    header = (
        f"{'model':<11} {'variant':<42} {'ms/step':>8} {'IQR ms':>13} {'ratio':>6} "
        f"{'95% CI':>13} {'paired':>7} {'cpu':>6}"
    )
    print(header)
    print("-" * len(header))
    for res in results:
        for v, label in VARIANTS.items():
            if v not in res.times:
                continue
            q1, q3 = quartiles(res.times[v])
            lo, hi = res.ratio_ci(v)
            print(
                f"{res.spec.name:<11} {f'({v}) {label}':<42} {res.median(v):>8.3f} "
                f"{f'{q1:.2f}-{q3:.2f}':>13} {res.ratio(v):>6.3f} {f'{lo:.3f}-{hi:.3f}':>13} "
                f"{res.paired_ratio(v):>7.3f} {res.cpu_ratio(v):>6.3f}"
            )


def evaluate_targets(results: Sequence[ModelResult]) -> list[dict[str, Any]]:
    """Each target's measured ratio, its 95% interval over rounds, and whether it is met.

    ``met`` compares the point estimate with the limit. ``resolved`` says whether the whole
    interval lies on one side of the limit (otherwise the run cannot tell). ``reliable`` is
    False when more than ``MAX_CONTENDED_ROUNDS`` of the model's rounds had CPU contention.
    """
    by_name = {r.spec.name: r for r in results}
    out = []
    for model, variant, limit in TARGETS:
        if model not in by_name:
            continue
        res = by_name[model]
        value = res.ratio(variant)
        lo, hi = res.ratio_ci(variant)
        contended = res.contended_rounds()
        out.append(
            {
                "model": model,
                "ratio": f"{variant}/a",
                "limit": limit,
                "value": value,
                "ci95": [lo, hi],
                "paired_value": res.paired_ratio(variant),
                "cpu_value": res.cpu_ratio(variant),
                "met": value <= limit,
                "resolved": hi <= limit or lo > limit,
                "contended_rounds": contended,
                "reliable": contended <= MAX_CONTENDED_ROUNDS * len(res.round_stall),
            }
        )
    return out


def verdict(t: dict[str, Any]) -> str:
    text = "met" if t["met"] else "MISSED"
    if not t["resolved"]:
        text += " (within noise: the 95% interval spans the limit)"
    if not t["reliable"]:
        text += f" (unreliable: {t['contended_rounds']} rounds with CPU contention; rerun)"
    return text


def count_masks(spec: ModelSpec) -> dict[str, int]:
    """How many masks (channel groups) and mask channels the masked model has."""
    masks = fisherprune.find_masks(make_model(spec, masked=True))
    return {"masks": len(masks), "channels": sum(m.num_channels for m in masks.values())}


def plot(results: Sequence[ModelResult], path: Path) -> None:
    """Each model's collecting (b), finished (c) and all-ones (e) ratio to the plain step with
    its 95% interval, the targets as ticks."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.25
    for j, v in enumerate(("b", "c", "e")):
        xs, ys, errs = [], [], []
        for i, res in enumerate(results):
            lo, hi = res.ratio_ci(v)
            xs.append(i + (j - 1) * width)
            ys.append(res.ratio(v))
            errs.append((res.ratio(v) - lo, hi - res.ratio(v)))
        ax.bar(xs, ys, width, yerr=list(zip(*errs, strict=True)), label=f"({v}) {VARIANTS[v]}")
    for model, variant, limit in TARGETS:
        names = [r.spec.name for r in results]
        if model in names:
            x = names.index(model) + (-1 if variant == "b" else 0) * width
            ax.plot([x - width / 2, x + width / 2], [limit, limit], "k-", lw=1.5)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(results)), [r.spec.name for r in results])
    ax.set_ylabel("step time / plain step")
    ax.set_ylim(0.8, max(1.3, *(r.ratio(v) for r in results for v in "bce")) + 0.05)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def cpu_pressure() -> tuple[float, float, int] | None:
    """Linux PSI for the CPU: (% of the last 10 s, of the last 60 s, total us) some task waited."""
    try:
        first = Path("/proc/pressure/cpu").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    fields = dict(item.split("=", 1) for item in first[1:])  # avg10=.. avg60=.. total=..
    return float(fields["avg10"]), float(fields["avg60"]), int(fields["total"])


def cpu_stall_us() -> int | None:
    pressure = cpu_pressure()
    return None if pressure is None else pressure[2]


def stall_fraction(stall_start: int | None, stall_end: int | None, seconds: float) -> float | None:
    if stall_start is None or stall_end is None or seconds <= 0:
        return None
    return (stall_end - stall_start) / (seconds * 1e6)


def wait_for_quiet(max_seconds: float) -> float:
    """Wait (at most ``max_seconds``) until CPU pressure over the last 10 s and 60 s is low."""
    waited = 0.0
    while waited < max_seconds:
        pressure = cpu_pressure()
        if pressure is None or max(pressure[:2]) < QUIET_PSI:
            break
        if waited == 0.0:
            print(f"waiting up to {max_seconds:.0f} s for a quiet CPU ...", file=sys.stderr)
        time.sleep(5.0)
        waited += 5.0
    if max_seconds > 0:
        state = "still busy, timing anyway" if waited >= max_seconds else "quiet"
        print(f"waited {waited:.0f} s for a quiet CPU: {state}", file=sys.stderr)
    return waited


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--rounds", type=int, default=None, help="round-robin rounds (default 40)")
    p.add_argument("--steps", type=int, default=None, help="steps per timed block (default 25)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per variant (def. 30)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="small models 8 rounds x 10 steps, 10 warm-up; standard-size ones 3 rounds x 1 "
        "step at batch 4, 1 warm-up, no naive baseline",
    )
    p.add_argument("--std-rounds", type=int, default=None, help="standard-size rounds (def. 6)")
    p.add_argument("--std-steps", type=int, default=None, help="standard-size steps per block (1)")
    p.add_argument("--std-warmup", type=int, default=None, help="standard-size warm-up steps (1)")
    p.add_argument("--std-batch", type=int, default=None, help="standard-size batch (16)")
    p.add_argument(
        "--no-naive",
        action="store_true",
        help="skip the naive per-example baseline on the standard-size models (--quick does)",
    )
    p.add_argument(
        "--models",
        nargs="+",
        choices=sorted(MODELS),
        default=["mlp", "cnn", "cnn_prepool"],
        help=f"models to run (default: the small ones; the standard sizes are {STANDARD})",
    )
    p.add_argument(
        "--standard",
        action="store_true",
        help=f"run the standard-size models {STANDARD} only (instead of --models), to "
        f"{STANDARD_OUT.name} unless --out says otherwise",
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="first wait up to this long for other processes to leave the CPU (default 0)",
    )
    add_allocator_option(p, default="glibc-default")
    p.add_argument("--out", type=Path, default=None, help=f"JSON output path ({DEFAULT_OUT.name})")
    args = p.parse_args(argv)
    if args.standard:
        args.models = list(STANDARD)
    if args.out is None:
        args.out = STANDARD_OUT if args.standard else DEFAULT_OUT
    defaults = (8, 10, 10, 3, 1, 1, 4) if args.quick else (40, 25, 30, 6, 1, 1, 16)
    names = ("rounds", "steps", "warmup", "std_rounds", "std_steps", "std_warmup", "std_batch")
    for name, default in zip(names, defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.no_naive = args.no_naive or args.quick
    for name in ("threads", "rounds", "steps", "std_rounds", "std_steps", "std_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.warmup, args.std_warmup) < 0:
        p.error("--warmup and --std-warmup must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    _, allocator = apply_allocator(args.allocator)
    started = time.perf_counter()
    load_start = load_average()
    specs = [MODELS[m] for m in args.models]

    checks = {  # the baseline's check, where the baseline is timed
        spec.name: check_signal(spec) for spec in specs if not (spec.standard and args.no_naive)
    }
    for name, chk in checks.items():
        if not chk["ok"]:
            print(
                f"{name}: the vmap signal differs from fisherprune's by {chk['max_rel_diff']:.2e} "
                f"(> {SIGNAL_RTOL}); the naive baseline is wrong, not timing it",
                file=sys.stderr,
            )
            return 1

    waited = wait_for_quiet(args.wait_quiet)
    stall_start, timing_start = cpu_stall_us(), time.perf_counter()
    results = [run_model(spec, args) for spec in specs]
    stall = stall_fraction(stall_start, cpu_stall_us(), time.perf_counter() - timing_start)
    print(
        f"\nfisherprune {fisherprune.__version__}, torch {torch.__version__}, "
        f"{args.threads} threads; small models batch {BATCH}, {args.rounds} rounds x "
        f"{args.steps} steps; standard-size ones batch {args.std_batch}, {args.std_rounds} "
        f"rounds x {args.std_steps} steps (ms/step: median over rounds of each block's median "
        "step; ratio = ms/step over (a)'s; paired = median of per-round ratios; cpu = the "
        "same ratio in process CPU time)"
    )
    print_table(results)
    if stall is not None:
        rounds = ", ".join(
            f"{res.spec.name} {res.contended_rounds()}/{len(res.round_stall)}" for res in results
        )
        print(
            f"CPU contention (Linux PSI): some task waited for a CPU {stall:.0%} of the timing "
            f"time; rounds with more than {MAX_STALL:.0%}: {rounds}"
        )
    targets = evaluate_targets(results)
    if targets:
        print()
    for t in targets:
        lo, hi = t["ci95"]
        print(
            f"target {t['model']} {t['ratio']} <= {t['limit']:.2f}: {t['value']:.3f} "
            f"[95% CI {lo:.3f}-{hi:.3f}, paired {t['paired_value']:.3f}, CPU time "
            f"{t['cpu_value']:.3f}] -> {verdict(t)}"
        )

    payload: dict[str, Any] = {
        "benchmark": "overhead",
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "fisherprune_version": fisherprune.__version__,
        "torch_version": torch.__version__,
        "threads": args.threads,
        "quick": args.quick,
        "machine": machine_info(),
        "load_average_start": load_start,
        "load_average_end": load_average(),
        "cpu_stall_fraction": stall,
        "waited_for_quiet_s": waited,
        "settings": {
            "batch": BATCH,
            "rounds": args.rounds,
            "steps_per_block": args.steps,
            "warmup_steps": args.warmup,
            "standard_size": {
                "batch": args.std_batch,
                "rounds": args.std_rounds,
                "steps_per_block": args.std_steps,
                "warmup_steps": args.std_warmup,
                "naive": not args.no_naive,
            },
            "allocator": allocator,
            "quick": args.quick,
            "decay": DECAY,
            "optimizer": f"SGD(lr={LR}, momentum={MOMENTUM})",
        },
        "variants": VARIANTS,
        "signal_check": checks,
        "models": {
            res.spec.name: {
                "architecture": res.spec.description,
                "batch": res.sched.batch,
                "masks": count_masks(res.spec),
                "round_cpu_stall_fraction": res.round_stall,
                "variants": {
                    v: {
                        "median_ms": res.median(v),
                        "quartiles_ms": list(quartiles(res.times[v])),
                        "ratio_to_a": res.ratio(v),
                        "paired_ratio_to_a": res.paired_ratio(v),
                        "ratio_ci95": list(res.ratio_ci(v)),
                        "per_round_median_ms": res.times[v],
                        "per_round_mean_ms": res.means[v],
                        "cpu_ratio_to_a": res.cpu_ratio(v),
                        "per_round_median_cpu_ms": res.cpu[v],
                    }
                    for v in VARIANTS
                    if v in res.times
                },
            }
            for res in results
        },
        "targets": targets,
        "elapsed_s": time.perf_counter() - started,
    }
    write_json(args.out, payload)
    plot(results, args.out.with_suffix(".png"))
    print(f"\nwrote {args.out} and its plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
