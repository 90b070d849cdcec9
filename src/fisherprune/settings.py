"""Pruning settings, checked in one place.

``PruningOptimizer``, ``update_pruning_signals``, ``prune``, ``TrainConfig`` and the trainer all
take some of these; each check returns the normalised value or raises ``ValueError`` (``TypeError``
for a value of the wrong kind) with a message that names the setting and the bad value.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "LOSS_REDUCTIONS",
    "METHODS",
    "OPTIMIZERS",
    "check_decay",
    "check_flops_weight",
    "check_int",
    "check_loss_reduction",
    "check_method",
    "check_min_channels",
    "check_optimizer_name",
    "check_round_to",
    "parse_flops_weight",
]

#: how a training loss reduces over the batch (a mean-reduced loss's per-example gradients are
#: rescaled by the batch size before they are squared)
LOSS_REDUCTIONS: tuple[str, ...] = ("mean", "sum")
#: the gradient signals named by ``method=`` (shorthands for ``fisherprune.criteria`` objects)
METHODS: tuple[str, ...] = ("fisher", "taylor")
#: inner optimizers the trainer builds by name
OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")


def check_int(name: str, value: Any, low: int) -> int:
    """``value`` if it is an int (not a bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def check_decay(decay: Any, name: str = "decay") -> float:
    """The signal EMA factor as a float in [0, 1)."""
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay < 1:
        raise ValueError(f"{name} must be in [0, 1), got {decay!r}")
    return float(decay)


def check_loss_reduction(loss_reduction: Any) -> str:
    """``"mean"`` or ``"sum"``."""
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(
            f"loss_reduction must be one of {', '.join(LOSS_REDUCTIONS)}, got {loss_reduction!r}"
        )
    return str(loss_reduction)


def check_method(method: Any) -> str:
    """A gradient signal's name, lower-cased: ``"fisher"`` or ``"taylor"``."""
    if not isinstance(method, str) or method.lower() not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    return method.lower()


def check_min_channels(min_channels: Any, name: str = "min_channels") -> int | float:
    """An int >= 0 (0 lets a group be emptied) or a fraction in (0, 1) of each group's width."""
    ok_int = isinstance(min_channels, int) and not isinstance(min_channels, bool)
    if ok_int and min_channels >= 0:
        return min_channels
    if isinstance(min_channels, float) and 0.0 < min_channels < 1.0:
        return min_channels
    raise ValueError(f"{name} must be an int >= 0 or a fraction in (0, 1), got {min_channels!r}")


def check_round_to(round_to: Any, name: str = "round_to", default: int = 1) -> int:
    """An int >= 1 (1: no rounding); None stands for ``default``."""
    if round_to is None:
        return default
    if isinstance(round_to, bool) or not isinstance(round_to, int) or round_to < 1:
        raise ValueError(
            f"{name} must be an int >= 1 (1: no rounding; unset: the default), got {round_to!r}"
        )
    return round_to


def check_flops_weight(flops_weight: Any) -> str | float:
    """``"auto"`` or a finite float >= 0.

    Raises:
        ValueError: an unknown string, a negative or non-finite number.
        TypeError: neither a string nor a number.
    """
    if isinstance(flops_weight, str):
        if flops_weight.lower() != "auto":
            raise ValueError(
                f"flops_weight must be 'auto' or a number >= 0, got the string {flops_weight!r}"
            )
        return "auto"
    if isinstance(flops_weight, bool) or not isinstance(flops_weight, (int, float)):
        raise TypeError(
            f"flops_weight must be 'auto' or a number, got {type(flops_weight).__name__}"
        )
    w = float(flops_weight)
    if not (w >= 0 and math.isfinite(w)):
        raise ValueError(f"flops_weight must be a finite number >= 0, got {flops_weight!r}")
    return w


def check_optimizer_name(name: Any) -> str:
    """One of ``OPTIMIZERS``."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
    return str(name)


def parse_flops_weight(flops_weight: Any, name: str = "flops_weight") -> str | float:
    """``check_flops_weight`` of a value that may also be a number written as a string (a
    config file or command-line flag: ``"auto"``, ``"0"``, ``"1e-9"``)."""
    if isinstance(flops_weight, str) and flops_weight.strip().lower() != "auto":
        try:
            flops_weight = float(flops_weight)
        except ValueError:
            raise ValueError(f"{name} must be 'auto' or a number, got {flops_weight!r}") from None
    return check_flops_weight(flops_weight)
