"""How long ``fisherprune.prune_to_target`` takes on a ResNet-50 with 1,000 calibration images.

What is measured
----------------
A ResNet-50 (``standard_nets.ResNet50`` with 1,000 classes: torchvision's v1.5 layout, 25.6 M
parameters, random initialisation, no downloads), masks applied once (timed apart), then
``prune_to_target(..., target=0.5)`` with the label-free Fisher (``loss_fn=None``) on
``--images`` random 224x224 images in batches of ``--batch``, for each ``--rounds`` and with
and without the least-squares repair (``reconstruct``), each on a fresh copy of the model.
Per phase (``PruneResult.phase_seconds`` / ``phase_cpu_seconds``): ``signals`` (one eval-mode
forward and backward per batch per round), ``selection`` (choosing channels: cost reports and
``prune_many``), ``repair`` (the repair's passes and solves); ``other`` is the rest of the call
(the cost model's trace). The repair runs within ``prune_to_target``'s default
``repair_budget``: on a ResNet-50 at 224 that is 8 passes over the first 256 images whatever
the number given beyond that (each run records ``repair_examples`` and ``repair_passes``), so
a run with more than 256 images times the repair of 1,000. Wall and process CPU time (all
threads) are both recorded: on a shared machine the wall time also holds the waits for a core.

``floor``: a plain forward and backward of the same network without masks (parameters frozen,
the backward stopping where the first mask sits), over the first ``--floor-images`` images: the
least any signal pass can cost; ``signals`` per image over ``floor`` per image is the overhead
of the estimation itself.

Run ``python benchmarks/post_training_speed.py [--images 1000] [--rounds 1 3]``; the table is
printed and the JSON written to ``--out`` (default ``benchmarks/results/post_training_speed.json``);
``--append`` adds the runs to that file's (replacing those with the same images, rounds, repair
and ``--label``), so that runs with different image counts sit side by side; ``--label`` names
a variant (e.g. ``before`` for another version of fisherprune on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.calibrate import LabelFreeLoss

sys.path.insert(0, str(Path(__file__).resolve().parent))
import standard_nets
from _common import machine_info, write_json

PHASES = ("signals", "selection", "repair")


def _batches(images: int, batch: int, size: int) -> list[tuple[Tensor, None]]:
    """``images`` standard-normal images in batches of ``batch`` (seed 0), no labels."""
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(min(batch, images - i), 3, size, size, generator=g), None)
        for i in range(0, images, batch)
    ]


def _clock(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """``fn()``, its wall and process CPU seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def _floor(model: nn.Module, batches: list[tuple[Tensor, None]]) -> dict[str, float]:
    """Forward and backward alone: ``model`` unmasked and frozen, the label-free loss, the
    backward stopping at the stem's output (where ``apply_masks`` puts the first mask)."""
    plain = copy.deepcopy(model).eval()
    for p in plain.parameters():
        p.requires_grad_(False)
    plain.blocks.register_forward_pre_hook(lambda _m, args: (args[0].detach().requires_grad_(),))
    loss = LabelFreeLoss("classification", seed=0)

    def run() -> int:
        for x, _ in batches:
            loss(plain(x)).backward()
        return sum(x.shape[0] for x, _ in batches)

    n, wall, cpu = _clock(run)
    return {"images": n, "wall_s": wall, "cpu_s": cpu, "wall_per_image": wall / n}


def _one(
    masked: nn.Module,
    example: Tensor,
    batches: list[tuple[Tensor, None]],
    rounds: int,
    repair: bool,
) -> dict[str, Any]:
    model = copy.deepcopy(masked)
    result, wall, cpu = _clock(
        lambda: fp.prune_to_target(
            model, example, batches, 0.5, rounds=rounds, reconstruct=repair, seed=0
        )
    )
    masks = fp.find_masks(model).values()
    # a fisherprune from before phase_cpu_seconds (--label before) has wall times only
    phase_cpu = getattr(result, "phase_cpu_seconds", None) or dict.fromkeys(PHASES, math.nan)
    return {
        "images": sum(x.shape[0] for x, _ in batches),
        "batch": batches[0][0].shape[0],
        "rounds": rounds,
        "reconstruct": repair,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_average": list(os.getloadavg()),
        "wall_s": wall,
        "cpu_s": cpu,
        "phase_wall_s": result.phase_seconds,
        "phase_cpu_s": phase_cpu,
        "other_wall_s": wall - sum(result.phase_seconds.values()),
        "ratio": result.ratio,
        "events": len(result.events),
        "channels_removed": sum(m.num_channels - m.kept for m in masks),
        "channels": sum(m.num_channels for m in masks),
        "examples": result.examples,
        # what the repair read and how often (its budget caps both, so a run whose repair read
        # fewer images than it was given times the repair of any larger run too)
        "repair_examples": result.repair.examples if result.repair else 0,
        "repair_passes": getattr(result.repair, "passes", None),
    }


def _rows(runs: list[dict[str, Any]]) -> Iterator[str]:
    yield (
        f"{'label':>8} {'images':>6} {'rounds':>6} {'repair':>6} | "
        + " | ".join(f"{p:>15}" for p in (*PHASES, "total"))
        + " | FLOPs kept"
    )
    for r in runs:
        cells = [f"{r['phase_wall_s'][p]:6.1f} / {r['phase_cpu_s'][p]:6.1f}" for p in PHASES]
        cells.append(f"{r['wall_s']:6.1f} / {r['cpu_s']:6.1f}")
        repair = "on" if r["reconstruct"] else "off"
        head = f"{r['label']:>8} {r['images']:>6} {r['rounds']:>6} {repair:>6} | "
        yield head + " | ".join(cells) + f" | {r['ratio']:.4f}"


def _merged(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the runs (and floors) of the file at ``path`` that it does not redo."""
    if not path.is_file():
        return data
    old = json.loads(path.read_text())
    redone = {_key(r) for r in data["runs"]}
    data["runs"] = [r for r in old.get("runs", []) if _key(r) not in redone] + data["runs"]
    floors = {f["images"]: f for f in old.get("floors", []) if f}
    floors.update({f["images"]: f for f in data["floors"]})
    data["floors"] = [floors[k] for k in sorted(floors)]
    return data


def _key(run: dict[str, Any]) -> tuple[Any, ...]:
    return run["label"], run["images"], run["rounds"], run["reconstruct"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1000, help="calibration images")
    ap.add_argument("--batch", type=int, default=16, help="images per calibration batch")
    ap.add_argument("--size", type=int, default=224, help="image height and width")
    ap.add_argument("--rounds", type=int, nargs="+", default=[1, 3], help="rounds to run")
    ap.add_argument(
        "--repair", choices=("both", "on", "off"), default="both", help="reconstruct settings"
    )
    ap.add_argument("--floor-images", type=int, default=64, help="images of the floor (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--label", default="", help="names this variant in the table")
    ap.add_argument("--append", action="store_true", help="add to the runs already in --out")
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results/post_training_speed.json"
    )
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    model = standard_nets.ResNet50(num_classes=1000).eval()
    example = torch.randn(1, 3, args.size, args.size, generator=torch.Generator().manual_seed(1))
    batches = _batches(args.images, args.batch, args.size)
    floor = None
    if args.floor_images:
        floor = _floor(model, _batches(min(args.floor_images, args.images), args.batch, args.size))
        print(f"forward + backward alone: {floor['wall_per_image']:.3f} s per image", flush=True)
    masked = copy.deepcopy(model)
    _, apply_wall, apply_cpu = _clock(lambda: fp.apply_masks(masked, example))
    repairs = {"both": (True, False), "on": (True,), "off": (False,)}[args.repair]
    runs = []
    for rounds in args.rounds:
        for repair in repairs:
            runs.append({"label": args.label, **_one(masked, example, batches, rounds, repair)})
            print(list(_rows(runs[-1:]))[-1], flush=True)
    data = {
        "benchmark": "post_training_speed",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "torch": torch.__version__,
        "threads": args.threads,
        "model": "ResNet-50 (standard_nets.ResNet50, 1000 classes, random init)",
        "size": args.size,
        "target": 0.5,
        "apply_masks": {"wall_s": apply_wall, "cpu_s": apply_cpu},
        "floors": [floor] if floor else [],
        "runs": runs,
    }
    if args.append:
        data = _merged(args.out, data)
    write_json(args.out, data)
    print(f"\nimages of {args.size}x{args.size}, seconds wall / process CPU")
    print("\n".join(_rows(data["runs"])))
    return data


if __name__ == "__main__":
    main()
