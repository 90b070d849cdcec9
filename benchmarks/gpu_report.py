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
TARGETS = {"b": 1.10, "c": 1.01, "f": 1.01, "throughput": 0.9, "memory": 1.10}


def load(folder: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("gpu_*.json"))]
    runs = [r for r in runs if r.get("benchmark") == "gpu"]
    prof = folder / "gpu_profile.json"
    return runs, json.loads(prof.read_text()) if prof.exists() else None


def earlier(folder: Path) -> tuple[str, dict[str, dict[str, Any]]]:
    """The newest earlier run kept beside the latest (a subfolder named by its date): its
    name and its ``gpu.py`` results by network ("" and {} where there is none)."""
    dated = sorted(p for p in folder.iterdir() if p.is_dir() and p.name[:2] == "20")
    if not dated:
        return "", {}
    runs, _ = load(dated[-1])
    return dated[-1].name, {n: r for r in runs for n in r["steps"]}


def step_table(runs: list[dict[str, Any]], before: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| network | variant | ms/step | ratio (paired) | target | earlier run | peak memory "
        "| host syncs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for name, res in run["steps"].items():
            old = before.get(name, {})
            for v, r in res["variants"].items():
                mem = res["memory"].get(v, {}).get("ratio", float("nan"))
                target = f"≤ {TARGETS[v]:.2f}" if v in TARGETS else ""
                was = old.get("steps", {}).get(name, {}).get("variants", {}).get(v)
                was_cell = f"{was['ratio']:.3f} ({was['paired_ratio']:.3f})" if was else ""
                lines.append(
                    f"| {name} | ({v}) {r['label']} | {r['median_ms']:.2f} | "
                    f"{r['ratio']:.3f} ({r['paired_ratio']:.3f}) | {target} | {was_cell} | "
                    f"{mem:.3f} | {res['sync_check'].get(v, '-')} |"
                )
            for v, r in res.get("compiled_variants", {}).items():
                target = f"≤ {TARGETS[v]:.2f}" if v == "b" else ""
                lines.append(
                    f"| {name} | ({v}+) {r['label']} (ratio to (a+)) | {r['median_ms']:.2f} | "
                    f"{r['ratio']:.3f} ({r['paired_ratio']:.3f}) | {target} | | | |"
                )
            t = run["throughput"][name]
            was_t = old.get("throughput", {}).get(name)
            was_cell = f"{was_t['on_over_off']:.3f}" if was_t else ""
            lines.append(
                f"| {name} | trainer's loop (prunes every 10 steps), examples/s | "
                f"{t['examples_per_s']['on']:.0f} vs {t['examples_per_s']['off']:.0f} | "
                f"{t['on_over_off']:.3f} | ≥ {TARGETS['throughput']} | {was_cell} | | "
                f"{res['sync_check'].get('pruning_optimizer', '-')} (no prune due) |"
            )
            t = run.get("compiled_throughput", {}).get(name)
            if t and "examples_per_s" in t:
                lines.append(
                    f"| {name} | trainer's loop, compiled (ratio to (a+)), examples/s | "
                    f"{t['examples_per_s']['on']:.0f} vs {t['examples_per_s']['off']:.0f} | "
                    f"{t['on_over_off']:.3f} | ≥ {TARGETS['throughput']} | | | |"
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
        "in either. (a+), (b+), (c+) and (g+) run the model's forward under `torch.compile` "
        "(inductor), as ratios to (a+): masks inside a compiled graph "
        "(`fisherprune.masks.compiled`; their kernels are generated code, not counted as "
        "operators); (g+) is the step `fisherprune train --compile` runs. Before that path, "
        "the compiled collecting step broke into a graph per mask point and ran 4.3x the "
        "compiled plain one (2-block encoder, 2026-11-30); with per-example leaves in place of "
        "the hand-over op (until 2026-11-30), 1.32-1.42x, and its first step at each batch "
        "size gathered nothing.",
        "",
        "| variant | ops/step | ops ratio | CPU ms | CPU ratio (paired) | H200 BERT-base ratio |",
        "|---|---|---|---|---|---|",
    ]
    gpu = data.get("gpu_h200_bert_base", {})
    for v, r in data["variants"].items():
        ops = f"{r['ops_per_step']} | {r['ops_ratio']:.3f}" if "ops_per_step" in r else "- | -"
        lines.append(
            f"| ({v}) {r['label']} | {ops} | "
            f"{r['cpu_ms_per_step']:.2f} | {r['cpu_ratio']:.3f} ({r['paired_ratio']:.3f}) | "
            f"{gpu.get(v, '')} |"
        )
    return [*lines, ""]


def check_section(folder: Path) -> list[str]:
    """What ``gpu_check.sh`` logged of the CUDA tests and the main job (``check.log``)."""
    log = folder / "check.log"
    if not log.exists():
        return []
    keep = ("pytest -m cuda", "main job rc", "dense:", "pruned:", "fisherprune train: warning")
    found = [ln.strip() for ln in log.read_text().splitlines() if ln.startswith(keep)]
    return [
        "## The CUDA tests and the main job (`benchmarks/gpu_check.sh`)",
        "",
        "`pytest -m cuda tests/test_cuda.py` (each test has a CPU twin in the normal suite) and "
        "the README's main job (`fisherprune train --precision bf16`: digits, the built-in "
        "CNN, on `cuda:0`), as logged:",
        "",
        "```",
        *found,
        "```",
        "",
    ]


def latency_prediction_section(folder: Path) -> list[str]:
    """``latency_prediction.py`` on the GPU (issue 32, point 3), one table per serving form."""
    files = sorted(folder.glob("latency_prediction_*.json"))
    if not files:
        return []
    lines = [
        "## The latency table's prediction on the GPU (`benchmarks/latency_prediction.py`)",
        "",
        'Each network pruned by weight L1 with `convention="latency"` to a share of its '
        "latency timed on this GPU (bf16, batch and form as given, `round_to=8`, the curve "
        "through copies keeping 0.5 and 0.25 of every width), shrunk, and timed whole beside "
        "the dense network. Share: shrunk over dense, predicted by the table and measured (the "
        "median of the rounds' ratios, quartiles in brackets); error: predicted over measured, "
        "less 1. A refused target lies below the network's floor in that form: in eager at "
        "these sizes the host's launches bound the forward, so no width makes it faster.",
        "",
        "| network | form | batch | target | predicted share | measured share | share error "
        "| table (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path in files:
        data = json.loads(path.read_text())
        st = data["settings"]
        for r in data["rows"]:
            for t in st["targets"]:
                c = r.get(t, {})
                head = f"| {r['model']} | {st['form']} | {st['batch']} | {t} |"
                if "out_of_reach" in c:
                    floor = c["out_of_reach"].split("its floor is ", 1)[-1].split(" ")[0]
                    lines.append(
                        f"{head} refused: floor {floor} | - | - | {r['table_seconds']:.0f} |"
                    )
                elif "predicted_share" in c:
                    iqr = c.get("measured_share_iqr") or [float("nan")] * 2
                    lines.append(
                        f"{head} {c['predicted_share']:.1%} | {c['measured_share']:.1%} "
                        f"({iqr[0]:.1%}-{iqr[1]:.1%}) | {c['share_error']:+.1%} | "
                        f"{r['table_seconds']:.0f} |"
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
    folder = Path(argv[0]).resolve() if argv else RESULTS
    # named from the repository where it lies in it (a folder elsewhere: as given)
    shown = folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder
    runs, prof = load(folder)
    when, before = earlier(folder)
    if not runs:
        print(f"no gpu.py results in {folder}", file=sys.stderr)
        return 1
    first = runs[0]
    head = [
        "# On a GPU",
        "",
        f"Generated by `benchmarks/gpu_report.py` from `{shown}` "
        f"(written by `benchmarks/gpu_check.sh` on the device). Card: {first['device_name']}; "
        f"torch {first['torch_version']} (CUDA {first['cuda_version']}); "
        f"{first['dtype']} autocast, fp32 weights; run {first['timestamp']}. "
        "Ratios are taken side by side in one process.",
        "",
        *check_section(folder),
        "## Training-step overhead, memory, host syncs",
        "",
        "(a) plain step of the unmasked network, (b) every mask `apply_masks` finds, collecting "
        "the Fisher signal, (c) the same pruned to 50% and no longer collecting, (f) (c) shrunk "
        "in place (`fisherprune.shrink(model, inplace=True, optimizer=...)`: what the trainer "
        "and the Lightning and Hugging Face integrations do once pruning is over, so (c) lasts "
        "only from the last prune to that call). 'pass' means no synchronising CUDA call in a "
        "few steps under `set_sync_debug_mode('warn')`. At batch 32 these steps are bound by "
        "the host, not the GPU (the profile below: BERT-base's plain step runs 11 ms of "
        "kernels in 31 ms of wall time): what masks cost here is the Python they run and the "
        "kernels they launch; the CPU stand-in at the end measures exactly that.",
        "",
    ]
    body = [*head, *step_table(runs, before), ""]
    if when:
        body += [f"Earlier run: `{shown}/{when}` (ratio, paired).", ""]
    if any(
        "FAIL" in str(c)
        for r in runs
        for res in r["steps"].values()
        for c in res["sync_check"].values()
    ):
        body += [
            "A 'FAIL' naming `torch/cuda/__init__.py` is torch's own notice that the sync "
            "debug mode is a prototype (`gpu.py` matches only 'called a synchronizing').",
            "",
        ]
    body += [
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
    body += latency_prediction_section(folder)
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
