"""Peak memory of a training step with the Fisher signal collected, against a plain step.

Each measurement runs in a fresh Python process (one model, one variant of
``overhead.py``: ``a`` plain, ``b`` collecting, ``c`` pruned and not collecting), so that
no other model or earlier allocation is counted. The child builds the model (with every mask
``apply_masks`` finds) and its batches, records its resident set size (``base``: weights,
inputs, Python and torch), runs ``--steps`` steps and reads the process's peak resident set
size (``getrusage`` ``ru_maxrss``). Reported per variant: the peak, and the steps' own memory
``peak - base`` (the gradients and the optimizer's momentum, the same in every variant, plus
what the forward keeps for the backward and the backward's temporaries), with ratios over
the plain step. Then one more step is run under ``torch.profiler(profile_memory=True)`` and
the peak of its live tensor memory (allocations minus frees, from the step's start) is
reported (``tensors``): the figure least disturbed by what the process did before (the
resident set also holds what ``apply_masks``'s trace freed to glibc but glibc kept). No
tracemalloc, which does not see torch's allocations.

Run ``python benchmarks/overhead_memory.py [--quick]``; JSON to ``--out`` (default
``benchmarks/results/overhead_memory.json``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import overhead as oh
import torch
from _common import machine_info, write_json
from torch.profiler import profile

import fisherprune

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "overhead_memory.json"
VARIANTS = ("a", "b", "c")


def rss_kib() -> int:
    """The current resident set size of this process, in KiB (Linux ``/proc``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def allocated_peak_kib(step: oh.StepFn, x: torch.Tensor, y: torch.Tensor) -> int:
    """The most tensor memory live at once during one step, counted from what was live when
    it began: the peak of the running sum of torch's allocations and frees in the step, as
    ``torch.profiler(profile_memory=True)`` records them."""
    with profile(profile_memory=True) as prof:
        step(x, y)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak // 1024


def child(model: str, variant: str, batch: int, steps: int) -> dict[str, int]:
    """In this process: build one variant, step, and return base and peak RSS in KiB, and
    the peak tensor memory of one more step (``allocated_peak_kib``)."""
    torch.set_num_threads(1)
    spec = oh.MODELS[model]
    step = oh.VARIANT_STEPS[variant](spec, oh.DECAY)
    batches = oh.make_batches(spec, oh.NUM_BATCHES, batch)
    base = rss_kib()
    for i in range(steps):
        step(*batches[i % len(batches)])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "base_kib": base,
        "peak_kib": peak,
        "step_alloc_kib": allocated_peak_kib(step, *batches[0]),
    }


def measure(model: str, variant: str, batch: int, steps: int) -> dict[str, int]:
    cmd = [sys.executable, __file__, "--child", model, variant, str(batch), str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=HERE)
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=sorted(oh.MODELS), default=list(oh.STANDARD))
    p.add_argument("--batch", type=int, default=None, help="standard-size batch (16; quick 4)")
    p.add_argument("--steps", type=int, default=3, help="steps (default 3)")
    p.add_argument("--repeats", type=int, default=None, help="processes per variant (2; quick 1)")
    p.add_argument("--quick", action="store_true", help="batch 4, one process per variant")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--child", nargs=4, metavar=("MODEL", "VARIANT", "BATCH", "STEPS"))
    args = p.parse_args(argv)
    if args.batch is None:
        args.batch = 4 if args.quick else 16
    if args.repeats is None:
        args.repeats = 1 if args.quick else 2
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        model, variant, batch, steps = args.child
        print(json.dumps(child(model, variant, int(batch), int(steps))))
        return 0
    results: dict[str, Any] = {}
    for name in args.models:
        spec = oh.MODELS[name]
        batch = args.batch if spec.standard else spec.batch
        runs: dict[str, list[dict[str, int]]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for v in VARIANTS:  # alternating, so that every variant sees the same machine
                runs[v].append(measure(name, v, batch, args.steps))
        peak = {v: statistics.median(r["peak_kib"] for r in runs[v]) for v in VARIANTS}
        own = {
            v: statistics.median(r["peak_kib"] - r["base_kib"] for r in runs[v]) for v in VARIANTS
        }
        alloc = {v: statistics.median(r["step_alloc_kib"] for r in runs[v]) for v in VARIANTS}
        results[name] = {
            "batch": batch,
            "runs": runs,
            "peak_mib": {v: peak[v] / 1024 for v in VARIANTS},
            "step_mib": {v: own[v] / 1024 for v in VARIANTS},
            "peak_ratio_to_a": {v: peak[v] / peak["a"] for v in VARIANTS},
            "step_ratio_to_a": {v: own[v] / max(own["a"], 1) for v in VARIANTS},
            "alloc_peak_mib": {v: alloc[v] / 1024 for v in VARIANTS},
            "alloc_ratio_to_a": {v: alloc[v] / max(alloc["a"], 1) for v in VARIANTS},
        }
        r = results[name]
        for v in VARIANTS:
            print(
                f"{name:<10} ({v}) {oh.VARIANTS[v]:<38} peak {r['peak_mib'][v]:8.0f} MiB "
                f"x{r['peak_ratio_to_a'][v]:.3f}   step {r['step_mib'][v]:7.0f} MiB "
                f"x{r['step_ratio_to_a'][v]:.3f}   tensors {r['alloc_peak_mib'][v]:7.0f} MiB "
                f"x{r['alloc_ratio_to_a'][v]:.3f}"
            )
    payload = {
        "benchmark": "overhead_memory",
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "fisherprune_version": fisherprune.__version__,
        "torch_version": torch.__version__,
        "quick": args.quick,
        "threads": 1,
        "machine": machine_info(),
        "settings": {"steps": args.steps, "repeats": args.repeats, "threads": 1},
        "target_peak_ratio": oh.MEMORY_TARGET,
        "variants": {v: oh.VARIANTS[v] for v in VARIANTS},
        "models": results,
    }
    write_json(args.out, payload)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
