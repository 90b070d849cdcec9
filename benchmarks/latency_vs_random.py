"""Does pruning to a measured latency at the defaults beat random channels at the same target?

What is measured
----------------
The trained networks of ``latency_vs_flops.py`` (the one-shot suite's ResNet-18 and
MobileNetV3 on the 16x16 digits, MiniLM and the small decoder), each pruned one-shot with
``convention="latency"`` to a share of its timed latency at the library's defaults (its
``round_to`` following the table's step, 8; every other argument as the one-shot benchmark
gives it), and again with ``criterion="random"`` (everything else the same), both shrunk and
measured. The table compares the qualities at the same target; the prices the prunes landed on
(predicted share of the dense latency) and the smallest share of a group kept are recorded
beside them, so that a collapsed group shows. A "default" worse than "random" on a row is a
defect of the default.

Run: ``python benchmarks/latency_vs_random.py [--seeds 3]`` on an otherwise idle machine, one
timing thread; writes ``benchmarks/results/latency_vs_random.json``. The latency tables come
from ``latency_vs_flops.py``'s cache (timed afresh when missing).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, write_json
from latency_vs_flops import NET_BATCH, PRUNE_THREADS, Subject, metric_of

import fisherprune as fp
from fisherprune.export import retain_freed_memory

RESULTS = Path(__file__).resolve().parent / "results" / "latency_vs_random.json"
#: the latency targets per network: where ``latency_vs_flops`` compared every seed
PLAN = {
    "resnet18": (0.9, 0.8),
    "mobilenetv3": (0.9, 0.8),
    "minilm": (0.8,),
    "decoder_lm": (0.8, 0.5),
}


def prune(s: Subject, target: float, criterion: str | None) -> dict[str, float]:
    """``s``'s network pruned to ``target`` of its latency (``criterion`` None: the default),
    shrunk and measured: its quality, predicted share and smallest share of a group kept."""
    t = s.task
    model = copy.deepcopy(t.dense)
    settings = {**t.settings, **({"criterion": criterion} if criterion else {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fp.prune_to_target(
            model, t.example, t.batches, target, loss_fn=t.loss_fn, task=t.task, seed=s.seed,
            convention="latency", latency=s.spec, **settings,
        )  # fmt: skip
        small = fp.shrink(model, inplace=True)
    return {
        "quality": t.measure(small)[t.metric],
        "predicted_share": result.cost_after / result.cost_before,
        "min_kept_fraction": result.min_kept_fraction,
        "round_to": result.round_to,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.seeds < 1:
        p.error(f"--seeds must be at least 1, not {args.seeds}")
    torch.set_num_threads(PRUNE_THREADS)
    retain_freed_memory()
    started, rows = time.perf_counter(), []
    for name, targets in PLAN.items():
        metric, higher = metric_of(name)
        for seed in range(args.seeds):
            s = Subject.load(name, seed, 1, NET_BATCH[name])
            for target in targets:
                got = {c or "default": prune(s, target, c) for c in (None, "random")}
                sign = 1 if higher else -1
                diff = sign * (got["default"]["quality"] - got["random"]["quality"])
                rows.append({"net": name, "seed": seed, "target": target, "metric": metric,
                             "default_better_by": diff, **got})  # fmt: skip
                print(f"{name} s{seed} {target:.0%}: default {got['default']['quality']:.4g}, "
                      f"random {got['random']['quality']:.4g} ({metric})", flush=True)  # fmt: skip
    cells = []
    for name, targets in PLAN.items():
        for target in targets:
            rs = [r for r in rows if r["net"] == name and r["target"] == target]
            cells.append({
                "net": name, "target": target, "metric": rs[0]["metric"],
                "default": statistics.mean(r["default"]["quality"] for r in rs),
                "random": statistics.mean(r["random"]["quality"] for r in rs),
                "default_better_on": sum(r["default_better_by"] > 0 for r in rs),
                "seeds": len(rs),
                "min_kept_fraction": min(r["default"]["min_kept_fraction"] for r in rs),
            })  # fmt: skip
    print("| net | latency target | metric | default | random | default better on | "
          "least share of a group kept (default) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for c in cells:
        print(f"| {c['net']} | {c['target']:.0%} | {c['metric']} | {c['default']:.4g} | "
              f"{c['random']:.4g} | {c['default_better_on']}/{c['seeds']} | "
              f"{c['min_kept_fraction']:.3f} |")  # fmt: skip
    write_json(args.out, {
        "benchmark": "latency_vs_random", "timestamp": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch_version": torch.__version__, "fisherprune_version": fp.__version__,
        "machine": machine_info(), "seeds": args.seeds,
        "seconds": time.perf_counter() - started, "cells": cells, "rows": rows,
    })  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
