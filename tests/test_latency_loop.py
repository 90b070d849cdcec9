"""The latency loop (issue 32, point 3): ``prune_to_target`` times the states its rounds reach
whole and refits its latency line through them (``LatencyLoop``).

The operators' clock is a fake (an operator's FLOPs in nanoseconds), and the model timed whole
takes its operators, a constant overhead and a term quadratic in the second convolution's
width: the uniform copy's line cannot price every mix of widths a prune keeps, so the
reference (``checks=0``) misses the target, and the loop must land on it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fisherprune as fp
import fisherprune.calibrate.latency_line as line_module
import fisherprune.cost.model as model_module
from fisherprune.calibrate import fit_latency_line
from fisherprune.cost import CostModel, LatencySpec
from fisherprune.cost import latency as lat
from tests.test_latency_cost import _fake_whole
from tests.test_latency_line import OVERHEAD, _flops_seconds, install_clock

BENT = 300e-6  # seconds the whole model adds at the second convolution's full width, squared


def _bent(model, example_inputs, spec, clock=None):
    """Whole seconds: the operators, the overhead, and ``BENT * (k2 / 48) ** 2`` for the
    second convolution's ``k2`` output channels (a masked model: its full width)."""
    k2 = [m for m in model.modules() if isinstance(m, nn.Conv2d)][1].out_channels
    return (
        _fake_whole(model, example_inputs, spec, _flops_seconds) + OVERHEAD + BENT * (k2 / 48) ** 2
    )


@pytest.fixture
def bent_clock(monkeypatch):
    install_clock(monkeypatch, _bent)


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 48, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(48, 5),
    ).eval()  # fmt: skip
    with torch.no_grad():
        net[2].weight[:, 16:].mul_(10.0)  # L1 thins the first convolution, not the second
    return net


def _prune(tmp_path, net, target, checks=2, **kw):
    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fp.prune_to_target(
            net, x, [(x, None)], target, criterion="l1", convention="latency",
            latency=LatencySpec(cache=tmp_path / "latency", threads=1, checks=checks),
            reconstruct=False, **kw,
        )  # fmt: skip
    share = _bent(fp.shrink(net), x, None) / _bent(_net(), x, None)
    return result, share


def test_the_loop_lands_on_the_target_where_the_copys_line_misses(tmp_path, bent_clock):
    """At 50%: the copy's line alone lands more than 5% slower than the target; with the
    states timed on the way, within 1%, and the price of the end state is its time."""
    result, share = _prune(tmp_path, _net(), "50%")
    assert abs(share / 0.5 - 1) < 0.01, share
    assert result.cost_after / result.cost_before == pytest.approx(share, rel=1e-9)
    assert [c.goal for c in result.latency_checks] == [2, 3, 4]
    _, copy_only = _prune(tmp_path, _net(), "50%", checks=0)
    assert copy_only / 0.5 - 1 > 0.05, copy_only


def _steep(model, example_inputs, spec, clock=None):
    """Whole seconds: the operators, the overhead, and 1.5 ms at the second convolution's full
    width, in proportion to its width (a state that keeps it wide runs slower than the copy's
    line prices it)."""
    k2 = [m for m in model.modules() if isinstance(m, nn.Conv2d)][1].out_channels
    return _fake_whole(model, example_inputs, spec, _flops_seconds) + OVERHEAD + 1.5e-3 * k2 / 48


def test_a_last_state_slower_than_the_target_is_pruned_again_once(tmp_path, monkeypatch):
    """One goal (no state checked before it): the state it reaches on the copy's line times
    more than the slack slower than the target, so the goal is reached again on the line
    through that state, and checked once more (never a third time)."""
    install_clock(monkeypatch, _steep)
    net, x = _net(), torch.randn(2, 3, 8, 8)
    result, _ = _prune(tmp_path, net, "50%", rounds=1)
    first, last = result.latency_checks
    assert (first.goal, last.goal) == (1, 1)
    assert first.refitted and first.measured_share > 0.5 * (1 + line_module.CHECK_SLACK)
    share = _steep(fp.shrink(net), x, None) / _steep(_net(), x, None)
    assert abs(share / 0.5 - 1) < 0.02, share


def test_a_state_timed_far_from_its_price_is_taken_for_other_load(tmp_path, monkeypatch):
    """Every state but the dense model and the copy is timed 1.6x slower (a burst of other
    load): no check refits the line through it, each says why, and the end state is priced
    on the copy's line (``fit_latency_line`` on the same network, independently)."""

    def loaded(model, example_inputs, spec, clock=None):
        widths = [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)]
        burst = 1.0 if widths in ([32, 48], [16, 24]) else 1.6
        return _bent(model, example_inputs, spec) * burst

    monkeypatch.setattr(lat.OpTimer, "seconds", _flops_seconds)
    monkeypatch.setattr(model_module, "whole_model_seconds", loaded)
    monkeypatch.setattr(line_module, "whole_model_seconds", loaded)
    net = _net()
    result, _ = _prune(tmp_path, net, "50%")
    assert result.latency_checks
    for check in result.latency_checks:
        assert not check.refitted and "other load" in check.reason
    x, ref = torch.randn(2, 3, 8, 8), _net()
    fp.apply_masks(ref, x)
    cm = CostModel(ref, x, "latency", latency=LatencySpec(cache=tmp_path / "latency", threads=1))
    assert fit_latency_line(cm, ref, x).fitted
    pruned = fp.find_masks(net)
    for name, m in fp.find_masks(ref).items():
        m.mask.copy_(pruned[name].mask)
    assert cm.total() == pytest.approx(result.cost_after, rel=1e-9)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_checks_are_refused(bad):
    with pytest.raises(ValueError, match="checks"):
        LatencySpec(checks=bad)
