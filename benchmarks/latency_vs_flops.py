"""Pruning to a measured latency target against pruning to the FLOPs target that gives the same
measured latency (issue 32: "better than FLOPs at equal measured speed").

What is measured
----------------
The networks are the trained suite the one-shot defaults are chosen on
(``one_shot_defaults.py``: ``resnet18`` and ``mobilenetv3`` on the 16x16 digits, test
accuracy; ``one_shot_text.py``: ``minilm``, the cosine of its embeddings to the dense model's,
and ``decoder_lm``, held-out perplexity, lower is better), with the same trained weights,
calibration batches and quality measures, imported from those files. For each network and seed:

1. Latency-targeted: ``prune_to_target(..., convention="latency", latency=spec)`` to each
   ``--targets`` share of the dense model's latency (the table's prediction, scaled to the
   dense model timed whole), every other argument as the one-shot benchmark gives it (MiniLM:
   the label-free loss and ``repair_passes=2``), then ``fisherprune.shrink``. ``spec`` is a
   ``LatencySpec(device="cpu", threads=--threads, batch=<the net's batch>, step=--round_to)``
   (default 8: what ``round_to`` is under the latency convention when it is not given, the
   table's ``LatencySpec.step``; every prune of the run, latency- or FLOPs-targeted, uses
   that ``round_to``), its table kept under the benchmark cache
   (``one_shot_text.cache_dir() / "latency"``), not in the repository. Pruning and quality run
   at one thread (``PRUNE_THREADS``, as ``one_shot_defaults`` runs); every timing (the table,
   the whole model) at ``--threads``.
2. FLOPs-targeted: the same call with the default ``convention="flops"`` at every
   ``--flops_grid`` share of the FLOPs, then shrunk (a share below the floor that
   ``round_to`` leaves is refused by the prune and left out of the grid).
3. The dense network and every shrunk copy of that seed are timed side by side with
   ``fisherprune.export.compare_latency`` (eval and inference mode, the order reversed every
   other round, ``TIMING``'s rounds) on the example repeated to the spec's batch, with
   ``--threads`` threads and glibc's freed memory retained, as the table was timed. A model's
   measured share is ``1 / speedup.median``, the median over rounds of the dense block over its
   block of the same round: the drift of a shared machine's speed cancels out of it.
4. The FLOPs-targeted quality at the latency-targeted model's measured share is interpolated
   linearly between the two grid points (ordered by measured share) that bracket it; both are
   recorded. The dense model is the grid's widest point (100% of the FLOPs at exactly the
   dense latency), so a 90% latency target that lands above the 90% FLOPs model is compared
   (``--recompare`` redoes this for a run written before, from what it stored). A share
   outside the grid's is reported as such, never extrapolated. The default grid is 0.1 apart
   (quality is concave in the share kept, so a coarser grid understates the FLOPs-targeted
   quality between its points) and goes down to 5% of the FLOPs: on the small
   CNNs at batch 64 the FLOPs-targeted model at 30% of the FLOPs still took ~76% of the dense
   latency, and the latency-targeted one at 50% of the latency kept 6% of its FLOPs.

A row's difference is signed so that positive means the latency-targeted model is better
(perplexity: lower). The verdict per (network, target) is "equal or better" when the mean
difference is above minus the noise: the larger of the two seed standard deviations and, for
test accuracy, the test set's binomial standard error (as ``one_shot_defaults.verdicts``).

Batch per forward pass timed (``--batch`` overrides it for every net): 64 for the CNNs (at
16x16 pixels a batch of one is bound by operator launches, which channels do not change), 16
for the text nets (their calibration batch).

Run it on an otherwise idle machine, timing at one thread (``--threads``, default 1). At two
threads this 2-vCPU VM switches for 20-40 s at a time into a state where every operator costs
some 25 us more (``timing_regimes.py``), so a table or a comparison timed in one state and not
the other misses by up to 27%; at one thread ``timing_regimes.py`` saw no such state within
its 90 s on ResNet-50, but across runs an hour apart the decoder's shrunk models (identical
widths, and the FLOPs grid alike) measured 5-6 points further from the dense model in one run
than in the other: compare cells within one run only. Beside any other process two
timing threads also wait for a core: beside two single-thread benchmark processes the dense
ResNet-18 took 875 ms per forward pass of 64 (21 ms at one thread), and a table timed so stays
in the cache: delete ``cache_dir() / "latency"`` after such a run.

Run: ``python benchmarks/latency_vs_flops.py [--nets resnet18 minilm] [--seeds 3]``; writes
``benchmarks/results/latency_vs_flops.json`` and prints the table. ``--quick`` (resnet18, one
seed, 70% of the latency, FLOPs grid 50/30/10%; ``latency_vs_flops_quick.json``) takes about 2
minutes (the operator table read from the cache). A full run (4 nets, 3 seeds, 4 targets, 10
grid points: 168 prunes) should take under an hour on idle cores, most of it MiniLM's 42 prunes
of 25-60 s each; the two CNNs at one seed took 275 s.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import counted_flops, machine_info, write_json
from one_shot_defaults import ACCURACY, NETS, accuracy, cached_train, calibration_batches
from one_shot_text import METRICS, TASKS, TextTask, cache_dir, log_cell, result_fields

import fisherprune as fp
from fisherprune.cost import LatencySpec
from fisherprune.cost.latency import timing_threads, with_batch
from fisherprune.export import SpeedUp, allocator_state, compare_latency, retain_freed_memory

ROOT = Path(__file__).resolve().parent.parent
#: forward-pass batch timed per net (see the module docstring)
NET_BATCH = {"resnet18": 64, "mobilenetv3": 64, "minilm": 16, "decoder_lm": 16}
#: 90% and 80% are where the one-shot suite's FLOPs targets (70-30%) put the small CNNs at
#: batch 64; 70% and 50% are where they lose most of their accuracy and the text nets prune to
TARGETS = (0.9, 0.8, 0.7, 0.5)
#: down to 5%: the digits ResNet-18 pruned to 50% of its latency at batch 64 kept 6% of its FLOPs
FLOPS_GRID = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05)
QUICK = {"nets": ["resnet18"], "seeds": 1, "targets": [0.7], "flops_grid": [0.5, 0.3, 0.1]}
#: the pruner's ``round_to`` under the latency convention when none is given: the table's step
ROUND_TO = LatencySpec().step
#: torch threads while pruning and measuring quality (as ``one_shot_defaults`` runs, so its
#: cells are these); timing runs at ``--threads``. Two threads pruning on a shared 2-core
#: machine waited on each other: one FLOPs cell took 242 s instead of 10
PRUNE_THREADS = 1
#: how ``compare_latency`` times the models of one (net, seed)
TIMING = {"rounds": 21, "min_rounds": 11, "budget_seconds": 60.0, "block_seconds": 0.05}


# --------------------------------------------------------------------------------- cells
def task(name: str, seed: int) -> TextTask:
    """What ``prune_to_target`` is given for network ``name`` at ``seed`` and how its quality
    is measured: the text nets' own ``one_shot_text.TASKS``; for a CNN the same fields from
    ``one_shot_defaults`` (its trained network, calibration batches, cross-entropy and test
    accuracy; the seed passed to ``prune_to_target`` only seeds the label-free loss)."""
    if name in TASKS:
        return TASKS[name](seed)
    split = NETS[name].data()
    return TextTask(
        dense=cached_train(name, split, seed),
        example=split.x_train[:2],
        batches=calibration_batches(split, seed),
        loss_fn=F.cross_entropy,
        task="auto",
        measure=lambda m: {"accuracy": accuracy(m, split)},
        metric="accuracy",
        details={"test_examples": len(split.y_test)},
        settings={},
    )


def metric_of(name: str) -> tuple[str, bool]:
    """The name of network ``name``'s quality measure and whether higher is better."""
    return METRICS.get(name, (ACCURACY, True))


@dataclass
class Pruned:
    """A shrunk copy of a dense network pruned to one target, and what its pruning did."""

    label: str  # its name in the latency comparison: "latency 0.5", "flops 0.7"
    target: float
    model: nn.Module
    quality: float
    measured: dict[str, float]  # everything ``TextTask.measure`` gave
    flops_share: float  # FLOPs per example (FlopCounterMode) over the dense model's
    fields: dict[str, Any]  # ``one_shot_text.result_fields`` of its ``PruneResult``


@dataclass
class Subject:
    """One trained network at one seed: how it is pruned, timed and measured."""

    name: str
    seed: int
    task: TextTask
    spec: LatencySpec
    dense_quality: float
    dense_flops: float

    @classmethod
    def load(
        cls, name: str, seed: int, threads: int, batch: int, round_to: int = ROUND_TO
    ) -> Subject:
        """Network ``name`` trained (or read from the cache) at ``seed``, with the
        ``LatencySpec`` of ``threads`` and ``batch`` and its dense quality and FLOPs."""
        t = task(name, seed)
        spec = LatencySpec(
            device="cpu", threads=threads, batch=batch, step=round_to,
            cache=str(cache_dir() / "latency"),
        )  # fmt: skip
        dense = t.measure(t.dense)[t.metric]
        return cls(name, seed, t, spec, dense, counted_flops(t.dense, t.example))

    def prune(self, target: float, convention: str) -> Pruned:
        """Prune a copy of the dense network to ``target`` in ``convention`` (timed in
        ``spec`` when it is ``latency``), every other argument as the one-shot benchmark
        gives it; shrink it, measure its quality and FLOPs, and log one line."""
        t = self.task
        model = copy.deepcopy(t.dense)
        latency = {"latency": self.spec} if convention == "latency" else {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = fp.prune_to_target(
                model, t.example, t.batches, target, loss_fn=t.loss_fn, task=t.task,
                seed=self.seed, round_to=self.spec.step, convention=convention, **latency,
                **t.settings,
            )  # fmt: skip
            small = fp.shrink(model, inplace=True)
        measured = t.measure(small)
        fields = result_fields(result, caught)
        quality = measured[t.metric]
        log_cell(self.name, self.seed, target, convention, t.metric, quality,
                 self.dense_quality, fields)  # fmt: skip
        return Pruned(
            label=f"{convention} {target:.4g}",
            target=target,
            model=small,
            quality=quality,
            measured=measured,
            flops_share=counted_flops(small, t.example) / self.dense_flops,
            fields=fields,
        )

    def shares(self, pruned: list[Pruned]) -> tuple[dict[str, Share], dict[str, Any]]:
        """Every model of ``pruned`` timed side by side with the dense one (``TIMING``), on
        the example repeated to the spec's batch, with the spec's threads. Returns each one's
        measured share of the dense latency by label and the comparison as JSON."""
        models = {"dense": self.task.dense, **{p.label: p.model for p in pruned}}
        inputs = with_batch(self.task.example, self.spec.batch)
        with timing_threads(self.spec):
            cmp = compare_latency(models, inputs, **TIMING)
        return {p.label: Share.of(cmp.speedup("dense", p.label)) for p in pruned}, cmp.to_json()


# --------------------------------------------------------------------------- comparison
@dataclass(frozen=True)
class Share:
    """A model's measured latency over the dense model's: ``1 / SpeedUp.median`` (the median
    over rounds of the dense block over the model's block of the same round), and the same of
    the speed-up's quartiles (``low`` from its third, ``high`` from its first)."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, speedup: SpeedUp) -> Share:
        """The share of the dense latency that ``speedup`` (dense over the model) implies."""
        q1, q3 = speedup.quartiles
        return cls(1 / speedup.median, 1 / q3, 1 / q1)


@dataclass(frozen=True)
class GridPoint:
    """One FLOPs-targeted model: its FLOPs target, measured latency share and quality."""

    flops_target: float
    share: float
    quality: float


def at_share(grid: list[GridPoint], share: float) -> tuple[float | None, list[GridPoint]]:
    """The quality at measured ``share``, linear between the two grid points, ordered by
    their measured shares, that bracket it, and those two points; ``(None, [])`` when
    ``share`` lies outside the grid's shares (never extrapolated)."""
    ordered = sorted(grid, key=lambda p: p.share)
    for lo, hi in itertools.pairwise(ordered):
        if lo.share <= share <= hi.share:
            w = (share - lo.share) / (hi.share - lo.share) if hi.share > lo.share else 0.5
            return lo.quality + w * (hi.quality - lo.quality), [lo, hi]
    return None, []


def with_dense(grid: list[GridPoint], dense_quality: float) -> list[GridPoint]:
    """``grid`` with the dense model as its widest point: the FLOPs-targeted prune at 100% of
    the FLOPs is the dense model, at exactly the dense latency (share 1), so a latency target
    of 90% that lands above the 90% FLOPs model's share is compared, not left out."""
    return [GridPoint(1.0, 1.0, dense_quality), *grid]


def comparison(grid: list[GridPoint], share: float, quality: float, higher: bool) -> dict[str, Any]:
    """A latency-targeted model of ``quality`` at measured ``share`` against the FLOPs-targeted
    quality interpolated on ``grid`` there: ``flops_quality``, ``difference`` (positive when
    the latency-targeted model is better), the ``bracket`` and a ``note`` when outside."""
    flops_quality, bracket = at_share(grid, share)
    difference, note = None, ""
    if flops_quality is not None:
        difference = (quality - flops_quality) * (1 if higher else -1)
    else:
        lo, hi = min(g.share for g in grid), max(g.share for g in grid)
        note = f"measured share {share:.3f} outside the FLOPs grid's {lo:.3f}-{hi:.3f}"
    return {
        "flops_quality": flops_quality,
        "difference": difference,
        "bracket": [asdict(g) for g in bracket],
        "note": note,
    }


def recompare(data: dict[str, Any]) -> dict[str, Any]:
    """A written run compared again from what it stored (each seed's grid, measured shares
    and dense quality), with the dense model in the grid (``with_dense``): the rows'
    comparisons, the cells and the verdicts; nothing is pruned or timed again."""
    grids = {
        (r["net"], r["seed"]): with_dense(
            [GridPoint(g["flops_target"], g["share"], g["quality"]) for g in r["grid"]],
            r["dense_quality"],
        )
        for r in data["runs"]
    }
    for row in data["rows"]:
        if "refused" not in row:
            grid = grids[(row["net"], row["seed"])]
            row.update(comparison(grid, row["measured_share"], row["quality"],
                                  row["higher_is_better"]))  # fmt: skip
    cells = summary(data["rows"])
    return {**data, "dense_in_grid": True, "cells": cells, "verdicts": verdicts(cells)}


def compare_row(s: Subject, p: Pruned, measured: Share, grid: list[GridPoint]) -> dict[str, Any]:
    """The row of latency-targeted model ``p`` (``measured`` share of the dense latency): its
    quality beside the FLOPs-targeted quality interpolated on ``grid`` at that share, and
    their difference, positive when ``p`` is better."""
    metric, higher = metric_of(s.name)
    share = measured.median
    return {
        "net": s.name,
        "seed": s.seed,
        "target": p.target,
        "metric": metric,
        "higher_is_better": higher,
        "dense_quality": s.dense_quality,
        "test_examples": s.task.details.get("test_examples"),
        "batch": s.spec.batch,
        "measured_share": share,
        "share_quartiles": [measured.low, measured.high],
        "predicted_share": p.fields["ratio"],
        "flops_share": p.flops_share,
        "quality": p.quality,
        "measured": p.measured,
        **comparison(grid, share, p.quality, higher),
        "latency_seconds": p.fields["seconds"],
        "fields": p.fields,
    }


def run_seed(name: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every cell of network ``name`` at ``seed``: the latency-targeted models, the FLOPs
    grid, their latency timed together, and one row per latency target. Returns
    ``{"rows": [...], "run": {...}}`` (the run: the grid's points and the timing)."""
    s = Subject.load(name, seed, args.threads, args.batch or NET_BATCH[name], args.round_to)
    by_latency, refused = [], []
    for target in args.targets:
        try:
            by_latency.append(s.prune(target, "latency"))
        except ValueError as e:  # below the floor the prune can reach: refused, nothing pruned
            if "out of reach" not in str(e):
                raise
            refused.append({"net": name, "seed": seed, "target": target,
                            "metric": metric_of(name)[0], "refused": str(e), "difference": None,
                            "latency_seconds": 0.0})  # fmt: skip
            print(f"{name} s{seed} latency {target:.0%}: {e}", flush=True)
    by_flops, flops_refused = [], []
    for target in args.flops_grid:  # below the FLOPs floor (round_to's blocks): left out
        try:
            by_flops.append(s.prune(target, "flops"))
        except ValueError as e:
            if "out of reach" not in str(e):
                raise
            flops_refused.append(target)
            print(f"{name} s{seed} FLOPs {target:.0%}: {e}", flush=True)
    shares, timing = s.shares(by_latency + by_flops)
    grid = [GridPoint(p.target, shares[p.label].median, p.quality) for p in by_flops]
    flops_seconds = statistics.mean([p.fields["seconds"] for p in by_flops] or [0.0])
    rows = []
    for p in by_latency:
        compared = compare_row(s, p, shares[p.label], with_dense(grid, s.dense_quality))
        row = {**compared, "flops_seconds": flops_seconds}
        rows.append(row)
        found = "-" if row["flops_quality"] is None else f"{row['flops_quality']:.4g}"
        print(
            f"{name} s{seed} latency {p.target:.0%}: measured share {row['measured_share']:.3f}"
            f" (predicted {row['predicted_share']:.3f}), {row['metric']} {p.quality:.4g}; "
            f"FLOPs-targeted at that share {found} {row['note']}",
            flush=True,
        )
    rows += [{**r, "flops_seconds": flops_seconds} for r in refused]
    monotone = all(a.share >= b.share for a, b in itertools.pairwise(grid))
    if not monotone:
        print(f"{name} s{seed}: the grid's measured shares do not fall with its FLOPs targets "
              "(timing noise); interpolated between neighbours in measured share")  # fmt: skip
    points = [
        {
            **asdict(g),
            "share_quartiles": [shares[p.label].low, shares[p.label].high],
            "flops_share": p.flops_share,
            "measured": p.measured,
            "fields": p.fields,
        }
        for g, p in zip(grid, by_flops, strict=True)
    ]
    run = {
        "net": name,
        "seed": seed,
        "dense_quality": s.dense_quality,
        "latency_spec": asdict(s.spec),
        "grid": points,
        "flops_refused": flops_refused,
        "grid_monotone": monotone,
        "timing": timing,
    }
    return {"rows": rows, "run": run}


# ------------------------------------------------------------------------------- report
def _mean_sd(values: list[float]) -> tuple[float, float]:
    """The mean of ``values`` and their sample standard deviation (0 for one value)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and sd over seeds per (net, latency target), over the seeds whose measured share
    lies inside the FLOPs grid (``compared``; ``seeds`` counts all); the verdict and its
    noise (the larger seed sd of the two qualities and, for test accuracy, the test set's
    binomial standard error at the latency-targeted mean)."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["net"], r["target"]), []).append(r)
    cells = []
    for (net, target), rs in groups.items():
        inside = [r for r in rs if r["difference"] is not None]
        c: dict[str, Any] = {
            "net": net,
            "target": target,
            "metric": rs[0]["metric"],
            "seeds": len(rs),
            "compared": len(inside),
            "latency_seconds": statistics.mean(
                [r["latency_seconds"] for r in rs if "refused" not in r] or [0.0]
            ),
            "flops_seconds": statistics.mean(r["flops_seconds"] for r in rs),
        }
        if not inside:
            floors = [r["refused"].split("out of reach: ")[-1].split(", every")[0] for r in rs
                      if "refused" in r]  # fmt: skip
            why = (
                f"refused on {len(floors)} of {len(rs)} seeds ({'; '.join(floors)})"
                if floors
                else "every measured share outside the grid"
            )
            cells.append({**c, "verdict": f"not compared: {why}"})
            continue
        for key in ("measured_share", "quality", "flops_quality", "difference"):
            c[key], c[f"{key}_sd"] = _mean_sd([r[key] for r in inside])
        binomial = 0.0
        if c["metric"] == ACCURACY:
            p, n = c["quality"], inside[0]["test_examples"]
            binomial = (p * (1 - p) / n) ** 0.5
        c["noise"] = max(c["quality_sd"], c["flops_quality_sd"], binomial)
        c["verdict"] = "equal or better" if c["difference"] + c["noise"] >= 0 else "worse"
        cells.append(c)
    return cells


def verdicts(cells: list[dict[str, Any]]) -> list[str]:
    """One line per (net, target): both qualities at the same measured speed, the difference
    (positive: latency-targeted better), the noise and the verdict."""
    lines = []
    for c in cells:
        head = f"{c['net']} at {c['target']:.0%} of the latency"
        if not c["compared"]:
            lines.append(f"{head}: {c['verdict']}")
            continue
        skipped = c["seeds"] - c["compared"]
        lines.append(
            f"{head} (measured {c['measured_share']:.1%}): latency-targeted {c['quality']:.4g}, "
            f"FLOPs-targeted {c['flops_quality']:.4g}, difference {c['difference']:+.3g} "
            f"(noise {c['noise']:.2g}): {c['verdict']}"
            + (f"; {skipped} seed(s) outside the FLOPs grid" if skipped else "")
        )
    return lines


def table(cells: list[dict[str, Any]]) -> str:
    """The summary as a markdown table."""
    lines = [
        "| net | latency target | measured share | metric | latency-targeted | FLOPs-targeted, "
        "same share | difference (+: latency better) | verdict | seeds compared | s per cell "
        "(latency / FLOPs) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        timing = f"{c['latency_seconds']:.1f} / {c['flops_seconds']:.1f}"
        if not c["compared"]:
            lines.append(f"| {c['net']} | {c['target']:.0%} | - | {c['metric']} | - | - | - | "
                         f"{c['verdict']} | 0/{c['seeds']} | {timing} |")  # fmt: skip
            continue
        lines.append(
            f"| {c['net']} | {c['target']:.0%} | {c['measured_share']:.1%} ± "
            f"{c['measured_share_sd']:.1%} | {c['metric']} | {c['quality']:.4g} ± "
            f"{c['quality_sd']:.2g} | {c['flops_quality']:.4g} ± {c['flops_quality_sd']:.2g} | "
            f"{c['difference']:+.3g} ± {c['difference_sd']:.2g} | {c['verdict']} | "
            f"{c['compared']}/{c['seeds']} | {timing} |"
        )
    return "\n".join(lines)


def results(
    args: argparse.Namespace, rows: list[dict[str, Any]], runs: list[dict[str, Any]], seconds: float
) -> dict[str, Any]:
    """The JSON of a run so far: its settings, the summary of ``rows`` and every row and run."""
    cells = summary(rows)
    return {
        "benchmark": "latency_vs_flops",
        "timestamp": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch_version": torch.__version__,
        "fisherprune_version": fp.__version__,
        "machine": machine_info(),
        "threads": args.threads,
        "prune_threads": PRUNE_THREADS,
        "round_to": args.round_to,
        "batch": {n: args.batch or NET_BATCH[n] for n in args.nets},
        "allocator": allocator_state(),
        "timing": {
            "method": "fisherprune.export.compare_latency: the dense model and every shrunk "
            "copy of one (net, seed) side by side, eval and inference mode, the order reversed "
            "every other round; a model's measured share is 1 / the median over rounds of "
            "the dense block over its block of the same round (SpeedUp.median)",
            **TIMING,
        },
        "seeds": args.seeds,
        "targets": args.targets,
        "flops_grid": args.flops_grid,
        "seconds": seconds,
        "dense_in_grid": True,
        "cells": cells,
        "verdicts": verdicts(cells),
        "rows": rows,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    nets = list(NET_BATCH)
    p.add_argument("--nets", nargs="+", default=nets, choices=nets)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--targets", nargs="+", type=float, default=list(TARGETS),
                   help="shares of the dense latency")  # fmt: skip
    p.add_argument("--flops_grid", nargs="+", type=float, default=list(FLOPS_GRID),
                   help="shares of the dense FLOPs")  # fmt: skip
    p.add_argument(
        "--batch", type=int, help=f"examples per timed forward pass (default: {NET_BATCH})"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads while timing")
    p.add_argument("--round_to", type=int, default=ROUND_TO,
                   help="every prune's round_to and the latency table's step")  # fmt: skip
    p.add_argument("--quick", action="store_true", help=f"{QUICK}")
    p.add_argument("--out", type=Path)
    p.add_argument("--recompare", type=Path, metavar="JSON",
                   help="compare a written run again with the dense model in the FLOPs grid "
                   "(nothing pruned or timed), rewrite it and print its table")  # fmt: skip
    args = p.parse_args(argv)
    if args.recompare:
        if not args.recompare.is_file():
            p.error(f"--recompare {args.recompare}: no such file (a latency_vs_flops JSON)")
        data = recompare(json.loads(args.recompare.read_text()))
        write_json(args.recompare, data)
        print(table(data["cells"]))
        print("\n".join(data["verdicts"]))
        return 0
    for name in ("seeds", "round_to", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    out = args.out or ROOT / "benchmarks" / "results" / (
        "latency_vs_flops_quick.json" if args.quick else "latency_vs_flops.json"
    )
    load = machine_info().get("load_average", [0.0])[0]
    if load >= 0.5:
        print(f"NOTE: load average {load:.1f} before starting: timings at {args.threads} "
              "thread(s) beside other work measure waits for a core")  # fmt: skip
    torch.set_num_threads(PRUNE_THREADS)
    retain_freed_memory()  # before the first forward pass: the table and the comparison alike
    for name in args.nets:  # a network that cannot load stops the run before any cell
        task(name, 0)
    started = time.perf_counter()
    rows, runs = [], []
    for name in args.nets:
        for seed in range(args.seeds):
            part = run_seed(name, seed, args)
            rows += part["rows"]
            runs.append(part["run"])
            data = results(args, rows, runs, time.perf_counter() - started)
            write_json(out, data)  # after every seed: a run stopped later keeps what it did
    cells, seconds = data["cells"], data["seconds"]
    print(table(cells))
    print("\n".join(data["verdicts"]))
    print(f"wrote {out} ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
