"""The ``fisherprune`` command: registers one parser per subcommand and dispatches."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shlex
import signal
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

from fisherprune._version import __version__
from fisherprune.cli.distill import distill_parser
from fisherprune.cli.env import env_parser
from fisherprune.cli.export import export_parser
from fisherprune.cli.flops import flops_parser
from fisherprune.cli.prune import prune_parser
from fisherprune.cli.train import train_parser
from fisherprune.export.shrink import ShrinkError
from fisherprune.export.storage import os_error_text
from fisherprune.train.interrupts import DivergedError, Interrupted, PeerTimeoutError

__all__ = ["main"]

_PACKAGE = Path(__file__).resolve().parent.parent  # fisherprune's own source files


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fisherprune",
        description="Prune whole channels by their Fisher signal weighed against their cost, "
        "and export a physically smaller network.",
    )
    parser.add_argument("--version", action="version", version=f"fisherprune {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every prune")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in (
        train_parser,
        prune_parser,
        distill_parser,
        flops_parser,
        export_parser,
        env_parser,
    ):
        # -v also after the subcommand (fisherprune train -v)
        register(sub).add_argument(
            "-v",
            "--verbose",
            action="store_true",
            default=argparse.SUPPRESS,
            help="log every prune",
        )
    return parser


#: a value that starts with "-" but is numbers, such as -1,8,8 or -0.5 (argparse takes it
#: for an option and answers "expected one argument")
_NEGATIVE = re.compile(r"-\d[\d.,eE+-]*")


def _attach_negative_values(argv: list[str]) -> list[str]:
    """``--flag -1,8,8`` as ``--flag=-1,8,8``, so that the value reaches the flag's own
    check; everything else unchanged."""
    out: list[str] = []
    for arg in argv:
        if _NEGATIVE.fullmatch(arg) and out and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def resume_command(argv: Sequence[str]) -> str:
    """The command line that resumes the run ``argv`` started: ``--resume`` added,
    ``--overwrite`` (which would delete the checkpoints) left out."""
    args = [a for a in argv if a != "--overwrite"]
    if "--resume" not in args:
        args.append("--resume")
    return shlex.join(["fisherprune", *args])


def _terminated(signum: int, frame: FrameType | None) -> None:
    """SIGTERM outside a training loop (which saves a checkpoint first): stop like Ctrl-C,
    running ``finally`` blocks (temporary files are removed), exit status 143."""
    print("fisherprune: stopped by SIGTERM", file=sys.stderr)
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; with no subcommand, ``train`` on built-in data."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or (argv[0].startswith("--") and argv[0] not in ("--help", "--version")):
        argv = ["train", *argv]
    args = parser.parse_args(_attach_negative_values(argv))
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    in_main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminated) if in_main else None
    try:
        with _one_line_warnings(args.command):
            return _dispatch(args, argv)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def _one_line_warnings(command: str) -> Iterator[None]:
    """Format fisherprune's own warnings as one line, ``fisherprune COMMAND: warning: ...``,
    without the file and source line Python adds (meant for a library's user, not a
    command's); other packages' warnings keep Python's form. Changes:
    ``warnings.formatwarning`` inside the block (where they are shown is left alone)."""
    formatted = warnings.formatwarning

    def one_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 line: str | None = None) -> str:  # fmt: skip
        if Path(filename).resolve().is_relative_to(_PACKAGE):
            return f"fisherprune {command}: warning: {message}\n"
        return formatted(message, category, filename, lineno, line)

    warnings.formatwarning = one_line
    try:
        yield
    finally:
        warnings.formatwarning = formatted


def _dispatch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the subcommand; an expected failure becomes one line on stderr and its exit code
    (1 failed, 2 bad input, 128 + signal interrupted)."""
    err = f"fisherprune {args.command}: error:"
    try:
        return int(args.func(args) or 0)
    except Interrupted as e:
        how = f"; resume with: {resume_command(argv)}" if e.checkpoint else ""
        print(f"fisherprune {args.command}: stopped by {e}{how}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"fisherprune {args.command}: stopped by Ctrl-C (SIGINT)", file=sys.stderr)
        return 128 + signal.SIGINT
    except (DivergedError, PeerTimeoutError, ShrinkError) as e:
        print(f"{err} {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # output piped into e.g. head: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except OSError as e:
        if e.errno is None or (isinstance(e, FileNotFoundError) and e.filename is None):
            print(f"{err} {e}", file=sys.stderr)  # our own message, already naming the file
            return 2
        print(f"{err} {os_error_text(e)}", file=sys.stderr)
        return 2 if isinstance(e, (FileNotFoundError, IsADirectoryError)) else 1
    except (ValueError, ImportError, KeyError) as e:
        print(f"{err} {e}", file=sys.stderr)
        return 2
