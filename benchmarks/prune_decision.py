"""Host time of one prune decision of ``PruningOptimizer`` (the exact cost report, the scores,
the choice) on the standard networks with every mask ``apply_masks`` finds: on a GPU this is
host work the training loop waits for at every prune (``fisherprune train`` prunes every 10
steps), so it bounds the trainer's throughput there.

``python benchmarks/prune_decision.py [--models bert_base resnet50] [--repeats 5]`` prints a
table and writes ``benchmarks/results/prune_decision.json``; run it at two commits to compare.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import overhead as ov
import torch
from _common import machine_info, write_json

import fisherprune as fp

OUT = Path(__file__).resolve().parent / "results" / "prune_decision.json"


def time_decisions(name: str, repeats: int) -> dict[str, float]:
    spec = ov.MODELS[name]
    model = spec.build(True)
    x1 = spec.make_input(1, torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    popt = fp.PruningOptimizer(model, x1, lr=0.0, prune_every=1, flops_target="10%")
    setup = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    for m in fp.find_masks(model).values():
        m.signal.copy_(torch.rand(m.num_channels, generator=gen))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        popt._maybe_prune()
        times.append(time.perf_counter() - t0)
    return {"setup_s": setup, "decision_s": statistics.median(times), "all_s": times}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["bert_base", "resnet50"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = {name: time_decisions(name, args.repeats) for name in args.models}
    print(f"{'model':<12}{'setup s':>10}{'decision s':>12}")
    for name, r in rows.items():
        print(f"{name:<12}{r['setup_s']:>10.2f}{r['decision_s']:>12.3f}")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    write_json(
        args.out,
        {
            "benchmark": "prune_decision",
            "git": rev.stdout.strip(),
            "machine": machine_info(),
            **rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
