"""``fisherprune train``: train with pruning to a cost target, fine-tune, evaluate, export."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

import torch.distributed as dist

from fisherprune.train.config import ALIASES, HELP, TrainConfig
from fisherprune.train.interrupts import leave_process_group
from fisherprune.train.trainer import PruningTrainer

__all__ = ["train_command", "train_parser"]


def _parse_list(kind: type) -> Any:
    def parse(text: str) -> list:
        return [kind(v) for v in text.split(",") if v.strip()]

    return parse


def _number(text: str) -> int | float:
    """An int if the text is one, else a float."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def _flag_type(tp: Any) -> Any:
    if typing.get_origin(tp) is list:
        return _parse_list(typing.get_args(tp)[0])
    args = [a for a in typing.get_args(tp) if a is not type(None)]  # X | None -> X
    if set(args) == {int, float}:
        return _number
    if args:
        return _flag_type(args[0])
    return {"int": int, "float": float, "str": str}.get(getattr(tp, "__name__", ""), str)


def train_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="train, prune to a cost target, fine-tune and export (no arguments: digits demo)",
        description="Train with Fisher pruning from records on disk or built-in data, then "
        "export the physically smaller model with a report. Every setting is a flag; seed "
        "spellings such as --pruning.iter / --pruning_iter both work. Values from --config "
        "are overridden by flags.",
    )
    p.add_argument("--config", help="JSON file of settings (unknown keys are errors)")
    reverse: dict[str, list[str]] = {}
    for alias, name in ALIASES.items():
        reverse.setdefault(name, []).append(alias)
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flags = [f"--{f.name}"]
        if "_" in f.name:
            flags.append(f"--{f.name.replace('_', '-')}")
        flags += [f"--{a}" for a in reverse.get(f.name, [])]
        if f.name.startswith("pruning_"):
            flags.append(f"--pruning.{f.name[len('pruning_') :]}")
        flags = list(dict.fromkeys(flags))
        if hints[f.name] is bool:  # on by default: --no-NAME turns it off
            p.add_argument(
                *flags,
                dest=f.name,
                action=argparse.BooleanOptionalAction if f.default else "store_true",
                default=argparse.SUPPRESS,
                help=HELP.get(f.name),
            )
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:
            default = ",".join(map(str, f.default_factory()))
        p.add_argument(
            *flags,
            dest=f.name,
            type=_flag_type(hints[f.name]),
            default=argparse.SUPPRESS,
            metavar=f.name.split("_")[-1].upper(),
            help=f"{HELP.get(f.name, '')} (default: {str(default).replace('%', '%%')})",
        )
    p.set_defaults(func=train_command)
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    given = {
        k: v for k, v in vars(args).items() if k not in ("func", "config", "command", "verbose")
    }
    if args.config:
        return TrainConfig.from_file(args.config, given)
    return TrainConfig.from_dict(given)


def train_command(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    joined = dist.is_available() and dist.is_initialized()
    PruningTrainer(config).run()
    if not joined:  # the run joined torchrun's group: leave it in order (rank 0 last)
        leave_process_group(config.dist_timeout)
    return 0
