"""How steady is a shrunk network's share of the dense network's time on this machine?

What is measured (issue 32, point 3: why a latency prediction missed on this CPU)
----------------------------------------------------------------------------------
ResNet-50 at 224x224, batch 1, masked by ``fisherprune.apply_masks``, and two copies keeping
0.5 and 0.25 of every mask's channels (the copies ``fit_latency_line`` times), shrunk. For
each thread count of ``--threads``, for ``--seconds`` seconds: rounds of the dense model,
then each copy, timed whole (``whole_model_seconds``: the fastest of its blocks), one after
the other, as ``fit_latency_line`` and ``latency_prediction.py`` time them.

Per thread count and copy: the rounds' shares (copy over dense) as a series, their quartiles,
and what a fit that times ``ROUNDS`` consecutive rounds would have read, over every window of
the series: the median of the window's ratios (the fit before 2026-11-30) and its fastest
copy over its fastest dense model (since). A share that moves between states lasting longer
than a window moves both; the fastest times read the quiet state whenever a window holds any.

With ``--model decoder_lm``: the one-shot text suite's trained character decoder (many small
operators: 4 layers of width 64, 64 characters) at batch 16, as ``latency_vs_flops.py`` times
it, where identical prunes measured 5-6 points apart between two runs at one thread.

Run: ``python benchmarks/timing_regimes.py [--model resnet50] [--threads 1 2] [--seconds 90]``
on an otherwise idle machine; writes ``benchmarks/results/timing_regimes.json`` (for another
model ``timing_regimes_<model>.json``) and, with matplotlib, the series to ``--plot``
(default ``docs/timing_regimes.png``, ``docs/timing_regimes_<model>.png``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, write_json
from standard_nets import build_resnet50

import fisherprune as fp
from fisherprune.calibrate.latency_line import ROUNDS
from fisherprune.cost import LatencySpec
from fisherprune.cost.latency import whole_model_seconds
from fisherprune.export.latency import retain_freed_memory
from fisherprune.masks import masks_kept

HERE = Path(__file__).resolve().parent
SHARES = (0.5, 0.25)


def _resnet50() -> tuple[torch.nn.Module, Any, str]:
    torch.manual_seed(0)
    return build_resnet50().eval(), torch.randn(1, 3, 224, 224), "ResNet-50, batch 1"


def _decoder_lm() -> tuple[torch.nn.Module, Any, str]:
    from latency_vs_flops import NET_BATCH
    from one_shot_text import decoder_task

    from fisherprune.cost.latency import with_batch

    task = decoder_task(0)
    batch = NET_BATCH["decoder_lm"]
    return task.dense.eval(), with_batch(task.example, batch), f"decoder_lm, batch {batch}"


#: the networks, each with its input at the batch it is timed at and a title
MODELS = {"resnet50": _resnet50, "decoder_lm": _decoder_lm}


def _paths(model: str) -> tuple[Path, Path]:
    """The JSON and the plot of ``model`` (ResNet-50's keep their first names)."""
    tail = "" if model == "resnet50" else f"_{model}"
    return HERE / "results" / f"timing_regimes{tail}.json", (
        HERE.parent / "docs" / f"timing_regimes{tail}.png"
    )


def _copies(model: torch.nn.Module, x: torch.Tensor) -> list[torch.nn.Module]:
    """``model`` shrunk with each of ``SHARES`` of every mask's channels kept."""
    masks = fp.find_masks(model)
    out = []
    for share in SHARES:
        kept = {n: max(1, math.ceil(share * m.num_channels)) for n, m in masks.items()}
        with warnings.catch_warnings(), masks_kept(model, kept):
            warnings.simplefilter("ignore")
            out.append(fp.shrink(model, x, check=False))
    return out


def _windows(dense: list[float], small: list[float]) -> dict[str, list[float]]:
    """What a fit timing ``ROUNDS`` consecutive rounds reads, for every window."""
    med, fastest = [], []
    for i in range(len(dense) - ROUNDS + 1):
        d, s = dense[i : i + ROUNDS], small[i : i + ROUNDS]
        med.append(statistics.median(b / a for a, b in zip(d, s, strict=True)))
        fastest.append(min(s) / min(d))
    return {"median_of_ratios": med, "fastest_over_fastest": fastest}


def _quartiles(xs: list[float]) -> list[float]:
    return [float(q) for q in np.quantile(xs, [0.0, 0.25, 0.5, 0.75, 1.0])]


def run(threads: int, seconds: float, model: torch.nn.Module, x: torch.Tensor) -> dict[str, Any]:
    spec = LatencySpec(threads=threads)
    torch.set_num_threads(threads)
    smalls = _copies(model, x)
    clock, dense, times = [], [], [[] for _ in smalls]
    start = time.perf_counter()
    with masks_kept(model, {}):
        while time.perf_counter() - start < seconds:
            clock.append(time.perf_counter() - start)
            dense.append(whole_model_seconds(model, x, spec))
            for ts, small in zip(times, smalls, strict=True):
                ts.append(whole_model_seconds(small, x, spec))
    row: dict[str, Any] = {"threads": threads, "rounds": len(dense), "clock": clock,
                           "dense_s": dense, "copies": {}}  # fmt: skip
    for share, ts in zip(SHARES, times, strict=True):
        series = [b / a for a, b in zip(dense, ts, strict=True)]
        windows = _windows(dense, ts)
        row["copies"][str(share)] = {
            "seconds": ts,
            "share_by_round": series,
            "share_quantiles": _quartiles(series),
            "windows": {k: _quartiles(v) for k, v in windows.items()},
        }
    return row


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for r in rows:
        for share, c in r["copies"].items():
            ax.plot(r["clock"], c["share_by_round"], ".-", ms=3, lw=0.6,
                    label=f"{r['threads']} thread(s), copy keeping {share}")  # fmt: skip
    ax.set_xlabel("seconds")
    ax.set_ylabel("copy over dense, per round")
    ax.set_title(f"{title}: a shrunk copy's share of the dense time")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet50")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--out", type=Path, help="default: results/timing_regimes[_model].json")
    parser.add_argument("--plot", type=Path, help="default: docs/timing_regimes[_model].png")
    args = parser.parse_args()
    out, plot = _paths(args.model)
    args.out, args.plot = args.out or out, args.plot or plot
    retain_freed_memory()
    model, x, title = MODELS[args.model]()
    fp.apply_masks(model, x[:1])
    rows = [run(t, args.seconds, model, x) for t in args.threads]
    print(f"\nwindows of {ROUNDS} rounds: min / quartiles / max of what a fit reads\n")
    print("| threads | copy | rounds | share by round | median of ratios | fastest over fastest |")
    print("|---|---|---|---|---|---|")
    fmt = lambda q: " / ".join(f"{v:.3f}" for v in q)  # noqa: E731
    for r in rows:
        for share, c in r["copies"].items():
            w = c["windows"]
            print(f"| {r['threads']} | {share} | {r['rounds']} | {fmt(c['share_quantiles'])} | "
                  f"{fmt(w['median_of_ratios'])} | {fmt(w['fastest_over_fastest'])} |")  # fmt: skip
    write_json(args.out, {"settings": {"model": args.model, "title": title,
                                       "threads": args.threads, "seconds": args.seconds,
                                       "rounds_per_fit": ROUNDS, "torch": torch.__version__},
                          "machine": machine_info(), "rows": rows})  # fmt: skip
    _plot(rows, args.plot, title)


if __name__ == "__main__":
    main()
