"""Peak memory of training from a Parquet file streamed in record batches, against its size.

A generated Parquet file (``--features`` float32 columns and an integer label, row groups of
65,536 rows) of each ``--sizes`` (GB) is trained on by ``PruningTrainer`` with
``stream="always"``: the scan reads every row once (split, label check, statistics for the
standardisation), then ``--steps`` training steps read the file batch by batch through a
shuffle buffer of ``--shuffle_buffer`` rows, and the dense and final evaluations read the eval
split from the file again. Each run is a fresh Python process that reports its own peak
resident set size (``getrusage(RUSAGE_SELF).ru_maxrss``), so one run's memory cannot hide
another's. For contrast, the smallest file is also loaded whole (``stream="never"``), and a
process that only imports torch and fisherprune gives the floor.

Run::

    python benchmarks/streaming_memory.py --sizes 0.25,1            # ~5 minutes on 2 cores
    python benchmarks/streaming_memory.py --sizes 1,10 --keep_files  # the issue's 10 GB file

The files go to ``--dir`` (default a temporary folder, deleted afterwards unless
``--keep_files``); the JSON to ``--out`` (default ``benchmarks/results/streaming_memory.json``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from _common import machine_info, write_json

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks/results/streaming_memory.json"
ROW_GROUP = 65_536

_CHILD = """
import json, resource, sys, time
import torch
from fisherprune.train.config import TrainConfig
from fisherprune.train.data import DataSpec, load_data
from fisherprune.train.trainer import PruningTrainer
args = json.loads(sys.argv[1])
out = {}
if args["mode"] != "imports":
    t = time.perf_counter()
    data = load_data(DataSpec(args["path"], stream=args["mode"],
                              shuffle_buffer=args["shuffle_buffer"]))
    out["load_s"] = time.perf_counter() - t
    out["train_rows"], out["eval_rows"] = data.num_train, data.num_eval
    cfg = TrainConfig(
        data=args["path"], model="mlp", width=64, depth=2, batch_size=256, steps=args["steps"],
        pruning_burn_in=args["steps"] // 2, pruning_iter=1, fine_tune_steps=4,
        eval_every=10**9, checkpoint_every=10**9, save_dir=args["save_dir"],
        export_formats=["state_dict"], progress="none", threads=2,
    )
    t = time.perf_counter()
    result = PruningTrainer(cfg, data=data).run()
    out["train_s"] = time.perf_counter() - t
    out["dense_accuracy"], out["final_accuracy"] = result.dense_metric, result.final_metric
out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def write_parquet(path: Path, gigabytes: float, features: int, seed: int = 0) -> int:
    """Write about ``gigabytes`` of float32 features and a 2-class label (a noisy linear rule)
    in row groups of ``ROW_GROUP`` rows; return the row count. Memory: one row group."""
    rows = max(ROW_GROUP, int(gigabytes * 1e9 / (4 * features + 8)))
    rng = np.random.default_rng(seed)
    w = rng.normal(size=features)
    schema = pa.schema([*(pa.field(f"f{i}", pa.float32()) for i in range(features)),
                        pa.field("label", pa.int64())])  # fmt: skip
    with pq.ParquetWriter(path, schema, compression="none") as writer:
        for lo in range(0, rows, ROW_GROUP):
            n = min(ROW_GROUP, rows - lo)
            x = rng.normal(size=(n, features)).astype(np.float32) * 3 + 10
            y = ((x - 10) @ w + rng.normal(size=n) > 0).astype(np.int64)
            cols = [pa.array(x[:, i]) for i in range(features)] + [pa.array(y)]
            writer.write_table(pa.Table.from_arrays(cols, schema=schema), ROW_GROUP)
    return rows


def run_child(args: dict) -> dict:
    """One measurement in a fresh process; its JSON line."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(args)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.25,1", help="file sizes in GB, comma-separated")
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--shuffle_buffer", type=int, default=65_536)
    p.add_argument("--dir", default=None, help="where the files go (default: a temp folder)")
    p.add_argument("--keep_files", action="store_true")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    a = p.parse_args()
    sizes = [float(s) for s in a.sizes.split(",")]
    tmp = tempfile.TemporaryDirectory(dir=a.dir)
    folder = Path(a.dir) if a.keep_files and a.dir else Path(tmp.name)
    rows: list[dict] = []
    base = {"mode": "imports"}
    rows.append({"size_gb": 0.0, "mode": "imports only", **run_child(base)})
    for k, gb in enumerate(sizes):
        path = folder / f"stream_{gb:g}gb.parquet"
        t = time.perf_counter()
        n = write_parquet(path, gb, a.features)
        made = time.perf_counter() - t
        modes = ["always", "never"] if k == 0 else ["always"]
        for mode in modes:
            child = {
                "path": str(path),
                "mode": mode,
                "steps": a.steps,
                "shuffle_buffer": a.shuffle_buffer,
                "save_dir": str(folder / "run"),
            }
            r = run_child(child)
            rows.append({"size_gb": path.stat().st_size / 1e9, "rows": n, "write_s": made,
                         "mode": "streamed" if mode == "always" else "whole", **r})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        if not a.keep_files:
            path.unlink()
    print()
    print("| file GB | rows | read | load/scan s | train s | dense acc | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['size_gb']:.2f} | {r.get('rows', 0):,} | {r['mode']} | "
            f"{r.get('load_s', 0):.1f} | {r.get('train_s', 0):.1f} | "
            f"{r.get('dense_accuracy', float('nan')):.3f} | {r['peak_rss_mb']:,.0f} |"
        )
    write_json(
        Path(a.out),
        {
            "benchmark": "streaming_memory",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "settings": vars(a),
            "machine": machine_info(),
            "rows": rows,
        },
    )
    if not a.keep_files:
        tmp.cleanup()


if __name__ == "__main__":
    main()
