"""Latency as a curve through several sizes of the model, each timed whole.

The ``latency`` convention prices every operator timed alone and scales their sum to the
dense model timed whole. What lies between the operators (Python, the allocator, a lone
operator's warm caches) does not shrink in proportion with them: BERT-base at batch 1 on two
CPU threads, pruned to 24.8% of its predicted latency, ran at 33.9% of the dense model, and
ViT-B/16 at 29.4% for 24.4% (``benchmarks/latency_prediction.py``, before the line).

``fit_latency_line`` therefore times more sizes: for each share of ``LatencySpec.line_at``
(0.5 and 0.25 by default), a copy of the model with that share of every mask's channels kept,
shrunk, timed whole beside the dense model (one after the other, ``ROUNDS`` times, more for a
fast model; ``mu`` is the median of the rounds' ratios, so that a drift of the machine's speed
cancels out of it; ``_timed_shares``);
all are timed in the ``LatencySpec.form`` that serves them, so the curve maps the eager
operators' sum to that form's time. With ``S`` the operators' summed times alone and ``W``
the dense total the table already predicts, a state is priced on the piecewise-linear curve
through ``(S_dense, W)`` and every ``(S_copy, mu * W)`` (``LatencyCurve``): a target between
two sizes is interpolated, and only below the narrowest copy is the last segment extended.
The dense total, and with it every target given as a share, is unchanged. With one share, the
curve is the line ``slope * S + offset`` through the dense model and the copy: a state's
share of the dense total is ``1 - (1 - mu) (S_dense - S) / (S_dense - S_copy)``.

The line through the dense model and the widest copy must have a positive slope, and with
one copy a positive offset (a copy that is relatively faster than its operators keeps the
proportional scale then, as does a model whose copy cannot be shrunk: a warning says why;
with narrower copies the curve through them prices the states below it). The narrower
copies must each run faster than the one before, else a warning says so and that line
prices every state, as with one share (in proportion, where its offset is negative). Where
the narrowest segment, extended, would price no operators below 0, the states below the
narrowest copy are priced in proportion to it instead.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from torch import nn

from fisherprune.cost import CostModel, LatencyCurve, LatencySpec
from fisherprune.cost.latency import served, timing_threads, whole_model_seconds, with_batch
from fisherprune.export.shrink import shrink
from fisherprune.inputs import Inputs
from fisherprune.masks import masks_kept

log = logging.getLogger("fisherprune")

__all__ = ["LatencyCheck", "LatencyLine", "LatencyLoop", "check_latency", "fit_latency_line"]

#: rounds of the dense model and the shrunk copy timed one after the other; their ratio is the
#: median of the rounds' ratios (a round that a burst of other load slowed stays an outlier)
ROUNDS = 5

#: past ``ROUNDS``, rounds go on (up to ``MAX_ROUNDS``) until the rounds' passes (each round's
#: fastest pass of the dense model and of every copy) add up to this many seconds: a model of a
#: few milliseconds per pass moves by several percent from round to round on a shared VM (the
#: one-shot suite's MobileNetV3 at batch 64: +-6-9%), and five such rounds left its predictions
#: 2-5% apart from one fit to the next; a model whose five rounds already take this long gets
#: five
STEADY_SECONDS = 0.3
MAX_ROUNDS = 25

#: a copy whose rounds' ratios to the dense model spread further than this (half their
#: interquartile range over their median) was timed on a machine whose speed changed under it;
#: the fit says so in the log and in ``LatencyLine.points`` (``spread``)
UNSTEADY = 0.05


@dataclass
class LatencyLine:
    """What ``fit_latency_line`` found.

    Attributes:
        fitted: whether the cost model now prices states on the fitted line or curve.
        slope: what the operators' summed times alone are multiplied by on the line through
            the dense model and the widest copy (the curve's widest segment).
        offset: microseconds per forward pass added to them on that line.
        operators_share: the widest copy's operators summed, over the dense model's.
        measured_share: the widest copy timed whole, over the dense model timed beside it.
        kept_share: the share of every mask's channels the widest copy kept.
        reason: why the line was not fitted, or what was kept instead ("" when fitted).
        points: every copy timed, widest first: ``kept_share``, ``operators_share``,
            ``measured_share`` and its ``spread`` (``TimedShare``; None when not timed).
        curve: whether states are priced on the curve through the dense model and every
            point (``CostModel.latency_curve``), not on the line alone.
    """

    fitted: bool
    slope: float
    offset: float
    operators_share: float | None = None
    measured_share: float | None = None
    kept_share: float | None = None
    reason: str = ""
    points: list[dict[str, float | None]] = field(default_factory=list)
    curve: bool = False

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


@dataclass(frozen=True)
class TimedShare:
    """A shrunk model timed whole beside the dense one (``_timed_shares``).

    Attributes:
        share: the median over the rounds of its time over the dense model's.
        spread: half the interquartile range of the rounds' ratios over their median: how far
            the machine's state moved the ratio while it was timed.
    """

    share: float
    spread: float


def _timed_shares(
    model: nn.Module, smalls: list[nn.Module], inputs: Any, spec: LatencySpec
) -> list[TimedShare]:
    """Each of ``smalls`` timed whole against ``model`` with every mask at one, in
    ``spec.form`` (each built once): rounds of the dense model, then every small one, one after
    the other, ``ROUNDS`` of them and more while the rounds' passes (one per model per round)
    add up to less than ``STEADY_SECONDS`` (at most ``MAX_ROUNDS``). The masks are given back after.

    The share is the median of the rounds' ratios: a drift of the machine's speed cancels out
    of each round, and a round a burst of load slowed stays an outlier. What it cannot cancel
    is load that adds time out of proportion: on this project's 2-vCPU VM, two threads ran for
    tens of seconds at a time in a state where every operator cost some 25 us more (the second
    core contended), and a ResNet-50 copy with a quarter of every width then ran at 23% of the
    dense model, at 17% otherwise (``benchmarks/timing_regimes.py``). The fastest time over
    the fastest would read the quiet state only where both fastest blocks fell in it (one
    lucky block of the dense model read BERT-base's half at 62% for 51-55% by round).
    ``TimedShare.spread`` says how far the ratio moved, and a spread over ``UNSTEADY`` is
    logged: a state that changes inside the rounds is seen, one that lasts longer is not."""
    times: list[list[float]] = [[] for _ in smalls]
    dense: list[float] = []
    with timing_threads(spec), masks_kept(model, {}):  # the model itself, dense
        timed_dense = served(model, inputs, spec)
        timed = [served(s, inputs, spec) for s in smalls]
        spent = 0.0
        while len(dense) < ROUNDS or (spent < STEADY_SECONDS and len(dense) < MAX_ROUNDS):
            dense.append(whole_model_seconds(timed_dense, inputs, spec))
            for ts, small in zip(times, timed, strict=True):
                ts.append(whole_model_seconds(small, inputs, spec))
            spent += dense[-1] + sum(ts[-1] for ts in times)
    shares = []
    for ts in times:
        q1, mid, q3 = np.quantile(np.asarray(ts) / np.asarray(dense), [0.25, 0.5, 0.75])
        shares.append(TimedShare(float(mid), float((q3 - q1) / 2 / mid)))
        if shares[-1].spread > UNSTEADY:
            log.warning(
                "latency: a shrunk model's time over the dense model's moved by +-%.0f%% "
                "between rounds (other load, or more threads than idle cores): a prediction "
                "from these times may miss by as much; time on a quiet machine, or with fewer "
                "threads (LatencySpec.threads)",
                100 * shares[-1].spread,
            )
    return shares


def _line_through(
    whole: float, s_dense: float, s_point: float, share: float
) -> tuple[float, float]:
    """Slope and offset of the line through ``(s_dense, whole)`` and ``(s_point, share *
    whole)``: operators summed alone to microseconds timed whole."""
    slope = whole * (1 - share) / (s_dense - s_point)
    return slope, whole - slope * s_dense


def fit_latency_line(cost_model: CostModel, model: nn.Module, example_inputs: Any) -> LatencyLine:
    """Fit ``cost_model``'s latency to the model timed whole at several sizes (module
    docstring): the line through the dense model and the widest copy of
    ``LatencySpec.line_at``, then the curve through every copy.

    Changes: ``cost_model``'s line (``CostModel.set_latency_line``) when fitted, and its curve
    (``CostModel.set_latency_curve``) when more than one copy was timed and the curve holds;
    the model comes back as it was (its masks are set and given back; the copies are
    dropped). The copies are shrunk, then timed in rounds of the dense model and every copy, one
    after the other (``_timed_shares``: ``ROUNDS``, more for a fast model): every share past the
    first adds one shrink (and, in a compiled form, one build) and a whole forward pass of its
    copy timed per round (with their warm-up); the dense model's passes are shared.

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
    shares = spec.line_shares
    if not shares:
        return LatencyLine(False, scale, offset, reason="line_at=None: operators in proportion")
    whole = cost_model.dense_total()
    s_dense = cost_model.operators(np.ones(cost_model.n_entries))
    inputs = with_batch(example_inputs, spec.batch or Inputs.of(example_inputs).batch_size)
    line = LatencyLine(False, scale, offset, kept_share=shares[0])
    copies: list[_Copy] = []
    for share in shares:  # shrunk until one is not (the narrower ones are not tried)
        copies.append(_shrunk_copy(cost_model, model, inputs, share, s_dense, len(copies)))
        if copies[-1].small is None:
            break
    smalls = [c.small for c in copies if c.small is not None]  # the copies before any not
    timed = copies[: len(smalls)]
    measured = _timed_shares(model, smalls, inputs, spec) if smalls else []
    for c, mu in zip(timed, measured, strict=True):
        c.measured_share, c.spread = mu.share, mu.spread
    line.points = [c.point() for c in copies]
    knots = [(s_dense, whole), *((c.operators, float(c.measured_share) * whole) for c in timed)]
    if len(knots) == 1:
        line.reason = f"{copies[0].reason}; operators in proportion"
        return line
    curve_next = len(knots) > 2 and not copies[-1].reason
    if _fit_first(cost_model, line, knots[:2], negative_ok=curve_next):
        if copies[-1].reason:
            line.reason = f"{copies[-1].reason}; priced on the widest copy's line"
        elif curve_next:
            _fit_curve(cost_model, line, knots)
            if not line.curve and line.offset < 0:  # the line alone would price narrow
                cost_model.set_latency_line(scale, offset)  # states below 0: proportion
                line.fitted, line.slope, line.offset = False, scale, offset
                line.reason += "; that line's offset is negative: operators in proportion"
    return line


def _fit_first(
    cost_model: CostModel,
    line: LatencyLine,
    knots: list[tuple[float, float]],
    negative_ok: bool = False,
) -> bool:
    """Price ``cost_model`` on the line through the dense model and the widest copy (the
    first two ``knots``) when its slope is positive and its offset not negative, or negative
    with ``negative_ok`` (a curve through narrower copies is fitted next, and prices the
    states below the widest copy: a copy that runs relatively faster than its operators, as
    MobileNetV3's half copy at batch 1, is then priced by the copies, not in proportion);
    record it in ``line``. Returns whether it was set."""
    (s_dense, whole), (s_copy, price) = knots
    mu = price / whole
    line.operators_share, line.measured_share = s_copy / s_dense, mu
    slope, offset = _line_through(whole, s_dense, s_copy, mu)
    if not (slope > 0 and (offset >= 0 or negative_ok)):
        line.reason = (
            f"the copy ran at {mu:.1%} of the dense model for {s_copy / s_dense:.1%} of its "
            "operators: no line with a positive slope and offset; operators in proportion"
        )
        return False
    cost_model.set_latency_line(slope, offset)
    line.fitted, line.slope, line.offset = True, slope, offset
    return True


def _fit_curve(cost_model: CostModel, line: LatencyLine, knots: list[tuple[float, float]]) -> None:
    """Price ``cost_model`` on the curve through ``knots`` (the dense model, then the copies
    widest first) when each copy has fewer operators and runs faster than the one before;
    else warn and keep the line (``line.reason`` says why). Where the narrowest segment,
    extended, would price no operators below 0, the curve goes to 0 at no operators instead
    (below the narrowest copy, the operators in proportion to it)."""
    (x1, y1), (x0, y0) = knots[-2], knots[-1]
    if all(a[0] > b[0] and a[1] > b[1] for a, b in itertools.pairwise(knots)):
        ends = [(0.0, 0.0)] if y0 - x0 * (y1 - y0) / (x1 - x0) < 0 else []
        cost_model.set_latency_curve(LatencyCurve.through(knots + ends))
        line.curve = True
        return
    timed = ", ".join(
        f"{p['kept_share']:g} ran at {p['measured_share']:.1%} for {p['operators_share']:.1%}"
        for p in line.points
    )
    line.reason = (
        f"the copies timed whole (kept share, measured share for the operators' share: "
        f"{timed}) do not get faster with fewer operators; priced on the line through the "
        "dense model and the widest copy"
    )
    warnings.warn(f"latency curve not fitted: {line.reason}", stacklevel=3)


@dataclass
class _Copy:
    """A copy of the model keeping ``kept_share`` of every width: its ``operators`` summed
    alone (microseconds) and their ``operators_share`` of the dense model's, the copy shrunk
    (``small``; None: it was not, ``reason`` says why) and its ``measured_share`` timed
    whole with the ``spread`` of its rounds (``TimedShare``; None until it is)."""

    kept_share: float
    operators: float
    operators_share: float | None
    small: nn.Module | None = None
    measured_share: float | None = None
    spread: float | None = None
    reason: str = ""

    def point(self) -> dict[str, float | None]:
        """What ``LatencyLine.points`` keeps of it."""
        return {
            "kept_share": self.kept_share,
            "operators_share": self.operators_share,
            "measured_share": self.measured_share,
            "spread": self.spread,
        }


def _shrunk_copy(
    cost_model: CostModel,
    model: nn.Module,
    inputs: Any,
    share: float,
    s_dense: float,
    before: int,
) -> _Copy:
    """The copy of ``model`` with ``share`` of every mask's channels, shrunk (``before``:
    how many wider copies were shrunk before it). A copy that cannot be shrunk warns that the
    line (the widest copy) or the curve (a narrower one) is not fitted."""
    entries, kept = _cut_entries(cost_model, share)
    s_copy = cost_model.operators(entries)
    copy = _Copy(share, s_copy, s_copy / s_dense if s_dense > 0 else None)
    if not s_dense > s_copy > 0:
        copy.reason = f"the copy at {share:g} costs what the dense model does: nothing to fit"
        return copy
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with masks_kept(model, kept):
                copy.small = shrink(model, inputs, check=False)
    except Exception as e:  # any model shrink refuses at these widths is not timed
        copy.reason = f"the copy with {share:g} of every width was not shrunk ({e})"
        fitting = "curve" if before else "line"
        warnings.warn(f"latency {fitting} not fitted: {copy.reason}", stacklevel=3)
    return copy


def add_floor_knot(
    cost_model: CostModel,
    model: nn.Module,
    example_inputs: Any,
    at_floor: Callable[[], AbstractContextManager[Any]],
    line: LatencyLine,
) -> None:
    """Time whole the state of every mask at its floor (``at_floor()`` sets it and puts the
    masks back on exit) and price states below the narrowest copy on the curve through it,
    where they were priced by extending the narrowest segment: a target there, and whether it
    can be reached at all, is then read off a time, not an extrapolation (MobileNetV3's floor
    at batch 64 was priced from 74% to 86% of the dense model by two fits a minute apart).
    Recorded in ``line.points`` (``kept_share`` 0: the floor). Not added (and the curve kept)
    when the floor cannot be shrunk or is not both narrower and faster than the narrowest
    copy (timing noise). Changes: the cost model's curve when added; the masks only inside
    ``at_floor``."""
    whole = cost_model.dense_total()
    s_dense = cost_model.operators(np.ones(cost_model.n_entries))
    curve = cost_model.latency_curve
    if curve is not None:
        knots = [k for k in zip(curve.operators, curve.prices, strict=True) if k[0] > 0]
    else:
        copy = next((p for p in line.points if p.get("measured_share") is not None), None)
        if not line.fitted or copy is None:
            return
        knots = [
            (s_dense, whole),
            (copy["operators_share"] * s_dense, copy["measured_share"] * whole),
        ]
    with at_floor():
        check = check_latency(cost_model, model, example_inputs, whole)
    x, mu = check.operators_share * s_dense, check.measured_share
    line.points.append({"kept_share": 0.0, "operators_share": check.operators_share,
                        "measured_share": mu, "spread": check.spread})  # fmt: skip
    narrowest = min(knots)
    if mu is None or not (0 < x < narrowest[0] and mu * whole < narrowest[1]):
        log.info("latency: the floor state (%s) is not priced on a knot of its own",
                 check.reason or f"timed at {mu:.1%} for {check.operators_share:.1%}")  # fmt: skip
        return
    cost_model.set_latency_curve(LatencyCurve.through([*knots, (x, mu * whole)]))
    line.curve = True


#: a state timed further than this (a share of its price on the line) from its price is taken
#: for other load while timing, not for the line's error: under a neighbour's benchmark a
#: ResNet-50 state once timed at 85.5% of the dense model for a predicted 44.1% (the lines'
#: own errors on the four networks of ``benchmarks/latency_prediction.py`` were up to 19%)
CHECK_TOLERANCE = 0.3

#: a refit may not ask for fewer than this share of the operators the line before it asked
#: for at the target: one check never sends a prune far below where it was aimed
CHECK_FLOOR = 0.6

#: the least gap, in shares of the dense model's operators, between the two points a line is
#: refitted through (closer points leave the slope to the timing's noise)
CHECK_SPAN = 0.05

#: the state at the last goal timed more than this share above the target is pruned again
#: (once) on the line refitted through it
CHECK_SLACK = 0.03


@dataclass
class LatencyCheck:
    """One state of a latency prune, shrunk and timed whole beside the dense model
    (``check_latency``).

    Attributes:
        goal: the goal (1, 2, ...) the prune had reached.
        operators_share: the state's operators summed alone, over the dense model's.
        predicted_share: its price on the line before the check, over the dense model's
            price when the prune started.
        measured_share: it timed whole, over the dense model timed beside it (the median of
            the rounds' ratios, ``_timed_shares``; None: it was not shrunk).
        spread: how far the rounds' ratios moved (``TimedShare.spread``; None: not timed).
        refitted: whether the line now goes through this state (``LatencyLoop``).
        reason: why it was not refitted ("" when it was).
        seconds: wall time of the check (the shrink and the timing).
        floor: whether the state timed was not the prune's but every mask at its floor
            (``LatencyLoop.time_floor``).
    """

    goal: int
    operators_share: float
    predicted_share: float
    measured_share: float | None = None
    spread: float | None = None
    refitted: bool = False
    reason: str = ""
    seconds: float = 0.0
    floor: bool = False

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields (reports)."""
        return asdict(self)

    @property
    def off(self) -> float | None:
        """Measured over predicted share, less 1 (None: not timed)."""
        return (
            None if self.measured_share is None else self.measured_share / self.predicted_share - 1
        )

    @property
    def trusted(self) -> bool:
        """Timed, and within ``CHECK_TOLERANCE`` of its price (further: taken for other load
        while timing, not for the line's error)."""
        return self.off is not None and abs(self.off) <= CHECK_TOLERANCE


def check_latency(
    cost_model: CostModel, model: nn.Module, example_inputs: Any, dense: float, goal: int = 0
) -> LatencyCheck:
    """Shrink the state ``model``'s masks are in and time it whole beside the dense model
    (in rounds, one after the other: ``_timed_shares``), in ``spec.form``.

    Changes nothing: the model comes back as it was (its masks are set and given back; the
    shrunk copy is dropped). A state that cannot be shrunk is not timed (``reason``).

    Args:
        cost_model: a ``CostModel`` of the ``latency`` convention, built on ``model``.
        model: the masked network, in the state to time.
        example_inputs: its example inputs (repeated to the spec's batch, as the table was).
        dense: the dense model's price (``cost_model.dense_total()`` before any refit).
        goal: the prune's goal reached (recorded in the check).

    Raises:
        ValueError: ``cost_model`` is not of the ``latency`` convention.
    """
    spec = cost_model.latency
    if spec is None:
        raise ValueError(f"check_latency needs a latency cost model, not {cost_model.convention!r}")
    start = time.perf_counter()
    ops_dense = cost_model.operators(np.ones(cost_model.n_entries))
    check = LatencyCheck(goal, cost_model.operators() / ops_dense, cost_model.total() / dense)
    inputs = with_batch(example_inputs, spec.batch or Inputs.of(example_inputs).batch_size)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            small = shrink(model, inputs, check=False)
    except Exception as e:  # a state shrink refuses is not timed; the line stays
        check.reason = f"the state was not shrunk ({e})"
    else:
        (timed,) = _timed_shares(model, [small], inputs, spec)
        check.measured_share, check.spread = timed.share, timed.spread
    check.seconds = time.perf_counter() - start
    return check


@dataclass
class LatencyLoop:
    """A latency prune's states timed whole on its way (``check_latency``), and its line
    refitted through them, so that the rounds after a check aim at the target on a line that
    is right where the prune is.

    A prune's state is not the uniform copy ``fit_latency_line`` timed: an L1 prune of
    BERT-base kept hidden 472/768, 7 of 12 heads and the MLPs whole, and ran at 21.6% of the
    dense model for 11.9% of its operators, where the copy ran at 31.7% for 19.8% and its
    line priced the state at 25%. After a check the line goes through the state and the
    point of the prune's path before it at least ``CHECK_SPAN`` of the operators wider (the
    dense model first): a secant along the path, so a whole time that bends away from the
    operators' sum (a kept mix of widths the copy did not have) is followed as it bends.
    Prices stay in the dense model's microseconds when the prune started (``dense``), so a
    target given as a share keeps its meaning. Not refitted (the check's ``reason`` says
    why): a state timed more than ``CHECK_TOLERANCE`` from its price (other load while
    timing), a secant that does not fall, and a line that would price the target at fewer
    than ``CHECK_FLOOR`` of the operators the line (or curve) before it did, or the dense
    model at 0. A refitted line replaces the copies' curve (``fit_latency_line``) for the
    rest of the prune: it goes through the prune's own states, where the curve went through
    uniform copies.

    States are checked after each goal in ``at``, then after the last, which is reached once
    more (on the line refitted through its state) when that state timed more than
    ``CHECK_SLACK`` above the target. The other way cannot be corrected after the last goal
    (channels are not given back): the goals before it are where a state priced too high is
    found in time.

    Attributes:
        cost_model, model, example_inputs: as ``check_latency`` takes them.
        target: the prune's target (microseconds).
        dense: the dense model's price when the prune started.
        goals: the prune's goals.
        at: the goals before the last after which the state is checked.
        checks: every check, in order.
        path: (operators share, measured share) of the dense model and each state refitted
            through, in order.
        again: whether the last goal may still be reached again.
    """

    cost_model: CostModel
    model: nn.Module
    example_inputs: Any
    target: float
    dense: float
    goals: int
    at: set[int]
    checks: list[LatencyCheck] = field(default_factory=list)
    path: list[tuple[float, float]] = field(default_factory=lambda: [(1.0, 1.0)])
    again: bool = True

    @classmethod
    def planned(
        cls, cost_model: CostModel, model: nn.Module, example_inputs: Any, target: float, goals: int
    ) -> LatencyLoop | None:
        """The loop ``cost_model.latency.checks`` asks for: that many goals before the last,
        the one before it first, then evenly down (at most ``goals - 1``); None with no
        checks or another convention."""
        n = cost_model.latency.checks if cost_model.latency is not None else 0
        if n == 0:
            return None
        step = max(1, (goals - 1) // n)
        at = {goals - 1 - i * step for i in range(n)} & set(range(1, goals))
        dense = cost_model.dense_total()
        return cls(cost_model, model, example_inputs, target, dense, goals, at)

    def reached(self, goal: int) -> bool:
        """After goal ``goal`` is reached: check the state when planned, and refit the line
        through it; True when the last goal must be reached again. Changes: the cost model's
        slope and offset when refitted (and its curve is dropped)."""
        if goal != self.goals and goal not in self.at:
            return False
        check = check_latency(self.cost_model, self.model, self.example_inputs, self.dense, goal)
        self.checks.append(check)
        if check.measured_share is not None:
            self._refit(check)
        if goal != self.goals or not self.again:
            return False
        self.again = False
        slow = check.measured_share is not None and (
            check.measured_share > self.target / self.dense * (1 + CHECK_SLACK)
        )
        return check.refitted and slow

    def time_floor(self, at_floor: Callable[[], AbstractContextManager[Any]]) -> LatencyCheck:
        """Time whole the state of every mask at its floor (``at_floor()`` sets it and puts
        the masks back on exit), as a check after the last goal reached, and refit the line
        through it and the prune's last state: where a secant along the prune's path prices
        the floor above the target, this measures whether it is. Changes: the cost model's
        line when refitted; the masks only inside ``at_floor``."""
        goal = self.checks[-1].goal if self.checks else 0
        with at_floor():
            check = check_latency(
                self.cost_model, self.model, self.example_inputs, self.dense, goal
            )
        check.floor = True
        self.checks.append(check)
        if check.measured_share is not None:
            self._refit(check)
        return check

    def _refit(self, check: LatencyCheck) -> None:
        """The line through ``check``'s state and the path's last point ``CHECK_SPAN`` wider,
        unless a guard says no (``check.reason``)."""
        x, y = check.operators_share, float(check.measured_share)
        if not check.trusted:
            check.reason = (
                f"timed at {y:.1%} of the dense model where the line prices it at "
                f"{check.predicted_share:.1%} ({check.off:+.0%}): taken for other load while "
                "timing"
            )
            return
        x0, y0 = next((p for p in reversed(self.path) if p[0] - x >= CHECK_SPAN), (x, y))
        if not (x0 > x and y0 > y):
            check.reason = "not faster than the state before it: nothing to fit"
            return
        cm, share = self.cost_model, self.target / self.dense
        a = (y0 - y) / (x0 - x)  # in shares: y = a x + b
        b = y - a * x
        ops_dense = cm.operators(np.ones(cm.n_entries))
        aimed = cm.operators_at(self.target) / ops_dense  # on the line, or curve, before it
        now = (share - b) / a
        if not (now >= CHECK_FLOOR * aimed and a + b > 0):
            check.reason = (
                f"the line through it prices the target at {now:.1%} of the operators (the "
                f"line before it at {aimed:.1%}) and the dense model at {a + b:.1%}: kept"
            )
            return
        cm.set_latency_line(a * self.dense / ops_dense, b * self.dense)
        self.path.append((x, y))
        check.refitted = True
