"""``fisherprune train`` on scikit-learn's tabular data sets written to CSV and Parquet, as a
user would bring them, against scikit-learn references on the same split.

For each data set: an 80/20 stratified split (seed 0) written as raw features (no scaling:
``fisherprune train`` standardises them itself), then ``fisherprune train --model mlp`` to
50% of the FLOPs; the reference is ``StandardScaler`` + ``MLPClassifier((64,))`` (or
``MLPRegressor`` and ``Ridge`` for the regressions: diabetes and ``make_friedman1``, 1,000 rows
with noise 1) fitted on the same training rows; regressions are also scored by R^2 on the eval
rows. Prints a table and writes ``benchmarks/results/tables.json``.

    python benchmarks/tables.py [--formats csv,parquet] [--sets wine,iris,...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
from _common import machine_info, write_json
from sklearn import datasets
from sklearn.linear_model import Ridge
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier, MLPRegressor
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

SETS = ("wine", "breast_cancer", "iris", "digits", "diabetes", "friedman1")
REGRESSIONS = ("diabetes", "friedman1")
RESULTS = Path(__file__).parent / "results" / "tables.json"


def _reference(name: str, xtr, xev, ytr, yev) -> dict[str, float]:
    if name in REGRESSIONS:
        mlp = MLPRegressor(hidden_layer_sizes=(64,), max_iter=5000, random_state=0)
        out = {}
        for key, est in (("mlp", mlp), ("ridge", Ridge())):
            pred = make_pipeline(StandardScaler(), est).fit(xtr, ytr).predict(xev)
            out[key] = float(np.mean((pred - yev) ** 2))
        return out
    clf = MLPClassifier(hidden_layer_sizes=(64,), max_iter=2000, random_state=0)
    return {"mlp": float(make_pipeline(StandardScaler(), clf).fit(xtr, ytr).score(xev, yev))}


def _write(path: Path, x: np.ndarray, y: np.ndarray, fmt: str) -> Path:
    cols = {f"f{j}": x[:, j].astype(np.float64) for j in range(x.shape[1])}
    table = pa.table({**cols, "label": y})
    if fmt == "csv":
        pcsv.write_csv(table, path.with_suffix(".csv"))
        return path.with_suffix(".csv")
    pq.write_table(table, path.with_suffix(".parquet"))
    return path.with_suffix(".parquet")


def _load(name: str) -> tuple[np.ndarray, np.ndarray]:
    if name == "friedman1":
        return datasets.make_friedman1(n_samples=1000, noise=1.0, random_state=0)
    return getattr(datasets, f"load_{name}")(return_X_y=True)


def _r2(mse: float, y: np.ndarray) -> float:
    """R^2 of a predictor with eval MSE ``mse`` on targets ``y``."""
    return 1.0 - mse / float(np.var(y))


def run_one(name: str, fmt: str, root: Path) -> dict[str, Any]:
    x, y = _load(name)
    regression = name in REGRESSIONS
    strat = None if regression else y
    xtr, xev, ytr, yev = train_test_split(x, y, test_size=0.2, random_state=0, stratify=strat)
    ref = _reference(name, xtr, xev, ytr, yev)
    row: dict[str, Any] = {"set": name, "format": fmt, "reference": ref}
    cast = np.float64 if regression else np.int64
    train = _write(root / f"{name}_train", xtr, ytr.astype(cast), fmt)
    evals = _write(root / f"{name}_eval", xev, yev.astype(cast), fmt)
    save = root / f"run_{name}_{fmt}"
    cmd = [sys.executable, "-m", "fisherprune", "train", "--data", str(train),
           "--eval_data", str(evals), "--label", "label", "--model", "mlp",
           "--pruning.flops_target", "50%", "--save_dir", str(save),
           "--export_formats", "state_dict", "--progress", "none", "--threads", "1"]  # fmt: skip
    if regression:
        cmd += ["--task", "regression"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    row["seconds"] = time.perf_counter() - t0
    if done.returncode:
        row["error"] = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"
        return row
    r = json.loads((save / "result.json").read_text())
    row.update(
        metric="mse" if regression else "accuracy",
        dense=r["dense_metric"],
        pruned=r["final_metric"],
        flops_kept=r["final_cost"] / r["dense_cost"],
        steps=r["steps"],
        dense_learned=r.get("dense_learned"),
    )
    if regression:
        row["r2"] = {
            "dense": _r2(row["dense"], yev),
            "pruned": _r2(row["pruned"], yev),
            **{k: _r2(v, yev) for k, v in ref.items()},
        }
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="csv,parquet")
    p.add_argument("--sets", default=",".join(SETS))
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in args.sets.split(","):
            for fmt in args.formats.split(","):
                row = run_one(name, fmt, Path(d))
                rows.append(row)
                ref = ", ".join(f"{k} {v:.4g}" for k, v in row["reference"].items())
                got = row.get("error") or (
                    f"dense {row['dense']:.4g}  pruned {row['pruned']:.4g}  "
                    f"FLOPs kept {row['flops_kept']:.3f}  ({row['seconds']:.0f} s)"
                )
                if "r2" in row:
                    got += "  R^2 " + ", ".join(f"{k} {v:.3f}" for k, v in row["r2"].items())
                print(f"{name:14s} {fmt:8s} sklearn {ref:28s} fisherprune {got}", flush=True)
    result = {
        "benchmark": "tables",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "rows": rows,
    }
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
