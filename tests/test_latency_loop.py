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
import fisherprune.calibrate.to_target as to_target_module
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
    kw.setdefault("round_to", 1)  # channel by channel: the loop's steps are what is tested
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


def _as_it_came(net: nn.Module) -> bool:
    """Whether ``net`` is ``_net()`` as built: no masks, every tensor bitwise equal."""
    ref = _net().state_dict()
    state = net.state_dict()
    return (
        not fp.find_masks(net)
        and state.keys() == ref.keys()
        and all(torch.equal(state[k], ref[k]) for k in ref)
    )


def _half() -> nn.Module:
    """``_net()`` with every width halved: every mask at ``min_channels=0.5``."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 24, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(24, 5),
    )  # fmt: skip


@pytest.fixture
def floor_spy(monkeypatch):
    """The bent clock, and every state ``check_latency`` times, in order."""
    install_clock(monkeypatch, _bent)
    checked = []
    real = line_module.check_latency

    def spy(*args, **kwargs):
        checked.append(real(*args, **kwargs))
        return checked[-1]

    monkeypatch.setattr(line_module, "check_latency", spy)
    return checked


def test_a_target_below_the_floor_its_checks_time_is_refused_and_given_back(tmp_path, floor_spy):
    """With checks the floor is not priced up front on the copies' curve. At
    ``min_channels=0.5`` every mask's floor is the half network (27% of the dense model's
    time on this clock), which the first refitted line prices above 25%: that floor is timed
    whole, found above 25%, and the target refused naming it, before the prune drains any
    mask; the model comes back as it came (before: pruned to every floor, with a warning)."""
    net, x = _net(), torch.randn(2, 3, 8, 8)
    with pytest.raises(ValueError, match="out of reach") as caught:
        _prune(tmp_path, net, "25%", min_channels=0.5)
    text = str(caught.value)
    floor = _bent(_half(), x, None) / _bent(_net(), x, None)
    assert f"its floor is {floor:.1%}" in text and "timed whole" in text, (floor, text)
    assert "nothing was changed" in text
    assert [c.floor for c in floor_spy] == [False, True], floor_spy
    assert _as_it_came(net)


def test_a_floor_its_line_prices_too_high_is_timed_and_the_target_met(tmp_path, floor_spy):
    """30%, above the half network's 27%: the first refitted line prices the floor above it
    (an extrapolation), the floor is timed once, the line refitted through it, and the prune
    lands within 5% of the target (it lands 2.7% below: a channel is a large step on a
    network this small) instead of being refused."""
    result, share = _prune(tmp_path, _net(), "30%", min_channels=0.5)
    assert sum(c.floor for c in result.latency_checks) == 1, result.latency_checks
    assert next(c for c in result.latency_checks if c.floor).refitted
    assert abs(share / 0.3 - 1) < 0.05, share


def test_a_prune_left_at_every_floor_is_refused_and_given_back(tmp_path, monkeypatch):
    """No check refits (every state is timed 1.6x slow, taken for other load): the prune
    reaches every mask's floor above 1%, and is refused then, the model given back as it
    came, not left at its floors with a warning."""

    def loaded(model, example_inputs, spec, clock=None):
        widths = [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)]
        burst = 1.0 if widths in ([32, 48], [16, 24]) else 1.6
        return _bent(model, example_inputs, spec) * burst

    install_clock(monkeypatch, loaded)
    net = _net()
    with pytest.raises(ValueError, match="out of reach: every mask is at its floor"):
        _prune(tmp_path, net, "1%")
    assert _as_it_came(net)


def _widths(k1: int, k2: int) -> nn.Module:
    """``_net()``'s layout with ``k1`` and ``k2`` channels."""
    return nn.Sequential(
        nn.Conv2d(3, k1, 3, padding=1), nn.ReLU(), nn.Conv2d(k1, k2, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(k2, 5),
    )  # fmt: skip


def _cliff(model, example_inputs, spec, clock=None):
    """Whole seconds: the operators, the overhead, and 30% of the dense operators' time that
    every copy (kept 1, 0.5, 0.25) pays whole and that falls in proportion to the operators
    below the quarter copy's: the narrowest segment, extended, prices the floor far above its
    time."""
    x = torch.zeros(2, 3, 8, 8)
    ops = _fake_whole(model, example_inputs, spec, _flops_seconds)
    dense, quarter = (
        _fake_whole(_widths(*k), x, None, _flops_seconds) for k in ((32, 48), (8, 12))
    )
    return ops + OVERHEAD + 0.3 * dense * min(1.0, ops / quarter)


def test_a_target_below_the_narrowest_copy_is_priced_on_the_floor_timed(tmp_path, monkeypatch):
    """No checks: 25%, below the quarter copy (29%) and far above the floor's time (2%),
    which the narrowest segment, extended, prices at 28%: refused so when the floor is not
    timed. The floor is timed (its knot is its time on this clock) and priced as the curve's
    last knot, and the prune reaches the target."""
    install_clock(monkeypatch, _cliff)
    x = torch.randn(2, 3, 8, 8)
    floor = _cliff(_widths(1, 1), x, None) / _cliff(_net(), x, None)
    result, share = _prune(tmp_path, _net(), "25%", checks=0)
    knot = result.latency_line.points[-1]
    assert knot["kept_share"] == 0.0
    assert knot["measured_share"] == pytest.approx(floor, rel=1e-9)
    assert result.cost_after <= result.target and share <= 0.25, share
    monkeypatch.setattr(to_target_module, "add_floor_knot", lambda *a, **k: None)
    with pytest.raises(ValueError, match="out of reach"):
        _prune(tmp_path, _net(), "25%", checks=0)
