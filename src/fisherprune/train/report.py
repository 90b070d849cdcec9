"""The run report: Markdown with PNG plots (plots need matplotlib: ``fisherprune[report]``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from fisherprune.cost.conventions import cost_unit
from fisherprune.pruner import PruningOptimizer
from fisherprune.train.config import TrainConfig
from fisherprune.train.result import TrainResult

__all__ = ["write_report"]


def _plots(
    save_dir: Path, metrics: list[dict[str, Any]], popt: PruningOptimizer, metric_name: str
) -> dict[str, str]:
    if importlib.util.find_spec("matplotlib") is None:
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: dict[str, str] = {}
    evals = [m for m in metrics if m["kind"] in ("dense", "eval", "final")]
    if evals:
        fig, ax1 = plt.subplots(figsize=(6, 3.5))
        steps = [m["step"] for m in evals]
        ax1.plot(steps, [m[metric_name] for m in evals], "o-", color="tab:blue")
        ax1.set_xlabel("step")
        ax1.set_ylabel(f"eval {metric_name}", color="tab:blue")
        ax2 = ax1.twinx()
        ax2.plot(steps, [m["cost"] / popt.start_cost for m in evals], "s--", color="tab:red")
        ax2.set_ylabel("cost / starting cost", color="tab:red")
        ax2.set_ylim(0, 1.05)
        fig.tight_layout()
        path = save_dir / "training.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        files["plot_training"] = str(path)
    names = list(popt.masks)
    if names:
        fig, ax = plt.subplots(figsize=(6, 0.35 * len(names) + 1))
        total = [popt.masks[n].num_channels for n in names]
        kept = [popt.masks[n].kept for n in names]
        labels = [n.removeprefix("fisherprune_masks.") for n in names]
        ax.barh(labels, total, color="lightgray", label="dense")
        ax.barh(labels, kept, color="tab:green", label="kept")
        ax.invert_yaxis()
        ax.set_xlabel("channels")
        ax.legend(loc="lower right")
        fig.tight_layout()
        path = save_dir / "channels.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        files["plot_channels"] = str(path)
    return files


def write_report(
    save_dir: Path,
    config: TrainConfig,
    metrics: list[dict[str, Any]],
    popt: PruningOptimizer,
    result: TrainResult,
) -> dict[str, str]:
    """Write ``report.md`` (and plots) into ``save_dir``; return the files written."""
    metric_name, final, cost = result.metric_name, result.final_metric, result.final_cost
    dense = {metric_name: result.dense_metric, "cost": result.dense_cost}
    dense_params, small_params, latency = result.dense_params, result.final_params, result.latency
    files = _plots(save_dir, metrics, popt, metric_name)
    conv = config.pruning_convention
    lines = [
        "# fisherprune run report",
        "",
        f"Data `{config.data}`, model `{config.model}`, target `{config.pruning_flops_target}` "
        f"({conv}), channels weighed against {popt.score_convention}, flops_weight "
        f"`{config.pruning_flops_weight}`, min_channels {config.pruning_min_channels}, "
        f"round_to {popt.round_to}, seed {config.seed}.",
        "",
        "| | dense | pruned | ratio |",
        "|---|---:|---:|---:|",
        f"| eval {metric_name} | {dense[metric_name]:.4f} | {final:.4f} | |",
        f"| {cost_unit(conv)} | {dense['cost']:,.0f} | {cost:,.0f} | {cost / dense['cost']:.3f} |",
        f"| parameters | {dense_params:,} | {small_params:,} | {small_params / dense_params:.3f} |",
    ]
    for label, prefix in (("eager", ""), ("as served", "served_")):
        for bs in (1, 64):
            cells = result.latency_cells(prefix, bs)
            if cells is not None:
                dense_ms, pruned_ms, speedup = cells
                lines.append(
                    f"| CPU latency {label}, batch {bs} | {dense_ms} | {pruned_ms} | {speedup} |"
                )
    served = (
        "As served: frozen TorchScript (`fisherprune export --format torchscript --freeze`), "
        'channels-last for images; see "Serving a shrunk model on CPU" in docs/usage.md.'
        if "served_speedup_b64" in latency
        else "Not timed as served (frozen TorchScript): the model could not be traced; the "
        "run's output says why."
    )
    lines += [
        "",
        f"Latency: {latency['conditions']}, on {latency['device']}; the median of the blocks "
        "timed in rounds, dense and pruned side by side (alternating which goes first), ± half "
        "their interquartile range. The ratio is the median of the rounds' paired ratios with "
        "its interquartile range; where that range includes 1.0 the rounds disagree on which "
        "model is faster, and no ratio is given. Every block is in result.json. Eager: the "
        "modules as trained, in the input's layout. "
        f"{served}",
        "",
        "## Channels kept per group",
        "",
        "| group | kept | of |",
        "|---|---:|---:|",
    ]
    for n, m in popt.masks.items():
        lines.append(f"| {n.removeprefix('fisherprune_masks.')} | {m.kept} | {m.num_channels} |")
    if files:
        lines += ["", "## Plots", ""]
        lines += [f"![{k}]({Path(v).name})" for k, v in files.items()]
    else:
        lines += ["", "(plots skipped: install matplotlib, `pip install 'fisherprune[report]'`)"]
    path = save_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    files["report"] = str(path)
    return files
