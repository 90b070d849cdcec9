"""Where a masked training step's time goes on a GPU: ``torch.profiler`` over a few steps of
``overhead.py``'s variants (a) plain, (b) collecting, (c) pruned and not collecting, and of the
trainer's loop (``PruningOptimizer``, no prune due), for the standard networks.

Per variant: wall ms per step, device (kernel) ms per step, kernels launched per step; then the
operators whose device time or call count grows most from (a) to each other variant. A step
whose wall time exceeds its kernel time by far is bound by the host (launches, Python hooks),
not by the arithmetic. ``python benchmarks/gpu_profile.py --models bert_base --device cuda``
prints the tables and writes ``benchmarks/results/gpu_profile.json``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import gpu
import overhead as ov
import torch
from _common import write_json
from torch.profiler import ProfilerActivity, profile

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu_profile.json"
STEPS, WARMUP, TOP = 5, 3, 12


def _device_us(e: Any) -> float:
    return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))


def profile_steps(fn: gpu.Fn, device: torch.device) -> dict[str, Any]:
    """Wall and device time per step, kernels per step, and per-operator device time."""
    for _ in range(WARMUP):
        fn()
    gpu.sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(STEPS):
            fn()
        gpu.sync(device)
        wall = (time.perf_counter() - t0) / STEPS
    ops: dict[str, dict[str, float]] = {}
    kernels = 0
    for e in prof.key_averages():
        dev = _device_us(e)
        if e.key.startswith("aten::") or e.key.startswith("fisherprune"):
            ops[e.key] = {"device_ms": dev / 1e3 / STEPS, "calls": e.count / STEPS}
    for e in prof.events():
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            kernels += 1
    device_ms = sum(_device_us(e) for e in prof.key_averages() if not e.key.startswith("aten::"))
    return {
        "wall_ms": wall * 1e3,
        "device_ms": device_ms / 1e3 / STEPS,
        "kernels_per_step": kernels / STEPS,
        "ops": ops,
    }


def grown(base: dict[str, Any], other: dict[str, Any]) -> list[dict[str, Any]]:
    """The operators whose device time grew most from ``base`` to ``other``."""
    rows = []
    for k, o in other["ops"].items():
        b = base["ops"].get(k, {"device_ms": 0.0, "calls": 0.0})
        rows.append(
            {
                "op": k,
                "device_ms": round(o["device_ms"] - b["device_ms"], 4),
                "calls": round(o["calls"] - b["calls"], 1),
            }
        )
    rows.sort(key=lambda r: (-r["device_ms"], -r["calls"]))
    return rows[:TOP]


def run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = (gpu.quick_specs() if args.quick else ov.MODELS)[name]
    fns = gpu.variant_fns(spec, args, gpu.STEP_VARIANTS)
    fns["pruning_optimizer"] = gpu.popt_loop(spec, args, prune_every=10**9)[0]
    figures = {k: profile_steps(fn, args.device) for k, fn in fns.items()}
    out: dict[str, Any] = {"variants": {}, "grown_from_plain": {}}
    for k, f in figures.items():
        out["variants"][k] = {
            x: round(f[x], 3) for x in ("wall_ms", "device_ms", "kernels_per_step")
        }
        if k != "a":
            out["grown_from_plain"][k] = grown(figures["a"], f)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=sorted(gpu.DTYPES), default="bfloat16")
    p.add_argument("--models", nargs="+", choices=list(ov.STANDARD), default=["bert_base"])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--quick", action="store_true", help="small models, batch 2: a check")
    a = p.parse_args(argv)
    quick = ["--quick"] if a.quick else []
    args = gpu.parse_args(["--device", a.device, "--dtype", a.dtype, "--no-compile", *quick])
    results = {name: run(name, args) for name in a.models}
    for name, r in results.items():
        print(f"\n{name}: per step")
        print(f"{'variant':<18}{'wall ms':>9}{'device ms':>11}{'kernels':>9}")
        for k, v in r["variants"].items():
            print(
                f"{k:<18}{v['wall_ms']:>9.2f}{v['device_ms']:>11.2f}{v['kernels_per_step']:>9.0f}"
            )
        for k, rows in r["grown_from_plain"].items():
            print(f"  grown from (a) to {k}:")
            for row in rows:
                print(
                    f"    {row['op']:<44}{row['device_ms']:>+9.3f} ms {row['calls']:>+8.1f} calls"
                )
    write_json(
        a.out,
        {
            "benchmark": "gpu_profile",
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch_version": torch.__version__,
            "device_name": torch.cuda.get_device_name(args.device)
            if args.device.type == "cuda"
            else "cpu",
            "dtype": a.dtype,
            "batch": args.batch,
            **results,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
