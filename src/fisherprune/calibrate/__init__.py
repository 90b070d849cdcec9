"""Pruning a trained model from calibration data: ``prune_to_target``, the label-free Fisher
loss and the least-squares repair; the perplexity of a causal language model on held-out tokens."""

from fisherprune.calibrate.label_free import TASKS, LabelFreeLoss, output_tensor, resolve_task
from fisherprune.calibrate.latency_line import (
    LatencyCheck,
    LatencyLine,
    LatencyLoop,
    check_latency,
    fit_latency_line,
)
from fisherprune.calibrate.perplexity import Perplexity, perplexity, token_windows
from fisherprune.calibrate.repair import REPAIRABLE, RepairReport, repair_consumers
from fisherprune.calibrate.to_target import PruneResult, estimate_signals, prune_to_target

__all__ = [
    "REPAIRABLE",
    "TASKS",
    "LabelFreeLoss",
    "LatencyCheck",
    "LatencyLine",
    "LatencyLoop",
    "Perplexity",
    "PruneResult",
    "RepairReport",
    "check_latency",
    "estimate_signals",
    "fit_latency_line",
    "output_tensor",
    "perplexity",
    "prune_to_target",
    "repair_consumers",
    "resolve_task",
    "token_windows",
]
