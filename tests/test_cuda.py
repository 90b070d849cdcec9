"""What must hold on a GPU, each test with a CPU twin that always runs.

The ``cuda`` cases carry the ``cuda`` marker (``pytest -m cuda`` runs them alone) and skip where
torch sees no CUDA device; their twins run on the CPU, with ``meta`` standing for a device the
tracer never runs on where structure is checked. On a GPU: groups, mask placement and costs
equal the CPU's, the main job's cost falls, the shrunk model gives the masked model's outputs,
the Fisher signal equals the float64 CPU reference, masks change no activation's dtype under
autocast, and a step that does not prune makes no synchronising call.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.cost import CostModel
from fisherprune.cost.latency import LatencySpec, served
from fisherprune.masks import layer as mask_layer
from fisherprune.train.models import build_model
from tests import tiny_hf
from tests.test_device_independence import structure
from tests.test_signals import DOT_TOLERANCE
from tests.zoo import ARCHS

CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
    ],
)


def _prune_first(masks: dict[str, fp.MaskLayer]) -> None:
    with torch.no_grad():
        for m in masks.values():
            if m.num_channels > 1:
                m.mask[0] = 0.0


@pytest.mark.parametrize("device", ["meta", CUDA])
@pytest.mark.parametrize(
    "name", ["resnet_bottleneck", "densenet", "mobilenetv2", "transformer_sdpa"]
)
def test_structure_equals_the_cpus(name: str, device: str) -> None:
    """Groups, mask points, skips and costs of a model on ``device`` equal those on the CPU."""
    arch = ARCHS[name]
    model, x = arch.build(), arch.example_input(2)
    there = copy.deepcopy(model).to(device)
    assert structure(there, x.to(device)) == structure(model, x)
    masks = fp.apply_masks(model, x)
    _prune_first(masks)
    pruned = CostModel(model, x).entries()
    moved = copy.deepcopy(model).to(device)
    assert CostModel(moved, x.to(device)).total(pruned) == CostModel(model, x).total(pruned)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_main_jobs_cost_falls_to_the_target(device: str) -> None:
    """The quick start's CNN (conv-BN-ReLU stages) trained by ``PruningOptimizer`` towards 50%
    of its FLOPs on ``device``: every mask removes channels (none lands before a batch norm)
    and the cost reaches the target."""
    torch.manual_seed(0)
    model = build_model("cnn", (1, 8, 8), 10).to(device)
    x = torch.randn(64, 1, 8, 8, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "removes no channel", "below what min_channels allows"
        fp.apply_masks(model, x[:1])
        popt = fp.PruningOptimizer(model, x[:1], lr=0.01, prune_every=1, flops_target="50%")
    start = popt.cost().total
    for _ in range(200):
        popt.minimize(F.cross_entropy(model(x), y))
        if popt.finished:
            break
    assert popt.finished and popt.cost().total <= 0.5 * start
    assert all(m.kept >= 1 for m in fp.find_masks(model).values())


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("name", ["resnet_bottleneck", "transformer_sdpa"])
def test_shrunk_model_gives_the_masked_outputs(name: str, device: str) -> None:
    """``shrink`` on ``device`` of a part-pruned model gives the masked model's outputs."""
    arch = ARCHS[name]
    model, x = arch.build().to(device), arch.example_input(4).to(device)
    masks = fp.apply_masks(model, x[:1])
    _prune_first(masks)
    model.eval()
    with torch.no_grad():
        want = model(x)
    small = fp.shrink(model, x[:1])
    assert next(small.parameters()).device.type == device
    with torch.no_grad():
        torch.testing.assert_close(small(x), want, rtol=1e-4, atol=1e-5)


def _signals(model: nn.Module, x: Tensor, y: Tensor, autocast: torch.dtype | None) -> Tensor:
    masks = fp.find_masks(model)
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=autocast or torch.float32, enabled=bool(autocast)):
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    fp.update_pruning_signals(masks, decay=0.0)
    return torch.cat([m.signal.double().cpu() for m in masks.values()])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("name", ["resnet_bottleneck", "transformer_sdpa"])
def test_signal_equals_the_float64_cpu_signal(name: str, device: str) -> None:
    """The float32 signal on ``device`` equals the float64 CPU one (``test_signals`` checks
    that against a per-example loop); under bf16 autocast it is within a few percent."""
    arch = ARCHS[name]
    model, x = arch.build(), arch.example_input(16)
    y = torch.arange(16) % 5
    fp.apply_masks(model, x[:1])
    model.train()
    ref = _signals(copy.deepcopy(model).double(), x.double(), y, None)
    there = copy.deepcopy(model).to(device)
    got = _signals(there, x.to(device), y.to(device), None)
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-9 * float(ref.max()))
    low = _signals(there, x.to(device), y.to(device), torch.bfloat16)
    assert float((low - ref).abs().sum() / ref.abs().sum()) < 0.05


def _dtypes(model: nn.Module, x: Tensor, dtype: torch.dtype) -> list[tuple[str, Any]]:
    """The dtype of every module's output (and of the loss's gradient at the input) in one
    training step under ``dtype`` autocast, by module name; mask holders left out."""
    seen: list[tuple[str, Any]] = []
    handles = [
        mod.register_forward_hook(
            lambda _m, _i, out, name=name: seen.append(
                (name, out.dtype if isinstance(out, Tensor) else None)
            )
        )
        for name, mod in model.named_modules()
        if "fisherprune_masks" not in name
    ]
    try:
        with torch.autocast(x.device.type, dtype=dtype):
            out = model(x)
        out.float().sum().backward()
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("name", ["resnet_bottleneck", "transformer_sdpa"])
def test_masks_keep_every_activations_dtype_under_autocast(name: str, device: str) -> None:
    """Under bf16 autocast every module of the masked model (collecting, and pruned) outputs
    the dtype it outputs without masks: a mask never promotes an activation."""
    arch = ARCHS[name]
    plain, x = arch.build().to(device), arch.example_input(4).to(device)
    plain.train()
    want = _dtypes(plain, x, torch.bfloat16)
    masked = copy.deepcopy(plain)
    masks = fp.apply_masks(masked, x[:1])
    assert _dtypes(masked, x, torch.bfloat16) == want
    _prune_first(masks)
    assert _dtypes(masked, x, torch.bfloat16) == want
    for m in masks.values():
        m.collecting = False
    assert _dtypes(masked, x, torch.bfloat16) == want


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
@pytest.mark.parametrize("name", ["resnet_bottleneck", "transformer_sdpa"])
@pytest.mark.parametrize("precision", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_steps_that_do_not_prune_never_synchronise(
    name: str, precision: torch.dtype, compiled: bool
) -> None:
    """Collecting steps of ``PruningOptimizer`` on CUDA, after the first (with ``compiled``,
    the forward under ``torch.compile`` as ``fisherprune train --compile`` runs it, here
    ``aot_eager``: after the first two), run under ``set_sync_debug_mode("error")`` and
    gather a signal (the CPU twins: ``test_no_host_sync``'s spy, eager and compiled)."""
    arch = ARCHS[name]
    model, x = arch.build().cuda(), arch.example_input(8).cuda()
    y = torch.arange(8, device="cuda") % 5
    fp.apply_masks(model, x[:1])
    popt = fp.PruningOptimizer(model, x[:1], lr=0.01, prune_every=10**6, burn_in=0)
    forward = torch.compile(model, backend="aot_eager") if compiled else model

    def step() -> None:
        with torch.autocast("cuda", dtype=precision, enabled=precision != torch.float32):
            loss = F.cross_entropy(forward(x).float(), y)
        popt.minimize(loss)

    for _ in range(2 if compiled else 1):
        step()  # the first step checks that every mask received a gradient
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(float(m.signal.sum()) > 0 for m in fp.find_masks(model).values())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_per_example_dot_runs_on_cuda(dtype: torch.dtype) -> None:
    """On CUDA the fused per-example dot is taken (not refused) and equals a float64 dot of the
    same inputs, within the rounding of the products to the inputs' precision (``test_signals``
    covers both paths on the CPU, to the same tolerances)."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(8, 16, 32, 32, generator=gen).to("cuda", dtype)
    x = torch.randn(8, 16, 32, 32, generator=gen).relu().to("cuda", dtype)
    got = mask_layer._per_example_channel_dot(g, x, 1)
    assert ("cuda", dtype) not in mask_layer._NO_FUSED
    assert got.dtype == torch.float32
    want = (g.double() * x.double()).sum((2, 3))
    torch.testing.assert_close(got.double(), want, **DOT_TOLERANCE[dtype])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_a_zero_filled_output_is_served_as_a_cuda_graph() -> None:
    """A shrunk base model whose returned width lost channels (zero-filled back by its
    ``OutputFill`` hook) is captured and replayed as a CUDA graph, giving the masked model's
    outputs (the CPU twin: ``test_output_width``'s index copied to a device once)."""
    model = tiny_hf.bert().eval().cuda()
    inputs = tiny_hf.token_inputs(device="cuda")
    masks = fp.apply_masks(model, inputs)
    with torch.no_grad():
        masks["fisherprune_masks.embeddings_word_embeddings:dim1"].mask[::3] = 0.0
        want = model(**inputs).last_hidden_state
    form = served(model, inputs, LatencySpec(device="cuda", form="cuda_graphs"))
    with torch.inference_mode():
        form.run()
    torch.cuda.synchronize()
    got = form.keep[-1].last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
