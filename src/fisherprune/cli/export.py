"""``fisherprune export``: write the shrunk model of a training checkpoint."""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fisherprune.export import FORMATS, PruningPlan, export_model, shrink
from fisherprune.export.manifest import MANIFEST_FILE, ExportSet, Manifest
from fisherprune.graph import apply_masks
from fisherprune.masks import find_masks
from fisherprune.train.checkpoint import CheckpointManager
from fisherprune.train.scaling import model_from_meta

__all__ = [
    "export_command",
    "export_parser",
    "masked_from_checkpoint",
    "model_from_checkpoint",
    "pruned_from_checkpoint",
    "shrunk_checkpoint",
]


def export_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="export the shrunk model of a checkpoint")
    p.add_argument("--checkpoint", required=True, help="ckpt-*.pt written by fisherprune train")
    p.add_argument("--format", default="state_dict", choices=FORMATS)
    p.add_argument("--out", required=True, help="file to write (aoti: a .pt2 file)")
    p.add_argument(
        "--freeze",
        action="store_true",
        help="torchscript only: freeze it for inference (weights as constants, batch norm "
        "folded into convs; faster on CPU, cannot be trained further)",
    )
    p.set_defaults(func=export_command)
    return p


def masked_from_checkpoint(path: str) -> tuple[nn.Module, Tensor, dict[str, Any]]:
    """The masked model of a training checkpoint, with the masks it saved; an example input
    for it; the checkpoint. The weights are loaded when they are the masked model's (a
    checkpoint written before the shrink), else (``shrunk_checkpoint``) they stay as built:
    the costs and the channels kept are right, the outputs are not.

    Raises:
        FileNotFoundError / ValueError: missing or foreign checkpoint.
        IsADirectoryError: ``path`` is a directory.
        DamagedCheckpointError: (a ValueError) its content hash differs or it cannot be read.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    state = CheckpointManager.load(p)
    meta = state.get("model_meta")
    if meta is None:
        raise ValueError(f"{p} does not record its model; it was not written by fisherprune train")
    model = model_from_meta(meta)
    example = torch.zeros(1, *meta["input_shape"])
    apply_masks(model, example)
    if shrunk_checkpoint(state):
        masks = find_masks(model)
        with torch.no_grad():
            for name, saved in state["pruner"]["masks"].items():
                masks[name].mask.copy_(saved["mask"])
    else:
        model.load_state_dict(state["model"])
    return model, example, state


def shrunk_checkpoint(state: dict[str, Any]) -> bool:
    """Whether the checkpoint ``state`` was written after its run shrank the model in place
    (its ``model`` entry holds the shrunk weights)."""
    return bool(state["pruner"].get("shrunk", False))


def pruned_from_checkpoint(path: str) -> tuple[nn.Module, Tensor, PruningPlan | None]:
    """The pruned model of a training checkpoint with its weights, an example input for it,
    and the plan it was shrunk by: the masked model and None for a checkpoint written while
    masked, the shrunk model (shrunk by its saved masks, then loaded) and its plan for one
    written after the shrink. Both give the pruned model's outputs.

    Raises:
        as ``masked_from_checkpoint``.
    """
    model, example, state = masked_from_checkpoint(path)
    if not shrunk_checkpoint(state):
        return model, example, None
    plan = PruningPlan.from_model(model, example)
    shrink(model, example, inplace=True)
    model.load_state_dict(state["model"])
    return model, example, plan


def model_from_checkpoint(path: str) -> tuple[nn.Module, Tensor]:
    """``pruned_from_checkpoint`` without the plan: the model and an example input."""
    model, example, _ = pruned_from_checkpoint(path)
    return model, example


def _run_set(out: Path, checkpoint: str) -> ExportSet | None:
    """The export set that ``out`` is a file of (its folder's manifest names it), when it is
    the set of the checkpoint's own run: writing ``out`` then goes through it, so that the
    manifest records the new bytes. None when no manifest names ``out`` (a plain write).

    Raises:
        ValueError: the manifest names ``out`` as a file of another run's set (a write would
            leave that set naming bytes it no longer holds).
    """
    manifest = Manifest.read(out.parent)
    if manifest is None or out.name not in manifest.files:
        return None
    owner = str(Path(checkpoint).resolve().parent.parent)  # SAVE_DIR/checkpoints/ckpt-*.pt
    if manifest.owner != owner:
        raise ValueError(
            f"--out {out} is a file of the export of {manifest.describe()} (its "
            f"{MANIFEST_FILE} names it), not of {checkpoint}'s run: give another --out"
        )
    return ExportSet(out.parent, manifest, written=True)


def export_command(args: argparse.Namespace) -> int:
    """Write the shrunk model of ``--checkpoint`` to ``--out``; when ``--out`` is a file of
    that run's export set (named in the folder's manifest), record its new bytes there."""
    if args.freeze and args.format != "torchscript":
        raise ValueError(f"--freeze applies to --format torchscript only, not {args.format}")
    out = Path(args.out)
    exports = _run_set(out, args.checkpoint)
    model, example, plan = pruned_from_checkpoint(args.checkpoint)
    write = partial(
        export_model,
        model,
        example_inputs=example,
        format=args.format,
        freeze=args.freeze,
        plan=plan,
    )
    if exports is None:
        path = write(out)
    else:
        what = f"the pruned model, {args.format} export of {args.checkpoint}"
        path = exports.write(out.name, what, write)
    print(f"wrote {path}")
    return 0
