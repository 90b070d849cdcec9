"""``prune_to_target`` on a decoder held in bf16 against the same decoder in float32: wall
time per phase and peak memory (issue 36, point 5).

The decoder is Llama-shaped and built from its config with random weights (time and memory
do not depend on the values): hidden 768, 12 layers, 12 heads, 4 key/value heads, MLP 2048,
a vocabulary of 16,000 and an untied head, about 100M parameters. Each dtype runs in a fresh
process (``--child``), so that no other allocation is counted: it builds the model, records
its resident set (``base_mib``: weights, Python, torch), runs ``prune_to_target(..., "50%")``
label-free on ``--batches`` batches of ``--batch`` sequences of ``--tokens`` tokens with
every other argument at its default, and reads the process's peak resident set
(``getrusage``). Reported: the seconds of the call and of each of its phases, the peak, the
peak over the base, and bf16 over float32. On a CPU without bf16 instructions (AVX2 only)
torch computes bf16 matmuls by conversion, so bf16 costs time there; the memory saving is
what bf16 buys.

Run ``python benchmarks/half_precision.py [--threads 2] [--quick]``; JSON to ``--out``
(default ``benchmarks/results/half_precision.json``). ``--quick``: a 4-layer, 256-wide model.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from _common import machine_info, write_json

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "half_precision.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FULL = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=4, intermediate_size=2048, vocab_size=16000)  # fmt: skip
QUICK = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=688, vocab_size=4000)  # fmt: skip


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def child(dtype: str, quick: bool, batches: int, batch: int, tokens: int) -> dict[str, Any]:
    """One dtype's run in this process: the row of the table."""
    import transformers

    import fisherprune as fp

    shape = QUICK if quick else FULL
    config = transformers.LlamaConfig(**shape, max_position_embeddings=max(tokens, 64))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(DTYPES[dtype]).eval()
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    data = [
        {"input_ids": torch.randint(0, shape["vocab_size"], (batch, tokens), generator=g)}
        for _ in range(batches)
    ]
    base = _rss_mib()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fp.prune_to_target(model, {"input_ids": data[0]["input_ids"][:1]}, data, "50%")
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "dtype": dtype,
        "parameters": params,
        "seconds": round(seconds, 1),
        "phase_seconds": {k: round(v, 1) for k, v in result.phase_seconds.items()},
        "cost_ratio": round(result.cost_after / result.cost_before, 4),
        "base_mib": round(base),
        "peak_mib": round(peak),
        "above_base_mib": round(peak - base),
        "dtypes_after": sorted({str(p.dtype) for p in model.parameters()}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--child", choices=tuple(DTYPES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick and args.out == DEFAULT_OUT:  # a smoke run is not the result
        args.out = DEFAULT_OUT.with_name("half_precision_quick.json")
    if args.child:
        row = child(args.child, args.quick, args.batches, args.batch, args.tokens)
        print(json.dumps(row))
        return 0
    rows = []
    for dtype in DTYPES:
        cmd = [sys.executable, __file__, "--child", dtype, "--threads", str(args.threads),
               "--batches", str(args.batches), "--batch", str(args.batch),
               "--tokens", str(args.tokens), *(["--quick"] if args.quick else [])]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    f32, b16 = rows
    print(f"{'dtype':<9} {'params':>8} {'seconds':>8} {'signals':>7} {'select':>7} "
          f"{'repair':>7} {'peak MiB':>9} {'over base':>9}")  # fmt: skip
    for r in rows:
        ph = r["phase_seconds"]
        phases = " ".join(f"{ph.get(k, 0):>7.1f}" for k in ("signals", "selection", "repair"))
        print(f"{r['dtype']:<9} {r['parameters'] / 1e6:>7.1f}M {r['seconds']:>8.1f} {phases} "
              f"{r['peak_mib']:>9} {r['above_base_mib']:>9}")  # fmt: skip
    ratios = {
        "seconds": round(b16["seconds"] / f32["seconds"], 2),
        "peak": round(b16["peak_mib"] / f32["peak_mib"], 2),
        "above_base": round(b16["above_base_mib"] / max(f32["above_base_mib"], 1), 2),
    }
    print(f"bf16 / float32: time {ratios['seconds']}x, peak {ratios['peak']}x, "
          f"above base {ratios['above_base']}x")  # fmt: skip
    write_json(
        args.out,
        {
            "benchmark": "half_precision",
            "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(),
            "torch": torch.__version__,
            "threads": args.threads,
            "calibration": {"batches": args.batches, "batch": args.batch, "tokens": args.tokens},
            "shape": QUICK if args.quick else FULL,
            "rows": rows,
            "bf16_over_float32": ratios,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
