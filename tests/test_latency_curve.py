"""The latency curve (issue 32, point 3): ``fit_latency_line`` times copies at several widths
and prices a state on the piecewise-linear curve of its operators' sum through them, so a
target between two timed sizes is interpolated, not extrapolated from one copy's line.

The operators' clock is a fake (an operator's FLOPs in nanoseconds), and the model timed whole
is a known convex function of the operators' sum ``S``: ``f(S) = 0.3 S_d + S + 0.3 S^2 / S_d``
(``S_d`` the dense model's sum), a positive offset with a time that falls slower as the
model narrows. The table is timed in steps of 2 channels, so that it prices every width the
copies and the prunes keep exactly (in steps of 8 a copy keeping 6 of 24 channels is priced
as 8 on the table's staircase, the curve's knot then off its time by the step)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fisherprune as fp
import fisherprune.calibrate.to_target as to_target_module
from fisherprune.calibrate import fit_latency_line
from fisherprune.cost import CostModel, LatencyCurve, LatencySpec
from fisherprune.cost import latency as lat
from tests.test_latency_cost import _fake_whole
from tests.test_latency_line import _flops_seconds, _net, install_clock

#: predicted share over measured share, less 1, that the curve must keep within: the chord's
#: distance from ``f`` between the dense model and the half copy (28% of its operators) is
#: +3.2% at the 50% state; between the copies, +0.1% at the 25% state
CURVE_TOLERANCE = 0.05

#: how far the line through the dense model and the half copy must miss the 25% state (it
#: misses by -9.1%: the line, extended past the copy, falls below the convex ``f``)
LINE_MISS = 0.08


def _ops(model: nn.Module, x: torch.Tensor) -> float:
    return _fake_whole(model, x, None, _flops_seconds)


def _convex(model, example_inputs, spec, clock=None):
    """``f(S)`` of the docstring, in seconds (a masked model: its full widths)."""
    dense = _ops(_net(), example_inputs)
    s = _ops(model, example_inputs)
    return 0.3 * dense + s + 0.3 * s * s / dense


@pytest.fixture
def convex_clock(monkeypatch):
    install_clock(monkeypatch, _convex)


def _spec(tmp_path, **kw) -> LatencySpec:
    return LatencySpec(cache=tmp_path / "latency", threads=1, step=2, **kw)


def _prediction_error(tmp_path, target: str, **kw) -> float:
    """Prune ``_net`` to ``target`` on the latency convention; its predicted share of the
    dense price over its measured share (``_convex`` on the shrunk model), less 1."""
    return _prediction_error_on(tmp_path, target, _convex, **kw)


def _prediction_error_on(tmp_path, target: str, clock, **kw) -> float:
    """``_prediction_error`` with the model timed whole by ``clock``."""
    net, x = _net(), torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fp.prune_to_target(
            net, x, [(x, torch.tensor([0, 1]))], target, loss_fn=F.cross_entropy,
            convention="latency", latency=_spec(tmp_path, **kw), reconstruct=False,
        )  # fmt: skip
    measured = clock(fp.shrink(net), x, None) / clock(_net(), x, None)
    return (result.cost_after / result.cost_before) / measured - 1


def test_the_curve_predicts_both_targets_where_the_line_misses_the_quarter(
    tmp_path, convex_clock, monkeypatch
):
    """With copies at 0.5 and 0.25 (the default) a prune to 50% and to 25% is predicted
    within ``CURVE_TOLERANCE`` of its time; the line through the half copy alone, extended
    to 25%, misses by more than ``LINE_MISS``, and with the floor timed as a knot below it
    (what a target below the narrowest copy gets) it is within ``CURVE_TOLERANCE`` too."""
    for target in ("50%", "25%"):
        err = _prediction_error(tmp_path, target)
        assert abs(err) < CURVE_TOLERANCE, (target, err)
    floor_err = _prediction_error(tmp_path, "25%", line_at=0.5)
    assert abs(floor_err) < CURVE_TOLERANCE, floor_err
    monkeypatch.setattr(to_target_module, "add_floor_knot", lambda *a, **k: None)
    line_err = _prediction_error(tmp_path, "25%", line_at=0.5)
    assert abs(line_err) > LINE_MISS, line_err


def test_a_single_share_fits_the_line_through_the_dense_model_and_that_copy(tmp_path, convex_clock):
    """``line_at=0.5`` prices every state on the line through the dense model and the copy
    keeping 8/16 and 12/24 channels, both timed whole independently here; no curve."""
    net, x = _net(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    cm = CostModel(net, x, "latency", latency=_spec(tmp_path, line_at=0.5))
    dense = cm.total()
    line = fit_latency_line(cm, net, x)
    ref = _net()
    fp.apply_masks(ref, x)
    for m, k in zip(fp.find_masks(ref).values(), (8, 12), strict=True):
        m.mask[k:] = 0.0
    s_d, s_c = _ops(_net(), x) / lat.UNIT, _ops(fp.shrink(ref), x) / lat.UNIT
    mu = _convex(fp.shrink(ref), x, None) / _convex(_net(), x, None)
    slope = dense * (1 - mu) / (s_d - s_c)
    assert line.fitted and not line.curve and cm.latency_curve is None
    assert [p["kept_share"] for p in line.points] == [0.5]
    assert (line.slope, line.offset) == (cm.latency_scale, cm.latency_offset)
    assert cm.latency_scale == pytest.approx(slope, rel=1e-9)
    assert cm.latency_offset == pytest.approx(dense - slope * s_d, rel=1e-9)
    for m, r in zip(fp.find_masks(net).values(), fp.find_masks(ref).values(), strict=True):
        m.mask.copy_(r.mask)
    assert cm.total() == pytest.approx(mu * dense, rel=1e-9)  # the copy, priced on its line


def test_copies_that_do_not_get_faster_keep_the_line_with_a_warning(tmp_path, monkeypatch):
    """The quarter copy timed slower than the half copy (not falling with its operators):
    a warning, and the line through the dense model and the half copy prices every state."""

    def slow_quarter(model, example_inputs, spec, clock=None):
        widths = [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)]
        s = _convex(model, example_inputs, spec)
        return s * 3 if widths == [4, 6] else s

    install_clock(monkeypatch, slow_quarter)
    net, x = _net(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    cm = CostModel(net, x, "latency", latency=_spec(tmp_path))
    with pytest.warns(UserWarning, match="latency curve not fitted"):
        line = fit_latency_line(cm, net, x)
    assert line.fitted and not line.curve and cm.latency_curve is None
    assert "widest copy" in line.reason
    ref = CostModel(net, x, "latency", latency=_spec(tmp_path, line_at=0.5))
    ref_line = fit_latency_line(ref, net, x)
    assert (line.slope, line.offset) == pytest.approx((ref_line.slope, ref_line.offset))


def test_a_narrowest_segment_below_0_gives_way_to_the_proportion(tmp_path, monkeypatch):
    """The quarter copy timed so fast that the segment through it, extended, would price no
    operators below 0: below the quarter copy states are priced in proportion to it."""

    def fast_quarter(model, example_inputs, spec, clock=None):
        widths = [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)]
        s = _ops(model, example_inputs)
        return 0.3 * s if widths == [4, 6] else s + 0.3 * _ops(_net(), example_inputs)

    install_clock(monkeypatch, fast_quarter)
    net, x = _net(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    cm = CostModel(net, x, "latency", latency=_spec(tmp_path))
    assert fit_latency_line(cm, net, x).curve
    quarter = cm.latency_curve.operators[1], cm.latency_curve.prices[1]
    assert (cm.latency_curve.operators[0], cm.latency_curve.prices[0]) == (0.0, 0.0)
    first, second = fp.find_masks(net).values()
    first.mask[2:] = 0.0  # fewer operators than the quarter copy (4 and 6)
    second.mask[3:] = 0.0
    assert cm.total() == pytest.approx(cm.operators() * quarter[1] / quarter[0], rel=1e-12)


def test_marginal_costs_are_exact_on_the_curve(tmp_path, convex_clock):
    """Each channel's marginal cost is the price now less the price without it (brute
    force, per channel), at a state just above the half copy's knot, which removing a
    channel of the first convolution crosses (a slope times the operators saved would not
    do there)."""
    net, x = _net(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    cm = CostModel(net, x, "latency", latency=_spec(tmp_path))
    assert fit_latency_line(cm, net, x).curve
    (first_name, first), (_, second) = fp.find_masks(net).items()
    first.mask[8:] = 0.0  # the half copy keeps 8 and 12
    second.mask[13:] = 0.0
    report, now = cm.report(), cm.entries()
    for name, start in cm.entry_start.items():
        for k, got in enumerate(report.marginal[name].tolist()):
            without = now.copy()
            without[start + k] = 0.0
            assert got == pytest.approx(report.total - cm.total(without), abs=1e-9), (name, k)
    without = now.copy()
    without[cm.entry_start[first_name]] = 0.0
    assert cm.operators(without) < cm.latency_curve.operators[1] < cm.operators()


def test_the_calibration_gives_the_curve_back(tmp_path, convex_clock):
    """``latency_calibration`` carries the curve: a cost model built from it prices a
    pruned state as the fitted one does, without timing the model whole."""
    net, x = _net(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    cm = CostModel(net, x, "latency", latency=_spec(tmp_path))
    assert fit_latency_line(cm, net, x).curve
    next(iter(fp.find_masks(net).values())).mask[3:] = 0.0
    again = CostModel(
        net, x, "latency", latency=_spec(tmp_path), latency_calibration=cm.latency_calibration
    )
    assert again.latency_curve == cm.latency_curve
    assert again.total() == pytest.approx(cm.total(), rel=1e-12)


def test_the_curve_interpolates_and_extends_its_end_segments():
    curve = LatencyCurve.through([(4.0, 10.0), (1.0, 4.0), (2.0, 7.0)])
    xs = np.array([1.0, 1.5, 2.0, 3.0, 4.0])
    assert np.allclose(curve(xs), np.interp(xs, [1, 2, 4], [4, 7, 10]))
    assert curve(0.5) == pytest.approx(2.5)  # the narrowest segment's slope goes on
    assert curve(5.0) == pytest.approx(11.5)
    assert curve.operators_at(8.5) == pytest.approx(3.0)


@pytest.mark.parametrize(
    "knots",
    [[(1.0, 2.0)], [(1.0, 2.0), (2.0, 2.0)], [(1.0, 3.0), (2.0, 2.0)], [(-1.0, 1.0), (2.0, 3.0)]],
)
def test_a_curve_that_does_not_rise_is_refused(knots):
    with pytest.raises(ValueError, match="latency curve"):
        LatencyCurve.through(knots)


@pytest.mark.parametrize(
    ("bad", "match"),
    [((), "empty"), ((0.5, 0.5), "twice"), ((0.5, 1.0), "1.0 is not a share"),
     ((0.5, "a"), "'a' is not a share"), ((0.5, True), "True is not a share")],
)  # fmt: skip
def test_bad_line_at_tuples_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        LatencySpec(line_at=bad)


def test_line_at_shares_are_kept_widest_first():
    assert LatencySpec(line_at=[0.25, 0.5]).line_at == (0.5, 0.25)
    assert LatencySpec(line_at=0.5).line_shares == (0.5,)
    assert LatencySpec().line_shares == (0.5, 0.25)


def test_line_at_does_not_change_the_tables_file(tmp_path):
    """The table is per operator and the curve per prune: every ``line_at`` opens the same
    table file."""
    files = {
        lat.LatencyTable.open(_spec(tmp_path, line_at=a)).path for a in (None, 0.5, (0.5, 0.25))
    }
    assert len(files) == 1


def _concave(model, example_inputs, spec, clock=None):
    """``S (0.85 + 0.15 S / S_d)`` in seconds: a copy runs relatively faster than its
    operators (the line through the dense model and the half copy has a negative offset)."""
    dense = _ops(_net(), example_inputs)
    s = _ops(model, example_inputs)
    return s * (0.85 + 0.15 * s / dense)


def test_a_copy_faster_than_its_operators_is_priced_on_the_curve(tmp_path, monkeypatch):
    """Where the half copy runs relatively faster than its operators (the line through it
    has a negative offset), the curve through the quarter copy still prices the states: a
    prune to 50% and to 25% is predicted within ``CURVE_TOLERANCE``; in proportion, as with
    the half copy alone, the 50% state is predicted more than 6% slow (50% of the operators
    run at 46.25% of the dense time: +8.1%)."""
    install_clock(monkeypatch, _concave)
    net, x = _net(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    cm = CostModel(net, x, "latency", latency=_spec(tmp_path))
    line = fit_latency_line(cm, net, x)
    assert line.fitted and line.curve and line.offset < 0
    for target in ("50%", "25%"):
        err = _prediction_error_on(tmp_path, target, _concave)
        assert abs(err) < CURVE_TOLERANCE, (target, err)
    alone = _prediction_error_on(tmp_path, "50%", _concave, line_at=0.5)
    assert alone > 0.06, alone  # the half copy alone: no line, operators in proportion
