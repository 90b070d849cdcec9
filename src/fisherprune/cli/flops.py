"""``fisherprune flops``: the cost table of a model, per channel group and per layer."""

from __future__ import annotations

import argparse

import torch

from fisherprune.cli.export import masked_from_checkpoint
from fisherprune.cost import CostModel
from fisherprune.graph import apply_masks
from fisherprune.train.models import build_model

__all__ = ["flops_command", "flops_parser"]


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"input shape must look like 1,28,28, got {text!r}"
        ) from None
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"input shape needs positive sizes, got {text!r}")
    return dims


def flops_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("flops", help="cost per channel group and per layer of a model")
    p.add_argument("--model", default="cnn", help="built-in name or package.module:function")
    p.add_argument(
        "--input-shape",
        "--input_shape",
        type=_shape,
        default=(1, 28, 28),
        help="shape of one example, e.g. 1,28,28 or 20",
    )
    p.add_argument("--num-outputs", "--num_outputs", type=int, default=10)
    p.add_argument("--width", type=int)
    p.add_argument("--depth", type=int)
    p.add_argument("--convention", default="flops", help="flops, macs, twml, memory or params")
    p.add_argument("--checkpoint", help="a training checkpoint: cost of its pruned model")
    p.set_defaults(func=flops_command)
    return p


def flops_command(args: argparse.Namespace) -> int:

    if args.checkpoint:
        model, example, _ = masked_from_checkpoint(args.checkpoint)
        masks = None
    else:
        model = build_model(args.model, args.input_shape, args.num_outputs, args.width, args.depth)
        example = torch.zeros(1, *args.input_shape)
        masks = apply_masks(model, example)
    cm = CostModel(model, example, args.convention)
    rep = cm.report()
    dense = cm.dense_total()
    print(
        f"{args.convention} per example: {rep.total:,.0f} (dense {dense:,.0f}, "
        f"{rep.total / dense:.1%})"
    )
    print(f"\n{'channel group':<44} {'kept':>6} {'of':>6} {'marginal/ch':>13}")
    for name, m in cm.masks.items():
        marg = rep.marginal[name]
        alive = m.mask > 0.5
        per = float(marg[alive].mean()) if alive.any() else 0.0
        print(
            f"{name.removeprefix('fisherprune_masks.'):<44} {m.kept:>6} {m.num_channels:>6} "
            f"{per:>13,.0f}"
        )
    print(f"\n{'layer':<44} {args.convention:>14} {'share':>7}")
    for mod, c in sorted(rep.by_module.items(), key=lambda kv: -kv[1]):
        if c > 0:
            print(f"{mod:<44} {c:>14,.0f} {c / rep.total:>7.1%}")
    if masks is not None and masks.skipped:
        print("\nnot prunable:")
        for s in masks.skipped:
            print(f"  {s}")
    return 0
