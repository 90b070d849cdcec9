"""Which form to serve a shrunk network in: eager, frozen TorchScript or an AOTInductor package.

For each network of ``export_speed.py`` (trained briefly on its synthetic task, Fisher signals,
FLOP-weighed selection, ``round_to=8``), the dense network and the shrunk ones at 50% and 25%
of the FLOPs are served in every form of ``export_speed.SERVE``:

* ``eager``: the module itself (channels-last weights and inputs for the conv nets);
* ``torchscript``: ``frozen_for_serving`` (what ``export_model(format="torchscript",
  freeze=True)`` writes, channels-last for the conv nets);
* ``aoti``: ``export_model(format="aoti")`` loaded with ``load_aoti_export`` (contiguous inputs;
  the package computes the conv nets in channels-last itself),

and all of them (3 forms x 3 networks) are timed in one interleaved run per batch size, the
fastest single call of each taken as its latency (``measure_latency(statistic="min")``), so that
every ratio in the table is taken side by side. Printed: the latency of each, its speed-up over
the dense network in the same form (``speed-up``), ``eff`` = speed-up x FLOPs ratio, and each
form's latency relative to TorchScript's for the same network (``vs ts``).

Run ``python benchmarks/serve_forms.py [--threads 1] [--models resnet18 ...]``: about 5 min per
network, most of it compiling the packages. JSON to ``benchmarks/results/serve_forms.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import logging
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import export_speed as es
import torch
from _common import counted_flops, machine_info, write_json

import fisherprune as fp
from fisherprune.export.latency import measure_latency, retain_freed_memory

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks/results/serve_forms.json"
FORMS = tuple(es.SERVE)


def serve_all(
    name: str, cfg: es.Config, tmp: Path
) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
    """The dense and shrunk networks of ``name`` in every form, by (form, network), and the
    FLOPs ratio of each network."""
    spec = es.MODELS[name]
    torch.manual_seed(0)
    dense = spec.build(cfg.width)
    es.train_briefly(dense, spec, cfg.train_steps, torch.Generator().manual_seed(1))
    dense.eval()
    pruned = es.prune_to_targets(copy.deepcopy(dense), spec, "fisher", cfg, "flops", 8)
    x1 = torch.randn(1, *spec.input_shape)
    nets = {"dense": dense, **{f"{t:.0%}": m.eval() for t, m in pruned.shrunk.items()}}
    f_dense = counted_flops(dense, x1)
    ratios = {k: counted_flops(m, x1) / f_dense for k, m in nets.items()}
    image = x1.dim() == 4
    served: dict[str, dict[str, Any]] = {}
    for form in FORMS:
        cl = image and form != "aoti"  # a package takes contiguous inputs
        served[form] = {}
        for k, m in nets.items():
            net = copy.deepcopy(m)
            if cl:
                net.to(memory_format=torch.channels_last)
            served[form][k] = es.SERVE[form](f"{name}_{k}", net, x1, cl, tmp)
    return served, ratios


def time_all(
    name: str, served: dict[str, dict[str, Any]], cfg: es.Config
) -> dict[int, dict[str, float]]:
    """Fastest interleaved call of every (form, network) at each batch size, by "form network"."""
    spec = es.MODELS[name]
    out: dict[int, dict[str, float]] = {}
    for b in es.BATCHES:
        x = torch.randn(b, *spec.input_shape)
        inputs = {f: es.as_format(x, x.dim() == 4 and f != "aoti") for f in FORMS}
        calls = es.calibrate_calls(served["aoti"]["dense"], x, cfg.timing_seconds, (20, 1000))
        # one interleaved run: every form's networks take turns (inputs differ only in layout)
        models = {
            f"{f} {k}": (lambda m=m, xi=inputs[f]: m(xi))
            for f, nets in served.items()
            for k, m in nets.items()
        }
        out[b] = measure_latency(models, (), repeats=1, warmup=2, rounds=calls, statistic="min")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--models", nargs="*", default=list(es.MODELS), choices=list(es.MODELS))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON (default {DEFAULT_OUT})")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    logging.getLogger("fisherprune").setLevel(logging.ERROR)
    retained = retain_freed_memory()
    cfg = es.FULL
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for name in args.models:
        print(f"{name}: pruning, compiling, timing...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            served, ratios = serve_all(name, cfg, Path(tmp))
            lat = time_all(name, served, cfg)
        for form in FORMS:
            for k, ratio in ratios.items():
                row: dict[str, Any] = {"model": name, "form": form, "network": k}
                row["flops_ratio"] = ratio
                for b in es.BATCHES:
                    mine, dense = lat[b][f"{form} {k}"], lat[b][f"{form} dense"]
                    row[f"latency_ms_b{b}"] = 1e3 * mine
                    row[f"speedup_b{b}"] = dense / mine
                    row[f"eff_b{b}"] = dense / mine * ratio
                    row[f"vs_torchscript_b{b}"] = mine / lat[b][f"torchscript {k}"]
                rows.append(row)
    b1, b64 = es.BATCHES
    print(
        f"\nserving forms, torch {torch.__version__}, {args.threads} thread(s), fastest of "
        f"interleaved calls, {time.perf_counter() - t0:.0f} s, load average before "
        f"{load_before[0]:.2f} after {os.getloadavg()[0]:.2f}; freed memory "
        f"{'retained' if retained else 'not retained'}"
    )
    head = (
        f"{'model':<12}{'form':<13}{'network':<9}{'FLOPs':>7}{'ms b=' + str(b1):>10}"
        f"{'ms b=' + str(b64):>10}{'speed-up':>10}{'eff':>7}{'vs ts':>7}{'vs ts':>7}"
    )
    print(head)
    print(
        f"{'':<41}{'':>10}{'':>10}{'b=' + str(b64):>10}{'b=' + str(b64):>7}"
        f"{'b=' + str(b1):>7}{'b=' + str(b64):>7}"
    )
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['model']:<12}{r['form']:<13}{r['network']:<9}{r['flops_ratio']:>7.3f}"
            f"{r[f'latency_ms_b{b1}']:>10.2f}{r[f'latency_ms_b{b64}']:>10.1f}"
            f"{r[f'speedup_b{b64}']:>9.2f}x{r[f'eff_b{b64}']:>7.2f}"
            f"{r[f'vs_torchscript_b{b1}']:>7.2f}{r[f'vs_torchscript_b{b64}']:>7.2f}"
        )
    result = {
        "benchmark": "serve_forms",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "fisherprune": fp.__version__,
        "threads": args.threads,
        "machine": machine_info(),
        "allocator": "retain_freed_memory" if retained else "default",
        "timing": "fastest single call, all forms and networks interleaved",
        "pruning": "fisher signals, flops selection, round_to=8 (export_speed.prune_to_targets)",
        "config": dataclasses.asdict(cfg),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "rows": rows,
    }
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
