"""How long ``apply_masks`` and ``computational_cost`` take on a ResNet-50-sized network (or,
with ``--model``, BERT-base, ViT-B/16, Swin-B, MViT-v2-S or a hierarchical transformer).

What is measured
----------------
``--model resnet50`` (the default): a bottleneck ResNet-50 written here by hand (torchvision
layout: 7x7 stem, max-pool, stages of [3, 4, 6, 3] bottleneck blocks with widths 64..512 and
expansion 4, so 256..2048 output channels, projection shortcuts, in-place ReLU and
``out += identity``; 25.6 M parameters) on one 224x224 image (batch 1), CPU,
``torch.set_num_threads`` pinned:

* ``forward``: one plain ``torch.no_grad`` forward pass (the unit everything else is compared to);
* ``apply_masks``: tracing + grouping + installing the masks (``remove_masks`` between repeats,
  not timed), and its parts: ``trace`` (``trace_model``), ``group`` (``ChannelGraph`` +
  ``find_groups``);
* ``computational_cost``: trace + cost report (total and marginal cost of every channel) on the
  masked model.

``--model bert`` / ``vit``: ``standard_nets``' BERT-base (128 tokens) and ViT-B/16 (224x224),
one hidden width each. ``--model swin_b``: Hugging Face's Swin-B built from its config
(transformers; 224x224, 88 M parameters), the issue's hierarchical model written by others.
``--model mvit_v2_s``: torchvision's MViT-v2-S (16 frames of 224x224, 34.5 M parameters; random
weights), when torchvision imports; else the run stops with a one-line message. On the
project's machine the only torchvision wheel is built for CUDA torch and does not import beside
the CPU torch: the figures in ``results/trace_speed_mvit_v2_s.json`` were measured with a local
shim (not part of the project) that declares the two operator schemas torchvision's fake
registrations need, so that its pure-Python models import.

``--model hierarchical``: four stages of pre-norm blocks of widths 128-1024 (depths 2, 2, 6,
2, as Swin-B and MViT change width from stage to stage) on 3136 -> 49 tokens, each stage's
width its own hidden-width group: ``apply_masks`` tries every group with one shrink, so four
hidden widths must not cost four.

Each figure is the median of ``--repeats`` runs (default 3) after one warm-up run. The targets
(issue 34, 2 cores) are ``apply_masks`` under 5 s on ResNet-50, 10 s on BERT-base and ViT-B,
60 s on Swin-B, MViT-v2-S and the hierarchical stand-in. ``--profile`` also runs ``apply_masks`` and
``computational_cost`` once under cProfile and prints the functions with the largest own time.

Run ``python benchmarks/trace_speed.py``; the table is printed and the JSON written to ``--out``
(default ``benchmarks/results/trace_speed.json``).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import itertools
import os
import platform
import pstats
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import standard_nets
import torch
import torch.nn.functional as F
from _common import write_json
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.graph import ChannelGraph, find_groups, trace_model

#: issue 34's limits for apply_masks on 2 CPU cores, by --model (10 s for the rest)
TARGET_APPLY_S = {
    "resnet50": 5.0,
    "bert": 10.0,
    "swin_b": 60.0,
    "mvit_v2_s": 60.0,
    "hierarchical": 60.0,
}


# ------------------------------------------------------------------ ResNet-50
class Bottleneck(nn.Module):
    """1x1 (width) - 3x3 stride (width) - 1x1 (4 * width), BN after each; projection if needed."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class ResNet50(nn.Module):
    """ResNet-50 (He et al. 2016), torchvision module names; (N, 3, 224, 224) -> (N, 1000)."""

    def __init__(self, layers: tuple[int, ...] = (3, 4, 6, 3), classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin, stages = 64, []
        for i, (n, width) in enumerate(zip(layers, (64, 128, 256, 512), strict=True)):
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(cin, width, 2 if i > 0 and j == 0 else 1))
                cin = width * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class Hierarchical(nn.Module):
    """Stages of pre-norm blocks whose width doubles as the tokens quarter (pooled in fours,
    then a Linear to the next width): each stage's residual width is its own group."""

    def __init__(self, widths: tuple[int, ...] = (128, 256, 512, 1024)) -> None:
        super().__init__()
        depths = (2, 2, 6, 2)
        self.patch = nn.Conv2d(3, widths[0], 4, 4)
        self.stages = nn.ModuleList(
            nn.Sequential(*(standard_nets.Block(w, w // 32, 4 * w, True) for _ in range(n)))
            for w, n in zip(widths, depths, strict=True)
        )
        self.merge = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        self.norm = nn.LayerNorm(widths[-1])
        self.head = nn.Linear(widths[-1], 1000)

    def forward(self, x: Tensor) -> Tensor:
        h = self.patch(x).flatten(2).transpose(1, 2)
        for i, stage in enumerate(self.stages):
            if i:
                h = self.merge[i - 1](F.avg_pool1d(h.transpose(1, 2), 4).transpose(1, 2))
            h = stage(h)
        return self.head(self.norm(h).mean(1))


def _swin_b() -> nn.Module:
    """Hugging Face's Swin-B (Liu et al. 2021) from its config (embed 128, depths 2-2-18-2,
    heads 4-8-16-32, window 7, 224x224): shifted windows, relative-position bias tables per
    head and patch merging, as a user brings it (random weights: the trace reads shapes)."""
    from transformers import SwinConfig, SwinForImageClassification

    config = SwinConfig(embed_dim=128, depths=[2, 2, 18, 2], num_heads=[4, 8, 16, 32])
    return SwinForImageClassification(config)


def _mvit_v2_s() -> nn.Module:
    """torchvision's MViT-v2-S (Li et al. 2022): pooling attention with relative-position
    tables, heads merged to ``output_dim``, widths 96-768 over four stages; exits with one line
    when torchvision does not import."""
    try:
        from torchvision.models.video import mvit_v2_s
    except Exception as e:  # a missing wheel, or one built for another torch
        raise SystemExit(
            f"--model mvit_v2_s needs torchvision's video models, which do not import here "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    return mvit_v2_s()


def _first(out: Any) -> Tensor:
    """A model's output tensor (a Hugging Face output's first field)."""
    return out if isinstance(out, Tensor) else out[0]


def _model(name: str, size: int) -> tuple[nn.Module, Tensor]:
    """The network ``--model`` names and its example input (batch 1)."""
    if name == "bert":
        return standard_nets.build_bert_base(), torch.randint(0, 30522, (1, 128))
    if name == "swin_b":
        return _swin_b().eval(), torch.randn(1, 3, 224, 224)
    if name == "mvit_v2_s":  # its position embeddings fix 16 frames of 224x224
        return _mvit_v2_s().eval(), torch.randn(1, 3, 16, 224, 224)
    net = {"resnet50": ResNet50, "vit": standard_nets.build_vit_b16, "hierarchical": Hierarchical}
    return net[name]().eval(), torch.randn(1, 3, size, size)


# -------------------------------------------------------------------- timing
def _time(fn: Callable[[], Any], repeats: int, between: Callable[[], Any] | None = None) -> dict:
    fn()  # warm-up
    if between is not None:
        between()
    runs = []
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
        gc.enable()
        if between is not None:
            between()
    return {"median_s": statistics.median(runs), "runs_s": runs}


def _profile(fn: Callable[[], Any], top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        choices=("resnet50", "bert", "vit", "hierarchical", "swin_b", "mvit_v2_s"),
        default="resnet50",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", type=int, default=224, help="input height and width")
    ap.add_argument("--profile", action="store_true", help="cProfile apply_masks and cost once")
    ap.add_argument("--top", type=int, default=25, help="rows of the profile to print")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default results/trace_speed[_<model>].json)",
    )
    args = ap.parse_args(argv)
    suffix = "" if args.model == "resnet50" else f"_{args.model}"
    args.out = args.out or Path(__file__).parent / f"results/trace_speed{suffix}.json"

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, x = _model(args.model, args.size)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        plain = _first(model(x))

    def forward() -> None:
        with torch.no_grad():
            model(x)

    def trace() -> None:
        trace_model(model, x)

    holder: dict[str, Any] = {}

    def group() -> None:
        t = holder["trace"]
        find_groups(t, ChannelGraph(t))

    def apply() -> None:
        holder["masks"] = fp.apply_masks(model, x)

    def cost() -> None:
        holder["cost"] = fp.computational_cost(model, x)

    results: dict[str, dict] = {}
    results["forward"] = _time(forward, args.repeats)
    results["trace"] = _time(trace, args.repeats)
    holder["trace"] = trace_model(model, x)
    results["group"] = _time(group, args.repeats)
    results["apply_masks"] = _time(apply, args.repeats, between=lambda: fp.remove_masks(model))
    apply()
    results["computational_cost"] = _time(cost, args.repeats)

    masks = holder["masks"]
    report = holder["cost"]
    with torch.no_grad():
        masked_equal = bool(torch.equal(_first(model(x)), plain))
    facts = {
        "groups": len(masks),
        "masked_channels": sum(m.num_channels for m in masks.values()),
        "skipped": [str(s) for s in masks.skipped],
        "flops_per_example": report.total,
        "all_ones_output_unchanged": masked_equal,
    }
    fwd = results["forward"]["median_s"]
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(
        f"{args.model} ({n_params / 1e6:.1f} M params), input {list(x.shape)}, "
        f"{args.threads} threads, median of {args.repeats}; load average {load}"
    )
    print(f"{'step':<22}{'median s':>10}{'x forward':>11}   runs (s)")
    for name, r in results.items():
        runs = ", ".join(f"{v:.3f}" for v in r["runs_s"])
        print(f"{name:<22}{r['median_s']:>10.3f}{r['median_s'] / fwd:>11.1f}   {runs}")
    apply_s = results["apply_masks"]["median_s"]
    limit = TARGET_APPLY_S.get(args.model, 10.0)
    verdict = "met" if apply_s < limit else "NOT met"
    print(f"target apply_masks < {limit:.0f} s: {verdict} ({apply_s:.2f} s)")
    print(
        f"{facts['groups']} groups, {facts['masked_channels']} masked channels, "
        f"{report.total / 1e9:.3f} GFLOPs per example, "
        f"all-ones output unchanged: {masked_equal}"
    )

    profiles = {}
    if args.profile:
        fp.remove_masks(model)
        profiles["apply_masks"] = _profile(apply, args.top)
        profiles["computational_cost"] = _profile(cost, args.top)
        for name, text in profiles.items():
            print(f"\n===== cProfile: {name} (sorted by own time)\n{text}")

    out = {
        "benchmark": "trace_speed",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "fisherprune": fp.__version__,
            "threads": args.threads,
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "load_average_1_5_15": list(os.getloadavg()),  # other processes share the machine
        },
        "model": {"name": args.model, "params": n_params, "input": list(x.shape)},
        "repeats": args.repeats,
        "results": results,
        "ratios_to_forward": {k: v["median_s"] / fwd for k, v in results.items()},
        "target_apply_s": limit,
        "target_met": apply_s < limit,
        "facts": facts,
        "profiles": profiles,
    }
    write_json(args.out, out)
    print(f"\nwrote {args.out}")
    return out


if __name__ == "__main__":
    main()
