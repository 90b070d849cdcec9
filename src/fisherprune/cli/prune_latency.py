"""``fisherprune prune --convention latency``: the flags that say where the model is timed, and
the check of the prediction: the shrunk model timed whole beside what its table predicted.

The ``latency`` convention (``fisherprune.cost.latency``) prices each operator by timing it on
the device that serves; the target is then a share of the measured dense latency or a time
(``--target 12ms``). After the prune the written model is timed whole, in the same spec
(device, batch, threads), and the report gives predicted and measured side by side.
"""

from __future__ import annotations

import argparse

from fisherprune.cost import LatencySpec
from fisherprune.cost.latency import FORMS, spec_for
from fisherprune.settings import check_round_to

__all__ = ["add_latency_arguments", "latency_spec"]


def add_latency_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--latency_device``, ``--latency_batch``, ``--latency_threads``,
    ``--latency_form``, ``--latency_cache`` and ``--latency_checks`` to ``p``."""
    p.add_argument(
        "--latency_device",
        default="cpu",
        help="with --convention latency: where each operator is timed (cpu, cuda, cuda:N)",
    )
    p.add_argument(
        "--latency_batch",
        type=int,
        default=1,
        help="with --convention latency: examples per timed forward pass (the serving batch)",
    )
    p.add_argument(
        "--latency_threads",
        type=int,
        help="with --convention latency: CPU threads while timing (default: torch's setting)",
    )
    p.add_argument(
        "--latency_form",
        default="eager",
        choices=list(FORMS),
        help="with --convention latency: the serving form the whole model is timed in "
        "(operators are timed in eager): eager, torchscript, aoti (CPU), compile, "
        "cuda_graphs (GPU)",
    )
    p.add_argument(
        "--latency_cache",
        help="with --convention latency: folder (or .json file) of the timing tables "
        "(default ~/.cache/fisherprune/latency; a second run reads them)",
    )
    p.add_argument(
        "--latency_checks",
        type=int,
        default=0,
        help="with --convention latency: states of the prune shrunk and timed whole on the "
        "way, the latency line refitted through each (LatencySpec.checks; experimental: "
        "not yet validated on a quiet machine)",
    )


def latency_spec(args: argparse.Namespace) -> LatencySpec | None:
    """The ``LatencySpec`` the flags describe, or None when no convention is ``latency``.

    Raises:
        ValueError: a bad latency flag (the message names it).
    """
    check_round_to(args.round_to, "--round_to")  # the table's step: named as the user gave it
    return spec_for(
        (args.convention, args.score_convention),
        "--latency_*",
        device=args.latency_device,
        batch=args.latency_batch,
        threads=args.latency_threads,
        form=args.latency_form,
        cache=args.latency_cache,
        checks=args.latency_checks,
        step=args.round_to,
    )
