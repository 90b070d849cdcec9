"""The host's share of a training step with masks, measured on a CPU: a stand-in for a GPU.

On a GPU a BERT-base step at batch 32 is bound by the host (11 ms of kernels in 34 ms of wall
time on an H200, ``docs/gpu.md``): what masks cost there is the Python they run and the
operators they launch, not arithmetic. The same holds on a CPU for a network whose every
operator is tiny, so this script times one: the BERT-shaped encoder of ``standard_nets`` with
all 12 blocks, 12 heads and every mask ``apply_masks`` finds, but d 96, MLP 192, 16 tokens,
batch 2, one thread. Its variants are ``overhead.py``'s:

* ``a`` plain, ``b`` collecting the Fisher signal (``update_pruning_signals`` every step),
  ``c`` half of every mask pruned and not collecting (weights folded, norms over the kept
  channels), ``e`` all-ones masks not collecting, ``f`` ``c`` shrunk in place
  (``fisherprune.shrink(model, inplace=True, optimizer=...)``, what fine-tuning runs once
  pruning is over), ``g`` the trainer's loop: ``PruningOptimizer.minimize`` collecting every
  step and pruning every 10th (``gpu.py``'s throughput run; its prune steps read the signals
  and price the masks on the host).

For each: the ATen operators one step dispatches (forward, backward and SGD step; counted by a
``TorchDispatchMode`` over one round of 10 steps: deterministic, the launches a GPU would pay,
the extra ones listed), and the process CPU time of a step (median of ``--rounds`` interleaved
rounds of 10 steps, as a ratio to ``a``'s from the same rounds: the host time, less sensitive
than wall time to other processes on this shared machine). For comparison, the H200 measured
``b`` 1.37x and ``c`` 1.51x ``a`` on BERT-base, and the trainer's loop at 0.663x a plain
step's throughput (1.51x its time; ``docs/gpu.md``, 2026-11-30). With ``--compiled``, ``a+``,
``b+``, ``c+`` and ``g+`` run the model's forward under ``torch.compile`` (inductor; as ratios
to ``a+``): masks inside a compiled graph (``fisherprune.masks.compiled``); ``g+`` is
the step ``fisherprune train --compile`` runs.

Run ``python benchmarks/host_overhead.py`` (about two minutes); the table is printed and the JSON
written to ``--out`` (default ``benchmarks/results/host_overhead.json``).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import standard_nets as sn
import torch
import torch.nn.functional as F
from _common import machine_info, write_json
from torch.utils._python_dispatch import TorchDispatchMode

import fisherprune as fp

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "host_overhead.json"
VARIANTS = {
    "a": "plain (no masks)",
    "b": "masks, collecting",
    "c": "masks, pruned 50%, not collecting",
    "e": "masks all ones, not collecting",
    "f": "pruned 50%, shrunk in place",
    "g": "PruningOptimizer loop, prunes every 10 steps",
}
#: with ``--compiled``: the model's forward under ``torch.compile`` (inductor), plain and
#: collecting (``fisherprune.masks.compiled``; the first step compiles)
COMPILED = {
    "a+": "plain, compiled",
    "b+": "masks, collecting, compiled",
    "c+": "masks, pruned 50%, not collecting, compiled",
    "g+": "PruningOptimizer loop, compiled (train --compile)",
}
#: steps per timed round: ``g`` prunes once in each (the H200's trainer-loop figure is the
#: throughput of such blocks)
ROUND_STEPS = 10
SHAPE = {"vocab": 1000, "length": 16, "d": 96, "heads": 12, "hidden": 192, "layers": 12}
BATCH = 2
#: docs/gpu.md, BERT-base, bf16, batch 32, 2026-11-30 (g: 1 / the trainer loop's throughput
#: ratio, 0.663)
GPU_H200 = {"b": 1.367, "c": 1.506, "f": 1.067, "g": 1.508}


class OpCount(TorchDispatchMode):
    """Counts the ATen operators dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def make_step(variant: str) -> Callable[[], None]:
    """One training step of ``variant`` on fixed data (the same weights for every variant;
    a variant ending in ``+`` runs the model's forward compiled)."""
    compiled = variant.endswith("+")
    variant = variant.rstrip("+")
    torch.manual_seed(0)
    model = sn.Encoder(**SHAPE)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, SHAPE["vocab"], (BATCH, SHAPE["length"]), generator=gen)
    y = torch.randint(0, sn.NUM_CLASSES, (BATCH,), generator=gen)
    if variant != "a":
        fp.apply_masks(model, x[:1])
        with torch.no_grad():
            for m in fp.find_masks(model).values():
                m.collecting = variant == "b"
                if variant in "cf":
                    m.mask[: m.num_channels // 2] = 0.0
    if variant == "f":
        fp.shrink(model, x[:1], inplace=True)
    masks = fp.find_masks(model)
    model.train()
    forward = torch.compile(model) if compiled else model
    if variant == "g":  # the trainer's loop: gpu.py's PruningOptimizer settings
        popt = fp.PruningOptimizer(
            model, x[:1], prune_every=ROUND_STEPS, lr=0.01, momentum=0.9, decay=0.96,
            flops_target="50%",
        )  # fmt: skip

        def loop_step() -> None:
            popt.minimize(F.cross_entropy(forward(x), y))

        return loop_step
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(forward(x), y).backward()
        opt.step()
        if variant == "b":
            fp.update_pruning_signals(masks, 0.96)

    return step


def measure(rounds: int, compiled: bool = False) -> dict[str, Any]:
    labels = {**VARIANTS, **(COMPILED if compiled else {})}
    steps = {v: make_step(v) for v in labels}
    ops: dict[str, collections.Counter[str]] = {}
    for v, step in steps.items():
        for _ in range(ROUND_STEPS - 1):  # warm-up: caches made, the folded weights zeroed
            step()
        if v in COMPILED:  # (its kernels are generated code, not ATen operators)
            continue
        with OpCount() as count:  # g: one round, its prune among them
            for _ in range(ROUND_STEPS):
                step()
        ops[v] = collections.Counter({k: n // ROUND_STEPS for k, n in count.ops.items()})
    times: dict[str, list[float]] = {v: [] for v in labels}
    order = list(labels)
    for r in range(rounds):
        for v in order[r % len(order) :] + order[: r % len(order)]:
            t = time.process_time()
            for _ in range(ROUND_STEPS):
                steps[v]()
            times[v].append((time.process_time() - t) / ROUND_STEPS * 1e3)
    out: dict[str, Any] = {}
    for v, label in labels.items():
        base = "a+" if v in COMPILED else "a"  # (a compiled step beside the compiled plain one)
        paired = [t / p for t, p in zip(times[v], times[base], strict=True)]
        out[v] = {
            "label": label,
            "cpu_ms_per_step": statistics.median(times[v]),
            "cpu_ratio": statistics.median(times[v]) / statistics.median(times[base]),
            "paired_ratio": statistics.median(paired),
        }
        if v in ops:
            out[v].update(
                ops_per_step=sum(ops[v].values()),
                ops_ratio=sum(ops[v].values()) / sum(ops["a"].values()),
                extra_ops=dict((ops[v] - ops["a"]).most_common(12)),
            )
    return out


def print_table(res: dict[str, Any]) -> None:
    print(f"{'variant':44} {'ops/step':>9} {'ops x':>6} {'cpu ms':>8} {'cpu x':>6} {'H200 x':>7}")
    for v, r in res.items():
        gpu = f"{GPU_H200[v]:.3f}" if v in GPU_H200 else ""
        ops = f"{r['ops_per_step']:>9} {r['ops_ratio']:>6.3f}" if "ops_per_step" in r else " " * 16
        print(
            f"({v}) {r['label']:40} {ops} {r['cpu_ms_per_step']:>8.2f} {r['cpu_ratio']:>6.3f} "
            f"{gpu:>7}"
        )
    for v in ("b", "c", "g"):
        print(f"({v}) extra operators: {res[v]['extra_ops']}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=21, help="interleaved rounds (default 21)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    p.add_argument(
        "--compiled",
        action="store_true",
        help="also (a), (b), (c) and (g) with the forward under torch.compile, as ratios to "
        "compiled (a)",
    )
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    res = measure(args.rounds, args.compiled)
    print(
        f"fisherprune {fp.__version__}, torch {torch.__version__}, 1 thread; encoder {SHAPE}, "
        f"batch {BATCH}; cpu = process CPU time per step, median of {args.rounds} rounds"
    )
    print_table(res)
    write_json(
        args.out,
        {
            "benchmark": "host_overhead",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "shape": SHAPE,
            "batch": BATCH,
            "rounds": args.rounds,
            "machine": machine_info(),
            "gpu_h200_bert_base": GPU_H200,
            "variants": res,
        },
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
