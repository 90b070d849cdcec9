"""The ``latency`` cost convention (issue 32): per-operator timing tables, their cache, and
predictions checked against the physically shrunk model.

Timing is noisy, so the invariants about predictions replace the clock by a deterministic
one (``_fake_seconds``: an operator's FLOPs plus the elements it writes, in nanoseconds;
the whole model "takes" the sum of its operators, so the scale to the whole is 1):
what is tested is the table's bookkeeping (axes, sweeps, interpolation, the separable
product, the cache), with the shrunk model re-traced and re-timed as the reference. A few
tests time real operators, on tiny shapes, for what needs no exact value.
"""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fisherprune as fp
from fisherprune.cost import CostModel, LatencySpec, computational_cost, formula_for
from fisherprune.cost import latency as lat
from fisherprune.graph.trace import trace_model
from fisherprune.graph.types import Slot
from fisherprune.pruner import resolve_target


def _fake_seconds(self, rec, dense, shapes):
    """An operator's "time": its FLOPs plus the elements it writes, 1 ns each."""
    outs = shapes[rec.n_inputs :]
    return (flops_at(rec, shapes) + sum(math.prod(s) for s in outs)) * 1e-9


def flops_at(rec, shapes):
    """The FLOPs of the traced operator ``rec`` with its slots at ``shapes``."""
    n_in = rec.n_inputs

    def sub(a):
        if isinstance(a, Slot):
            return torch.Size(shapes[a.i])
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        return a

    outs = [torch.Size(s) for s in shapes[n_in:]]
    f = formula_for("flops", rec.op)
    flops = 0.0
    if f is not None:
        out_shape = outs[0] if len(outs) == 1 else tuple(outs)
        kwargs = {k: sub(v) for k, v in rec.kwargs.items()}
        flops = float(f(*sub(rec.args), out_shape=out_shape, **kwargs))
    return flops


def _fake_whole(model, example_inputs, spec, clock=None):
    """The fake clock's whole model: the sum of its operators' fake times at the traced
    shapes (so ``latency_scale`` is 1 and a total is the operators' sum)."""
    from fisherprune.cost.formulas import VIEWS
    from fisherprune.graph.trace import trace_model

    trace = trace_model(model, example_inputs)
    clock = clock or _fake_seconds
    return sum(
        clock(None, rec, [i.shape for i in rec.slots], [i.shape for i in rec.slots])
        for rec in trace.ops
        if not rec.is_mask and getattr(rec.op, "overloadpacket", None) not in VIEWS
    )


@pytest.fixture
def fake_clock(monkeypatch):
    import fisherprune.calibrate.latency_line as line_module
    import fisherprune.cost.model as model_module

    monkeypatch.setattr(lat.OpTimer, "seconds", _fake_seconds)
    monkeypatch.setattr(model_module, "whole_model_seconds", _fake_whole)
    monkeypatch.setattr(line_module, "whole_model_seconds", _fake_whole)


@pytest.fixture
def whole_padded(monkeypatch):
    """The whole model timed for real (through ``_measure``, which tests count), plus one
    second: operators timed while another process runs (the other pytest-xdist worker) can
    sum to more than a quick whole model, and the table would rightly not be saved; these
    tests are about the file, not the clock."""
    import fisherprune.cost.model as model_module

    real = model_module.whole_model_seconds
    monkeypatch.setattr(model_module, "whole_model_seconds", lambda *a, **k: real(*a, **k) + 1.0)


def _spec(tmp_path, **kw) -> LatencySpec:
    return LatencySpec(cache=tmp_path / "latency", threads=1, **kw)


def _operators(report) -> float:
    """The total of a latency report under the fake clock: the operators' sum (scale 1)."""
    return report.total


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU(),
        nn.Conv2d(12, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 16, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5),
    )  # fmt: skip


def test_axes_are_the_prunable_widths_only(tmp_path, fake_clock):
    """Each timed operator's axes are the prunable channel groups it touches: a convolution
    between two masked widths has two (its input's and its output's), never the batch,
    spatial or image-channel dimensions."""
    net, x = _cnn(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    cm = CostModel(net, x, "latency", latency=_spec(tmp_path))
    axes = {t.module: t.shapes[0] for t in cm._terms if t.dims}
    assert axes["0"] == (12,)  # the first conv: its output channels only
    assert axes["3"] == (12, 16)
    assert axes["5"] == (16, 16)


def test_prediction_equals_the_shrunk_models_own_table(tmp_path, fake_clock):
    """With every width timed, the cost predicted for a masked model equals the cost of
    the physically shrunk model timed afresh (separable product and interpolation are exact
    for a clock that is a sum of per-axis products)."""
    net, x = _cnn(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    masks = fp.find_masks(net)
    gen = torch.Generator().manual_seed(1)
    for m in masks.values():
        keep = torch.randperm(m.num_channels, generator=gen)[: max(1, m.num_channels // 2 - 1)]
        m.mask.zero_()
        m.mask[keep] = 1.0
    spec = _spec(tmp_path)
    predicted = _operators(computational_cost(net, x, "latency", latency=spec))
    small = fp.shrink(net)
    measured = _operators(computational_cost(small, x, "latency", latency=spec))
    dense = _operators(computational_cost(_cnn(), x, "latency", latency=spec))
    assert predicted < 0.6 * dense  # not vacuous: the prune saved time
    assert predicted == pytest.approx(measured, rel=1e-9)


@pytest.mark.parametrize("arch", ["bert", "llama", "vit"])
def test_prediction_on_hugging_face_models(tmp_path, fake_clock, arch):
    """The same on Hugging Face models built from their configs (heads, grouped key/value
    heads, MLP units and the hidden width pruned unevenly; every width timed): the
    prediction equals the shrunk model's own table."""
    pytest.importorskip("transformers")
    from tests.test_hf_integration import _models

    build, inputs = _models()[arch]
    torch.manual_seed(0)
    model = build().eval()
    fp.apply_masks(model, inputs)
    gen = torch.Generator().manual_seed(2)
    for m in fp.find_masks(model).values():
        drop = torch.randperm(m.num_channels, generator=gen)[: m.num_channels // 3]
        m.mask[drop] = 0.0
    spec = _spec(tmp_path, points=64)
    predicted = computational_cost(model, inputs, "latency", latency=spec)
    small = fp.shrink(model, inputs)
    shrunk = computational_cost(small, inputs, "latency", latency=spec)
    # a shrunk model may write pruned units back as zeros into what it returns
    # (``output_fill``, at its top level): a copy the masked model never makes
    top = "<model>"
    want = shrunk.total - shrunk.by_module.get(top, 0.0)
    assert predicted.total - predicted.by_module.get(top, 0.0) == pytest.approx(want, rel=1e-9)
    dense = computational_cost(build().eval(), inputs, "latency", latency=spec).total
    assert predicted.total < 0.9 * dense  # not vacuous: the prune saved time


def test_marginal_cost_is_the_tables_step(tmp_path, fake_clock):
    """A channel's marginal latency is the total now less the total with that channel's
    mask entry zeroed, recomputed by brute force for every entry."""
    net, x = _cnn(), torch.randn(2, 3, 8, 8)
    fp.apply_masks(net, x)
    cm = CostModel(net, x, "latency", latency=_spec(tmp_path))
    report = cm.report()
    e = cm.entries()
    for name, start in cm.entry_start.items():
        for k in range(cm.masks[name].num_channels):
            off = e.copy()
            off[start + k] = 0.0
            want = cm.total(e) - cm.total(off)
            assert float(report.marginal[name][k]) == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert all(float(v.min()) > 0 for v in report.marginal.values())


def test_interpolation_is_separable_and_rising():
    """``OpLatency`` multiplies each axis' ratio to the dense time, interpolates linearly
    between timed widths, and a width of 0 costs nothing."""
    op = lat.OpLatency(
        100.0,
        [np.array([2.0, 4.0]), np.array([1.0, 2.0, 3.0])],
        [np.array([50.0, 100.0]), np.array([40.0, 70.0, 100.0])],
    )
    assert op((4, 3)) == pytest.approx(100.0)
    assert op((2, 3)) == pytest.approx(50.0)
    assert op((3, 2)) == pytest.approx(100.0 * 0.75 * 0.70)
    assert op((0, 3)) == 0.0


def test_rising_is_the_nearest_non_decreasing_sequence():
    """``rising`` pools adjacent violators: [1, 3, 2, 4] -> [1, 2.5, 2.5, 4]; the mean is
    kept and the result never falls."""
    got = lat.rising(np.array([1.0, 3.0, 2.0, 4.0]))
    assert got.tolist() == [1.0, 2.5, 2.5, 4.0]
    noisy = np.array([5.0, 3.0, 4.0, 9.0, 8.0, 8.5, 12.0])
    out = lat.rising(noisy)
    assert np.all(np.diff(out) >= 0) and out.mean() == pytest.approx(noisy.mean())


def test_sweep_widths():
    """Every width of a small axis; else ``points`` widths in steps of ``step`` with the
    dense width last."""
    assert lat.sweep_widths(5, 8, 16) == [1, 2, 3, 4, 5]
    got = lat.sweep_widths(300, 8, 10)
    assert len(got) == 10 and got[-1] == 300 and all(w % 8 == 0 for w in got[:-1])


def _count_measures(monkeypatch) -> list[int]:
    calls = [0]
    real = lat._measure

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(lat, "_measure", counting)
    return calls


def _tiny() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(4, 6)
    fp.apply_masks(net, x)
    return net, x


@pytest.mark.usefixtures("whole_padded")
def test_second_run_reads_every_operator_from_the_cache(tmp_path, monkeypatch):
    """A table is saved; building the same model's cost again times only the whole model
    (the check of the table), no operator."""
    calls = _count_measures(monkeypatch)
    net, x = _tiny()
    spec = _spec(tmp_path, blocks=1)
    CostModel(net, x, "latency", latency=spec)
    first = calls[0]
    assert first > 2
    files = list((tmp_path / "latency").glob("*.json"))
    assert len(files) == 1
    CostModel(net, x, "latency", latency=spec)
    assert calls[0] - first == 1  # the whole model, timed afresh every time


@pytest.mark.usefixtures("whole_padded")
def test_damaged_cache_is_timed_afresh(tmp_path, monkeypatch, caplog):
    """A table file that no longer matches its checksum is not trusted: a warning, every
    operator timed again, the file rewritten whole."""
    net, x = _tiny()
    spec = _spec(tmp_path, blocks=1)
    CostModel(net, x, "latency", latency=spec)
    (path,) = (tmp_path / "latency").glob("*.json")
    data = json.loads(path.read_text())
    key = next(iter(data["entries"]))
    data["entries"][key] = 1e-9  # a forged time
    path.write_text(json.dumps(data))
    calls = _count_measures(monkeypatch)
    with caplog.at_level("WARNING", logger="fisherprune"):
        CostModel(net, x, "latency", latency=spec)
    assert "damaged" in caplog.text
    assert calls[0] > 2
    fresh = json.loads(path.read_text())
    assert fresh["sha256"] == lat._digest(fresh["header"], fresh["entries"])


def test_a_burst_of_load_during_one_pass_leaves_no_trace_in_the_table(tmp_path, monkeypatch):
    """Every operator width a build measures is timed in two passes, the faster kept: a burst
    of load over the last third of the first pass and the first third of the second leaves
    the table as a quiet build would. A layer repeated at the same shapes is timed once per
    pass (the second pass once took ViT-B's table from 12 s to 118 s, timing each of its
    twelve layers again)."""
    import fisherprune.cost.model as model_module

    calls, quiet, n = [0], 1e-6, [0]

    def clock(*a, **k):  # (n[0]: timings per pass, once counted)
        calls[0] += 1
        return quiet * (3.0 if 2 * n[0] // 3 < calls[0] <= n[0] + n[0] // 3 else 1.0)

    monkeypatch.setattr(model_module, "whole_model_seconds", lambda *a, **k: 1.0)
    monkeypatch.setattr(lat, "_measure", clock)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8),
                        nn.ReLU(), nn.Linear(8, 3))  # fmt: skip
    x = torch.randn(4, 6)
    fp.apply_masks(net, x)
    counted = _spec(tmp_path / "count", blocks=1)
    CostModel(net, x, "latency", latency=counted)
    n[0] = sum(v >= 0 for v in lat.LatencyTable.open(counted).entries.values())
    assert n[0] > 3 and calls[0] == 2 * n[0]  # each width timed once per pass
    calls[0] = 0
    spec = _spec(tmp_path, blocks=1)
    CostModel(net, x, "latency", latency=spec)
    entries = lat.LatencyTable.open(spec).entries
    assert entries and all(v == quiet for v in entries.values())


@pytest.mark.usefixtures("whole_padded")
def test_table_from_another_torch_version_is_refused(tmp_path):
    """A table file measured under another header (here a torch version) is refused with a
    message naming the field and both values."""
    net, x = _tiny()
    file = tmp_path / "table.json"
    spec = LatencySpec(cache=file, threads=1, blocks=1)
    CostModel(net, x, "latency", latency=spec)
    data = json.loads(file.read_text())
    data["header"]["torch"] = "1.0.0"
    data["sha256"] = lat._digest(data["header"], data["entries"])
    file.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"torch='1\.0\.0'"):
        CostModel(net, x, "latency", latency=spec)


def test_latency_is_measured_in_the_specs_batch(tmp_path, fake_clock):
    """``LatencySpec(batch=8)`` times a forward pass of 8 examples whatever batch the
    example inputs hold: the operators' cost is that of the example repeated to 8."""
    net, x = _tiny()
    one = _operators(computational_cost(net, x[:1], "latency", latency=_spec(tmp_path, batch=8)))
    eight = _operators(computational_cost(net, x.repeat(2, 1), "latency", latency=_spec(tmp_path)))
    assert one == pytest.approx(eight)


@pytest.mark.parametrize(
    ("target", "want"), [("12ms", 12_000.0), ("800us", 800.0), ("0.5s", 500_000.0), ("50%", 50.0)]
)
def test_time_targets(target, want):
    """Latency targets may be times (in the convention's microseconds) or shares."""
    assert resolve_target(target, 100.0, "latency") == pytest.approx(want)


def test_time_target_needs_the_latency_convention():
    """A time given as a FLOPs target is refused, naming the convention to use."""
    with pytest.raises(ValueError, match="convention='latency'"):
        resolve_target("12ms", 1e9, "flops")
    with pytest.raises(ValueError, match="positive time"):
        resolve_target("-3ms", 1e9, "latency")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"device": "tpu"}, "'cpu' or 'cuda"),
        ({"form": "jit"}, "form must be one of"),
        ({"form": "cuda_graphs"}, "not built on device .cpu."),
        ({"form": "torchscript", "line_at": None}, "needs line_at"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"threads": 0}, "threads must be an int >= 1"),
        ({"points": 1}, "points must be an int >= 2"),
    ],
)
def test_bad_spec_is_refused(kw, match):
    """A LatencySpec with a bad field is refused at once, naming the field."""
    with pytest.raises(ValueError, match=match):
        LatencySpec(**kw)


def test_spec_with_a_computed_convention_is_refused(tmp_path):
    """``latency=`` with a computed convention is a mistake, not silently ignored."""
    net, x = _tiny()
    with pytest.raises(ValueError, match="drop latency="):
        CostModel(net, x, "flops", latency=_spec(tmp_path))


def test_no_formula_registration_for_latency():
    """The measured convention takes no formula (it would never be read)."""
    with pytest.raises(ValueError, match="timed on the device"):
        fp.register_cost_formula("latency", torch.ops.aten.mm)


def test_prune_to_target_meets_a_latency_target(tmp_path, fake_clock):
    """``prune_to_target(convention="latency")`` stops at or below a "60%" latency target,
    and the shrunk model's own table agrees with the reported cost."""
    net = _cnn()
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 5, (16,))
    spec = _spec(tmp_path)
    result = fp.prune_to_target(
        net, x[:2], [(x, y)], "60%", loss_fn=F.cross_entropy, convention="latency",
        latency=spec, reconstruct=False,
    )  # fmt: skip
    assert result.cost_after <= 0.6 * result.cost_before + 1e-6
    small = fp.shrink(net)
    shrunk = computational_cost(small, x[:2], "latency", latency=spec).total
    assert shrunk == pytest.approx(result.cost_after, rel=1e-9)


def test_a_latency_prune_reaches_only_widths_its_table_timed(tmp_path, fake_clock):
    """With ``round_to`` unset, a latency prune keeps every mask at a multiple of the table's
    step (``LatencySpec.step``, 8) or at its width, and says so; a FLOPs prune of the same
    model is not rounded."""
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 5, (16,))
    kw = {"loss_fn": F.cross_entropy, "reconstruct": False}
    net = _cnn()
    result = fp.prune_to_target(
        net, x[:2], [(x, y)], "50%", convention="latency", latency=_spec(tmp_path), **kw
    )
    assert result.round_to == 8
    assert result.kept and all(k % 8 == 0 or k == n for k, n in result.kept.values())
    assert any(k < n for k, n in result.kept.values())
    assert fp.prune_to_target(_cnn(), x[:2], [(x, y)], "50%", **kw).round_to == 1


@pytest.mark.parametrize(
    ("round_to", "conventions", "spec", "want"),
    [
        (None, ("latency", None), None, 8),
        (None, ("flops", "latency"), LatencySpec(step=4), 4),
        (None, ("flops", None), None, 1),
        (3, ("flops", None), None, 3),
        (16, ("latency", None), None, 16),
    ],
)
def test_round_to_follows_the_latency_tables_step_unless_given(round_to, conventions, spec, want):
    """``round_to_for``: a given ``round_to`` as it is; None is the step of the latency
    table when a convention is timed (the cost's or the score's), else 1."""
    assert lat.round_to_for(round_to, conventions, spec) == want


def test_a_round_to_between_the_tables_steps_is_warned(caplog):
    """``round_to=1`` with a table timed in steps of 8 is kept, and a warning says widths
    between are interpolated and what to give instead; a bad value is refused by name."""
    with caplog.at_level("WARNING", logger="fisherprune"):
        assert lat.round_to_for(1, ("latency", None), LatencySpec()) == 1
    assert "round_to=1 reaches widths between the latency table's steps of 8" in caplog.text
    with pytest.raises(ValueError, match="round_to must be an int >= 1"):
        lat.round_to_for(0, ("latency", None), None)


def test_an_unreachable_latency_target_is_warned_in_its_unit(tmp_path, fake_clock):
    """A latency target below what the floor allows is warned about in microseconds per
    forward pass, the latency convention's unit, not "per example"."""
    net, x = _tiny()
    with pytest.warns(UserWarning, match=r"allows \(about [\d.e+-]+ us/forward pass\)"):
        fp.PruningOptimizer(
            net, x, lr=0.1, flops_target="0.001us", convention="latency", latency=_spec(tmp_path)
        )


def test_pruning_optimizer_rounds_to_the_latency_step(tmp_path, fake_clock):
    """``PruningOptimizer`` with ``round_to`` unset: the latency table's step under the
    ``latency`` convention, 1 under ``flops``."""
    net, x = _tiny()
    timed = fp.PruningOptimizer(net, x, lr=0.1, convention="latency", latency=_spec(tmp_path))
    assert timed.round_to == 8
    assert fp.PruningOptimizer(net, x, lr=0.1).round_to == 1


def test_pruning_optimizer_takes_a_time_target(tmp_path, fake_clock, monkeypatch):
    """``PruningOptimizer(convention="latency", flops_target="...us")`` resolves the time
    to the convention's microseconds, and the start cost is the model timed whole."""
    import fisherprune.cost.model as model_module

    monkeypatch.setattr(model_module, "whole_model_seconds", lambda *a, **k: 1e-3)
    net, x = _tiny()
    opt = fp.PruningOptimizer(
        net, x, lr=0.1, flops_target="900us", convention="latency", latency=_spec(tmp_path)
    )
    assert opt.target == pytest.approx(900.0)
    assert opt.start_cost == pytest.approx(1000.0)  # the whole model's (patched) 1 ms


def latency_train(tmp_path, steps: int, target: str, *extra: str) -> int:
    """``fisherprune train`` of a 16-unit MLP on a separable 4-column CSV table, pruned to
    ``target`` of its timed latency, the tables cached under ``tmp_path / "tables"``."""
    from fisherprune.cli.main import main

    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 4))
    y = (x[:, 0] + x[:, 1] > 0).astype(int)
    csv = tmp_path / "t.csv"
    rows = [
        "a,b,c,d,label",
        *(",".join(f"{v:.4f}" for v in r) + f",{c}" for r, c in zip(x, y, strict=True)),
    ]
    csv.write_text("\n".join(rows) + "\n")
    return main([
        "train", "--data", str(csv), "--model", "mlp", "--width", "16", "--depth", "1",
        "--train.steps", str(steps), "--pruning.burn_in", "5", "--pruning_iter", "2",
        "--eval_every", "10", "--fine_tune_steps", "5", "--export_formats", "state_dict",
        "--threads", "1", "--progress", "none", "--dense_check", "warn",
        "--pruning.convention", "latency", "--pruning.flops_target", target,
        "--pruning.latency_cache", str(tmp_path / "tables"), *extra,
    ])  # fmt: skip


def test_train_cli_prunes_to_a_latency_target(tmp_path, fake_clock):
    """``fisherprune train --pruning.convention latency`` prunes to a share of the timed
    latency, writes its table where ``--pruning.latency_cache`` says, its plan records the
    latency convention, and result.json gives the prediction beside the model timed whole."""
    cache = tmp_path / "tables"
    code = latency_train(tmp_path, 40, "70%", "--save_dir", str(tmp_path / "run"))
    assert code == 0
    assert list(cache.glob("*.json"))
    plan = json.loads((tmp_path / "run" / "export" / "plan.json").read_text())
    assert plan["convention"] == "latency"
    assert plan["cost"]["pruned"] <= 0.7 * plan["cost"]["dense"] + 1e-6
    latency = json.loads((tmp_path / "run" / "result.json").read_text())["latency"]
    assert latency["line"]["slope"] > 0  # (its offset may be below 0 where a curve follows)
    check = latency["prediction"]
    assert check["pruned_predicted_ms"] == pytest.approx(plan["cost"]["pruned"] / 1e3)
    assert check["pruned_measured_ms"] > 0 and check["spec"]["batch"] == 1


def test_prune_cli_reports_predicted_and_measured_latency(tmp_path, fake_clock):
    """``fisherprune prune --convention latency`` meets a share of the timed latency and its
    report gives the table's prediction beside the written model timed whole, in ms, and
    with ``--latency_checks`` the states its loop timed (the last, the state written)."""
    from tests.test_cli import run_cli
    from tests.test_cli_prune import _data_and_weights

    data, weights, _, _ = _data_and_weights(tmp_path)
    out = tmp_path / "out"
    cli = run_cli(
        "prune", "mlp", "--width", "32", "--depth", "2", "--weights", weights, "--data", data,
        "--target", "60%", "--convention", "latency", "--latency_batch", "4",
        "--latency_threads", "1", "--latency_cache", tmp_path / "tables", "--out", out,
        "--latency_checks", "2",
    )  # fmt: skip
    assert cli.code == 0, cli.err
    report = json.loads((out / "report.json").read_text())
    assert report["convention"] == "latency" and report["cost_ratio"] <= 0.6
    assert report["round_to"] == 8  # --round_to unset: the table's step
    check = report["latency_prediction"]
    assert check["spec"]["batch"] == 4 and check["spec"]["threads"] == 1
    assert check["pruned_predicted_ms"] == pytest.approx(report["cost_after"] / 1e3)
    assert check["pruned_measured_ms"] > 0 and check["dense_measured_ms"] > 0
    assert "predicted" in cli.out and "measured" in cli.out
    assert list((tmp_path / "tables").glob("*.json"))
    assert report["latency_line"]["kept_share"] == 0.5  # the line was tried (fit_latency_line)
    last = report["latency_checks"][-1]  # the end state timed whole by the loop, priced on it
    assert last["measured_share"] == pytest.approx(report["cost_ratio"], rel=1e-6)


@pytest.mark.parametrize(
    ("flags", "named", "not_named"),
    [
        # a bad --latency_device: one line naming the latency flags
        (["--latency_device", "tpu"], ["--latency_*", "'cpu' or 'cuda"], []),
        # --round_to 0 (it sets the table's step): named as --round_to, not --latency_*
        (["--round_to", "0"], ["--round_to must be an int >= 1"], ["--latency_*"]),
    ],
)
def test_prune_cli_refuses_a_bad_latency_setting_naming_its_flag(
    tmp_path, flags: list[str], named: list[str], not_named: list[str]
):
    """A bad latency setting of ``fisherprune prune --convention latency`` exits 2 with one
    line naming the flag the user gave; nothing written."""
    from tests.test_cli import run_cli
    from tests.test_cli_prune import _data_and_weights

    data, weights, _, _ = _data_and_weights(tmp_path)
    out = tmp_path / "out"
    cli = run_cli(
        "prune", "mlp", "--width", "32", "--depth", "2", "--weights", weights, "--data", data,
        "--convention", "latency", *flags, "--out", out,
    )  # fmt: skip
    assert cli.code == 2
    assert all(text in cli.err for text in named), cli.err
    assert not any(text in cli.err for text in not_named), cli.err
    assert not out.exists()


def _fake_seconds_joint(self, rec, dense, shapes):
    """The fake clock, slower the narrower an operator's narrowest input dimension: a small
    matrix product's lost efficiency, which no product of one-axis sweeps can express."""
    n_in = rec.n_inputs
    narrowest = min((d for s in shapes[:n_in] for d in s[-1:] if d > 0), default=1)
    return _fake_seconds(self, rec, dense, shapes) * (1 + 4 / narrowest)


def test_joint_grid_captures_what_is_not_separable(tmp_path, fake_clock, monkeypatch):
    """With a clock that is not a product of per-axis factors, the prediction for a layer
    whose two axes are both narrowed equals the shrunk model's own table when every width
    is on the joint grid, and the one-axis product alone would be off."""
    import fisherprune.cost.model as model_module

    monkeypatch.setattr(lat.OpTimer, "seconds", _fake_seconds_joint)
    monkeypatch.setattr(
        model_module,
        "whole_model_seconds",
        functools.partial(_fake_whole, clock=_fake_seconds_joint),
    )
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    x = torch.randn(8, 3)
    fp.apply_masks(net, x)
    masks = fp.find_masks(net)
    for m, keep in zip(masks.values(), (2, 3), strict=True):
        m.mask[keep:] = 0.0
    spec = _spec(tmp_path)
    cm = CostModel(net, x, "latency", latency=spec)
    middle = next(t.formula for t in cm._terms if t.module == "2" and t.dims)
    assert middle.joint is not None and np.abs(middle.joint - 1).max() > 0.05  # not vacuous
    predicted = _operators(cm.report())
    small = fp.shrink(net)
    measured = _operators(computational_cost(small, x, "latency", latency=spec))
    assert predicted == pytest.approx(measured, rel=1e-9)


def test_timing_on_a_loaded_machine_is_warned_once(tmp_path, monkeypatch, caplog):
    """Operators timed while the load exceeds the CPU count (their times are cached for
    later runs) give one warning naming the load and the table file."""
    monkeypatch.setattr(lat.os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    net, x = _tiny()
    with caplog.at_level("WARNING", logger="fisherprune"):
        CostModel(net, x, "latency", latency=_spec(tmp_path, blocks=1))
    warned = [r for r in caplog.records if "machine loaded" in r.getMessage()]
    assert len(warned) == 1 and "load 99.0" in warned[0].getMessage()
    assert str(tmp_path / "latency") in warned[0].getMessage()


def test_times_the_whole_model_contradicts_are_not_saved(tmp_path, monkeypatch, caplog):
    """Operators timed alone that sum to far more than the model timed whole were timed under
    contention (issue 32: a loaded VM's table summed to 2-3x and mispredicted later runs):
    this run uses them, scaled to the whole model, but the table file is not written, and the
    warning says so; a later plausible run times them again and writes it."""
    import fisherprune.cost.model as model_module

    calls = _count_measures(monkeypatch)
    net, x = _tiny()
    spec = _spec(tmp_path, blocks=1)
    monkeypatch.setattr(model_module, "whole_model_seconds", lambda *a, **k: 1e-9)
    with caplog.at_level("WARNING", logger="fisherprune"):
        cm = CostModel(net, x, "latency", latency=spec)
    assert not list((tmp_path / "latency").glob("*.json"))
    assert "the model timed whole" in caplog.text and "not saved" in caplog.text
    assert cm.total() == pytest.approx(1e-9 / lat.UNIT)  # used, scaled to the whole
    first = calls[0]
    monkeypatch.undo()
    calls = _count_measures(monkeypatch)
    # a whole model slower than its operators' sum: plausible however loaded this machine is
    monkeypatch.setattr(model_module, "whole_model_seconds", lambda *a, **k: 1.0)
    CostModel(net, x, "latency", latency=spec)
    assert calls[0] >= first  # timed again, not read from a file
    assert len(list((tmp_path / "latency").glob("*.json"))) == 1


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(3, 4), nn.Linear(4, 2)
        self.rnn = nn.GRU(4, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(torch.relu(self.fc(x)))[0].mean(1))


def test_a_recurrent_models_operators_may_exceed_the_whole_and_are_saved(
    tmp_path, monkeypatch, caplog
):
    """A recurrent layer's steps are traced (and timed) one by one but run as one fused
    kernel, so its operators may sum to more than the model timed whole on a quiet machine:
    the table is saved and no warning blames other load (it did: every run timed afresh)."""
    import fisherprune.cost.model as model_module

    torch.manual_seed(0)
    net, x = _Recurrent(), torch.randn(2, 5, 3)
    fp.apply_masks(net, x[:1])
    monkeypatch.setattr(model_module, "whole_model_seconds", lambda *a, **k: 1e-9)
    with caplog.at_level("INFO", logger="fisherprune"):
        CostModel(net, x, "latency", latency=_spec(tmp_path, blocks=1))
    assert len(list((tmp_path / "latency").glob("*.json"))) == 1
    assert "something else ran" not in caplog.text
    assert "recurrent layers run their steps as one fused kernel" in caplog.text


def test_cpu_only_attention_is_timed_as_the_devices_attention(tmp_path, monkeypatch):
    """The CPU trace records attention as ``_scaled_dot_product_flash_attention_for_cpu``,
    which a GPU has no kernel for (every such operator was priced 0 there): off the CPU it is
    timed as the public attention on the same arguments, whose output is the CPU kernel's
    first. ``meta`` stands for the GPU here."""
    cpu_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    twin = lat.DEVICE_TWINS[cpu_op]
    want = cpu_op(q, k, v, 0.0, True, scale=0.3)[0]
    torch.testing.assert_close(twin((q, k, v, 0.0, True), {"scale": 0.3}), want)

    class Attention(nn.Module):
        def forward(self, x):
            return F.scaled_dot_product_attention(x, x, x)

    trace = trace_model(Attention(), torch.randn(2, 3, 5, 4))
    (rec,) = [r for r in trace.ops if r.op is cpu_op]
    dense = [tuple(s.shape) for s in rec.slots]
    called = []
    monkeypatch.setitem(lat.DEVICE_TWINS, cpu_op, lambda a, kw: called.append(1) or twin(a, kw))
    monkeypatch.setattr(lat, "_measure", lambda run, sync, blocks: (run(), 1e-5)[1])
    timer = lat.OpTimer(_spec(tmp_path, blocks=1), lat.LatencyTable.open(_spec(tmp_path)))
    timer.device = torch.device("meta")
    assert timer.seconds(rec, dense, dense) == 1e-5
    assert called
    # a table saved before the twin remembers the operator as not timed (-1): timed again
    timer.table.entries = dict.fromkeys(timer.table.entries, -1.0)
    called.clear()
    assert timer.seconds(rec, dense, dense) == 1e-5 and called
