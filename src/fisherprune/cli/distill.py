"""``fisherprune distill``: recover a shrunk causal language model by distillation from the
dense one on a text file, sharded with FSDP2 over the processes torchrun starts
(``fisherprune.recover.distill_sharded``); run again after a crash, it resumes."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fisherprune.cli.help import DefaultsFormatter
from fisherprune.recover import distill_sharded, save_pretrained_gathered
from fisherprune.train.devices import process_group_backend, resolve_device
from fisherprune.train.interrupts import init_distributed, leave_process_group

__all__ = ["distill_command", "distill_parser", "text_batches"]


def distill_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "distill",
        help="recover a shrunk language model from the dense one, sharded over processes",
        description="Distil the dense --teacher into the shrunk --student (Hugging Face causal "
        "LM folders) on --text with AdamW, both sharded with FSDP2 over the processes of "
        "torchrun (one process without it; only the first process reads the folders, the "
        "others receive their shards from it), checkpointing as it goes; the same command run "
        "again resumes from the newest whole checkpoint. Writes --out with save_pretrained.",
        formatter_class=DefaultsFormatter,
    )
    p.add_argument("--student", required=True, help="the shrunk model's folder")
    p.add_argument("--teacher", required=True, help="the dense model's folder")
    p.add_argument("--text", required=True, help="training text, read whole as one stream")
    p.add_argument("--out", required=True, help="folder to write the trained student to")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW's learning rate")
    p.add_argument("--weight_decay", type=float, default=0.0, help="AdamW's weight decay")
    p.add_argument("--seq_len", type=int, default=128, help="tokens per training window")
    p.add_argument("--batch_size", type=int, default=8, help="windows per step, over all processes")
    p.add_argument("--temperature", type=float, default=2.0, help="of the softened softmax")
    p.add_argument(
        "--checkpoint_dir", help="where checkpoints go and are resumed from (default: OUT.ckpt)"
    )
    p.add_argument("--every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    p.add_argument(
        "--replicate_teacher",
        action="store_true",
        help="a whole teacher on every process instead of a sharded one (when it fits)",
    )
    p.add_argument(
        "--dist_timeout", type=float, default=1800.0, help="seconds to wait for another process"
    )
    p.set_defaults(func=distill_command)
    return p


def text_batches(
    path: Path, tokenizer: Any, seq_len: int, batch_size: int
) -> list[dict[str, Tensor]]:
    """``path`` tokenized whole and cut into windows of ``seq_len`` tokens one after another
    (the tail shorter than a window left out), ``batch_size`` windows a batch (the windows
    that do not fill a last batch left out): ``{"input_ids": (batch_size, seq_len)}``.

    Raises:
        ValueError: ``seq_len`` or ``batch_size`` below 1, or text too short for one batch.
    """
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"--seq_len and --batch_size must be >= 1, got {seq_len}, {batch_size}")
    ids = torch.as_tensor(tokenizer(Path(path).read_text(), verbose=False)["input_ids"])
    per_batch = seq_len * batch_size
    count = ids.numel() // per_batch
    if count == 0:
        raise ValueError(
            f"--text {path} gives {ids.numel()} tokens, fewer than one batch of --batch_size "
            f"{batch_size} windows of --seq_len {seq_len} ({per_batch}): give more text or "
            "smaller windows"
        )
    windows = ids[: count * per_batch].reshape(count, batch_size, seq_len)
    return [{"input_ids": w} for w in windows]


def _join(timeout_s: float) -> bool:
    """Join torchrun's process group (collectives fail after ``timeout_s`` seconds), or make
    a group of this one process without torchrun. Returns whether this call made the group
    (and must end it). Changes: this process's CUDA device under NCCL (its LOCAL_RANK's GPU)."""
    if dist.is_initialized():
        return False
    device = resolve_device(
        "cuda" if torch.cuda.is_available() else "cpu", int(os.environ.get("LOCAL_RANK", "0"))
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = process_group_backend(device)
    if "WORLD_SIZE" in os.environ:
        init_distributed(timeout_s, backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def _read(transformers: Any, folder: Path) -> torch.nn.Module:
    """The causal LM in ``folder``, read on rank 0 only: the other ranks build it from its
    configuration on the meta device, holding no weights until their shards arrive from rank
    0 (``fisherprune.recover.rank0``), so that the host holds one whole copy, not one a
    process."""
    if dist.get_rank() == 0:
        return transformers.AutoModelForCausalLM.from_pretrained(folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def distill_command(args: argparse.Namespace) -> int:
    # imported here, not with the command line: transformers takes a second to import,
    # which every other command would pay
    try:
        import transformers
    except ImportError:
        raise ImportError("fisherprune distill reads model folders with transformers: "
                          "pip install transformers") from None  # fmt: skip
    for flag in ("student", "teacher", "text"):
        if not Path(getattr(args, flag)).exists():
            raise FileNotFoundError(f"--{flag} {getattr(args, flag)}: no such file or folder")
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.student)
    made, ok = _join(args.dist_timeout), False
    try:
        world = dist.get_world_size()
        if args.batch_size % world:
            raise ValueError(
                f"--batch_size {args.batch_size} does not split over {world} processes: give "
                f"a multiple of {world}"
            )
        batches = text_batches(Path(args.text), tokenizer, args.seq_len, args.batch_size)
        student = _read(transformers, Path(args.student))
        teacher = _read(transformers, Path(args.teacher))
        out = Path(args.out)
        done = distill_sharded(
            student, teacher, batches, steps=args.steps, lr=args.lr,
            weight_decay=args.weight_decay, temperature=args.temperature,
            checkpoint_dir=args.checkpoint_dir or out.with_name(out.name + ".ckpt"),
            every=args.every, keep=args.keep, shard_teacher=not args.replicate_teacher,
            dist_timeout_s=args.dist_timeout,
        )  # fmt: skip
        if save_pretrained_gathered(student, out) is not None:
            tokenizer.save_pretrained(out)
            last = f"{done.losses[-1]:.4g}" if done.losses else "none (no step left to run)"
            print(f"distilled steps {done.start_step}..{args.steps}: last loss {last}; "
                  f"wrote {out}")  # fmt: skip
        ok = True
    finally:
        if made and ok:
            leave_process_group(args.dist_timeout)
        elif made:
            dist.destroy_process_group()
    return 0
