"""--device and --precision: resolving devices, clear errors for absent ones, and bf16 training
on the CPU with the pruning statistics kept in float32."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cli_run import run_cli as _cli
from torch import nn

import fisherprune as fp
from fisherprune import MaskLayer
from fisherprune.graph import apply_masks
from fisherprune.masks import find_masks
from fisherprune.pruner import PruningOptimizer
from fisherprune.train.devices import Precision, process_group_backend, resolve_device
from fisherprune.train.models import build_model
from tests import tiny_hf

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
QUICK = [
    "--model", "mlp", "--width", "8", "--depth", "1", "--pruning.burn_in", "5",
    "--pruning_iter", "2", "--eval_every", "10", "--fine_tune_steps", "5",
    "--export_formats", "state_dict", "--threads", "1", "--progress", "plain",
    "--dense_check", "warn",
]  # fmt: skip


def _table(path: Path) -> Path:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    np.savez(path, x=x, y=x[:, :3].argmax(1).astype(np.int64))
    return path


def test_cpu_resolves_to_the_cpu_and_uses_gloo() -> None:
    device = resolve_device("cpu")
    assert device == torch.device("cpu") and process_group_backend(device) == "gloo"
    assert process_group_backend(torch.device("cuda", 0)) == "nccl"


@no_cuda
def test_auto_without_a_gpu_is_the_cpu() -> None:
    if torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize("name", ["tpu:3", "gpu", "cuda:x"])
def test_a_name_that_is_no_device_is_a_value_error(name: str) -> None:
    with pytest.raises(ValueError, match="use auto, cpu, cuda, cuda:N or mps"):
        resolve_device(name)


@no_cuda
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_cuda_without_cuda_exits_2_with_a_message_not_a_traceback(
    tmp_path: Path, name: str
) -> None:
    code, _, err = _cli("train", "--data", _table(tmp_path / "t.npz"), *QUICK,
                        "--device", name, "--save_dir", tmp_path / "run")  # fmt: skip
    assert code == 2
    assert f"--device {name}: CUDA is not available here" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_fp16_on_the_cpu_is_refused_with_what_to_use() -> None:
    with pytest.raises(ValueError, match="use --precision bf16 on a CPU"):
        Precision("fp16", torch.device("cpu"))


def test_device_cpu_and_bf16_run_trains_as_well_as_fp32(tmp_path: Path) -> None:
    """The same run in bf16 and in fp32 on the CPU: both reach the target, and the bf16 run's
    dense and pruned accuracies are within 5 points of the fp32 run's."""
    data = _table(tmp_path / "t.npz")
    results = {}
    for precision in ("fp32", "bf16"):
        save = tmp_path / precision
        code, out, err = _cli("train", "--data", data, *QUICK, "--pruning.burn_in", "100",
                              "--device", "cpu", "--precision", precision,
                              "--optimizer", "adam", "--learning_rate", "0.01",
                              "--save_dir", save)  # fmt: skip
        assert code == 0, err
        assert f"device cpu, {precision}" in out
        results[precision] = json.loads((save / "result.json").read_text())
    for r in results.values():
        assert r["final_cost"] <= 0.5 * r["dense_cost"]
    for key in ("dense_metric", "final_metric"):
        assert abs(results["bf16"][key] - results["fp32"][key]) <= 0.05, key


def test_bf16_fisher_signal_is_float32_and_close_to_the_fp32_one() -> None:
    """The same batch under bf16 autocast and in fp32: the signal buffers stay float32 and the
    bf16 estimate is within a few percent of the fp32 one."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 10), torch.randint(0, 3, (64,))
    signals = {}
    for name in ("fp32", "bf16"):
        torch.manual_seed(1)
        model = build_model("mlp", (10,), 3, 32, 2)
        apply_masks(model, x[:1])
        popt = PruningOptimizer(model, x[:1], lr=0.0, decay=0.0, prune_every=1000)
        precision = Precision(name, torch.device("cpu"))
        with precision.autocast():
            loss = F.cross_entropy(model(x).float(), y)
        precision.minimize(popt, loss)
        masks = find_masks(model)
        assert all(m.signal.dtype == torch.float32 for m in masks.values())
        signals[name] = torch.cat([m.signal for m in masks.values()])
    ref, low = signals["fp32"], signals["bf16"]
    assert float((low - ref).abs().sum() / ref.abs().sum()) < 0.05


def _masked_conv() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        MaskLayer(8),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 32 * 32, 4),
    )


def test_bf16_per_example_dot_is_accumulated_in_float32() -> None:
    """Under bf16 autocast the mask's per-example dot over 1,024 positions matches a float64
    dot of the very bf16 activations and gradients backward saw (to float32 rounding, not
    bf16's 0.4%): ``signal = 0.5 * mean_n (N * sum_pos g * x)^2`` with decay 0."""
    model, seen = _masked_conv(), {}

    def keep(module: torch.nn.Module, inputs: tuple, out: torch.Tensor) -> None:
        seen["x"] = inputs[0].detach()
        out.register_hook(lambda g: seen.__setitem__("g", g.detach()))

    model[1].register_forward_hook(keep)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 4, (16,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    assert seen["x"].dtype == seen["g"].dtype == torch.bfloat16
    fp.update_pruning_signals([model[1]], decay=0.0)
    dot = (seen["g"].double() * seen["x"].double()).sum((2, 3)) * x.shape[0]
    ref = 0.5 * (dot**2).mean(0)
    torch.testing.assert_close(model[1].signal.double(), ref, rtol=1e-4, atol=0.0)


def test_a_grad_scaler_leaves_the_signal_unchanged() -> None:
    """The same batch stepped through ``Precision.minimize`` with a ``GradScaler`` of scale
    2**12 and without one: the gathered mask gradients are unscaled, so the Fisher signals
    agree (a scaled signal would be 2**24 times larger)."""
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 4, (16,))
    signals = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**12)):
        model = _masked_conv()
        popt = PruningOptimizer(model, x[:1], lr=0.0, decay=0.0, prune_every=1000)
        precision = Precision("fp32", torch.device("cpu"))
        precision.scaler = scaler
        precision.minimize(popt, F.cross_entropy(model(x), y))
        signals.append(model[1].signal.clone())
    torch.testing.assert_close(signals[1], signals[0], rtol=1e-5, atol=0.0)


def test_a_step_the_grad_scaler_skips_leaves_no_statistics_behind() -> None:
    """A scale so large that the gradients overflow: ``GradScaler`` skips the step (the
    optimizer's counter does not move) and the inf gradients the masks gathered are dropped,
    so the next step's signal is that of its own batch alone, as on a fresh model."""
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 4, (16,))
    fresh = _masked_conv()
    model = _masked_conv()
    signals = []
    for m, overflow_first in ((fresh, False), (model, True)):
        popt = PruningOptimizer(m, x[:1], lr=0.0, decay=0.0, prune_every=1000)
        precision = Precision("fp32", torch.device("cpu"))
        if overflow_first:
            precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
            precision.minimize(popt, 1e6 * F.cross_entropy(m(x), y))  # scaled: inf
            assert popt.counter == 1  # skipped
            precision.scaler = None
        precision.minimize(popt, F.cross_entropy(m(x), y))
        assert popt.counter == 2
        signals.append(m[1].signal.clone())
    assert torch.isfinite(signals[1]).all()
    torch.testing.assert_close(signals[1], signals[0], rtol=1e-5, atol=0.0)


def test_a_scaled_step_does_not_read_the_scale_back_to_the_host(monkeypatch) -> None:
    """``GradScaler.get_scale()`` is an ``.item()`` of the scale (a wait for the GPU in every
    step); ``minimize`` unscales with the scale tensor and tells a skipped step by the
    optimizer's counter instead, so it never calls it."""

    def refuse(self) -> float:
        raise AssertionError("get_scale() read the scale back to the host")

    monkeypatch.setattr(torch.amp.GradScaler, "get_scale", refuse)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 4, (16,))
    model = _masked_conv()
    popt = PruningOptimizer(model, x[:1], lr=0.01, decay=0.0, prune_every=1000)
    precision = Precision("fp32", torch.device("cpu"))
    precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for _ in range(2):
        precision.minimize(popt, F.cross_entropy(model(x), y))
    assert popt.counter == 3


def _bert(masked: bool) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    model = tiny_hf.bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    inputs = tiny_hf.token_inputs()
    if masked:
        fp.apply_masks(model, inputs)
    return model, inputs


@pytest.mark.parametrize(("masked", "any_check"), [(False, True), (True, True), (True, False)])
def test_under_autocast_a_mask_keeps_no_float32_activation_alive(
    masked: bool, any_check: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under bf16 autocast the embeddings' LayerNorm output is float32 and every q, k, v
    layer casts it to bf16 first: without masks the float32 tensor is freed once the forward
    has read it. A collecting mask on those layers' input keeps no reference to it either
    (the product is taken on the cast copy the layers save anyway): the float32 copy alive
    until the backward was 11% of BERT-base's peak memory on an H200. ``any_check`` False:
    as on a torch without ``torch._C._is_any_autocast_enabled``, the device's own check
    alone decides the cast."""
    if not any_check:
        monkeypatch.setattr("fisherprune.masks.points._any_autocast", None)
    model, inputs = _bert(masked)
    seen: list[weakref.ref[torch.Tensor]] = []
    norm = model.embeddings.LayerNorm
    norm.register_forward_hook(lambda _m, _a, out: seen.append(weakref.ref(out)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**inputs).last_hidden_state
    assert seen and seen[0]() is None  # (the reference: the unmasked model frees it)
    out.float().sum().backward()
    if masked:
        fp.update_pruning_signals(fp.find_masks(model), decay=0.0)
        assert all(float(m.signal.sum()) > 0 for m in fp.find_masks(model).values())
