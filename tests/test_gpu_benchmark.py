"""benchmarks/gpu.py, the parts that run without a GPU: its mixed-precision step is
``overhead.py``'s step with autocast added (the same update in float32), its collecting variant
gathers the Fisher signal under bf16 autocast, and its ratios pair rounds.

Its ``--quick`` path itself (``python benchmarks/gpu.py --device cpu --quick``) takes one to four
minutes on this 2-core CPU (BERT-base widths in bf16), too long for a test; it is run by hand."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gpu() -> ModuleType:
    """benchmarks/gpu.py, imported as the scripts import each other (siblings on sys.path)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("gpu")


def _recording(gpu: ModuleType, built: list[nn.Module]) -> object:
    """overhead.py's small CNN, every model it builds appended to ``built``."""
    spec = gpu.ov.MODELS["cnn"]

    def build(masked: bool) -> nn.Module:
        built.append(spec.build(masked))
        return built[-1]

    return dataclasses.replace(spec, build=build)


def _run(gpu: ModuleType, step: object, steps: int = 2) -> None:
    for x, y in gpu.ov.make_batches(gpu.ov.MODELS["cnn"], steps, 8):
        step(x, y)


def test_float32_step_is_overhead_step(gpu: ModuleType) -> None:
    """In float32 (autocast off) the swapped-in step trains exactly as overhead.make_step."""
    ours: list[nn.Module] = []
    theirs: list[nn.Module] = []
    _run(gpu, gpu.variant_step(_recording(gpu, ours), "a", CPU, torch.float32))
    _run(gpu, gpu.ov.VARIANT_STEPS["a"](_recording(gpu, theirs), gpu.ov.DECAY))
    for (name, p), q in zip(ours[0].named_parameters(), theirs[0].parameters(), strict=True):
        assert torch.equal(p, q), name
    start = gpu.ov.make_model(gpu.ov.MODELS["cnn"], masked=False)
    assert not torch.equal(next(start.parameters()), next(ours[0].parameters()))


def test_collecting_variant_gathers_signal_in_bf16(gpu: ModuleType) -> None:
    """Variant b under bf16 autocast folds a finite, positive signal into every mask, within
    bf16 rounding of the float32 run's."""
    signals = {}
    for dtype in (torch.bfloat16, torch.float32):
        built: list[nn.Module] = []
        _run(gpu, gpu.variant_step(_recording(gpu, built), "b", CPU, dtype))
        signals[dtype] = {n: m.signal.clone() for n, m in gpu.fp.find_masks(built[0]).items()}
    assert signals[torch.bfloat16].keys() == signals[torch.float32].keys()
    for name, low in signals[torch.bfloat16].items():
        ref = signals[torch.float32][name]
        assert torch.isfinite(low).all() and (low > 0).any(), name
        assert float((low - ref).norm() / ref.norm()) < 0.1, name


def test_ratios_pair_rounds(gpu: ModuleType) -> None:
    """``ratio`` is of the medians, ``paired_ratio`` the median of the per-round ratios."""
    out = gpu.ratios({"a": [1.0, 2.0, 4.0], "b": [3.0, 2.0, 12.0]}, "a")
    assert out["b"]["ratio"] == pytest.approx(1.5)
    assert out["b"]["round_ratios"] == pytest.approx([3.0, 1.0, 3.0])
    assert out["b"]["paired_ratio"] == pytest.approx(3.0)
    assert out["a"]["ratio"] == 1.0
