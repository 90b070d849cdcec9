"""The ``fisherprune`` command: registers one parser per subcommand and dispatches."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from fisherprune._version import __version__
from fisherprune.cli.env import env_parser
from fisherprune.cli.export import export_parser
from fisherprune.cli.flops import flops_parser
from fisherprune.cli.prune import prune_parser
from fisherprune.cli.train import train_parser

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fisherprune",
        description="Prune whole channels by their Fisher signal weighed against their cost, "
        "and export a physically smaller network.",
    )
    parser.add_argument("--version", action="version", version=f"fisherprune {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every prune")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in (train_parser, prune_parser, flops_parser, export_parser, env_parser):
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; with no subcommand, ``train`` on built-in data."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or (argv[0].startswith("--") and argv[0] not in ("--help", "--version")):
        argv = ["train", *argv]
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, ImportError, KeyError) as e:
        print(f"fisherprune {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into e.g. head: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
