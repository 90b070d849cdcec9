"""The latency line (issue 32, point 3): ``fit_latency_line`` times the dense model and a
shrunk copy whole and prices a state at ``slope x operators + offset``.

The clock is a fake (an operator's FLOPs in nanoseconds: bilinear in its widths, which the
table's sweeps and separable product represent exactly), and a forward pass whole "takes" its
operators plus a constant ``OVERHEAD``: the line must find that constant, and then predict a
shrunk model's whole time exactly, where a proportional scale would not."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fisherprune as fp
import fisherprune.calibrate.latency_line as line_module
import fisherprune.cost.model as model_module
from fisherprune.calibrate import fit_latency_line
from fisherprune.cost import CostModel, LatencySpec
from fisherprune.cost import latency as lat
from tests.test_latency_cost import _fake_whole, flops_at

OVERHEAD = 40e-6  # seconds per forward pass between the operators


def _flops_seconds(self, rec, dense, shapes):
    return flops_at(rec, shapes) * 1e-9


def _with_overhead(model, example_inputs, spec, clock=None):
    return _fake_whole(model, example_inputs, spec, _flops_seconds) + OVERHEAD


def install_clock(monkeypatch: pytest.MonkeyPatch, whole) -> None:
    """Operators take their FLOPs in nanoseconds; a model timed whole takes ``whole``."""
    monkeypatch.setattr(lat.OpTimer, "seconds", _flops_seconds)
    monkeypatch.setattr(model_module, "whole_model_seconds", whole)
    monkeypatch.setattr(line_module, "whole_model_seconds", whole)


@pytest.fixture
def overhead_clock(monkeypatch):
    install_clock(monkeypatch, _with_overhead)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 24, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(24, 5),
    ).eval()  # fmt: skip


def _spec(tmp_path, **kw) -> LatencySpec:
    return LatencySpec(cache=tmp_path / "latency", threads=1, **kw)


def test_the_line_finds_the_overhead_and_keeps_the_dense_total(tmp_path, overhead_clock):
    net, x = _net(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    cm = CostModel(net, x, "latency", latency=_spec(tmp_path))
    dense = cm.total()
    line = fit_latency_line(cm, net, x)
    assert line.fitted and line.reason == ""
    assert line.slope == pytest.approx(1.0, rel=1e-9)
    assert line.offset == pytest.approx(OVERHEAD / lat.UNIT, rel=1e-9)
    assert cm.total() == pytest.approx(dense, rel=1e-12)  # shares of the dense stay put
    assert line.measured_share > line.operators_share  # the copy shrank less than its ops


def test_after_the_line_a_pruned_model_is_predicted_as_timed_whole(tmp_path, overhead_clock):
    net, x = _net(), torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fp.prune_to_target(
            net, x, [(x, torch.tensor([0, 1]))], "60%", loss_fn=F.cross_entropy,
            convention="latency", latency=_spec(tmp_path), reconstruct=False,
        )  # fmt: skip
    assert result.latency_line is not None and result.latency_line.fitted
    small = fp.shrink(net)
    measured = _with_overhead(small, x, None) / lat.UNIT
    assert result.cost_after == pytest.approx(measured, rel=1e-9)
    assert result.cost_after <= 0.6 * result.cost_before + 1e-6


def test_without_the_line_the_prediction_misses_the_overhead(tmp_path, overhead_clock):
    """The reference for the test above: ``line_at=None`` keeps the proportional scale
    (and ``checks=0`` never refits it through a state timed whole), which under-predicts the
    pruned model by the overhead it scaled down."""
    net, x = _net(), torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fp.prune_to_target(
            net, x, [(x, torch.tensor([0, 1]))], "60%", loss_fn=F.cross_entropy,
            convention="latency", latency=_spec(tmp_path, line_at=None, checks=0),
            reconstruct=False,
        )  # fmt: skip
    assert result.latency_line is not None and not result.latency_line.fitted
    measured = _with_overhead(fp.shrink(net), x, None) / lat.UNIT
    assert result.cost_after < measured * (1 - 1e-3)


def test_a_copy_faster_than_its_operators_keeps_the_proportion(tmp_path, monkeypatch):
    """With one copy (``line_at=0.5``), a whole time that falls faster than the operators
    (here: their square, scaled to the dense) would need a negative offset: the proportional
    scale is kept, and said why (with narrower copies the curve prices such states:
    ``test_latency_curve``)."""
    net, x = _net(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    dense_ops = _fake_whole(net, x, None, _flops_seconds)

    def superlinear(model, example_inputs, spec, clock=None):
        return _fake_whole(model, example_inputs, spec, _flops_seconds) ** 2 / dense_ops

    monkeypatch.setattr(lat.OpTimer, "seconds", _flops_seconds)
    monkeypatch.setattr(model_module, "whole_model_seconds", superlinear)
    monkeypatch.setattr(line_module, "whole_model_seconds", superlinear)
    cm = CostModel(net, x, "latency", latency=_spec(tmp_path, line_at=0.5))
    scale = cm.latency_scale
    line = fit_latency_line(cm, net, x)
    assert not line.fitted and "no line" in line.reason
    assert (cm.latency_scale, cm.latency_offset) == (scale, 0.0)


def test_a_copy_that_cannot_be_shrunk_keeps_the_proportion_with_a_warning(
    tmp_path, overhead_clock, monkeypatch
):
    net, x = _net(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    cm = CostModel(net, x, "latency", latency=_spec(tmp_path))

    def refuse(*args, **kwargs):
        raise ValueError("no shrink rule for this module")

    monkeypatch.setattr(line_module, "shrink", refuse)
    with pytest.warns(UserWarning, match="latency line not fitted.*no shrink rule"):
        line = fit_latency_line(cm, net, x)
    assert not line.fitted and cm.latency_offset == 0.0


def test_fitting_gives_the_masks_back_as_they_were(tmp_path, overhead_clock):
    net, x = _net(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    masks = fp.find_masks(net)
    first = next(iter(masks.values()))
    first.mask[3:7] = 0.0  # a model already part pruned
    before = {n: m.mask.clone() for n, m in masks.items()}
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    cm = CostModel(net, x, "latency", latency=_spec(tmp_path))
    fit_latency_line(cm, net, x)
    assert all(torch.equal(masks[n].mask, v) for n, v in before.items())
    assert all(torch.equal(net.state_dict()[k], v) for k, v in weights.items())


def test_set_latency_line_refuses_what_is_not_a_line(tmp_path, overhead_clock):
    net, x = _net(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    cm = CostModel(net, x, "latency", latency=_spec(tmp_path))
    ops = cm.dense_total() / cm.latency_scale  # the dense model's operators summed alone
    for slope, offset in ((0.0, 1.0), (1.0, -ops), (float("nan"), 0.0), (1.0, math.inf)):
        with pytest.raises(ValueError, match="positive slope"):
            cm.set_latency_line(slope, offset)
    cm.set_latency_line(1.0, -0.5 * ops)  # negative, but the dense model still costs
    assert cm.dense_total() == pytest.approx(0.5 * ops, rel=1e-12)
    with pytest.raises(ValueError, match="latency convention"):
        CostModel(net, x).set_latency_line(1.0, 0.0)


@pytest.mark.parametrize("bad", [0.0, 1.0, 1.5, True, "half"])
def test_bad_line_at_is_refused(bad):
    with pytest.raises(ValueError, match="line_at"):
        LatencySpec(line_at=bad)


def test_a_bilinear_clock_is_predicted_exactly_at_every_width(tmp_path, overhead_clock):
    """Operators whose time is bilinear in their widths are predicted exactly at widths the
    sweeps interpolate, also below the joint grid's narrowest rows (the grid once took
    ratios where a sweep was held flat, and spread them to widths above)."""
    net, x = _net(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    cm = CostModel(net, x, "latency", latency=_spec(tmp_path, step=8))
    cm.set_latency_line(1.0, 0.0)
    first, second = fp.find_masks(net).values()
    for k1, k2 in ((16, 12), (9, 20), (4, 12), (12, 9)):
        first.mask.fill_(1.0)
        second.mask.fill_(1.0)
        first.mask[k1:] = 0.0
        second.mask[k2:] = 0.0
        small = fp.shrink(net)
        want = _fake_whole(small, x, None, _flops_seconds) / lat.UNIT
        assert cm.total() == pytest.approx(want, rel=1e-9), (k1, k2)


def test_a_contended_minority_of_rounds_moves_no_share_and_is_reported(
    tmp_path, monkeypatch, caplog
):
    """Two of the five rounds run in a state that adds the same time to every forward pass
    (two threads with their second core contended did so on a shared VM): the copies' shares
    are the median of the rounds' ratios, so exactly those of the quiet state, and the fit
    records how far the rounds moved (``spread``) and logs it; quiet rounds log nothing."""
    net, x = _net(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    calls = []

    def contended(model, example_inputs, spec, clock=None):
        calls.append(model)  # per round: the dense model, then the copies (0.5, 0.25)
        slow = 4 <= len(calls) <= 9  # rounds 2 and 3 of 5
        return _with_overhead(model, example_inputs, spec) + (5 * OVERHEAD if slow else 0.0)

    install_clock(monkeypatch, _with_overhead)
    # the fake passes take microseconds: five rounds, as a model slower than STEADY_SECONDS gets
    monkeypatch.setattr(line_module, "STEADY_SECONDS", 0.0)
    cm = CostModel(net, x, "latency", latency=_spec(tmp_path))
    with caplog.at_level("WARNING", logger="fisherprune"):
        quiet_line = fit_latency_line(cm, net, x)
    assert "moved by" not in caplog.text
    assert all(p["spread"] == 0.0 for p in quiet_line.points)
    monkeypatch.setattr(line_module, "whole_model_seconds", contended)
    with caplog.at_level("WARNING", logger="fisherprune"):
        line = fit_latency_line(cm, net, x)
    assert len(calls) == 3 * line_module.ROUNDS
    dense_s = _with_overhead(net, x, None)
    for p, n in zip(line.points, (0.5, 0.25), strict=True):
        _entries, kept = line_module._cut_entries(cm, n)
        with line_module.masks_kept(net, kept):
            quiet = _with_overhead(fp.shrink(net), x, None) / dense_s
        assert p["measured_share"] == pytest.approx(quiet, rel=1e-12)
        assert p["spread"] > line_module.UNSTEADY
    assert "moved by" in caplog.text


@pytest.mark.parametrize(("round_seconds", "rounds"), [(1e-3, 25), (0.036, 9), (0.3, 5)])
def test_a_fast_model_is_timed_for_more_rounds_until_its_passes_add_up(
    tmp_path, monkeypatch, round_seconds, rounds
):
    """The copies are timed for ROUNDS rounds, and more while the forward passes timed add up
    to less than STEADY_SECONDS (0.3 s), never past MAX_ROUNDS: a round of the dense model
    and both copies taking 36 ms gets 9 rounds (0.288 s after 8), one of 1 ms gets 25 (the
    cap), one of 0.3 s gets 5."""
    net, x = _net(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    install_clock(monkeypatch, _with_overhead)
    cm = CostModel(net, x, "latency", latency=_spec(tmp_path))
    sizes = [_with_overhead(net, x, None)]
    for share in (0.5, 0.25):
        with line_module.masks_kept(net, line_module._cut_entries(cm, share)[1]):
            sizes.append(_with_overhead(fp.shrink(net), x, None))
    scale = round_seconds / sum(sizes)
    calls = []

    def timed(model, example_inputs, spec, clock=None):
        calls.append(model)
        return scale * _with_overhead(model, example_inputs, spec)

    monkeypatch.setattr(line_module, "whole_model_seconds", timed)
    fit_latency_line(cm, net, x)
    assert len(calls) == 3 * rounds
