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
from tests.test_latency_cost import (  # noqa: F401
    _cnn,
    _fake_seconds,
    _fake_whole,
    fake_clock,
    latency_train,
)


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
    """fit_latency_line in form torchscript traces the dense model and each shrunk copy
    (two by default) once, and times every round on those, keeping the dense total."""
    net, x = _masked_cnn()
    spec = LatencySpec(cache=tmp_path, threads=1, blocks=1, form="torchscript")
    cm = CostModel(net, x, "latency", latency=spec)
    dense = cm.dense_total()
    traced = _count_builds(monkeypatch, "frozen_for_serving")
    eager_operators.clear()
    fit_latency_line(cm, net, x)
    sizes = 1 + len(spec.line_shares)
    assert traced[0] == sizes == 3
    forms = [f for f, _ in eager_operators]
    rounds = len(forms) // sizes  # a fast model gets more than ROUNDS (STEADY_SECONDS)
    assert forms == ["torchscript"] * sizes * rounds
    assert line_module.ROUNDS <= rounds <= line_module.MAX_ROUNDS
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


def test_train_config_carries_the_form_and_refuses_a_wrong_device():
    """``--pruning.latency_form`` reaches the run's LatencySpec; CUDA graphs on the CPU are
    refused when the config is built, naming the field."""
    from fisherprune.train.config import TrainConfig

    cfg = TrainConfig(pruning_convention="latency", pruning_latency_form="torchscript")
    assert cfg.latency_spec().form == "torchscript"
    with pytest.raises(ValueError, match=r"pruning_latency.*'cuda_graphs' is not built on"):
        TrainConfig(pruning_convention="latency", pruning_latency_form="cuda_graphs")


def _prune_flags(form: str):
    import argparse

    from fisherprune.cli.prune_latency import add_latency_arguments

    parser = argparse.ArgumentParser()
    add_latency_arguments(parser)
    args = parser.parse_args(["--latency_form", form])
    args.convention, args.score_convention, args.round_to = "latency", None, 8
    return args


def test_prune_flag_carries_the_form():
    """``fisherprune prune --latency_form torchscript`` reaches the LatencySpec."""
    from fisherprune.cli.prune_latency import latency_spec

    assert latency_spec(_prune_flags("torchscript")).form == "torchscript"


def test_prune_flag_of_a_form_the_device_cannot_build_is_refused():
    """``--latency_form cuda_graphs`` on the CPU is refused, naming the flags."""
    from fisherprune.cli.prune_latency import latency_spec

    with pytest.raises(ValueError, match=r"--latency_\*: .*'cuda_graphs' is not built"):
        latency_spec(_prune_flags("cuda_graphs"))


def test_dense_prediction_is_the_aoti_packages_time(tmp_path, eager_operators, monkeypatch):
    """In form aoti the dense total is the time of the package exported once (from the model
    shrunk at its masks) and loaded back. The exporter and loader are stand-ins that record
    their calls: compiling a package (tests/test_export.py does) takes 15-35 s."""
    exported, loaded = [], []

    def export(net, path, example_inputs, format):
        exported.append((format, sum(p.numel() for p in net.parameters())))
        return path

    def load(path):
        loaded.append(path)
        return lambda *a, **k: net(*a, **k)

    monkeypatch.setattr(forms, "export_model", export)
    monkeypatch.setattr(forms, "load_aoti_export", load)
    torch.manual_seed(0)
    net, x = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)), torch.randn(2, 6)
    fp.apply_masks(net, x)
    spec = LatencySpec(cache=tmp_path, threads=1, blocks=1, form="aoti")
    cm = CostModel(net, x, "latency", latency=spec)
    assert exported == [("aoti", 6 * 16 + 16 + 16 * 3 + 3)] and len(loaded) == 1
    (compiled,) = [s for f, s in eager_operators if f == "aoti"]
    assert cm.dense_total() * lat.UNIT == pytest.approx(compiled, rel=1e-12)


def _train(tmp_path, steps: int, *extra: str) -> int:
    return latency_train(tmp_path, steps, "40%", *extra)


def _count_whole(monkeypatch) -> list[int]:
    """Count the whole-model timings (on the fake clock) from here on."""
    calls = [0]

    def counted(*a, **k):
        calls[0] += 1
        return _fake_whole(*a, **k)

    monkeypatch.setattr(model_module, "whole_model_seconds", counted)
    monkeypatch.setattr(line_module, "whole_model_seconds", counted)
    return calls


def _final_masks(save) -> dict[str, torch.Tensor]:
    from fisherprune.train.checkpoint import CheckpointManager

    path = CheckpointManager(save / "checkpoints", 3).paths()[-1]
    masks = CheckpointManager.load(path)["pruner"]["masks"]
    return {n: m["mask"] for n, m in masks.items()}


@pytest.mark.usefixtures("fake_clock")
def test_resumed_latency_run_is_not_timed_again(tmp_path, monkeypatch):
    """A run stopped mid-pruning and resumed reuses the checkpoint's latency calibration (the
    whole model is not timed again) and ends with the masks of the run never stopped."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert _train(tmp_path, 24, "--save_dir", str(straight)) == 0
    assert _train(tmp_path, 9, "--save_dir", str(stopped)) == 0
    calls = _count_whole(monkeypatch)
    assert _train(tmp_path, 24, "--save_dir", str(stopped), "--resume") == 0
    assert calls[0] == 0
    want, got = _final_masks(straight), _final_masks(stopped)
    assert set(got) == set(want)
    for name, mask in want.items():
        torch.testing.assert_close(got[name], mask, rtol=0, atol=0)


@pytest.mark.usefixtures("fake_clock")
def test_resume_from_a_checkpoint_without_calibration_times_afresh(tmp_path, monkeypatch, capsys):
    """A checkpoint written before the calibration was kept is resumed, not refused: the
    model is timed whole again, and one line says why."""
    from fisherprune.train.checkpoint import CheckpointManager

    save = tmp_path / "run"
    assert _train(tmp_path, 9, "--save_dir", str(save)) == 0
    ckpts = CheckpointManager(save / "checkpoints", 3)
    path = ckpts.paths()[-1]
    saved = CheckpointManager.load(path)
    del saved["pruner"]["latency"]
    ckpts.save(int(path.stem.split("-")[1]), saved)
    calls = _count_whole(monkeypatch)
    capsys.readouterr()
    assert _train(tmp_path, 24, "--save_dir", str(save), "--resume", "--progress", "plain") == 0
    assert calls[0] > 0
    out = capsys.readouterr()
    assert f"{path.name} holds no latency calibration" in out.out + out.err


def test_a_masked_model_is_timed_in_eager_as_served_without_its_masks(monkeypatch):
    """In eager a masked model is timed shrunk at its masks: no mask runs while it is timed
    whole (a mask's hook made the one-shot suite's CNNs 12-17% slower at every mask 1, and
    every shrunk state looked that much faster than the dense model served), and the module
    timed gives the masked model's outputs."""
    from fisherprune.masks.points import MaskPoint

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    ).eval()  # fmt: skip
    x = torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    calls = []
    real = MaskPoint.__call__

    def counted(self, *args, **kwargs):
        calls.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MaskPoint, "__call__", counted)
    with torch.no_grad():
        expected = net(x)
    assert calls, "the spy sees the masks of a plain forward"
    during = []  # the masks run while the passes are timed (not while the copy is shrunk)
    measure = lat._measure

    def timing(*args, **kwargs):
        calls.clear()
        seconds = measure(*args, **kwargs)
        during.append(len(calls))
        return seconds

    monkeypatch.setattr(lat, "_measure", timing)
    spec = LatencySpec(threads=1, blocks=1)
    assert lat.whole_model_seconds(net, x, spec) > 0
    assert during == [0]
    timed = lat.served(net, x, spec)
    assert not fp.find_masks(timed)
    with torch.no_grad():
        torch.testing.assert_close(timed(x), expected, rtol=1e-5, atol=1e-6)
    assert fp.find_masks(net), "the model timed keeps its masks"


def test_a_partly_pruned_masked_model_is_priced_on_its_dense_time(tmp_path, monkeypatch):
    """The dense total a latency cost model is scaled to is the model with every mask at 1,
    whatever its masks hold when it is built: the whole model is timed by the FLOPs of what
    is actually run (``FlopCounterMode``), and a model with half of every mask at 0 gets the
    latency scale and dense total of the same model unpruned (timed shrunk at its masks, it
    got about a quarter of them)."""
    from torch.utils.flop_counter import FlopCounterMode

    from tests.test_latency_line import _flops_seconds

    def counted(run, sync, blocks):
        with FlopCounterMode(display=False) as counter:
            run()
        return counter.get_total_flops() * 1e-9

    monkeypatch.setattr(lat.OpTimer, "seconds", _flops_seconds)
    monkeypatch.setattr(lat, "_measure", counted)
    x = torch.randn(2, 3, 8, 8)
    priced = []
    for zeroed in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 48, 3, padding=1),
            nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(48, 5),
        ).eval()  # fmt: skip
        fp.apply_masks(net, x)
        if zeroed:
            with torch.no_grad():
                for m in fp.find_masks(net).values():
                    m.mask[m.num_channels // 2 :] = 0.0
        spec = LatencySpec(cache=tmp_path / "latency", threads=1, line_at=None)
        cm = CostModel(net, x, "latency", latency=spec)
        priced.append((cm.latency_scale, cm.dense_total()))
    assert priced[1] == pytest.approx(priced[0], rel=1e-9), priced


def test_the_compiled_form_compiles_every_width_past_dynamos_recompile_limit():
    """Twelve widths of one class, each built as the ``compile`` form builds it: each gets a
    graph of its own (dynamo's limit of 8 graphs per ``forward`` would serve the ninth on
    eager, timed as compiled), gives the module's outputs, and the limit is restored after."""
    from torch._dynamo.utils import counters

    class Net(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, width), nn.Linear(width, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    torch._dynamo.reset()
    counters.clear()
    limit = torch._dynamo.config.recompile_limit
    x = torch.randn(2, 16)
    try:
        for width in range(4, 16):
            net = Net(width).eval()
            compiled = forms.compile_for_serving(net, lambda f: f(x), backend="eager")
            with torch.inference_mode():
                torch.testing.assert_close(compiled(x), net(x))
        assert counters["stats"]["unique_graphs"] == 12
        assert torch._dynamo.config.recompile_limit == limit
    finally:
        torch._dynamo.reset()
