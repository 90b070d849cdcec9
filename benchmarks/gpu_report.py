"""Write ``docs/gpu.md`` and ``docs/gpu.png`` from the GPU check's results
(``benchmarks/results/gpu_h200/``: ``gpu_*.json`` of ``gpu.py`` and ``gpu_profile.json`` of
``gpu_profile.py``, as ``gpu_check.sh`` wrote them on the device). Reads JSON only: it runs
anywhere, with no GPU. ``python benchmarks/gpu_report.py [results folder]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "gpu_h200"
#: the issue's targets for a training step, as ratios to a plain step of the unmasked network
TARGETS = {"b": 1.10, "c": 1.01, "throughput": 0.9, "memory": 1.10}


def load(folder: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("gpu_*.json"))]
    runs = [r for r in runs if r.get("benchmark") == "gpu"]
    prof = folder / "gpu_profile.json"
    return runs, json.loads(prof.read_text()) if prof.exists() else None


def step_table(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| network | variant | ms/step | ratio (paired) | target | peak memory | host syncs |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for name, res in run["steps"].items():
            for v, r in res["variants"].items():
                mem = res["memory"].get(v, {}).get("ratio", float("nan"))
                target = f"≤ {TARGETS[v]:.2f}" if v in TARGETS else ""
                lines.append(
                    f"| {name} | ({v}) {r['label']} | {r['median_ms']:.2f} | "
                    f"{r['ratio']:.3f} ({r['paired_ratio']:.3f}) | {target} | {mem:.3f} | "
                    f"{res['sync_check'].get(v, '-')} |"
                )
            t = run["throughput"][name]
            lines.append(
                f"| {name} | trainer's loop (prunes every 10 steps), examples/s | "
                f"{t['examples_per_s']['on']:.0f} vs {t['examples_per_s']['off']:.0f} | "
                f"{t['on_over_off']:.3f} | ≥ {TARGETS['throughput']} | | "
                f"{res['sync_check'].get('pruning_optimizer', '-')} (no prune due) |"
            )
    return lines


def latency_table(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| network | batch | form | shrunk to | ms | speed-up | FLOPs reduction | eff | bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for name, res in run["latency"].items():
            for r in res["rows"]:
                bound = r.get("bound") if r["form"] == "eager" else None
                lines.append(
                    f"| {name} | {r.get('batch', '')} | {r['form']} | {r['network']} | "
                    f"{r['latency_ms']:.2f} | {r['speedup']:.2f} | {r['flops_reduction']:.2f} | "
                    f"{r['efficiency']:.2f} | {bound or ''} |"
                )
    return lines


def profile_table(prof: dict[str, Any]) -> list[str]:
    lines = [
        "| network | variant | wall ms | kernel ms | kernels per step |",
        "|---|---|---|---|---|",
    ]
    for name, res in prof.items():
        if not isinstance(res, dict) or "variants" not in res:
            continue
        for v, r in res["variants"].items():
            lines.append(
                f"| {name} | {v} | {r['wall_ms']:.1f} | {r['device_ms']:.1f} | "
                f"{r['kernels_per_step']:.0f} |"
            )
    return lines


def host_section(path: Path) -> list[str]:
    """The CPU stand-in for the host-bound step (``benchmarks/host_overhead.py``), if run."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    lines = [
        "## The host's share, measured without a GPU (`benchmarks/host_overhead.py`)",
        "",
        "The BERT-shaped encoder with all its blocks, heads and masks but tiny widths (d "
        f"{data['shape']['d']}, {data['shape']['length']} tokens, batch {data['batch']}), one "
        "CPU thread: every operator is cheap, so a step's time is the host's, as on the GPU "
        "above. ATen operators per step (the launches a GPU pays) and process CPU time per "
        f"step as ratios to (a), measured {data['date'][:10]} on the CPU (torch "
        f"{data['torch']}). (f) is (c) shrunk in place, as `fisherprune.shrink(model, "
        "inplace=True, optimizer=...)` leaves a run once pruning is over; (g) is the "
        "trainer's loop (`PruningOptimizer.minimize`, a prune every 10th step), CPU time per "
        "step over rounds of 10 steps, and its H200 figure is one over that loop's throughput "
        "ratio. The CPU ratio is the ratio of the medians; in brackets the median of the "
        "rounds' paired ratios. Runs of the same code a few minutes apart differ by up to 0.1 "
        "in either.",
        "",
        "| variant | ops/step | ops ratio | CPU ms | CPU ratio (paired) | H200 BERT-base ratio |",
        "|---|---|---|---|---|---|",
    ]
    gpu = data.get("gpu_h200_bert_base", {})
    for v, r in data["variants"].items():
        lines.append(
            f"| ({v}) {r['label']} | {r['ops_per_step']} | {r['ops_ratio']:.3f} | "
            f"{r['cpu_ms_per_step']:.2f} | {r['cpu_ratio']:.3f} ({r['paired_ratio']:.3f}) | "
            f"{gpu.get(v, '')} |"
        )
    return [*lines, ""]


def plot(runs: list[dict[str, Any]], out: Path) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels, b, c = [], [], []
    for run in runs:
        for name, res in run["steps"].items():
            labels.append(name)
            b.append(res["variants"]["b"]["ratio"])
            c.append(res["variants"]["c"]["ratio"])
    xs = range(len(labels))
    ax1.bar([x - 0.2 for x in xs], b, 0.4, label="(b) collecting")
    ax1.bar([x + 0.2 for x in xs], c, 0.4, label="(c) pruned, not collecting")
    ax1.axhline(TARGETS["b"], ls="--", c="k", lw=1, label="target (b)")
    ax1.set_xticks(list(xs), labels)
    ax1.set_ylabel("step time / plain step")
    ax1.set_title("training-step overhead, bf16, batch 32")
    ax1.legend(fontsize=8)
    for run in runs:
        for name, res in run["latency"].items():
            for form, style in (("eager", "-o"), ("cuda graph", "--s")):
                for net in sorted({r["network"] for r in res["rows"] if r["network"] != "dense"}):
                    pts = sorted(
                        (r["batch"], r["efficiency"])
                        for r in res["rows"]
                        if r["form"] == form and r["network"] == net and "batch" in r
                    )
                    if pts:
                        ax2.plot(*zip(*pts, strict=True), style, label=f"{name} {form} {net}")
    ax2.axhline(0.7, ls="--", c="k", lw=1)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("batch")
    ax2.set_ylabel("speed-up / FLOPs reduction")
    ax2.set_title("latency of the shrunk encoder")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else RESULTS
    runs, prof = load(folder)
    if not runs:
        print(f"no gpu.py results in {folder}", file=sys.stderr)
        return 1
    first = runs[0]
    head = [
        "# On a GPU",
        "",
        f"Generated by `benchmarks/gpu_report.py` from `{folder.relative_to(ROOT)}` "
        f"(written by `benchmarks/gpu_check.sh` on the device). Card: {first['device_name']}; "
        f"torch {first['torch_version']} (CUDA {first['cuda_version']}); "
        f"{first['dtype']} autocast, fp32 weights; run {first['timestamp']}. "
        "Ratios are taken side by side in one process.",
        "",
        "## Training-step overhead, memory, host syncs",
        "",
        "(a) plain step of the unmasked network, (b) every mask `apply_masks` finds, collecting "
        "the Fisher signal, (c) the same pruned to 50% and no longer collecting. 'pass' means no "
        "synchronising CUDA call in a few steps under `set_sync_debug_mode('warn')`.",
        "",
    ]
    body = [*head, *step_table(runs), ""]
    body += [
        "A 'FAIL' naming `torch/cuda/__init__.py` is torch's own notice that the sync debug mode "
        "is a prototype, raised once per process by the first variant checked (the matcher of "
        "that run took it for a sync; `gpu.py` now matches only 'called a synchronizing').",
        "",
        "![overhead and latency](gpu.png)",
        "",
    ]
    body += ["## Latency of the shrunk encoders as served", ""]
    body += [
        "Dense against shrunk (`uniform=True`, `round_to=8`), eager and replayed as one CUDA "
        "graph. 'launch' marks an eager forward slower than its CUDA graph by more than 1.3x: "
        "the host's kernel launches, not the arithmetic, bound it there, and pruning cannot "
        "speed it up in that form.",
        "",
        *latency_table(runs),
        "",
    ]
    if prof:
        body += ["## Where the time goes (`benchmarks/gpu_profile.py`)", ""]
        body += [
            "Wall time against kernel time per step under `torch.profiler` (the profiler adds "
            "its own host time to the wall column): the masked steps launch more kernels and "
            "run more Python per step; their kernel time grows by a few percent only.",
            "",
            *profile_table(prof),
            "",
        ]
    body += host_section(ROOT / "benchmarks" / "results" / "host_overhead.json")
    out = ROOT / "docs"
    plot(runs, out / "gpu.png")
    (out / "gpu.md").write_text("\n".join(body) + "\n")
    print(f"wrote {out / 'gpu.md'} and {out / 'gpu.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
