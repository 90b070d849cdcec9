"""Latency as a line through two sizes of the model, each timed whole.

The ``latency`` convention prices every operator timed alone and scales their sum to the
dense model timed whole. What lies between the operators (Python, the allocator, a lone
operator's warm caches) does not shrink in proportion with them: BERT-base at batch 1 on two
CPU threads, pruned to 24.8% of its predicted latency, ran at 33.9% of the dense model, and
ViT-B/16 at 29.4% for 24.4% (``benchmarks/latency_prediction.py``, before this module).

``fit_latency_line`` therefore times a second size: a copy of the model with ``line_at`` (a
share, ``LatencySpec.line_at``) of every mask's channels kept, shrunk, timed whole beside the
dense model (one after the other, ``ROUNDS`` times; ``mu`` is the median of the rounds'
ratios, so that a drift of the machine's speed cancels out of it); both are timed in the
``LatencySpec.form`` that serves them, so the line maps the eager operators' sum to that
form's time. With ``S`` the operators'
summed times alone and ``W`` the dense total the table already predicts, the cost becomes
``slope * S + offset``, the line through ``(S_dense, W)`` and ``(S_copy, mu * W)``. The dense
total, and with it every target given as a share, is unchanged, and a state's share of it,
``1 - (1 - mu) (S_dense - S) / (S_dense - S_copy)``, depends on ``mu`` and the operators
only; narrower states cost more than in proportion when the offset is positive. A copy that
is relatively faster than its operators (offset below 0) keeps the proportional scale, as
does a model whose copy cannot be shrunk (a warning says why).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fisherprune.cost import CostModel
from fisherprune.cost.latency import served_pair, timing_threads, whole_model_seconds, with_batch
from fisherprune.export.shrink import shrink
from fisherprune.inputs import Inputs
from fisherprune.masks import find_masks

__all__ = ["LatencyLine", "fit_latency_line"]

#: rounds of the dense model and the shrunk copy timed one after the other; their ratio is the
#: median of the rounds' ratios (a round that a burst of other load slowed stays an outlier)
ROUNDS = 5


@dataclass
class LatencyLine:
    """What ``fit_latency_line`` found.

    Attributes:
        fitted: whether the cost model now prices states on the fitted line.
        slope: what the operators' summed times alone are multiplied by.
        offset: microseconds per forward pass added to them.
        operators_share: the copy's operators summed, over the dense model's.
        measured_share: the copy timed whole, over the dense model timed beside it.
        kept_share: the share of every mask's channels the copy kept (``line_at``).
        reason: why the line was not fitted, or what was kept instead ("" when fitted).
    """

    fitted: bool
    slope: float
    offset: float
    operators_share: float | None = None
    measured_share: float | None = None
    kept_share: float | None = None
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields (reports)."""
        return asdict(self)


def _cut_entries(cost_model: CostModel, share: float) -> tuple[np.ndarray, dict[str, int]]:
    """Mask entries with the first ``ceil(share * n)`` of every traced mask's ``n`` kept
    (at least one), and those counts by mask name."""
    entries = np.ones(cost_model.graph.n_entries)
    kept: dict[str, int] = {}
    for name, start in cost_model.entry_start.items():
        n = cost_model.masks[name].num_channels
        kept[name] = max(1, math.ceil(share * n - 1e-9))
        entries[start + kept[name] : start + n] = 0.0
    return entries, kept


@contextmanager
def _masks_kept(model: nn.Module, kept: dict[str, int]) -> Iterator[None]:
    """For the block, every mask of ``model`` at one except those named in ``kept``, which keep
    their first ``kept[name]`` channels; the masks are given back after, also on an error."""
    masks = find_masks(model)
    saved = {n: m.mask.detach().clone() for n, m in masks.items()}
    try:
        with torch.no_grad():
            for name, m in masks.items():
                m.mask.fill_(1.0)
                if name in kept:
                    m.mask[kept[name] :] = 0.0
        yield
    finally:
        with torch.no_grad():
            for name, m in masks.items():
                m.mask.copy_(saved[name])


def fit_latency_line(cost_model: CostModel, model: nn.Module, example_inputs: Any) -> LatencyLine:
    """Fit ``cost_model``'s latency to the model timed whole at two sizes (module docstring).

    Changes: ``cost_model``'s slope and offset (``CostModel.set_latency_line``) when fitted;
    the model comes back as it was (its masks are set and given back; the copy is dropped).

    Args:
        cost_model: a ``CostModel`` of the ``latency`` convention, built on ``model``.
        model: the masked network the cost model was built on.
        example_inputs: its example inputs (repeated to the spec's batch, as the table was).

    Raises:
        ValueError: ``cost_model`` is not of the ``latency`` convention.
    """
    spec = cost_model.latency
    if spec is None:
        raise ValueError(
            f"fit_latency_line needs a latency cost model, not {cost_model.convention!r}"
        )
    scale, offset = cost_model.latency_scale, cost_model.latency_offset
    if spec.line_at is None:
        return LatencyLine(False, scale, offset, reason="line_at=None: operators in proportion")
    entries, kept = _cut_entries(cost_model, spec.line_at)
    whole = cost_model.dense_total()
    s_dense = (whole - offset) / scale
    s_copy = (cost_model.total(entries) - offset) / scale
    line = LatencyLine(False, scale, offset, s_copy / s_dense if s_dense > 0 else None,
                       kept_share=spec.line_at)  # fmt: skip
    if not s_dense > s_copy > 0:
        line.reason = "the copy's operators cost what the dense model's do: nothing to fit"
        return line
    inputs = with_batch(example_inputs, spec.batch or Inputs.of(example_inputs).batch_size)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _masks_kept(model, kept):
                small = shrink(model, inputs, check=False)
    except Exception as e:  # any model shrink refuses at these widths keeps the proportion
        line.reason = f"the copy with {spec.line_at:g} of every width was not shrunk ({e})"
        warnings.warn(f"latency line not fitted: {line.reason}; operators in proportion",
                      stacklevel=2)  # fmt: skip
        return line
    ratios = []
    with timing_threads(spec), _masks_kept(model, {}):  # the model itself, dense
        timed_dense, timed_small = served_pair(model, small, inputs, spec)  # in spec.form
        for _ in range(ROUNDS):
            dense = whole_model_seconds(timed_dense, inputs, spec)
            ratios.append(whole_model_seconds(timed_small, inputs, spec) / dense)
    mu = float(np.median(ratios))
    line.measured_share = mu
    slope = whole * (1 - mu) / (s_dense - s_copy)
    fitted_offset = whole - slope * s_dense
    if not (slope > 0 and fitted_offset >= 0):
        line.reason = (
            f"the copy ran at {mu:.1%} of the dense model for {s_copy / s_dense:.1%} of its "
            "operators: no line with a positive slope and offset; operators in proportion"
        )
        return line
    cost_model.set_latency_line(slope, fitted_offset)
    line.fitted, line.slope, line.offset = True, slope, fitted_offset
    return line
