"""One-shot pruning defaults (issue 31): ``fisherprune.prune_to_target`` with every argument at
its default, on trained networks that no test or other benchmark uses, against the settings
it had before (one scoring, no cap) and against other criteria under the same defaults.

Suite (trained here, seeded, a few seconds to a minute each on 2 cores):

* ``resnet18``: torchvision ResNet-18's shape at small widths (a 3x3 stem, four stages of two
  basic residual blocks with batch norm, widths 8-16-32-64, stride 2 from the second stage,
  global average pool, a linear head) on scikit-learn's digits upsampled to 16x16;
* ``mobilenetv3``: MobileNetV3-Small's shape at small widths (a hardswish stem, inverted
  residual blocks: 1x1 expansion, depthwise 3x3, squeeze-and-excitation with a hardsigmoid
  gate, 1x1 projection, ReLU then hardswish, a 1x1 head conv and a linear classifier) on the
  same images;
* ``mlp_digits`` and ``mlp_cancer``: MLPs (three hidden layers with batch norm, ReLU) on
  scikit-learn's tables: digits read as 64 pixel columns, and the breast-cancer table
  (30 columns, standardised);
* ``lstm_rows``: a bidirectional ``nn.LSTM`` reading each digit's 8 rows as a sequence
  (``LSTMRows``; the width it reads and its hidden units are prunable).

* ``minilm`` and ``decoder_lm`` (``one_shot_text.py``): the pretrained MiniLM sentence encoder
  (quality: cosine similarity of its embeddings to the dense model's on held-out sentences) and
  a character-level decoder trained here on Python's documentation (quality: held-out
  perplexity, lower is better), with ``TEXT_METHODS`` only.

Each network is trained once per seed (the seed also picks the 8 calibration batches of 64 and
the random criterion's stream), then pruned from a copy to 70%, 50% and 30% of its FLOPs with
no fine-tuning, the least-squares repair on. Methods: ``fisher`` (every argument at its
default: ``criterion="auto"``, which is ``fisher_mean``'s ``FisherMean()`` with the repair,
``rounds="auto", round_cap=0.25``), ``fisher_plain`` (the same with the seed's Fisher signal,
``criterion="fisher"``: the default before; every ``fisher_*`` ablation of the settings
below keeps that criterion, as they were measured), ``fisher_one_scoring`` (``rounds=1,
round_cap=1``: the defaults before issue 31), ``fisher_cap_only`` (``rounds=1,
round_cap=0.5``), ``fisher_cap50`` (``round_cap=0.5``), ``fisher_cap10`` (``round_cap=0.1``),
``fisher_cap_pace`` and ``taylor_cap_pace`` (``round_cap=1 - sqrt(ROUND_RATIO)``, 0.106: the
pace of thinning every mask alike to one goal), ``fisher_rescore`` (``rescore_at_cap=True``:
a round ends when its first mask reaches the cap, the signals re-measured before the next),
``fisher_floor`` and ``fisher_floor75`` (``floor_power=1`` and ``0.75``: no mask below
``(target / start) ** p`` of its width over all rounds), ``fisher_rescore_floor``
(``rescore_at_cap=True, floor_power=1``: re-scoring that cannot drain a mask),
``fisher_rescore_min25`` (``rescore_at_cap=True, min_channels=0.25``: the same with a floor
that does not follow the target),
``fisher_rounds_only`` (``round_cap=1``),
``fisher_rounds8`` (``rounds=8, round_cap=1``), ``fisher_root`` (the defaults with the Fisher
signal's square root as importance: ``PowerFisher(0.5)``), ``fisher_pow67`` (its power 2/3:
a cost exponent of 1.5), ``fisher_repair`` (the defaults with ``FisherRepair``: the signal
times the share of each channel the repair cannot rebuild from the others, ``fisher_repair.py``),
``fisher_joint`` (the defaults with ``FisherJoint``, ``fisher_joint.py``: each channel scores
the increment of the joint Fisher loss of its group's lowest channels), ``fisher_joint_own``
(``FisherJoint(at_least_own=True)``: never below the channel's own signal), ``fisher_mean``
(``FisherMean(joint="none")``: the Fisher signal of replacing each channel by its calibration
mean, as the repair's refit bias does), ``fisher_joint_mean`` (``FisherMean(joint="all")``:
``fisher_joint_own``'s increments of the mean-replaced gradients), ``fisher_coupled``
(``FisherCoupled``, ``fisher_coupled.py``: ``fisher_joint_own``'s increments on masks read by
more than one layer, the plain signal elsewhere), ``fisher_coupled_mean`` (``FisherMean()``:
the same with the mean-replaced signal; ``prune_to_target``'s default criterion since issue
31, so the same cells as ``fisher``; its rows were measured with the benchmark's first version
of it, whose scores equal the library's to about 1e-7), ``fisher_no_norms``
(``recalibrate_norms=False``: every round's signals measured with the dense batch-norm
statistics, the default before), ``fisher_label_free`` (``loss_fn=None``: the Fisher of
labels sampled from the model, not the data's), ``fisher_expected``
(``loss_fn=LabelFreeLoss(labels="expected")``: the same with the expectation over the model's
labels through one random direction per example; classifiers only, so not run on ``minilm``),
``optimizer_one_shot`` (``PruningOptimizer``
with ``lr=0``, one prune per calibration batch, then the same repair: ``optimizer_cell``), and
``l1``,
``taylor``, ``random`` at the defaults. Each cell records test accuracy, the channels kept per
mask, the smallest kept fraction, the rounds run and its wall time, and (image and table rows)
the test rows it gets wrong and its test cross-entropy, for paired comparisons.

``python benchmarks/one_shot_defaults.py [--quick] [--seeds 3] [--nets ...]`` writes
``benchmarks/results/one_shot_defaults.json`` (``_quick`` with ``--quick``: one seed, 50%
only) and ``docs/one_shot_defaults.png``, and prints the table. On 2 cores, run two
processes of one thread with ``--nets`` split between them and ``--out`` apart, then
``--combine`` their files (``benchmarks/run_all`` does).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from sklearn.datasets import load_breast_cancer, load_digits
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.calibrate import LabelFreeLoss, repair_consumers
from fisherprune.calibrate.to_target import REPAIR_FLOPS, ROUND_RATIO
from fisherprune.criteria import Fisher, FisherMean, Random
from fisherprune.modes import eval_mode
from fisherprune.train.models import BasicBlock  # the trainer's own block, same layout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, write_json
from fisher_coupled import FisherCoupled
from fisher_joint import FisherJoint
from fisher_repair import FisherRepair
from one_shot_text import TEXT_NETS, cache_dir, log_cell, result_fields, text_rows
from paired import Paired, paired
from standard_nets import InvertedResidual

ROOT = Path(__file__).resolve().parent.parent
TARGETS = (0.7, 0.5, 0.3)
CALIBRATION_BATCHES, BATCH = 8, 64


# ----------------------------------------------------------------------------- networks
class ResNet18(nn.Module):
    """torchvision ResNet-18's layout (2-2-2-2 basic blocks) for small images."""

    def __init__(self, widths: tuple[int, ...] = (8, 16, 32, 64), classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
            cin = w
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


class SqueezeExcite(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(c, max(8, c // 4), 1)
        self.expand = nn.Conv2d(max(8, c // 4), c, 1)

    def forward(self, x: Tensor) -> Tensor:
        s = F.hardsigmoid(self.expand(F.relu(self.reduce(x.mean((2, 3), keepdim=True)))))
        return x * s


#: MobileNetV3-Small's blocks at half width: (hidden, out, SE, hardswish, stride)
MOBILENET_BLOCKS = (
    (16, 16, True, False, 2),
    (36, 24, False, False, 2),
    (44, 24, False, False, 1),
    (48, 40, True, True, 2),
    (120, 40, True, True, 1),
    (60, 48, True, True, 1),
)


class MobileNetV3(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish()
        )
        blocks, cin = [], 16
        for hidden, cout, se, hs, stride in MOBILENET_BLOCKS:
            blocks.append(InvertedResidual(cin, (3, hidden, cout, se, hs, stride), SqueezeExcite))
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(
            nn.Conv2d(cin, 144, 1, bias=False), nn.BatchNorm2d(144), nn.Hardswish()
        )
        self.classifier = nn.Sequential(
            nn.Linear(144, 256), nn.Hardswish(), nn.Linear(256, classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.head(self.blocks(self.stem(x))).mean((2, 3)))


class ConvNeXtV2(nn.Module):
    """Hugging Face's ConvNeXt-V2 (its blocks' MLP units pass a global response norm), built
    from a config for 16x16 digits, two stages of two blocks (24 and 48 channels); returns the
    logits. Needs ``transformers``."""

    def __init__(self) -> None:
        super().__init__()
        import transformers  # (optional: only this network needs it)

        config = transformers.ConvNextV2Config(
            num_channels=1,
            patch_size=2,
            num_stages=2,
            hidden_sizes=[24, 48],
            depths=[2, 2],
            num_labels=10,
        )
        self.net = transformers.ConvNextV2ForImageClassification(config)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(pixel_values=x).logits


class LSTMRows(nn.Module):
    """A bidirectional LSTM reading a digit's 8 rows as 8 steps: each row embedded by a linear
    layer with ReLU (64 units: the width the LSTM reads), 64 hidden units, the LSTM's outputs
    averaged over the steps, a linear head."""

    def __init__(self, width: int = 64, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(8, width), nn.ReLU())
        self.rnn = nn.LSTM(width, hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, 10)

    def forward(self, x: Tensor) -> Tensor:  # (N, 8 rows, 8 pixels)
        out, _ = self.rnn(self.embed(x))
        return self.head(out.mean(1))


def mlp(features: int, classes: int, width: int = 256) -> nn.Module:
    layers: list[nn.Module] = []
    for w in (width, width, width // 2):
        layers += [nn.Linear(features, w), nn.BatchNorm1d(w), nn.ReLU()]
        features = w
    return nn.Sequential(*layers, nn.Linear(features, classes))


# --------------------------------------------------------------------------------- data
@dataclass
class Split:
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor


def _split(x: Tensor, y: Tensor, test: float = 0.3) -> Split:
    """One fixed shuffle (seed 0) for every seed: the networks differ, the test set does not."""
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    n = round(len(y) * (1 - test))
    return Split(x[:n], y[:n], x[n:], y[n:])


def digits_images() -> Split:
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    x = F.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False)
    return _split((x - 0.3) / 0.4, torch.tensor(d.target))


def digits_table() -> Split:
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0  # (N, 64)
    return _split((x - x.mean(0)) / (x.std(0) + 1e-3), torch.tensor(d.target))


def digits_rows() -> Split:
    """Digits as sequences: 8 steps (rows) of 8 pixels, standardised."""
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32) / 16.0  # (N, 8, 8)
    return _split((x - 0.3) / 0.4, torch.tensor(d.target))


def cancer_table() -> Split:
    d = load_breast_cancer()
    x = torch.tensor(d.data, dtype=torch.float32)  # (N, 30)
    return _split((x - x.mean(0)) / x.std(0), torch.tensor(d.target))


@dataclass
class Net:
    build: Callable[[], nn.Module]
    data: Callable[[], Split]
    steps: int
    lr: float


NETS: dict[str, Net] = {
    "resnet18": Net(ResNet18, digits_images, 200, 0.05),
    "mobilenetv3": Net(MobileNetV3, digits_images, 400, 0.05),
    "mlp_digits": Net(lambda: mlp(64, 10), digits_table, 300, 0.05),
    "mlp_cancer": Net(lambda: mlp(30, 2, 128), cancer_table, 200, 0.02),
    "convnextv2": Net(ConvNeXtV2, digits_images, 1000, 0.01),  # (SGD at 0.05 diverged)
    "lstm_rows": Net(LSTMRows, digits_rows, 1500, 0.2),
}


def cached_train(name: str, split: Split, seed: int) -> nn.Module:
    """``train(NETS[name], split, seed)``, kept in ``cache_dir()`` (not in the repository)
    under its name, seed, steps and learning rate (training is deterministic on one thread)."""
    net = NETS[name]
    path = cache_dir() / f"{name}_s{seed}_{net.steps}_{net.lr}.pt"
    if path.exists():
        model = net.build()
        model.load_state_dict(torch.load(path))
        return model.eval()
    model = train(net, split, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return model


def train(net: Net, split: Split, seed: int) -> nn.Module:
    """SGD with momentum and a cosine schedule, batch 64, seeded."""
    torch.manual_seed(seed)
    model = net.build()
    opt = torch.optim.SGD(model.parameters(), lr=net.lr, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, net.steps)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(net.steps):
        i = torch.randint(0, len(split.y_train), (BATCH,), generator=g)
        loss = F.cross_entropy(model(split.x_train[i]), split.y_train[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model.eval()


def calibration_batches(split: Split, seed: int) -> list[tuple[Tensor, Tensor]]:
    """The calibration data of ``seed``: ``CALIBRATION_BATCHES`` batches of ``BATCH`` training
    examples with their labels, drawn without replacement by a generator seeded ``1000 + seed``."""
    g = torch.Generator().manual_seed(1000 + seed)
    pick = torch.randperm(len(split.y_train), generator=g)[: CALIBRATION_BATCHES * BATCH]
    return [
        (split.x_train[pick[i : i + BATCH]], split.y_train[pick[i : i + BATCH]])
        for i in range(0, len(pick), BATCH)
    ]


@torch.no_grad()
def accuracy(model: nn.Module, split: Split) -> float:
    model.eval()
    return float((model(split.x_test).argmax(1) == split.y_test).double().mean())


@torch.no_grad()
def test_errors(model: nn.Module, split: Split, dense: Tensor | None = None) -> dict[str, Any]:
    """The test rows ``model`` gets wrong (their indices, to compare two models' rows side by
    side), its mean test cross-entropy and, given the ``dense`` network's test logits, the
    mean KL divergence of ``model``'s predicted class distribution from the dense one's
    (``test_kl``, nats per test row: how far the prune moved the function, whatever the
    labels say)."""
    model.eval()
    logits = model(split.x_test)
    wrong = torch.nonzero(logits.argmax(1) != split.y_test).flatten()
    out = {"wrong": wrong.tolist(), "test_loss": float(F.cross_entropy(logits, split.y_test))}
    if dense is not None:
        kl = F.kl_div(
            logits.log_softmax(1), dense.log_softmax(1), reduction="batchmean", log_target=True
        )
        out["test_kl"] = float(kl)
    return out


# ------------------------------------------------------------------------------ methods
class PowerFisher(Fisher):
    """A power ``p`` of the Fisher signal as importance: with ``flops_weight="auto"`` its
    score ``s ** p / c`` ranks channels as ``s / c ** (1 / p)``, a cost exponent ``1 / p``.
    ``p = 1/2`` (``fisher_root``: the root-mean-square mask gradient, weighed against the cost
    in a gradient's units, as Taylor's ``mean |g|`` is) helps the CNNs at 30% of the FLOPs and
    hurts the decoder LM at every target; ``p = 2/3`` (``fisher_pow67``, cost exponent 1.5)
    lies between. Candidate defaults (issue 31), not library criteria."""

    def __init__(self, power: float) -> None:
        super().__init__()
        self.power = power

    def importance(self, masks: Any, model: nn.Module) -> dict[str, Tensor]:
        return {n: m.signal.clamp_min(0.0) ** self.power for n, m in masks.items()}


OLD = {"rounds": 1, "round_cap": 1.0}
#: the uniform pace of one goal: every mask thinned alike to ``ROUND_RATIO`` of the cost of a
#: layer between two of them (a candidate default, not adopted: it costs the MiniLM)
PACE = {"round_cap": 1 - math.sqrt(ROUND_RATIO)}


def plain(**settings: Any) -> Callable[[int], dict[str, Any]]:
    """Settings with the seed's Fisher signal as the criterion (the default before
    ``fisher_mean``: the ablations below were measured against it)."""
    return lambda seed: {"criterion": "fisher", **settings}


METHODS: dict[str, Callable[[int], dict[str, Any]]] = {
    "fisher": lambda seed: {},
    "fisher_plain": plain(),
    "fisher_one_scoring": plain(**OLD),
    "fisher_cap_only": plain(rounds=1, round_cap=0.5),
    "fisher_cap50": plain(round_cap=0.5),
    "fisher_cap10": plain(round_cap=0.1),
    "fisher_cap_pace": plain(**PACE),
    "fisher_rescore": plain(rescore_at_cap=True),
    "fisher_floor": plain(floor_power=1.0),
    "fisher_floor75": plain(floor_power=0.75),
    "fisher_rescore_floor": plain(rescore_at_cap=True, floor_power=1.0),
    "fisher_rescore_min25": plain(rescore_at_cap=True, min_channels=0.25),
    "fisher_rounds_only": plain(round_cap=1.0),
    "fisher_rounds8": plain(rounds=8, round_cap=1.0),
    "fisher_root": lambda seed: {"criterion": PowerFisher(0.5)},
    "fisher_pow67": lambda seed: {"criterion": PowerFisher(2 / 3)},
    "fisher_repair": lambda seed: {"criterion": FisherRepair()},
    "fisher_joint": lambda seed: {"criterion": FisherJoint()},
    "fisher_joint_own": lambda seed: {"criterion": FisherJoint(at_least_own=True)},
    "fisher_mean": lambda seed: {"criterion": FisherMean(joint="none")},
    "fisher_coupled": lambda seed: {"criterion": FisherCoupled()},
    "fisher_coupled_mean": lambda seed: {"criterion": FisherMean()},
    "fisher_joint_mean": lambda seed: {"criterion": FisherMean(joint="all")},
    "fisher_no_norms": plain(recalibrate_norms=False),
    "fisher_label_free": lambda seed: {"criterion": "fisher", "loss_fn": None, "seed": seed},
    "fisher_expected": lambda seed: {
        "criterion": "fisher",
        "loss_fn": LabelFreeLoss(seed=seed, labels="expected"),
    },
    "optimizer_one_shot": lambda seed: {"optimizer": True},
    "l1": lambda seed: {"criterion": "l1"},
    "taylor": lambda seed: {"criterion": "taylor"},
    "taylor_cap_pace": lambda seed: {"criterion": "taylor", **PACE},
    "random": lambda seed: {"criterion": Random(seed)},
}
#: the methods a verdict ranks Fisher among (issue 31: Fisher with repair against L1, Taylor
#: and random, each with repair, all at the defaults); the other rows are Fisher's ablations
RIVALS = ("fisher", "l1", "taylor", "random")
#: the methods of the text rows (a MiniLM cell takes tens of seconds: no ablations there)
TEXT_METHODS = (
    "fisher",
    "fisher_plain",
    "fisher_expected",
    "fisher_cap_pace",
    "fisher_rescore",
    "fisher_rescore_floor",
    "fisher_rescore_min25",
    "fisher_root",
    "fisher_pow67",
    "fisher_repair",
    "fisher_joint",
    "fisher_joint_own",
    "fisher_mean",
    "fisher_coupled",
    "fisher_coupled_mean",
    "fisher_joint_mean",
    "l1",
    "taylor",
    "taylor_cap_pace",
    "random",
)
#: text methods run on some of the text networks only: ``fisher_expected`` on ``decoder_lm``
#: (``minilm``'s loss is the regression one, which ``labels="expected"`` leaves as it was)
TEXT_ONLY: dict[str, tuple[str, ...]] = {"fisher_expected": ("decoder_lm",)}
ACCURACY = "test accuracy"


def quality(row: dict[str, Any]) -> float:
    """The number a row is ranked by (rows before the text rows carry ``accuracy`` only)."""
    return row.get("quality", row.get("accuracy"))


#: the most calibration batches ``optimizer_cell`` feeds (one prune each) before giving up
OPTIMIZER_STEPS = 3000


def optimizer_cell(model: nn.Module, split: Split, batches: list, target: float) -> Any:
    """``PruningOptimizer`` used one-shot (issue 31, point 3): ``lr=0``, one prune per
    calibration batch (the batches cycled), each batch's Fisher signal folded into the running
    estimate before the next removal, in eval mode; then the repair ``prune_to_target`` runs
    at its defaults, against the dense masks. Changes ``model``; returns a record with the
    ``PruneResult`` fields ``result_fields`` reads (``rounds``: the prunes made)."""
    started = time.perf_counter()
    fp.apply_masks(model, split.x_train[:2])
    masks = fp.find_masks(model)
    dense = {n: m.mask.detach().clone() for n, m in masks.items()}
    opt = fp.PruningOptimizer(model, split.x_train[:2], lr=0.0, momentum=0.0, prune_every=1,
                              flops_target=target)  # fmt: skip
    start, steps = opt.cost().total, 0
    with eval_mode(model):
        while not opt.finished and steps < OPTIMIZER_STEPS:
            xb, yb = batches[steps % len(batches)]
            opt.minimize(F.cross_entropy(model(xb), yb))
            steps += 1
    after = opt.cost().total
    selected = time.perf_counter()
    if not opt.finished:
        warnings.warn(f"optimizer_one_shot stopped after {steps} prunes, unfinished", stacklevel=2)
    repair_consumers(model, batches, dense, budget=REPAIR_FLOPS / start)
    kept = {n: (m.kept, m.num_channels) for n, m in masks.items()}
    return argparse.Namespace(
        ratio=after / start,
        rounds=steps,
        seconds=time.perf_counter() - started,
        phase_seconds={"optimizer": selected - started, "repair": time.perf_counter() - selected},
        kept=kept,
        min_kept_fraction=min(k / n for k, n in kept.values()),
        at_floor=[n for n, (k, _) in kept.items() if k == 1],
    )


def cell(
    trained: nn.Module, split: Split, batches: list, target: float, settings: dict[str, Any]
) -> dict[str, Any]:
    """Prune a copy of ``trained`` to ``target`` with ``settings``; accuracy, widths, time."""
    with torch.no_grad():
        dense = trained.eval()(split.x_test)
    model = copy.deepcopy(trained)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if settings.get("optimizer"):
            result = optimizer_cell(model, split, batches, target)
        else:
            settings = {"loss_fn": F.cross_entropy, **settings}  # None: label-free
            result = fp.prune_to_target(model, split.x_train[:2], batches, target, **settings)
    acc = accuracy(model, split)
    return {
        "accuracy": acc,
        "quality": acc,
        "metric": ACCURACY,
        "higher_is_better": True,
        **test_errors(model, split, dense),
        **result_fields(result, caught),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    trained_seconds: dict[str, list[float]] = {}
    for name in (n for n in args.nets if n in NETS):
        net = NETS[name]
        split = net.data()
        for seed in range(args.first_seed, args.seeds):
            t0 = time.perf_counter()
            trained = cached_train(name, split, seed)
            trained_seconds.setdefault(name, []).append(time.perf_counter() - t0)
            dense = accuracy(trained, split)
            dense_loss = test_errors(trained, split)["test_loss"]
            batches = calibration_batches(split, seed)
            for target in args.targets:
                for method in args.methods:
                    r = cell(trained, split, batches, target, METHODS[method](seed))
                    rows.append(
                        {"net": name, "seed": seed, "target": target, "method": method,
                         "dense": dense, "dense_test_loss": dense_loss,
                         "test_examples": len(split.y_test), **r}
                    )  # fmt: skip
                    log_cell(name, seed, target, method, "acc", r["accuracy"], dense, r)
    text = [n for n in args.nets if n in TEXT_NETS]
    details: dict[str, Any] = {}
    for name in text:
        methods = {m: METHODS[m] for m in args.methods
                   if m in TEXT_METHODS and name in TEXT_ONLY.get(m, (name,))}  # fmt: skip
        seeds = range(args.first_seed, args.seeds)
        part = text_rows([name], seeds, args.targets, methods, _log_text)
        rows += part["rows"]
        trained_seconds.update(part["train_seconds"])
        details.update(part["details"])
    if text:
        return {"rows": rows, "train_seconds": trained_seconds, "details": details}
    return {"rows": rows, "train_seconds": trained_seconds}


def _log_text(name: str, seed: int, target: float, method: str, r: dict[str, Any], dense: float):
    log_cell(name, seed, target, method, "quality", r["quality"], dense, r)


# ------------------------------------------------------------------------------- report
def summary(
    rows: list[dict[str, Any]],
    nets: Sequence[str] = (*NETS, *TEXT_NETS),
    methods: Sequence[str] = tuple(METHODS),
) -> list[dict[str, Any]]:
    """Mean, sd, and mean seconds per (net, target, method), in the order of ``nets``, of
    the targets from the largest and of ``methods`` (another benchmark passes its own)."""
    cells: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    nets, methods = list(nets), list(methods)
    order = sorted(
        rows, key=lambda r: (nets.index(r["net"]), -r["target"], methods.index(r["method"]))
    )
    for r in order:
        cells.setdefault((r["net"], r["target"], r["method"]), []).append(r)
    out = []
    for (net, target, method), rs in cells.items():
        acc = [quality(r) for r in rs]
        out.append(
            {
                "net": net,
                "target": target,
                "method": method,
                "metric": rs[0].get("metric", ACCURACY),
                "higher_is_better": rs[0].get("higher_is_better", True),
                "dense": statistics.mean(r["dense"] for r in rs),
                "test_examples": rs[0].get("test_examples"),
                "mean": statistics.mean(acc),
                "sd": statistics.stdev(acc) if len(acc) > 1 else 0.0,
                "min_kept_fraction": min(r["min_kept_fraction"] for r in rs),
                "rounds": statistics.mean(r["rounds"] for r in rs),
                "seconds": statistics.mean(r["seconds"] for r in rs),
                "seeds": len(rs),
                "by_seed": {str(r["seed"]): quality(r) for r in rs},
                "dense_by_seed": {str(r["seed"]): r["dense"] for r in rs},
                **_errors(rs),
            }
        )
    return out


def _errors(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean test cross-entropy of a cell's ``rs``, its value by seed and the dense
    network's by seed, and the mean KL divergence from the dense network and its value by
    seed, each when every row has it (rows measured before it was recorded have not; each row
    keeps its wrong test rows)."""
    out: dict[str, Any] = {}
    for key, by_seed in (("test_loss", "loss_by_seed"), ("test_kl", "kl_by_seed")):
        if all(key in r for r in rs):
            out[key] = statistics.mean(r[key] for r in rs)
            out[by_seed] = {str(r["seed"]): r[key] for r in rs}
    dense = {str(r["seed"]): r["dense_test_loss"] for r in rs if "dense_test_loss" in r}
    if "test_loss" in out and len(dense) == len(rs):
        out["dense_loss_by_seed"] = dense
    return out


def _standing(vs: dict[str, Paired], rivals: Sequence[str]) -> str:
    """Fisher's rank among ``rivals`` from its paired comparisons ``vs`` (first, within noise,
    or BEHIND the rivals whose interval lies wholly on their side), each non-random rival's
    comparison, and where it stands against random."""
    beaten_by = sorted((m for m in vs if m in rivals and vs[m].mean < 0),
                       key=lambda m: vs[m].mean)  # fmt: skip
    behind = [m for m in beaten_by if vs[m].verdict == "behind"]
    text = f"BEHIND {', '.join(behind)}" if behind else "within noise" if beaten_by else "first"
    text += "".join(f"; vs {m} {vs[m]}" for m in rivals if m in vs and m != "random")
    if "random" in vs:
        on_random = {"ahead": "ahead of random", "behind": "BEHIND random"}
        text += f"; {on_random.get(vs['random'].verdict, 'NOT ahead of random (within noise)')}"
        text += f" ({vs['random']})"
    return text


#: the continuous qualities (lower is better) a verdict also ranks on where fisher and a rival
#: recorded them by seed: (``summary``'s key of the values by seed, of their mean, their name)
CONTINUOUS = (
    ("loss_by_seed", "test_loss", "test cross-entropy"),
    ("kl_by_seed", "test_kl", "KL divergence from the dense network"),
)


def _on_continuous(every: dict[str, dict[str, Any]], rivals: Sequence[str]) -> str:
    """The same standing on each of ``CONTINUOUS`` where fisher and its rivals recorded it by
    seed: qualities that tell apart what the accuracy of a few hundred test rows (steps of
    1/171 on mlp_cancer) cannot, the KL divergence even where no method lost any accuracy or
    loss against the dense network (it measures how far each prune moved the function); ""
    where they did not. On the cross-entropy the line says when random is not measurably
    above the dense network's."""
    text = ""
    for by_seed, mean, name in CONTINUOUS:
        f = every["fisher"].get(by_seed)
        others = {m: every[m][by_seed] for m in rivals
                  if m != "fisher" and by_seed in every.get(m, {})}  # fmt: skip
        if f is None or not others:
            continue
        vs = {m: paired(f, b, higher_is_better=False) for m, b in others.items()}
        text += f". On {name} {every['fisher'][mean]:.4g}: {_standing(vs, rivals)}"
        random = every.get("random", {})
        if by_seed == "loss_by_seed" and "dense_loss_by_seed" in random:
            loss = paired(random["loss_by_seed"], random["dense_loss_by_seed"], False)
            if loss.verdict != "behind":
                text += f"; random not measurably above dense ({loss})"
    return text


def verdicts(cells: list[dict[str, Any]], rivals: Sequence[str] = RIVALS) -> list[str]:
    """Per (net, target) of ``summary``'s cells: is ``fisher`` first or within noise of the
    first of ``rivals``, and ahead of ``random``? Each comparison is paired seed by seed
    (``paired.paired``: the mean of the per-seed differences over the seeds both cells ran,
    with its 95% t interval; a seed is one trained network and its calibration draw), in the
    metric's direction (perplexity: lower is better). ``fisher`` is first when no rival's
    paired mean beats it, within noise when every rival that beats it does so by an interval
    that holds 0, and BEHIND a rival whose interval lies wholly on the rival's side. It is
    ahead of random when that interval lies above 0, else within noise of random or behind it;
    when random itself is not behind the dense network (paired the same way), the line says
    so: no method has lost anything there for fisher to be ahead of random by. Where the cells
    recorded the test cross-entropy or the KL divergence from the dense network by seed (the
    MLPs), the line gives the same standing on each (``_on_continuous``).
    Fisher's ablations (``fisher_*``, ``optimizer_one_shot``) are not rivals: of those ahead
    of ``fisher`` by an interval that lies wholly on their side, the furthest is named."""
    rows: dict[tuple[str, float], dict[str, dict[str, Any]]] = {}
    for c in cells:
        rows.setdefault((c["net"], c["target"]), {})[c["method"]] = c
    lines = []
    for (net, target), every in rows.items():
        if "fisher" not in every:
            continue
        f = every["fisher"]
        higher = f.get("higher_is_better", True)
        vs = {m: paired(f["by_seed"], c["by_seed"], higher)
              for m, c in every.items() if m != "fisher"}  # fmt: skip
        line = f"{net} at {target:.0%}: fisher {f['mean']:.4g}, {_standing(vs, rivals)}"
        if "random" in vs:
            loss = paired(every["random"]["by_seed"], every["random"]["dense_by_seed"], higher)
            if loss.verdict != "behind":
                line += f"; random not measurably below dense ({loss})"
        ablations = [m for m in vs if m not in rivals and vs[m].verdict == "behind"]
        if ablations:
            best = min(ablations, key=lambda m: vs[m].mean)
            line += f" (ablation {best} is ahead of fisher: fisher vs it {vs[best]})"
        line += _on_continuous(every, rivals)
        lines.append(line)
    return lines


def table(cells: list[dict[str, Any]], cost: str = "FLOPs") -> str:
    head = f"| net | {cost} kept | method | quality | smallest kept share | rounds | s per cell |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for c in cells:
        metric = c.get("metric", ACCURACY)
        lines.append(
            f"| {c['net']} | {c['target']:.0%} | {c['method']} | {metric} {c['mean']:.4g} ± "
            f"{c['sd']:.2g}"
            f" | {c['min_kept_fraction']:.2f} | {c['rounds']:.1f} | {c['seconds']:.1f} |"
        )
    return "\n".join(lines)


def plot(cells: list[dict[str, Any]], path: Path, cost: str = "FLOPs") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nets = list(dict.fromkeys(c["net"] for c in cells))
    methods = list(dict.fromkeys(c["method"] for c in cells))
    cols = min(len(nets), 3)
    rows = -(-len(nets) // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(4 * cols, 3.6 * rows), squeeze=False)
    axes = grid.flatten()
    for ax in axes[len(nets) :]:
        ax.set_visible(False)
    for ax, net in zip(axes, nets, strict=False):
        for m in methods:
            pts = sorted((c["target"], c["mean"], c["sd"]) for c in cells
                         if c["net"] == net and c["method"] == m)  # fmt: skip
            if pts:
                t, mean, sd = zip(*pts, strict=True)
                style = "-" if m == "fisher" else "--" if m.startswith("fisher") else ":"
                color = f"C{methods.index(m) % 10}"  # one colour per method on every panel
                ax.errorbar(t, mean, yerr=sd, label=m, linestyle=style, marker="o", ms=3,
                            color=color)  # fmt: skip
        metric = next(c.get("metric", ACCURACY) for c in cells if c["net"] == net)
        ax.set_xlabel(f"{cost} kept")
        ax.set_ylabel(f"{metric}, no fine-tuning")
        if metric == ACCURACY:
            ax.set_title(f"{net} (axis from 0.7)")
            ax.set_ylim(0.7, 1.0)  # l1 falls below it on the CNNs: the table has it
        else:
            ax.set_title(net)
            if metric == "perplexity":
                ax.set_yscale("log")
    higher = cells[0].get("higher_is_better", True)  # perplexity falls to the right: "best"
    axes[0].legend(fontsize=7, loc="lower right" if higher else "best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def report(measured: dict[str, Any], args: argparse.Namespace, out: Path, seconds: float) -> None:
    """Write the JSON (and, unless quick, the plot) of ``measured`` rows; print the table."""
    cells = summary(measured["rows"])
    run_nets = list(dict.fromkeys(r["net"] for r in measured["rows"]))
    data = {
        "benchmark": "one_shot_defaults",
        "timestamp": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch_version": torch.__version__,
        "fisherprune_version": fp.__version__,
        "machine": machine_info(),
        "threads": args.threads,
        "jobs": len(args.combine) if args.combine else 1,
        "note": args.note,
        "seeds": args.seeds,
        "targets": args.targets,
        "calibration": f"{CALIBRATION_BATCHES} batches of {BATCH}",
        "run": run_nets,
        "not_run": {n: "not asked for (--nets)" for n in [*NETS, *TEXT_NETS] if n not in run_nets},
        "seconds": seconds,
        "train_seconds": measured["train_seconds"],
        "text_details": measured.get("details", {}),
        "cells": cells,
        "verdicts": verdicts(cells),
        "rows": measured["rows"],
    }
    write_json(out, data)
    if not args.quick:
        plot(cells, args.plot)
    print(table(cells))
    print("\n".join(data["verdicts"]))
    print("not run: " + "; ".join(f"{n}: {why}" for n, why in data["not_run"].items()))
    print(f"wrote {out} ({seconds:.0f} s of measuring)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    nets = [*NETS, *TEXT_NETS]
    p.add_argument("--nets", nargs="+", default=nets, choices=nets)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="run seeds first-seed..seeds-1")
    p.add_argument("--targets", nargs="+", type=float, default=list(TARGETS))
    p.add_argument("--threads", type=int, default=1, help="torch threads (run two at once)")
    p.add_argument("--quick", action="store_true", help="one seed, 50%% only")
    p.add_argument(
        "--combine",
        nargs="+",
        type=Path,
        help="measure nothing: merge the rows of these runs (e.g. two processes, one per "
        "core, each given some --nets) into --out; a later file's row replaces an earlier "
        "one's of the same (net, seed, target, method); each net's training record is the first "
        "file's",
    )
    p.add_argument("--note", default="", help="a line for the report (how the run was made)")
    p.add_argument("--out", type=Path)
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "one_shot_defaults.png")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.targets = 1, [0.5]
    out = args.out or ROOT / "benchmarks" / "results" / (
        "one_shot_defaults_quick.json" if args.quick else "one_shot_defaults.json"
    )
    if args.combine:
        runs = [json.loads(path.read_text()) for path in args.combine]
        measured: dict[str, Any] = {"rows": [], "train_seconds": {}}
        cells: dict[tuple[str, int, float, str], dict[str, Any]] = {}
        for r in runs:  # a later file's row replaces an earlier one's of the same cell
            cells.update({(x["net"], x["seed"], x["target"], x["method"]): x for x in r["rows"]})
            for net, secs in r["train_seconds"].items():  # the first file's (a cache hit is ~0)
                measured["train_seconds"].setdefault(net, secs)
            for net, about in r.get("text_details", {}).items():  # the first file's too
                measured.setdefault("details", {}).setdefault(net, about)
        measured["rows"] = list(cells.values())
        report(measured, args, out, sum(r["seconds"] for r in runs))
        return 0
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    measured = run(args)
    report(measured, args, out, time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
