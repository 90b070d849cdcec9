"""``fisherprune prune --convention latency``: the flags that say where the model is timed, and
the check of the prediction: the shrunk model timed whole beside what its table predicted.

The ``latency`` convention (``fisherprune.cost.latency``) prices each operator by timing it on
the device that serves; the target is then a share of the measured dense latency or a time
(``--target 12ms``). After the prune the written model is timed whole, in the same spec
(device, batch, threads), and the report gives predicted and measured side by side.
"""

from __future__ import annotations

import argparse
from typing import Any

from torch import nn

from fisherprune.calibrate import PruneResult
from fisherprune.cost import LatencySpec
from fisherprune.cost.latency import (
    UNIT,
    spec_fields,
    spec_for,
    whole_model_seconds,
    with_batch,
)

__all__ = ["add_latency_arguments", "latency_check", "latency_check_text", "latency_spec"]


def add_latency_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--latency_device``, ``--latency_batch``, ``--latency_threads`` and
    ``--latency_cache`` to ``p``."""
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
        "--latency_cache",
        help="with --convention latency: folder (or .json file) of the timing tables "
        "(default ~/.cache/fisherprune/latency; a second run reads them)",
    )


def latency_spec(args: argparse.Namespace) -> LatencySpec | None:
    """The ``LatencySpec`` the flags describe, or None when no convention is ``latency``.

    Raises:
        ValueError: a bad latency flag (the message names it).
    """
    return spec_for(
        (args.convention, args.score_convention),
        "--latency_*",
        device=args.latency_device,
        batch=args.latency_batch,
        threads=args.latency_threads,
        cache=args.latency_cache,
        step=args.round_to,
    )


def latency_check(
    result: PruneResult, dense: nn.Module, small: nn.Module, example: Any, spec: LatencySpec
) -> dict[str, Any]:
    """Predicted (the prune's cost, from the table) and measured latency of the written model
    and of the dense one, in milliseconds, each model timed whole in ``spec`` (dense and
    shrunk alternately, three times, the fastest kept), and the prediction's error."""
    inputs = with_batch(example, spec.batch or 1)
    dense_s, small_s = [], []
    for _ in range(3):
        dense_s.append(whole_model_seconds(dense, inputs, spec))
        small_s.append(whole_model_seconds(small, inputs, spec))
    ms = UNIT * 1e3  # the convention's unit, in milliseconds
    measured = min(small_s) * 1e3
    return {
        "spec": spec_fields(spec),
        "dense_predicted_ms": result.cost_before * ms,
        "dense_measured_ms": min(dense_s) * 1e3,
        "pruned_predicted_ms": result.cost_after * ms,
        "pruned_measured_ms": measured,
        "prediction_error": result.cost_after * ms / measured - 1 if measured > 0 else None,
    }


def latency_check_text(check: dict[str, Any]) -> str:
    """One line: predicted and measured latency of the written model, at its spec."""
    spec = check["spec"]
    err = check["prediction_error"]
    return (
        f"latency on {spec['device']} at batch {spec['batch']}: predicted "
        f"{check['pruned_predicted_ms']:.3f} ms, measured {check['pruned_measured_ms']:.3f} ms"
        + (f" ({err:+.1%})" if err is not None else "")
        + f"; dense predicted {check['dense_predicted_ms']:.3f} ms, measured "
        f"{check['dense_measured_ms']:.3f} ms"
    )
