"""Do pruned transformers run faster? Dense vs shrunk BERT-base- and ViT-B/16-sized encoders.

For each encoder of ``standard_nets`` (BERT-base-sized at 128 tokens, ViT-B/16-sized at
224x224), every mask ``apply_masks`` finds (the heads and MLP units of every block and the
hidden width) is pruned to 50% and to 25% of the dense network's FLOPs in three ways:

* ``uneven``: the channels of lowest score ``fisherprune.score(signal, marginal FLOPs, "auto")``
  across all masks zeroed, the signals random (i.i.d. log-normal, fixed seed), as few as reach
  the target: the widths differ from layer to layer as a pruned network's do, any count;
* ``uniform``: the same head count, MLP width and hidden width in every block, by hand through
  the masks (the largest keep fraction whose FLOPs are at most the target), the MLP and hidden
  widths multiples of ``--round-to`` (64); the first channels of each mask are zeroed (which
  ones does not change the latency);
* ``uniform=True rK``: the library's own ``uniform=True`` with ``round_to=K`` (``--lib-round-to``,
  8): ``fisherprune.prune(..., uniform=True, round_to=K)`` on the same random signals, step by
  step as ``PruningOptimizer`` and ``prune_to_target`` call it: every block keeps the same head
  count (a head mask counts heads: 12 -> 8 with K = 8) and MLP width, all widths multiples of K.

Each pruned network is shrunk (``fisherprune.shrink``) and its FLOPs counted by
``FlopCounterMode``. All networks are timed side by side, round-robin, in two forms: eager
(``nn.Module``) and frozen TorchScript (``frozen_for_serving``, what
``export_model(format="torchscript", freeze=True)`` writes), each by its fastest block
(``measure_latency(statistic="min")``: other load on a shared machine only adds time).
Reported: latency, speed-up over the dense network in the same form, the FLOPs reduction
(dense / pruned FLOPs) and ``eff`` = speed-up / FLOPs reduction (target >= 0.8 at batch 32).

Run ``python benchmarks/transformer_latency.py`` (batch 32) or ``--quick`` (batch 2, fewer
repeats; a check that it runs, not figures to quote). JSON to ``--out`` (default
``benchmarks/results/transformer_latency.json``).
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import matplotlib
import standard_nets as sn
import torch
from _common import counted_flops, machine_info, write_json
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.export.latency import frozen_for_serving, measure_latency

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the headless backend

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "transformer_latency.json"
TARGETS = (0.5, 0.25)
EFFICIENCY_TARGET = 0.8

Build = Callable[..., nn.Module]
ENCODERS: dict[str, tuple[Build, Callable[[int], Tensor]]] = {
    "bert_base": (sn.build_bert_base, lambda n: torch.randint(0, 30522, (n, 128))),
    "vit_b16": (sn.build_vit_b16, lambda n: torch.randn(n, 3, 224, 224)),
}


def _zero_lowest(masks: dict[str, fp.MaskLayer], order: list[tuple[str, int]], count: int) -> None:
    """All masks to ones, then the first ``count`` channels of ``order`` zeroed, keeping at
    least one channel in every mask."""
    with torch.no_grad():
        for m in masks.values():
            m.mask.fill_(1.0)
        for k, i in order[:count]:
            m = masks[k]
            if m.kept > 1:
                m.mask[i] = 0.0


def prune_uneven(masks: dict[str, fp.MaskLayer], cost: fp.CostModel, target: float) -> int:
    """Zero the channels of lowest random score (i.i.d. log-normal signal over the channel's
    FLOPs marginal cost, ``fisherprune.score(..., "auto")``) across all masks, as few as bring
    the FLOPs to at most ``target`` of the dense ones (bisection on their number). Returns the
    number of channels zeroed."""
    with torch.no_grad():
        for m in masks.values():
            m.mask.fill_(1.0)
    start, marginal = cost.total(), cost.report().marginal
    gen = torch.Generator().manual_seed(0)
    ranked = sorted(
        (float(s), k, i)
        for k, m in masks.items()
        for i, s in enumerate(
            fp.score(torch.randn(m.num_channels, generator=gen).exp(), marginal[k], "auto")
        )
    )
    order = [(k, i) for _, k, i in ranked]
    lo, hi = 0, len(order)  # cost(lo) > target >= cost(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        _zero_lowest(masks, order, mid)
        lo, hi = (lo, mid) if cost.total() <= target * start else (mid, hi)
    _zero_lowest(masks, order, hi)
    return hi


def prune_uniform(
    masks: dict[str, fp.MaskLayer], cost: fp.CostModel, target: float, round_to: int
) -> float:
    """Zero the first channels of every mask: the same fraction of the heads, of the MLP
    units and of the hidden width in every block, the widths rounded down to ``round_to``
    (heads to whole heads), the largest fraction whose FLOPs are at most ``target`` of the
    dense ones. Returns the kept fraction."""
    with torch.no_grad():
        for m in masks.values():
            m.mask.fill_(1.0)
    start = cost.total()

    def keep(m: fp.MaskLayer, frac: float) -> int:
        step = 1 if m.num_channels < 4 * round_to else round_to
        return max(step, int(frac * m.num_channels / step) * step)

    for frac in [i / 200 for i in range(200, 0, -1)]:
        with torch.no_grad():
            for m in masks.values():
                m.mask.fill_(1.0)
                m.mask[: m.num_channels - keep(m, frac)] = 0.0
        if cost.total() <= target * start:
            return frac
    raise RuntimeError(f"no uniform width reaches {target:.0%} of the FLOPs")


def prune_library(
    masks: dict[str, fp.MaskLayer], cost: fp.CostModel, target: float, round_to: int
) -> int:
    """What ``PruningOptimizer(uniform=True, round_to=round_to)`` and ``prune_to_target`` do,
    with the same random signals as ``prune_uneven``: ``fisherprune.prune`` with
    ``uniform=True`` removes, one block of ``round_to`` channels (a head mask counts heads) at
    a time in every copy of a repeated block, the block of lowest mean score until the FLOPs
    are at most ``target`` of the dense ones. Returns the number of prune steps."""
    with torch.no_grad():
        for m in masks.values():
            m.mask.fill_(1.0)
    start = cost.total()
    gen = torch.Generator().manual_seed(0)
    signals = {k: torch.randn(m.num_channels, generator=gen).exp() for k, m in masks.items()}
    steps = 0
    while cost.total() > target * start:
        report = cost.report()
        scores = {k: fp.score(signals[k], report.marginal[k], "auto") for k in masks}
        if fp.prune(masks, scores, cost=report, round_to=round_to, uniform=True) is None:
            raise RuntimeError(f"uniform=True, round_to={round_to} cannot reach {target:.0%}")
        steps += 1
    return steps


def networks(
    name: str, layers: int, round_to: int, lib_round_to: int
) -> tuple[dict[str, nn.Module], dict[str, Any]]:
    """The dense encoder and its shrunk versions by label, and what each kept."""
    build, make_input = ENCODERS[name]
    x1 = make_input(1)
    dense = build(layers=layers).eval()
    nets: dict[str, nn.Module] = {"dense": dense}
    info: dict[str, Any] = {"dense": {"flops": counted_flops(dense, x1)}}
    masked = copy.deepcopy(dense)
    masks = dict(fp.apply_masks(masked, x1))
    cost = fp.CostModel(masked, x1)
    choose: dict[str, tuple[str, Callable[[float], float]]] = {
        "uneven": ("zeroed", lambda target: prune_uneven(masks, cost, target)),
        "uniform": ("kept_fraction", lambda target: prune_uniform(masks, cost, target, round_to)),
        f"uniform=True r{lib_round_to}": (
            "prune_steps",
            lambda target: prune_library(masks, cost, target, lib_round_to),
        ),
    }
    for how, (what, chooser) in choose.items():
        for target in TARGETS:
            t0 = time.perf_counter()
            chosen = chooser(target)
            label = f"{how} {target:.0%}"
            nets[label] = fp.shrink(masked, x1).eval()
            info[label] = {
                "flops": counted_flops(nets[label], x1),
                what: chosen,
                "widths": {k: m.kept for k, m in masks.items()},
                "prune_s": time.perf_counter() - t0,
            }
    for entry in info.values():
        entry["flops_reduction"] = info["dense"]["flops"] / entry["flops"]
    return nets, info


def run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    nets, info = networks(name, args.layers, args.round_to, args.lib_round_to)
    x = ENCODERS[name][1](args.batch)
    forms: dict[str, Any] = {}
    for label, net in nets.items():
        forms[f"eager|{label}"] = net
        forms[f"torchscript|{label}"] = frozen_for_serving(net, x)[0]
    lat = measure_latency(
        forms, x, repeats=1, warmup=args.warmup, rounds=args.rounds, statistic="min"
    )
    rows = []
    for key, seconds in lat.items():
        form, label = key.split("|")
        speedup = lat[f"{form}|dense"] / seconds
        reduction = info[label]["flops_reduction"]
        rows.append(
            {
                "form": form,
                "network": label,
                "latency_ms": seconds * 1e3,
                "speedup": speedup,
                "flops_reduction": reduction,
                "efficiency": speedup / reduction,
            }
        )
        print(
            f"{name:<10} {form:<12} {label:<13} {seconds * 1e3:9.1f} ms  speed-up "
            f"{speedup:5.2f}x  FLOPs /{reduction:5.2f}  eff {speedup / reduction:5.2f}"
        )
    return {"networks": info, "rows": rows}


def plot(results: dict[str, Any], path: Path) -> None:
    """Speed-up against FLOPs reduction, one marker per pruned network and form; the line is
    a speed-up equal to the FLOPs reduction, the dashed one ``EFFICIENCY_TARGET`` of it."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    markers = {"eager": "o", "torchscript": "s"}
    for name, res in results.items():
        for form, marker in markers.items():
            rows = [r for r in res["rows"] if r["form"] == form and r["network"] != "dense"]
            ax.scatter(
                [r["flops_reduction"] for r in rows],
                [r["speedup"] for r in rows],
                marker=marker,
                label=f"{name} {form}",
            )
    top = max(r["flops_reduction"] for res in results.values() for r in res["rows"]) * 1.1
    ax.plot([1, top], [1, top], "k-", lw=0.8, label="speed-up = FLOPs reduction")
    ax.plot([1, top], [EFFICIENCY_TARGET, EFFICIENCY_TARGET * top], "k--", lw=0.8)
    ax.set_xlabel("FLOPs reduction (dense / pruned)")
    ax.set_ylabel("speed-up (dense / pruned latency)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=sorted(ENCODERS), default=sorted(ENCODERS))
    p.add_argument("--batch", type=int, default=None, help="batch (default 32; quick 2)")
    p.add_argument("--rounds", type=int, default=None, help="timed calls each (10; quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls each (2; quick 1)")
    p.add_argument("--round-to", type=int, default=64, help="uniform widths' multiple (64)")
    p.add_argument(
        "--lib-round-to",
        type=int,
        default=8,
        help="round_to of the uniform=True networks (default 8: heads 12 -> 8, widths in 8s)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--layers", type=int, default=None, help="encoder blocks (12; quick 2)")
    p.add_argument(
        "--quick", action="store_true", help="2 blocks, batch 2, 3 timed calls, 1 warm-up"
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    for name, full, quick in (
        ("batch", 32, 2),
        ("rounds", 10, 3),
        ("warmup", 2, 1),
        ("layers", 12, 2),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if (
        min(args.batch, args.rounds, args.round_to, args.lib_round_to, args.threads, args.layers)
        < 1
    ):
        p.error(
            "--batch, --rounds, --round-to, --lib-round-to, --threads and --layers must be >= 1"
        )
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    results = {name: run(name, args) for name in args.models}
    write_json(
        args.out,
        {
            "benchmark": "transformer_latency",
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "fisherprune_version": fp.__version__,
            "torch_version": torch.__version__,
            "machine": machine_info(),
            "threads": args.threads,
            "settings": {
                "batch": args.batch,
                "rounds": args.rounds,
                "warmup": args.warmup,
                "round_to": args.round_to,
                "lib_round_to": args.lib_round_to,
                "layers": args.layers,
                "threads": args.threads,
                "quick": args.quick,
                "statistic": "min over rounds of one call each",
            },
            "efficiency_target": EFFICIENCY_TARGET,
            "models": results,
            "elapsed_s": time.perf_counter() - started,
        },
    )
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and its plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
