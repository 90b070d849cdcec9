"""What glibc's malloc defaults cost a CPU forward pass, and what ``retain_freed_memory`` saves.

Each measurement runs in a fresh Python process (the allocator settings are process-wide and
glibc adapts its thresholds to what a process has allocated before, so a process that trained
or timed other models first would not show the defaults' behaviour). A child builds a dense
network of ``export_speed.py`` (untrained: weights do not change latency), calls
``fisherprune.export.retain_freed_memory()`` or not, runs ``--warmup`` forward passes, then
times ``--calls`` passes one by one and counts the minor page faults of each
(``getrusage``). The two allocator settings alternate over ``--repeats`` child pairs, so that
both see the same machine load; the table gives medians over all timed passes and the ratio
of the default's latency to the retained one's.

Run ``python benchmarks/allocator.py`` (about a minute); the JSON goes to ``--out`` (default
``benchmarks/results/allocator.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from _common import write_json

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks/results/allocator.json"
SETTINGS = ("glibc-default", "retain")

_CHILD = """
import json, resource, sys, time
sys.path.insert(0, {here!r})
import torch
import export_speed as es
from fisherprune.export import retain_freed_memory
setting, name, batch, warmup, calls = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
applied = retain_freed_memory() if setting == "retain" else False
torch.set_num_threads(1)
spec = es.MODELS[name]
torch.manual_seed(0)
model = spec.build(1.0).eval()
x = torch.randn(batch, *spec.input_shape)
seconds, faults = [], []
with torch.inference_mode():
    for _ in range(warmup):
        model(x)
    for _ in range(calls):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        model(x)
        seconds.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({{"applied": applied, "seconds": seconds, "faults": faults}}))
"""


def child_env() -> dict[str, str]:
    """This environment without a preloaded allocator or glibc malloc tunables."""
    drop = ("LD_PRELOAD", "GLIBC_TUNABLES")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("MALLOC_")}


def run_child(setting: str, name: str, batch: int, warmup: int, calls: int) -> dict:
    code = _CHILD.format(here=str(Path(__file__).resolve().parent))
    argv = [sys.executable, "-c", code, setting, name, str(batch), str(warmup), str(calls)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"child {setting} {name} b={batch} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["vgg", "resnet18", "mobilenetv2"])
    ap.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    ap.add_argument("--repeats", type=int, default=3, help="child pairs per model and batch")
    ap.add_argument("--warmup", type=int, default=3, help="untimed passes per child")
    ap.add_argument("--calls", type=int, default=8, help="timed passes per child")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if min(args.repeats, args.warmup, args.calls, *args.batches) < 1:
        ap.error("--repeats, --warmup, --calls and --batches must be >= 1")
    rows = []
    print(f"{'model':<13}{'batch':>6}{'faults/pass':>14}{'faults/pass':>14}"
          f"{'ms default':>12}{'ms retain':>11}{'default/retain':>16}")  # fmt: skip
    print(f"{'':<13}{'':>6}{'default':>14}{'retain':>14}")
    for name in args.models:
        for batch in args.batches:
            got: dict[str, dict[str, list[float]]] = {
                s: {"seconds": [], "faults": []} for s in SETTINGS
            }
            applied = True
            for r in range(args.repeats):
                order = SETTINGS if r % 2 == 0 else SETTINGS[::-1]
                for setting in order:
                    out = run_child(setting, name, batch, args.warmup, args.calls)
                    got[setting]["seconds"] += out["seconds"]
                    got[setting]["faults"] += out["faults"]
                    applied = applied and (setting != "retain" or out["applied"])
            med = {s: {k: statistics.median(v) for k, v in got[s].items()} for s in SETTINGS}
            ratio = med["glibc-default"]["seconds"] / med["retain"]["seconds"]
            rows.append(
                {"model": name, "batch": batch, "retain_applied": applied, "median": med,
                 "latency_ratio_default_over_retain": ratio, "raw": got}
            )  # fmt: skip
            print(
                f"{name:<13}{batch:>6}{med['glibc-default']['faults']:>14.0f}"
                f"{med['retain']['faults']:>14.0f}{med['glibc-default']['seconds'] * 1e3:>12.1f}"
                f"{med['retain']['seconds'] * 1e3:>11.1f}{ratio:>16.2f}"
            )
    result = {
        "benchmark": "allocator",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "threads": 1,
        "load_average_after": os.getloadavg(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": rows,
    }
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
