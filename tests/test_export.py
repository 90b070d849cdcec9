"""Export layer: shrink, PruningPlan, export_model / load_state_dict_export / load_aoti_export.

Property tests draw (architecture) x (random pruning: per mask a random subset of channels
zeroed, at least one kept) x (batch size 1..5) and check the shrunk network against the masked
one in float64, eval mode. The architectures are those of ``zoo.py`` plus one defined here with a
grouped conv and a depthwise conv with channel multiplier 2 (the zoo has neither).

Round trips go through a plan's JSON, a freshly built model, and every export format. Bad inputs
must fail early and clearly, and a failed write must leave no partial file. Files are written
under ``tmp_path`` only; the Hypothesis example database is off for the same reason.

Structural properties (parameters, masks, metadata, idempotence) shrink with ``check=False``, so
that they test the transformation itself rather than shrink's own postcondition check.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import fisherprune as fp
import fisherprune.export as fpe
from fisherprune.cost.formulas import SAME_AS_TORCH
from fisherprune.masks.points import MASKS_ATTR

# ------------------------------------------------------------------ tolerances
ATOL_F64 = 1e-10  # shrunk vs masked output, float64, relative to max(1, max |masked output|)
ATOL_F32 = 1e-5  # exported (TorchScript / ONNX, float32) vs masked output, same scaling

PROPERTY = settings(
    max_examples=8,
    deadline=None,
    database=None,  # write nothing outside tmp_path
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

logging.getLogger("fisherprune").setLevel(logging.ERROR)  # apply_masks lists unmasked channels


# ============================================================ architectures
GROUPED_WIDTHS = {"c1": 8, "c2": 6, "c3": 7}  # c1, c2 even: the grouped conv has groups=2


class GroupedNet(nn.Module):
    """conv (c1) - grouped conv (groups=2, c1 -> c2) - depthwise conv x2 (groups=c2, c2 -> 2 c2)
    - 1x1 conv (c3) - avgpool - fc: grouped and depthwise-multiplier convs, absent from the zoo."""

    def __init__(self, w: dict[str, int]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, w["c1"], 3, 1, 1)
        self.bn1 = nn.BatchNorm2d(w["c1"])
        self.gconv = nn.Conv2d(w["c1"], w["c2"], 3, 1, 1, groups=2, bias=False)
        self.bn2 = nn.BatchNorm2d(w["c2"])
        self.dw = nn.Conv2d(w["c2"], 2 * w["c2"], 3, 1, 1, groups=w["c2"], bias=False)
        self.bn3 = nn.BatchNorm2d(2 * w["c2"])
        self.pw = nn.Conv2d(2 * w["c2"], w["c3"], 1)
        self.fc = nn.Linear(w["c3"], zoo.NUM_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.gconv(x)))
        x = F.relu(self.bn3(self.dw(x)))
        x = F.relu(self.pw(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_grouped(widths: dict[str, int] | None = None, seed: int = 0) -> nn.Module:
    """``GroupedNet`` with ``GROUPED_WIDTHS`` unless overridden; random BN statistics."""
    torch.manual_seed(seed)
    model = GroupedNet({**GROUPED_WIDTHS, **(widths or {})})
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.weight.copy_(0.5 + torch.rand(n, generator=gen))
                m.bias.copy_(0.2 * torch.randn(n, generator=gen))
                m.running_mean.copy_(0.1 * torch.randn(n, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(n, generator=gen))
    return model.eval()


@dataclass(frozen=True)
class ArchSpec:
    build: Callable[..., nn.Module]
    example_input: Callable[[int], Tensor]


ARCHS: dict[str, ArchSpec] = {
    **{n: ArchSpec(a.build, a.example_input) for n, a in zoo.ARCHS.items()},
    "grouped": ArchSpec(build_grouped, zoo.image_input),
}
ARCH_NAMES = sorted(ARCHS)
# export round trips (slow) on a subset; the plan JSON round trip covers every architecture
EXPORT_ARCHS = ["densenet", "grouped", "mobilenetv2", "resnet_bottleneck", "transformer"]


# ================================================================ helpers
@dataclass(frozen=True)
class Case:
    """One drawn example: architecture, zeroed channel indices per mask name, batch size."""

    arch: str
    zeroed: tuple[tuple[str, tuple[int, ...]], ...]
    batch: int

    @property
    def pruned(self) -> bool:
        return any(idx for _, idx in self.zeroed)


def _build(
    arch: str, widths: dict[str, int] | None = None, dtype: torch.dtype = torch.float64
) -> nn.Module:
    return ARCHS[arch].build(widths).to(dtype).eval()


def _input(arch: str, batch: int, dtype: torch.dtype = torch.float64) -> Tensor:
    return ARCHS[arch].example_input(batch).to(dtype)


@functools.cache
def _mask_sizes(arch: str) -> tuple[tuple[str, int], ...]:
    """(mask name, channels) of every mask ``apply_masks`` gives the architecture."""
    masks = fp.apply_masks(_build(arch), _input(arch, 2))
    return tuple((name, m.num_channels) for name, m in masks.items())


@st.composite
def cases(draw: st.DrawFn, archs: list[str] | None = None) -> Case:
    arch = draw(st.sampled_from(archs or ARCH_NAMES))
    zeroed = tuple(
        (name, tuple(sorted(draw(st.sets(st.integers(0, n - 1), max_size=n - 1)))))
        for name, n in _mask_sizes(arch)
    )
    return Case(arch, zeroed, draw(st.integers(1, 5)))


def _masked(case: Case, dtype: torch.dtype = torch.float64) -> tuple[nn.Module, Tensor]:
    """The case's model (float64, eval) with masks applied and its channels zeroed."""
    model = _build(case.arch, dtype=dtype)
    x = _input(case.arch, case.batch, dtype)
    masks = fp.apply_masks(model, x)
    for name, idx in case.zeroed:
        masks[name].mask[list(idx)] = 0
    return model, x


def _seeded_case(arch: str, seed: int = 0, batch: int = 3) -> Case:
    """A random pruning drawn from ``seed``: each mask keeps a random 1..all of its channels."""
    gen = torch.Generator().manual_seed(seed)
    zeroed = []
    for name, n in _mask_sizes(arch):
        k = int(torch.randint(1, n + 1, (1,), generator=gen))  # channels kept
        zeroed.append((name, tuple(sorted(torch.randperm(n, generator=gen)[k:].tolist()))))
    return Case(arch, tuple(zeroed), batch)


def _out(model: Any, x: Tensor) -> Tensor:
    with torch.no_grad():
        return model(x)


def _assert_close(actual: Tensor, expected: Tensor, atol: float) -> None:
    assert actual.shape == expected.shape
    scale = max(1.0, float(expected.abs().max()))
    err = float((actual.to(expected.dtype) - expected).abs().max())
    assert err <= atol * scale, f"max abs error {err:.3g} > {atol * scale:.3g}"


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if MASKS_ATTR not in name)


def _flops_per_example(model: nn.Module, x: Tensor) -> float:
    counter = FlopCounterMode(display=False, custom_mapping=dict(SAME_AS_TORCH))
    with counter, torch.no_grad():
        model(x)
    return counter.get_total_flops() / x.shape[0]


def _snapshot(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a
    )


_META = (
    "in_channels",
    "out_channels",
    "groups",
    "num_features",
    "in_features",
    "out_features",
    "normalized_shape",
    "num_channels",
    "num_groups",
)


def _metadata(model: nn.Module) -> dict[str, tuple]:
    return {name: tuple(getattr(m, a, None) for a in _META) for name, m in model.named_modules()}


def _metadata_problems(model: nn.Module) -> list[str]:
    """Every module whose metadata disagrees with its weight shapes."""
    bad = []
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.conv._ConvNd) and not m.transposed:
            w = m.weight.shape
            ok = (
                m.out_channels == w[0]
                and m.in_channels == w[1] * m.groups
                and m.out_channels % m.groups == 0
                and (m.bias is None or m.bias.shape == (w[0],))
            )
        elif isinstance(m, nn.modules.batchnorm._BatchNorm):
            ok = all(
                t is None or t.shape == (m.num_features,)
                for t in (m.weight, m.bias, m.running_mean, m.running_var)
            )
        elif isinstance(m, nn.Linear):
            ok = m.weight.shape == (m.out_features, m.in_features) and (
                m.bias is None or m.bias.shape == (m.out_features,)
            )
        elif isinstance(m, nn.LayerNorm):
            ok = m.weight is None or tuple(m.weight.shape) == tuple(m.normalized_shape)
        else:
            continue
        if not ok:
            bad.append(f"{name}: {m}")
    return bad


# ====================================================== properties (float64)
@PROPERTY
@given(case=cases())
def test_shrunk_output_equals_masked_output(case: Case) -> None:
    """In eval mode the shrunk model's output equals the masked model's (float64)."""
    model, x = _masked(case)
    ref = _out(model, x)
    small = fp.shrink(model, x)
    _assert_close(_out(small, x), ref, ATOL_F64)


@PROPERTY
@given(case=cases())
def test_shrunk_flops_equal_cost_of_masked_model(case: Case) -> None:
    """FlopCounterMode on the shrunk model, per example, equals computational_cost(masked)."""
    model, x = _masked(case)
    cost = fp.computational_cost(model, x).total
    small = fp.shrink(model, x)
    assert _flops_per_example(small, x) == cost


@PROPERTY
@given(case=cases())
def test_applying_the_plan_again_changes_nothing(case: Case) -> None:
    """Shrinking is idempotent: the plan applied to the shrunk model, or twice to a fresh
    model, leaves tensors (the very same objects) and module metadata as they were."""
    model, x = _masked(case)
    plan = fp.PruningPlan.from_model(model, x)
    small = fp.shrink(model, x, check=False)
    for target in (small, plan.apply(_build(case.arch))):
        state, meta = _snapshot(target), _metadata(target)
        tensors = [id(t) for t in [*target.parameters(), *target.buffers()]]
        assert plan.apply(target) is target
        assert _same_state(_snapshot(target), state)
        assert _metadata(target) == meta
        assert [id(t) for t in [*target.parameters(), *target.buffers()]] == tensors


@PROPERTY
@given(case=cases())
def test_shrunk_model_has_fewer_parameters_iff_pruned(case: Case) -> None:
    """The shrunk model has strictly fewer parameters when a channel was pruned, else as many."""
    model, x = _masked(case)
    n_dense = _n_params(model)
    n_small = _n_params(fp.shrink(model, x, check=False))
    assert (n_small < n_dense) if case.pruned else (n_small == n_dense)


@PROPERTY
@given(case=cases())
def test_shrunk_model_has_no_masks(case: Case) -> None:
    """No MaskLayer, mask hook or fisherprune_masks attribute is left in the shrunk model."""
    model, x = _masked(case)
    small = fp.shrink(model, x, check=False)
    assert not any(isinstance(m, fp.MaskLayer) for m in small.modules())
    assert not hasattr(small, MASKS_ATTR)
    assert not any(m._forward_pre_hooks for m in small.modules())
    assert not any(MASKS_ATTR in k for k in small.state_dict())


@PROPERTY
@given(case=cases())
def test_shrunk_metadata_matches_weight_shapes(case: Case) -> None:
    """Conv in/out_channels and groups, BN num_features, Linear in/out_features and LayerNorm
    normalized_shape agree with the shrunk weights."""
    model, x = _masked(case)
    assert _metadata_problems(fp.shrink(model, x, check=False)) == []


# ============================================================== round trips
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_plan_json_rebuilds_the_shrunk_model(arch: str, tmp_path: Path) -> None:
    """Plan -> JSON file -> fresh model from the constructor -> shrunk state_dict: same output."""
    case = _seeded_case(arch)
    model, x = _masked(case)
    ref = _out(model, x)
    small = fp.shrink(model, x)
    fp.PruningPlan.from_model(model, x).save(tmp_path / "plan.json")
    fresh = fp.PruningPlan.load(tmp_path / "plan.json").apply(_build(arch))
    fresh.load_state_dict(small.state_dict())
    _assert_close(_out(fresh, x), ref, ATOL_F64)


@pytest.mark.parametrize("arch", EXPORT_ARCHS)
def test_state_dict_export_round_trip(arch: str, tmp_path: Path) -> None:
    """export_model(state_dict) + load_state_dict_export into a fresh model: same output."""
    model, x = _masked(_seeded_case(arch, seed=1))
    ref = _out(model, x)
    path = fp.export_model(model, tmp_path / "m.pt", x, format="state_dict")
    fresh = fp.load_state_dict_export(path, _build(arch))
    _assert_close(_out(fresh.eval(), x), ref, ATOL_F64)


def test_state_dict_export_of_a_model_shrunk_in_place_carries_the_plan_given(
    tmp_path: Path,
) -> None:
    """A model shrunk in place has no masks to read its plan off: export_model(plan=) writes
    the plan it was shrunk by, and load_state_dict_export rebuilds it from a fresh dense model
    with the masked model's output; a plan given with a model that still has masks is
    refused."""
    model, x = _masked(_seeded_case("vgg", seed=1))
    ref = _out(model, x)
    with pytest.raises(ValueError, match="still has masks"):
        fp.export_model(model, tmp_path / "m.pt", x, plan=fp.PruningPlan())
    plan = fp.PruningPlan.from_model(model, x)
    fp.shrink(model, x, inplace=True)
    path = fp.export_model(model, tmp_path / "m.pt", x, format="state_dict", plan=plan)
    fresh = fp.load_state_dict_export(path, _build("vgg"))
    _assert_close(_out(fresh.eval(), x), ref, ATOL_F64)


@pytest.mark.parametrize(("arch", "freeze"), [("grouped", False), ("vgg", True)])
def test_torchscript_export_round_trip(arch: str, freeze: bool, tmp_path: Path) -> None:
    """export_model(torchscript) + torch.jit.load: same output, at another batch size too;
    also frozen, with batch norm folded into the convs (float32 rounding apart)."""
    model, x = _masked(_seeded_case(arch, seed=2), dtype=torch.float32)
    model.eval()
    path = fp.export_model(model, tmp_path / "m.ts", x, format="torchscript", freeze=freeze)
    loaded = torch.jit.load(str(path))
    if freeze:  # weights are constants and batch norm is folded away
        assert list(loaded.parameters()) == []
        assert "batch_norm" not in str(loaded.graph)
    for batch in (1, 3):
        xb = _input(arch, batch, torch.float32)
        _assert_close(_out(loaded, xb), _out(model, xb), ATOL_F32)


@pytest.mark.parametrize("fmt", ["state_dict", "onnx"])
def test_freeze_with_another_format_than_torchscript_raises_and_writes_nothing(
    fmt: str, tmp_path: Path
) -> None:
    """freeze=True with a format other than torchscript raises ValueError naming freeze, and no
    file is written."""
    model, x = _masked(_seeded_case("grouped", seed=2), dtype=torch.float32)
    with pytest.raises(ValueError, match="freeze"):
        fp.export_model(model, tmp_path / "m.out", x, format=fmt, freeze=True)
    assert list(tmp_path.iterdir()) == []


def test_onnx_export_of_a_projected_lstm_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    """An ``nn.LSTM`` with ``proj_size``, which PyTorch's ONNX exporter writes without its
    projection: a ValueError naming the layer and the formats that work, no file."""

    class Tagger(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = torch.nn.LSTM(4, 6, proj_size=3, batch_first=True)
            self.head = torch.nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(x)[0].mean(1))

    model, x = Tagger(), torch.randn(2, 5, 4)
    fp.apply_masks(model, x[:1])
    with pytest.raises(ValueError, match=r"proj_size \(rnn\).*'torchscript' or 'state_dict'"):
        fp.export_model(model, tmp_path / "m.onnx", x[:1], format="onnx")
    assert list(tmp_path.iterdir()) == []


ONNX_ARCH = "vgg"  # flatten into Linear, BN, max-pool; exports fast


@pytest.fixture(scope="module")
def onnx_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The pruned and the dense ONNX export of one architecture (exporting is slow)."""
    pytest.importorskip("onnx")
    d = tmp_path_factory.mktemp("onnx")
    model, x = _masked(_seeded_case(ONNX_ARCH, seed=3), dtype=torch.float32)
    pruned = fp.export_model(model, d / "pruned.onnx", x, format="onnx")
    dense = fp.export_model(_build(ONNX_ARCH, dtype=torch.float32), d / "dense.onnx", x, "onnx")
    return {"model": model, "pruned": pruned, "dense": dense}


@pytest.mark.parametrize("batch", [1, 3])
def test_onnx_export_matches_with_dynamic_batch(onnx_files: dict[str, Any], batch: int) -> None:
    """onnxruntime on the exported file gives the masked model's output at batch 1 and 3."""
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(onnx_files["pruned"]), providers=["CPUExecutionProvider"])
    x = _input(ONNX_ARCH, batch, torch.float32)
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    _assert_close(torch.from_numpy(out), _out(onnx_files["model"], x), ATOL_F32)


def test_onnx_file_of_pruned_model_is_smaller(onnx_files: dict[str, Any]) -> None:
    """The ONNX file of the pruned model is smaller than the dense model's."""
    assert os.path.getsize(onnx_files["pruned"]) < os.path.getsize(onnx_files["dense"])


AOTI_ARCH = "resnet_basic"  # residual adds, batch norm, 4-D input: the channels-last path


@pytest.fixture(scope="module")
def aoti_package(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One masked network exported as an AOTInductor package and loaded (compiling takes
    15-20 s)."""
    d = tmp_path_factory.mktemp("aoti")
    model, x = _masked(_seeded_case(AOTI_ARCH, seed=4), dtype=torch.float32)
    path = fp.export_model(model, d / "m.pt2", x, format="aoti")
    return {"model": model, "x": x, "path": path, "loaded": fpe.load_aoti_export(path)}


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_aoti_package_gives_the_masked_outputs_at_any_batch(
    aoti_package: dict[str, Any], batch: int
) -> None:
    """The loaded package computes the masked model's outputs (float32 rounding apart) at batch
    sizes other than the example's."""
    x = _input(AOTI_ARCH, batch, torch.float32)
    _assert_close(_out(aoti_package["loaded"], x), _out(aoti_package["model"], x), ATOL_F32)


def test_aoti_package_takes_a_channels_last_input_too(aoti_package: dict[str, Any]) -> None:
    """An input in channels-last layout gives the same outputs as a contiguous one (the compiled
    code itself would read it as contiguous and return wrong numbers)."""
    x = _input(AOTI_ARCH, 3, torch.float32)
    x_cl = x.contiguous(memory_format=torch.channels_last)
    _assert_close(_out(aoti_package["loaded"], x_cl), _out(aoti_package["model"], x), ATOL_F32)


def test_aoti_package_records_the_plan(aoti_package: dict[str, Any]) -> None:
    """The package carries the pruning plan of the masked model it was made from, and says it
    computes in channels-last layout."""
    loaded = aoti_package["loaded"]
    expected = fp.PruningPlan.from_model(aoti_package["model"], aoti_package["x"])
    assert loaded.plan.to_dict() == expected.to_dict()
    assert loaded.channels_last


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda x: x[:, :, :-1], r"shape \(3, 3, 7, 8\).*\(batch, 3, 8, 8\)"),
        (lambda x: x[0], r"shape \(3, 8, 8\)"),
        (lambda x: x.double(), "torch.float64.*torch.float32"),
        (lambda x: x[:0], "batch of at least 1"),
    ],
)
def test_aoti_package_rejects_an_input_it_was_not_compiled_for(
    aoti_package: dict[str, Any], bad: Callable[[Tensor], Tensor], message: str
) -> None:
    """An input of another shape, dtype or an empty batch raises ValueError naming what the
    package expects, instead of running compiled code that does not check."""
    with pytest.raises(ValueError, match=message):
        aoti_package["loaded"](bad(_input(AOTI_ARCH, 3, torch.float32)))


def test_aoti_package_rejects_a_wrong_number_of_inputs(aoti_package: dict[str, Any]) -> None:
    """Two inputs to a one-input package raise ValueError saying how many it takes."""
    x = _input(AOTI_ARCH, 2, torch.float32)
    with pytest.raises(ValueError, match="takes 1 input"):
        aoti_package["loaded"](x, x)


class _TwoInputs(nn.Module):
    """Two vector inputs, a hidden layer to prune, and a tuple of two outputs: the path without
    channels-last, and outputs that go through the package's output spec."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 10), nn.Linear(3, 10)
        self.head, self.aux = nn.Linear(10, 4), nn.Linear(10, 2)

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        h = F.relu(self.a(x) + self.b(y))
        return self.head(h), self.aux(h)


@pytest.fixture(scope="module")
def aoti_two_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``_TwoInputs`` with 4 of its 10 hidden units masked, exported and loaded."""
    torch.manual_seed(5)
    model = _TwoInputs().eval()
    args = (torch.randn(2, 6), torch.randn(2, 3))
    (mask,) = fp.apply_masks(model, args).values()
    mask.mask[[1, 4, 5, 8]] = 0
    path = fp.export_model(model, tmp_path_factory.mktemp("aoti2") / "m.pt2", args, "aoti")
    return {"model": model, "loaded": fpe.load_aoti_export(path)}


def test_aoti_package_of_two_inputs_gives_both_outputs(aoti_two_inputs: dict[str, Any]) -> None:
    """A two-input, two-output network: the package returns the same tuple as the masked model
    at another batch size, and computes without channels-last."""
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    with torch.no_grad():
        got, want = aoti_two_inputs["loaded"](x, y), aoti_two_inputs["model"](x, y)
    assert isinstance(got, tuple) and len(got) == 2
    for g, w in zip(got, want, strict=True):
        _assert_close(g, w, ATOL_F32)
    assert not aoti_two_inputs["loaded"].channels_last


def test_aoti_package_rejects_inputs_of_different_batch_sizes(
    aoti_two_inputs: dict[str, Any],
) -> None:
    """Inputs of batch 4 and 2 raise ValueError naming both sizes (the compiled code would read
    past the end of the smaller one)."""
    with pytest.raises(ValueError, match="one batch size, got 4, 2"):
        aoti_two_inputs["loaded"](torch.randn(4, 6), torch.randn(2, 3))


def test_aoti_export_of_inputs_without_a_shared_batch_raises(tmp_path: Path) -> None:
    """Example inputs whose first dimensions differ (or a 0-d input) raise ValueError before any
    work, and nothing is written."""
    for args in ((torch.randn(2, 6), torch.randn(3, 3)), (torch.randn(2, 6), torch.tensor(1.0))):
        with pytest.raises(ValueError, match="same"):
            fp.export_model(_TwoInputs(), tmp_path / "m.pt2", args, format="aoti")
    assert list(tmp_path.iterdir()) == []


def test_aoti_path_without_pt2_suffix_raises_and_writes_nothing(tmp_path: Path) -> None:
    """An AOTInductor package must be a .pt2 file: another name raises ValueError before any
    work, and nothing is written."""
    model, x = _masked(_seeded_case("mlp_skip"), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"\.pt2"):
        fp.export_model(model, tmp_path / "m.bin", x, format="aoti")
    assert list(tmp_path.iterdir()) == []


class _DataDependent(nn.Module):
    """Python control flow on a tensor's value: torch.export cannot capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        y = self.fc(x)
        return y if float(y.sum()) > 0 else -y


def test_aoti_export_of_a_model_torch_export_cannot_capture_names_it(tmp_path: Path) -> None:
    """A model with value-dependent control flow raises RuntimeError naming torch.export and
    the formats that work instead; nothing is written."""
    with pytest.raises(RuntimeError, match=r"torch\.export could not capture.*torchscript"):
        fp.export_model(_DataDependent(), tmp_path / "m.pt2", torch.randn(2, 4), format="aoti")
    assert list(tmp_path.iterdir()) == []


def test_aoti_export_with_a_non_tensor_input_raises_and_writes_nothing(tmp_path: Path) -> None:
    """A non-tensor example input would be compiled in as a constant: ValueError naming it."""
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"every example input to be a tensor.*int"):
        fp.export_model(model, tmp_path / "m.pt2", (torch.randn(2, 4), 3), format="aoti")
    assert list(tmp_path.iterdir()) == []


def test_aoti_export_without_a_cxx_compiler_says_so_and_writes_nothing(tmp_path: Path) -> None:
    """With no working C++ compiler, export raises RuntimeError saying that a compiler is what
    is missing, and leaves no file (inductor checks the compiler before compiling)."""
    import torch._inductor.config as inductor_config

    # inductor's own patch, not monkeypatch: pytest's undo reads the config proxy's __dict__,
    # finds no entry and deletes the setting, breaking every later AOTInductor compile
    no_compiler = inductor_config.patch({"cpp.cxx": ("/nonexistent/g++",)})
    with no_compiler, pytest.raises(RuntimeError, match=r"C\+\+ compiler"):
        fp.export_model(nn.Linear(4, 3), tmp_path / "m.pt2", torch.randn(2, 4), format="aoti")
    assert list(tmp_path.iterdir()) == []
    assert inductor_config.cpp.cxx != ("/nonexistent/g++",)  # given back


def test_aoti_module_calls_a_loader_without_boxed_run_through_its_wrapper() -> None:
    """A compiled model without torch's ``loader.boxed_run`` (another torch version) is called
    through its own wrapper, after the same input checks."""
    meta = {
        "inputs": [{"shape": [4], "dtype": "torch.float32"}],
        "plan": fp.PruningPlan().to_dict(),
        "channels_last": False,
    }
    module = fpe.AOTIModule(lambda x: 2 * x, meta, Path("m.pt2"))
    x = torch.randn(3, 4)
    assert torch.equal(module(x), 2 * x)
    with pytest.raises(ValueError, match=r"\(batch, 4\)"):
        module(torch.randn(3, 5))


def test_load_aoti_export_of_a_missing_file_names_it(tmp_path: Path) -> None:
    """Loading a package that is not there raises FileNotFoundError with its path."""
    with pytest.raises(FileNotFoundError, match=r"nothing\.pt2"):
        fpe.load_aoti_export(tmp_path / "nothing.pt2")


# ================================================================ mutation
@pytest.mark.parametrize(
    "collecting",
    [True, False],
)
def test_shrink_leaves_the_masked_model_unchanged(collecting: bool) -> None:
    """shrink (default) changes neither the masked model's parameters, masks nor output, while
    its masks collect signals and after pruning is over (``collecting=False``)."""
    model, x = _masked(_seeded_case("resnet_basic"))
    for m in fp.find_masks(model).values():
        m.collecting = collecting
    before = copy.deepcopy(model)
    state, masks = _snapshot(model), fp.find_masks(model)
    small = fp.shrink(model, x)
    assert small is not model
    assert _same_state(_snapshot(model), state)
    assert fp.find_masks(model).keys() == masks.keys()
    assert torch.equal(_out(model, x), _out(before, x))


def test_shrink_inplace_shrinks_the_model_itself() -> None:
    """shrink(inplace=True) returns the model itself, shrunk: no masks, fewer parameters."""
    model, x = _masked(_seeded_case("resnet_basic"))
    n_dense, ref = _n_params(model), _out(model, x)
    small = fp.shrink(model, x, inplace=True)
    assert small is model
    assert not fp.find_masks(model) and not hasattr(model, MASKS_ATTR)
    assert _n_params(model) < n_dense
    _assert_close(_out(model, x), ref, ATOL_F64)


# =============================================================== bad input
def test_shrink_without_masks_raises_value_error() -> None:
    """shrink of a model with no masks raises ValueError saying so."""
    model = _build("vgg")
    with pytest.raises(ValueError, match="no masks"):
        fp.shrink(model, _input("vgg", 2))


@functools.cache
def _full_plan(arch: str) -> fp.PruningPlan:
    """A plan pruning channel 0 of every mask (every mask has at least 2 channels)."""
    model = _build(arch)
    x = _input(arch, 2)
    for m in fp.apply_masks(model, x).values():
        m.mask[0] = 0
    return fp.PruningPlan.from_model(model, x)


def _first_mismatch(plan: fp.PruningPlan, model: nn.Module) -> str | None:
    """The first module, in the model's order, with a tensor whose shape differs from the
    model the plan was made for (the plan records every tensor's original shape)."""
    for name, mod in model.named_modules():
        tensors = {**mod._parameters, **mod._buffers}
        for tname, t in tensors.items():
            full = f"{name}.{tname}" if name else tname
            if t is not None and full in plan.shapes and list(t.shape) != plan.shapes[full]:
                return name
    return None


def _widths(arch: str) -> dict[str, int]:
    return GROUPED_WIDTHS if arch == "grouped" else zoo.DEFAULT_WIDTHS[arch]


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_plan_for_other_width_names_first_mismatching_module(arch: str) -> None:
    """A plan applied to the architecture built with another width raises PlanMismatchError
    naming the first (in module order) module that does not match, and changes nothing."""
    plan = _full_plan(arch)
    checked = 0
    for key, width in sorted(_widths(arch).items()):
        fresh = _build(arch, {key: 2 * width})
        expected = _first_mismatch(plan, fresh)
        if expected is None:  # this width changes no tensor's shape
            continue
        state = _snapshot(fresh)
        with pytest.raises(fp.PlanMismatchError) as err:
            plan.apply(fresh)
        assert _named_module(str(err.value)) == expected, str(err.value)
        assert _same_state(_snapshot(fresh), state)
        checked += 1
    assert checked > 0


def _named_module(message: str) -> str:
    """The module a PlanMismatchError message names: ``'<m>'`` or ``<m>.<tensor> has shape``."""
    quoted = re.search(r"module '([^']*)'", message)
    if quoted:
        return quoted.group(1)
    return message.split(" ", 1)[0].rpartition(".")[0]


def test_json_plan_for_other_width_names_first_mismatching_module() -> None:
    """Through JSON too, the mismatch error names the first mismatching module in model order."""
    plan = fp.PruningPlan.from_json(_full_plan("vgg").to_json())
    with pytest.raises(fp.PlanMismatchError) as err:
        plan.apply(_build("vgg", {"c1": 7}))
    assert _named_module(str(err.value)) == "conv1", str(err.value)


def test_state_dict_export_into_other_width_raises_plan_mismatch(tmp_path: Path) -> None:
    """Loading an export into a model of another width (only in an unpruned layer) raises
    PlanMismatchError naming that layer."""
    model, x = _build("vgg"), _input("vgg", 2)
    fp.apply_masks(model, x)["fisherprune_masks.conv1:out"].mask[0] = 0
    path = fp.export_model(model, tmp_path / "m.pt", x)
    with pytest.raises(fp.PlanMismatchError, match="fc1"):
        fp.load_state_dict_export(path, _build("vgg", {"fc1": 12}))


def test_plan_for_model_without_a_module_names_it() -> None:
    """A plan applied to a model lacking a planned module raises PlanMismatchError naming it."""

    class Truncated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 6, 3, 1, 1)

    plan = _full_plan("vgg")
    model = Truncated().double()
    first_missing = next(n for n in plan.modules if not hasattr(model, n))
    with pytest.raises(fp.PlanMismatchError, match=re.escape(repr(first_missing))):
        plan.apply(model)


def test_export_to_missing_directory_raises_and_writes_nothing(tmp_path: Path) -> None:
    """Exporting into a directory that does not exist raises FileNotFoundError, writes nothing."""
    model, x = _masked(_seeded_case("mlp_skip"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        fp.export_model(model, tmp_path / "no" / "such" / "m.pt", x)
    assert list(tmp_path.iterdir()) == []


def _fail_midway(tmp: Any) -> None:
    """A writer that gets some bytes into the temporary file, then fails."""
    with open(tmp, "wb") as f:
        f.write(b"partial" * 100)
    raise OSError("disk full (simulated)")


@pytest.mark.parametrize("fmt", ["state_dict", "torchscript", "onnx", "aoti"])
def test_failed_write_leaves_no_partial_file(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write failing midway leaves no new file and an existing file at the path untouched."""
    import fisherprune.export.files as files

    if fmt in ("state_dict", "torchscript"):  # serialised in memory, then written out
        monkeypatch.setattr(fpe.storage, "write_file", lambda path, data: _fail_midway(path))
    elif fmt == "onnx":
        pytest.importorskip("onnx", reason="ONNX export needs the onnx package")
        monkeypatch.setattr(files, "_onnx", lambda model, args, tmp: _fail_midway(tmp))
    else:
        monkeypatch.setattr(files, "write_aoti", lambda model, args, tmp, plan: _fail_midway(tmp))
    model, x = _masked(_seeded_case("mlp_skip"), dtype=torch.float32)
    ext = ".pt2" if fmt == "aoti" else ".bin"
    old = tmp_path / f"old{ext}"
    old.write_bytes(b"previous export")
    with pytest.raises(OSError, match="simulated"):
        fp.export_model(model, old, x, format=fmt)
    with pytest.raises(OSError, match="simulated"):
        fp.export_model(model, tmp_path / f"new{ext}", x, format=fmt)
    assert sorted(p.name for p in tmp_path.iterdir()) == [old.name]
    assert old.read_bytes() == b"previous export"


def test_unknown_format_raises_value_error(tmp_path: Path) -> None:
    """An unknown export format raises ValueError listing the formats, and writes nothing."""
    model, x = _masked(_seeded_case("mlp_skip"))
    with pytest.raises(ValueError, match="state_dict"):
        fp.export_model(model, tmp_path / "m.bin", x, format="pickle")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "text",
    ["garbage", "", "[1, 2]", "null", '{"modules": {}}', '{"format": 2, "modules": {}}'],
)
def test_plan_from_json_of_garbage_raises_value_error(text: str) -> None:
    """PruningPlan.from_json of text that is not a plan raises ValueError."""
    with pytest.raises(ValueError):
        fp.PruningPlan.from_json(text)


@pytest.mark.parametrize(
    "modules",
    [
        "5",
        '{"conv1": 3}',
        '{"conv1": {"weight": {"shape": [6, 3, 3, 3], "kept": {"0": [0, 99]}}}}',
    ],
)
def test_plan_from_json_of_malformed_plan_raises_value_error(modules: str) -> None:
    """A format-1 plan whose ``modules`` is malformed is rejected by from_json (ValueError)."""
    with pytest.raises(ValueError):
        fp.PruningPlan.from_json('{"format": 1, "modules": ' + modules + "}")


def test_export_of_unmasked_model_keeps_its_training_mode(tmp_path: Path) -> None:
    """export_model leaves the caller's model in the mode it was in (here: training)."""
    model = _build("vgg", dtype=torch.float32).train()
    fp.export_model(model, tmp_path / "m.ts", _input("vgg", 2, torch.float32), "torchscript")
    assert model.training


# ======================================================== hand-placed masks
def test_hand_placed_masks_shrink_to_identity() -> None:
    """Hand-placed MaskLayers (Linear and conv nets) are replaced by Identity and their zeroed
    channels removed; the output is unchanged."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), fp.MaskLayer(8), nn.Linear(8, 3)).double()
    mlp[2].mask[[1, 4, 7]] = 0
    cnn = nn.Sequential(
        nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), fp.MaskLayer(6), nn.Conv2d(6, 2, 1)
    ).double()
    cnn[3].mask[[0, 5]] = 0
    for model, x, mask_at, kept in [
        (mlp, torch.randn(4, 10, dtype=torch.float64), 2, 5),
        (cnn.eval(), torch.randn(4, 3, 6, 6, dtype=torch.float64), 3, 4),
    ]:
        ref = _out(model, x)
        small = fp.shrink(model, x)
        assert isinstance(small[mask_at], nn.Identity)
        assert small[mask_at + 1].weight.shape[1] == kept
        assert _metadata_problems(small) == []
        _assert_close(_out(small, x), ref, ATOL_F64)


def test_hand_mask_on_model_output_raises_value_error() -> None:
    """A hand mask zeroing a channel of the model's output: shrink raises ValueError saying so."""
    model = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 3), fp.MaskLayer(3))
    model[3].mask[1] = 0
    with pytest.raises(ValueError, match="output"):
        fp.shrink(model, torch.randn(2, 10))


def test_hand_mask_before_batchnorm_raises_value_error() -> None:
    """A hand mask zeroing a channel before BatchNorm: shrink raises ValueError naming the mask."""
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3), fp.MaskLayer(6), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 2, 1)
    ).eval()
    with torch.no_grad():
        model[2].bias.fill_(0.5)
    model[1].mask[2] = 0
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="'1'"):
        fp.shrink(model, torch.randn(2, 3, 6, 6))


# ------------------------------------------------------------ channel shuffle (ShuffleNetV2)
class _ShuffleUnit(nn.Module):
    """A ShuffleNetV2 unit: split the channels, transform one half (1x1, depthwise 3x3, 1x1),
    concatenate, interleave the halves (view / transpose / reshape), then a depthwise conv on
    the shuffled tensor and a linear head."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        h = c // 2
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.branch = nn.Sequential(
            nn.Conv2d(h, h, 1), nn.BatchNorm2d(h), nn.ReLU(),
            nn.Conv2d(h, h, 3, padding=1, groups=h), nn.BatchNorm2d(h),
            nn.Conv2d(h, h, 1), nn.BatchNorm2d(h), nn.ReLU(),
        )  # fmt: skip
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.pw = nn.Conv2d(c, 6, 1)
        self.head = nn.Linear(6, 4)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.stem(x).chunk(2, dim=1)
        x = torch.cat([a, self.branch(b)], 1)
        n, c, h, w = x.shape
        x = x.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)
        return self.head(torch.relu(self.pw(self.dw(x))).mean((2, 3)))


def test_depthwise_conv_of_a_shuffled_tensor_is_not_masked() -> None:
    """The shuffle hides which input channel feeds which depthwise filter, so the depthwise
    conv's channels are left unmasked with that reason (removing a filter needs its input
    channel removed too)."""
    torch.manual_seed(0)
    masks = fp.apply_masks(_ShuffleUnit().eval(), torch.randn(2, 3, 8, 8))
    assert not [n for n in masks if "dw" in n]
    assert "dw: grouped convolution of an untracked input" in masks.summary()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shuffle_unit_shrinks_to_the_masked_outputs_and_flops(seed: int) -> None:
    """Zeroing a random half of every mask of the shuffle unit, the shrunk network gives the
    masked outputs (float64) and FlopCounterMode on it equals the cost model's total."""
    torch.manual_seed(seed)
    model = _ShuffleUnit().double()
    zoo.randomise_norms(model, seed)
    model.eval()
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    masks = fp.apply_masks(model, x)
    assert len(masks) >= 2  # the branch and the pointwise conv at least
    gen = torch.Generator().manual_seed(seed)
    for m in masks.values():
        drop = torch.randperm(m.num_channels, generator=gen)[: m.num_channels // 2]
        m.mask[drop] = 0.0
    cost = fp.computational_cost(model, x).total
    small = fp.shrink(model, x)
    _assert_close(_out(small, x), _out(model, x), atol=1e-10)
    assert _flops_per_example(small, x) == cost


def test_a_shrunk_model_that_fails_to_run_raises_shrink_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If the rebuilt network cannot even run on the example inputs (here a plan that leaves a
    conv with the wrong input width), shrink raises ShrinkError naming the layer it failed in
    and the layer's error, and the masked model is left working."""
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Conv2d(6, 4, 3)).eval()
    x = torch.randn(2, 3, 8, 8)
    masks = fp.apply_masks(model, x)
    next(iter(masks.values())).mask[:2] = 0.0
    expected = _out(model, x)
    real_apply = fp.PruningPlan.apply

    def broken_apply(plan: fp.PruningPlan, target: nn.Module, *a: Any, **kw: Any) -> Any:
        out = real_apply(plan, target, *a, **kw)
        target[2].weight = nn.Parameter(torch.randn(4, 7, 3, 3))
        return out

    monkeypatch.setattr(fp.PruningPlan, "apply", broken_apply)
    failed = r"fails in 2 on the example inputs \(RuntimeError"
    with pytest.raises(fp.ShrinkError, match=failed) as e:
        fp.shrink(model, x)
    assert e.value.module == "2"
    torch.testing.assert_close(_out(model, x), expected)
