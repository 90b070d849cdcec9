"""The ``latency`` convention in a serving form (issue 32, point 1) and its calibration kept
for a resumed run: operators are timed alone in eager (here on the fake clock of
``test_latency_cost``), the whole model in the form that serves it, built once per size."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import fisherprune as fp
import fisherprune.calibrate.latency_line as line_module
import fisherprune.cost.model as model_module
import fisherprune.export.serving_forms as forms
from fisherprune.calibrate import fit_latency_line
from fisherprune.cost import CostModel, LatencySpec
from fisherprune.cost import latency as lat
from fisherprune.export.aoti import AOTIModule
from tests.test_latency_cost import _cnn, _fake_seconds, fake_clock  # noqa: F401


@pytest.fixture
def eager_operators(monkeypatch):
    """Operators on the fake clock; the whole model timed for real, and each timing recorded
    with the form it was served in."""
    monkeypatch.setattr(lat.OpTimer, "seconds", _fake_seconds)
    timed: list[tuple[str, float]] = []
    real = lat.whole_model_seconds

    def spy(model, example_inputs, spec):
        seconds = real(model, example_inputs, spec)
        timed.append((getattr(model, "form", spec.form), seconds))
        return seconds

    monkeypatch.setattr(model_module, "whole_model_seconds", spy)
    monkeypatch.setattr(line_module, "whole_model_seconds", spy)
    return timed


def _count_builds(monkeypatch, name: str) -> list[int]:
    calls = [0]
    real = getattr(forms, name)

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(forms, name, counting)
    return calls


def _masked_cnn() -> tuple[nn.Module, torch.Tensor]:
    net, x = _cnn(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    return net, x


def test_dense_prediction_is_the_torchscript_time(tmp_path, eager_operators, monkeypatch):
    """In form torchscript the dense total is the model timed whole as frozen TorchScript
    (traced once), not in eager; the eager time only checks the table."""
    traced = _count_builds(monkeypatch, "frozen_for_serving")
    net, x = _masked_cnn()
    spec = LatencySpec(cache=tmp_path, threads=1, blocks=1, form="torchscript")
    cm = CostModel(net, x, "latency", latency=spec)
    assert traced[0] == 1
    (scripted,) = [s for f, s in eager_operators if f == "torchscript"]
    assert cm.dense_total() * lat.UNIT == pytest.approx(scripted, rel=1e-12)
    assert [f for f, _ in eager_operators] == ["torchscript", "eager"]


def test_line_is_fitted_on_both_sizes_served_once_each(tmp_path, eager_operators, monkeypatch):
    """fit_latency_line in form torchscript traces the dense model and the shrunk copy once
    each, and times every round on those two, keeping the dense total."""
    net, x = _masked_cnn()
    spec = LatencySpec(cache=tmp_path, threads=1, blocks=1, form="torchscript")
    cm = CostModel(net, x, "latency", latency=spec)
    dense = cm.dense_total()
    traced = _count_builds(monkeypatch, "frozen_for_serving")
    eager_operators.clear()
    fit_latency_line(cm, net, x)
    assert traced[0] == 2
    assert [f for f, _ in eager_operators] == ["torchscript"] * 2 * line_module.ROUNDS
    assert cm.dense_total() == pytest.approx(dense, rel=1e-9)


@pytest.mark.usefixtures("fake_clock")
def test_table_of_another_form_is_refused_naming_it(tmp_path):
    """A table file measured under form eager is refused for form torchscript, the message
    naming the field and both values."""
    net, x = _masked_cnn()
    file = tmp_path / "table.json"
    CostModel(net, x, "latency", latency=LatencySpec(cache=file, threads=1, blocks=1))
    assert json.loads(file.read_text())["header"]["form"] == "eager"
    spec = LatencySpec(cache=file, threads=1, blocks=1, form="torchscript")
    with pytest.raises(ValueError, match=r"form='eager', not 'torchscript'"):
        CostModel(net, x, "latency", latency=spec)


def test_cuda_graphs_are_refused_on_the_cpu():
    """CUDA graphs need a GPU: refused at once, naming the form and the device."""
    with pytest.raises(ValueError, match=r"'cuda_graphs' is not built on device 'cpu'"):
        LatencySpec(form="cuda_graphs")


def test_dense_prediction_is_the_aoti_packages_time(tmp_path, eager_operators, monkeypatch):
    """In form aoti the dense total is the time of the model compiled by AOTInductor and
    loaded back (one compile, 15-25 s)."""
    loaded = []
    real = forms.load_aoti_export
    monkeypatch.setattr(forms, "load_aoti_export", lambda p: loaded.append(real(p)) or loaded[-1])
    torch.manual_seed(0)
    net, x = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)), torch.randn(2, 6)
    fp.apply_masks(net, x)
    spec = LatencySpec(cache=tmp_path, threads=1, blocks=1, form="aoti")
    cm = CostModel(net, x, "latency", latency=spec)
    assert len(loaded) == 1 and isinstance(loaded[0], AOTIModule)
    (compiled,) = [s for f, s in eager_operators if f == "aoti"]
    assert cm.dense_total() * lat.UNIT == pytest.approx(compiled, rel=1e-12)
