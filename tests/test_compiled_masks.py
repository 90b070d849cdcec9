"""Masks inside ``torch.compile`` (``fisherprune.masks.compiled``): a compiled step of a
masked model breaks no graph, from the first step, and gives what eager gives. References:
the eager masked model in float64 (its signal is checked against per-example float64 loops
in ``test_signals``), the shrunk model's outputs, and torch's own graph-break counters.

The compiled path's norm (weighted sums over the kept positions) is also checked alone against
the eager one for every norm form.

Compiled with the ``aot_eager`` backend: dynamo and AOTAutograd trace as for any backend,
without generating code (seconds, not minutes, per model)."""

from __future__ import annotations

import copy
import functools
import gc
import inspect
import types
import weakref
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import fisherprune as fp
from fisherprune.masks.blocks import BlockGate
from fisherprune.masks.compiled import _ANCHOR
from fisherprune.masks.norm_points import NormPoint
from fisherprune.norms import _FORMS, norm_spec, normalise_kept, normalise_masked
from tests import tiny_hf
from tests.counted import hf_moe
from tests.zoo import ARCHS

#: zoo networks whose every mask point is served by the compiled path (one mask over each
#: masked dim, rows that are the examples): a CNN with residual sums, a transformer with heads
NETS = ["resnet_bottleneck", "transformer_sdpa"]


def _masked(
    name: str, dtype: torch.dtype = torch.float64, batch: int = 4
) -> tuple[nn.Module, Tensor, Tensor]:
    arch = ARCHS[name]
    model = arch.build().to(dtype)
    x = arch.example_input(batch)
    x = x.to(dtype) if x.is_floating_point() else x
    y = torch.arange(batch) % 5
    fp.apply_masks(model, x[:1])
    return model, x, y


def _signals(model: nn.Module, run: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """One collecting step of ``run`` (the model or its compiled form): the signals it gives
    from zero, with decay 0."""
    masks = fp.find_masks(model)
    for m in masks.values():
        m.reset_statistics()
    model.zero_grad(set_to_none=True)
    F.cross_entropy(run(x).double(), y).backward()
    fp.update_pruning_signals(masks, decay=0.0)
    return {n: m.signal.clone() for n, m in masks.items()}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles afresh and counts its own graph breaks."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


@pytest.mark.parametrize("name", NETS)
def test_a_compiled_collecting_step_breaks_no_graph(name: str) -> None:
    """From the first step, a compiled collecting step is one graph: no break, nothing
    compiled again at the next step."""
    model, x, y = _masked(name)
    run = torch.compile(model, backend="aot_eager")
    for _ in range(2):
        _signals(model, run, x, y)
    assert counters["stats"]["unique_graphs"] == 1
    assert not any(counters["graph_break"]), dict(counters["graph_break"])


@pytest.mark.parametrize("name", NETS)
def test_a_compiled_step_gathers_the_eager_signal(name: str) -> None:
    """The signal of a compiled collecting step, the first one included, equals the eager
    step's on the same batch in float64 (masks part pruned, so the multiplier is not all
    ones)."""
    model, x, y = _masked(name)
    with torch.no_grad():
        for m in fp.find_masks(model).values():
            if m.num_channels > 2:
                m.mask[1] = 0.0
    _two_compiled_steps_gather_the_eager_signal(model, x, y, "aot_eager")


def _two_compiled_steps_gather_the_eager_signal(
    model: nn.Module, x: Tensor, y: Tensor, backend: str
) -> None:
    """A copy of masked ``model`` compiled with ``backend``: its first two collecting steps
    each gather the signal ``model``'s eager step gathers (float64), a non-zero one."""
    twin = copy.deepcopy(model)
    want = _signals(model, model, x, y)
    run = torch.compile(twin, backend=backend)
    for _ in range(2):
        got = _signals(twin, run, x, y)
        assert set(got) == set(want)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-12, msg=n)
            assert float(want[n].abs().sum()) > 0.0


@pytest.mark.parametrize("name", NETS)
def test_a_compiled_pruned_model_gives_the_shrunk_outputs(name: str) -> None:
    """A compiled forward of a part-pruned masked model (not collecting; norms over kept
    channels by weighted sums) equals the shrunk model's, in float64."""
    model, x, _ = _masked(name)
    with torch.no_grad():
        for m in fp.find_masks(model).values():
            m.collecting = False
            if m.num_channels > 2:
                m.mask[: m.num_channels // 2] = 0.0
    model.eval()
    small = fp.shrink(model, x[:1])
    run = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(run(x), small(x), rtol=1e-9, atol=1e-10)
    assert not any(counters["graph_break"]), dict(counters["graph_break"])


def test_a_compiled_collecting_step_keeps_activation_dtypes_under_autocast() -> None:
    """Under bf16 autocast, a compiled collecting step gives each masked module's input in
    the dtype it has without masks (the product is taken in float32 and cast back)."""
    arch = ARCHS["transformer_sdpa"]
    plain, x = arch.build(), arch.example_input(4)
    seen: dict[str, dict[str, torch.dtype]] = {"plain": {}, "masked": {}}

    def spy(tag: str):
        def hook(mod: nn.Module, args: tuple) -> None:
            seen[tag][mod._fp_name] = args[0].dtype  # type: ignore[attr-defined]

        return hook

    masked = copy.deepcopy(plain)
    fp.apply_masks(masked, x[:1])
    for tag, model in (("plain", plain), ("masked", masked)):
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear):
                mod._fp_name = name  # type: ignore[attr-defined]
                mod.register_forward_pre_hook(spy(tag))
        run = torch.compile(model, backend="aot_eager")
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = run(x)
            F.cross_entropy(out.float(), torch.arange(4) % 5).backward()
            if tag == "masked":
                fp.update_pruning_signals(fp.find_masks(model), decay=0.0)
    assert seen["masked"] == seen["plain"] and seen["plain"]


def test_points_the_compiled_path_does_not_serve_still_gather_the_eager_signal() -> None:
    """DenseNet's concatenations put several masks on one dim: those points take the eager
    path inside the compiled model (breaking its graph there) and the signal is still the
    eager one, from the first step."""
    model, x, y = _masked("densenet")
    twin = copy.deepcopy(model)
    want = _signals(model, model, x, y)
    run = torch.compile(twin, backend="aot_eager")
    got = _signals(twin, run, x, y)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-12, msg=n)


class _RMS(nn.Module):
    """An RMS norm of someone else's writing (the forms ``detect_norms`` matches)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, dtype=torch.float64))
        self.eps = 1e-6


@pytest.mark.parametrize("form", range(len(_FORMS)))
def test_weighted_statistics_give_the_kept_channels_norm(form: int) -> None:
    """``normalise_masked`` (the compiled path's norm: sums weighted by the kept positions)
    equals ``normalise_kept`` (the eager one, over the gathered kept positions), for each
    form a norm is matched against, in float64 (float32 where the form computes in it)."""
    gen = torch.Generator().manual_seed(form)
    spec = replace(_FORMS[form], eps="eps")
    module: nn.Module = _RMS(8) if spec.kind == "rms" else nn.LayerNorm(8, eps=1e-6).double()
    if spec.kind == "layer":
        nn.init.normal_(module.weight)
        nn.init.normal_(module.bias)
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=gen)
    keep = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    want = normalise_kept(module, spec, x, -1, keep.nonzero().flatten())
    tol = 1e-6 if spec.dtype == torch.float32 else 1e-12
    torch.testing.assert_close(
        normalise_masked(module, spec, x, -1, keep), want, rtol=tol, atol=tol
    )


def test_weighted_statistics_over_two_normalised_dims() -> None:
    """A ``LayerNorm`` over the last two dims, its first one masked: the same equality."""
    module = nn.LayerNorm((5, 8)).double()
    nn.init.normal_(module.weight)
    nn.init.normal_(module.bias)
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    keep = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    spec = norm_spec(module)
    want = normalise_kept(module, spec, x, 1, keep.nonzero().flatten())
    torch.testing.assert_close(
        normalise_masked(module, spec, x, 1, keep), want, rtol=1e-12, atol=1e-12
    )


def _hf(name: str) -> tuple[nn.Module, dict[str, Tensor]]:
    if name == "bert":  # (no dropout: eager and compiled draw different masks)
        model = tiny_hf.bert(
            "BertForSequenceClassification",
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    else:
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(
            vocab_size=100, num_key_value_heads=2, pad_token_id=0, num_labels=3, **tiny_hf.SIZE
        )
        model = transformers.LlamaForSequenceClassification(cfg)
    return model.double(), tiny_hf.token_inputs(batch=4)


@pytest.mark.parametrize("blocks", [False, True], ids=["channels", "channels+blocks"])
@pytest.mark.parametrize("name", ["bert", "llama"])
def test_hugging_face_models_compile_with_their_masks_whole(name: str, blocks: bool) -> None:
    """BERT and Llama (GQA, RMS norms) as Hugging Face builds them from a config: compiled
    with every mask (and a gate on their blocks), part pruned, a collecting step is one graph
    and gathers the eager signal from the first step (Llama's norm computes in float32, as its
    own code does: to that precision). The block gate's signal went through the eager gather,
    whose Python backward broke the graph at every block (9 graphs for BERT's 2)."""
    model, inputs = _hf(name)
    y = torch.arange(4) % 3
    masks = fp.apply_masks(model, {k: v[:1] for k, v in inputs.items()}, blocks=blocks)
    with torch.no_grad():
        for m in masks.values():
            if m.num_channels > 2:
                m.mask[1] = 0.0
    twin = copy.deepcopy(model)

    def step(run: nn.Module, owner: nn.Module) -> dict[str, Tensor]:
        return _signals(owner, lambda _x: run(**inputs).logits, inputs, y)

    want = step(model, model)
    run = torch.compile(twin, backend="aot_eager")
    got = step(run, twin)
    assert not any(counters["graph_break"]), dict(counters["graph_break"])
    tol = 1e-9 if name == "bert" else 1e-4
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=tol, atol=1e-12, msg=n)
    gates = [n for n, m in masks.items() if isinstance(m, BlockGate)]
    assert len(gates) == blocks and all(float(want[n].min()) > 0.0 for n in gates)


def test_a_mask_layer_called_as_a_module_compiles_whole() -> None:
    """The seed's form, a ``MaskLayer`` placed in the network by hand: compiled, a collecting
    step is one graph and gathers the eager signal from the first step; a deep copy, compiled,
    gathers into itself and not into the original."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), fp.MaskLayer(8), nn.ReLU(), nn.Flatten(), nn.Linear(512, 5)
    ).double()
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = torch.arange(4) % 5
    with torch.no_grad():
        model[1].mask[2] = 0.0
    twin = copy.deepcopy(model)
    want = _signals(model, model, x, y)
    run = torch.compile(twin, backend="aot_eager")
    got = _signals(twin, run, x, y)
    assert not any(counters["graph_break"]), dict(counters["graph_break"])
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-12, msg=n)
    third = copy.deepcopy(twin)
    F.cross_entropy(torch.compile(third, backend="aot_eager")(x), y).backward()
    assert third[1].received and not twin[1].received


def test_gradient_accumulation_traces_no_graph_per_micro_batch() -> None:
    """Four micro-batches (forward and backward each) per signal update, compiled: the graph
    is traced once, and never again per micro-batch (each would be a guard on the gathered
    passes, and past torch's limit of traces the model would run eager); each micro-batch's
    gradients are squared apart, as eager's, in float64, from the first update."""
    model, x, y = _masked("transformer_sdpa", batch=8)
    with torch.no_grad():
        for m in fp.find_masks(model).values():
            if m.num_channels > 2:
                m.mask[1] = 0.0
    twin = copy.deepcopy(model)

    def step(owner: nn.Module, run: nn.Module) -> dict[str, Tensor]:
        masks = fp.find_masks(owner)
        for i in range(0, 8, 2):
            F.cross_entropy(run(x[i : i + 2]).double(), y[i : i + 2]).backward()
        fp.update_pruning_signals(masks, decay=0.0)
        return {n: m.signal.clone() for n, m in masks.items()}

    want = step(model, model)
    run = torch.compile(twin, backend="aot_eager")
    for _ in range(2):
        got = step(twin, run)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-12, msg=n)
    assert counters["stats"]["unique_graphs"] == 1


class _Block(nn.Module):
    """A pre-norm MLP block whose residual width is masked by a mask every block shares."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = (
            nn.LayerNorm(width),
            nn.Linear(width, 32),
            nn.Linear(32, width),
        )

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class _CheckpointedNet(nn.Module):
    """Two blocks, each run under ``torch.utils.checkpoint`` by the model's own code."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 5)
        self.blocks = nn.ModuleList([_Block(16) for _ in range(2)])

    def forward(self, x: Tensor, checkpointed: bool = True) -> Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=self.reentrant) if checkpointed else b(h)
        return self.out(h.mean(1))


@pytest.mark.parametrize("reentrant", [False, True])
def test_blocks_the_model_checkpoints_itself_gather_the_plain_signal(reentrant: bool) -> None:
    """Blocks the model's own code checkpoints, the model compiled (its checkpointed blocks
    then run eager: the masks' effects are more than a checkpoint region may have): the signal
    of the mask every block shares equals that of the model run without checkpoints, in
    float64 (a block recomputed in the backward had closed the pass in its middle)."""
    torch.manual_seed(0)
    model = _CheckpointedNet(reentrant).double()
    x = torch.randn(4, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y = torch.arange(4) % 5
    fp.apply_masks(model, (x[:1], False))
    with torch.no_grad():
        for m in fp.find_masks(model).values():
            m.mask[1] = 0.0
    twin = copy.deepcopy(model)
    want = _signals(model, lambda v: model(v, False), x, y)
    run = torch.compile(twin, backend="aot_eager")
    got = _signals(twin, run, x, y)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-12, msg=n)
        assert float(want[n].abs().sum()) > 0.0


def test_a_compiled_model_under_the_pruning_optimizer_prunes_as_eager() -> None:
    """``PruningOptimizer`` training a compiled model (decay 0, pruning from the second step):
    it prunes the channels the eager twin prunes, step for step, so the compiled graph reads
    each prune's mask values; then the compiled outputs equal the shrunk model's, in
    float64."""
    model, x, y = _masked("transformer_sdpa", batch=8)
    twin = copy.deepcopy(model)
    run = torch.compile(twin, backend="aot_eager")
    opts = [
        fp.PruningOptimizer(m, x[:1], lr=0.05, prune_every=1, burn_in=1, decay=0.0)
        for m in (model, twin)
    ]
    for i in range(6):
        xb, yb = x[i % 2 * 4 : i % 2 * 4 + 4], y[i % 2 * 4 : i % 2 * 4 + 4]
        opts[0].minimize(F.cross_entropy(model(xb), yb))
        opts[1].minimize(F.cross_entropy(run(xb), yb))
    eager, compiled = ([(e.step, e.removed) for e in o.history] for o in opts)
    assert len(eager) == 5 and compiled == eager
    twin.eval()
    with torch.no_grad():
        torch.testing.assert_close(run(x), fp.shrink(twin, x[:1])(x), rtol=1e-9, atol=1e-10)


def _part_pruned(name: str, batch: int = 4) -> tuple[nn.Module, nn.Module, Tensor, Tensor]:
    """A zoo network with masks, one entry of each wider mask pruned, and its deep copy."""
    model, x, y = _masked(name, batch=batch)
    with torch.no_grad():
        for m in fp.find_masks(model).values():
            if m.num_channels > 2:
                m.mask[1] = 0.0
    return model, copy.deepcopy(model), x, y


@pytest.mark.parametrize("how", ["mark_dynamic", "dynamic=True"])
def test_a_dynamic_batch_gathers_the_eager_signal_at_every_size(how: str) -> None:
    """Compiled with a dynamic batch dim (``mark_dynamic`` on the input, or ``dynamic=True``),
    collecting steps at batch sizes 4, 6 and 3 each gather the eager signal in float64, with
    one graph for all of them and no break."""
    model, twin, x, y = _part_pruned("transformer_sdpa", batch=6)
    run = torch.compile(twin, backend="aot_eager", dynamic=True if how == "dynamic=True" else None)
    for n in (4, 6, 3):
        xb, yb = x[:n].clone(), y[:n]
        if how == "mark_dynamic":
            torch._dynamo.mark_dynamic(xb, 0)
        want, got = _signals(model, model, xb, yb), _signals(twin, run, xb, yb)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12, msg=f"{n} {k}")
    assert counters["stats"]["unique_graphs"] == 1
    assert not any(counters["graph_break"]), dict(counters["graph_break"])


def test_a_backward_asking_for_the_parameters_only_gathers_the_eager_signal() -> None:
    """``torch.autograd.grad(loss, params)`` (no ``.grad`` written), compiled, gathers the
    signal the same call gathers eager, in float64, from the first step."""
    model, twin, x, y = _part_pruned("resnet_bottleneck")

    def step(owner: nn.Module, run: nn.Module) -> dict[str, Tensor]:
        masks = fp.find_masks(owner)
        params = [p for p in owner.parameters() if p.requires_grad]
        torch.autograd.grad(F.cross_entropy(run(x), y), params)
        fp.update_pruning_signals(masks, decay=0.0)
        return {n: m.signal.clone() for n, m in masks.items()}

    want = step(model, model)
    got = step(twin, torch.compile(twin, backend="aot_eager"))
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-12, msg=n)
        assert float(want[n].abs().sum()) > 0.0


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 5)
    ).double()


def test_inductor_gathers_the_eager_signal() -> None:
    """Compiled by inductor (generated code, whose buffers are reused once read), two
    collecting steps each gather the eager signal in float64."""
    model = _mlp()
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    y = torch.arange(4) % 5
    masks = fp.apply_masks(model, x[:1])
    with torch.no_grad():
        for m in masks.values():
            m.mask[1] = 0.0
    _two_compiled_steps_gather_the_eager_signal(model, x, y, "inductor")


def test_a_mask_after_frozen_layers_gathers_the_eager_signal_in_one_graph() -> None:
    """A mask whose input requires no grad (the layers before it frozen, as a fine-tune with
    frozen embeddings has) gathers the eager signal in float64, compiled whole (it broke the
    graph there)."""
    model = _mlp()
    model[0].requires_grad_(False)
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    y = torch.arange(4) % 5
    fp.apply_masks(model, x[:1])
    torch._dynamo.reset()
    counters.clear()
    _two_compiled_steps_gather_the_eager_signal(model, x, y, "aot_eager")
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
    assert _ANCHOR.grad is None


def test_a_dropped_compiled_model_is_freed() -> None:
    """A masked model dropped after a compiled collecting step, its signals never folded, is
    freed, masks and mask points too: nothing of the compiled path holds them."""
    model, x, y = _masked("transformer_sdpa")
    run = torch.compile(model, backend="aot_eager")
    F.cross_entropy(run(x), y).backward()
    holder = fp.masks.points.find_holder(model)
    assert holder is not None
    refs = [weakref.ref(o) for o in (model, *holder[1].values(), *holder[1].points)]
    del model, run, holder
    torch._dynamo.reset()
    gc.collect()
    assert all(r() is None for r in refs)


def test_the_backward_that_hands_the_signal_over_is_never_a_cuda_graph() -> None:
    """The compiled backward of a collecting step calls ``fisherprune::hand_over``, which a
    CUDA graph's replay would skip: torch's CUDA-graph modes (``mode="reduce-overhead"``, the
    ``cudagraphs`` backend) find it unsafe to capture and run that graph uncaptured."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    graphs: dict[str, torch.fx.GraphModule] = {}

    def keep(name: str):
        def compiler(gm: torch.fx.GraphModule, _inputs: list) -> torch.fx.GraphModule:
            graphs[name] = gm
            return gm

        return compiler

    model = _mlp()
    x = torch.randn(4, 6, dtype=torch.float64)
    fp.apply_masks(model, x[:1])
    run = torch.compile(model, backend=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")))
    F.cross_entropy(run(x), torch.arange(4) % 5).backward()
    assert get_first_incompatible_cudagraph_node(graphs["fw"]) is None
    node = get_first_incompatible_cudagraph_node(graphs["bw"])
    assert node is not None and node.target is torch.ops.fisherprune.hand_over.default


class _Float32Reader(nn.Module):
    """fc2 reads a float32 input under autocast (as q, k and v read a LayerNorm's output on a
    GPU), which autocast casts to its lower precision first thing."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.relu(self.fc1(x)).float())


def test_a_compiled_mask_on_a_float32_input_under_autocast_gathers_the_eager_signal() -> None:
    """Under bf16 autocast, a mask on a Linear's float32 input takes the input in the dtype the
    layer casts it to before the product, compiled as in eager: the signals are equal (with the
    float32 input the dot differed by about 3e-3 relative, and kept the float32 copy alive)."""
    torch.manual_seed(0)
    model = _Float32Reader()
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    y = torch.arange(8) % 5
    fp.apply_masks(model, x[:1])
    twin = copy.deepcopy(model)

    def signals(m: nn.Module, run: Any) -> dict[str, Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(x)
        F.cross_entropy(out.float(), y).backward()
        masks = fp.find_masks(m)
        fp.update_pruning_signals(masks, decay=0.0)
        return {n: k.signal.clone() for n, k in masks.items()}

    want = signals(model, model)
    got = signals(twin, torch.compile(twin, backend="aot_eager"))
    assert want and all(float(v.abs().sum()) > 0 for v in want.values())
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("name", NETS)
@pytest.mark.parametrize("first", ["an unmasked twin", "the model itself"])
def test_a_graph_compiled_without_masks_is_not_reused_for_the_masked_model(
    name: str, first: str
) -> None:
    """A graph compiled for the model's class without masks (an unmasked instance, or the
    model itself before ``apply_masks``) is not run for the masked model: dynamo does not
    guard the hooks, so without the instance ``forward`` marks the masked model ran the
    unmasked graph, its pruned channels kept and no signal gathered. The reference is the
    eager masked model, one entry of each wider mask pruned."""
    arch = ARCHS[name]
    torch.manual_seed(0)
    model = arch.build().double()
    x = arch.example_input(4)
    x = x.double() if x.is_floating_point() else x
    y = torch.arange(4) % 5
    plain = copy.deepcopy(model) if first == "an unmasked twin" else model
    plain_run = torch.compile(plain, backend="aot_eager")
    plain_out = plain_run(x).detach()
    fp.apply_masks(model, x[:1])
    with torch.no_grad():
        for m in fp.find_masks(model).values():
            if m.num_channels > 2:
                m.mask[1] = 0.0
    twin = copy.deepcopy(model)
    want, want_signal = twin(x), _signals(twin, twin, x, y)
    run = plain_run if first == "the model itself" else torch.compile(model, backend="aot_eager")
    got = run(x)
    assert not torch.allclose(got, plain_out)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    got_signal = _signals(model, run, x, y)
    for n in want_signal:
        torch.testing.assert_close(got_signal[n], want_signal[n], rtol=1e-9, atol=1e-12, msg=n)


def test_removing_the_masks_of_a_compiled_model_gives_its_unmasked_outputs_and_modules() -> None:
    """``remove_masks`` after compiled calls leaves no instance ``forward`` behind, and the
    compiled model then gives the unmasked model's outputs again."""
    arch = ARCHS["resnet_bottleneck"]
    torch.manual_seed(0)
    model = arch.build().double()
    x = arch.example_input(4).double()
    plain = copy.deepcopy(model)
    fp.apply_masks(model, x[:1])
    with torch.no_grad():
        for m in fp.find_masks(model).values():
            m.mask[0] = 0.0
    run = torch.compile(model, backend="aot_eager")
    assert not torch.allclose(run(x), plain(x))
    fp.remove_masks(model)
    assert not [n for n, m in model.named_modules() if "forward" in m.__dict__]
    torch.testing.assert_close(run(x), plain(x), rtol=1e-9, atol=1e-12)


def test_a_hugging_face_resnet_compiled_after_its_unmasked_twin_gives_the_masked_outputs() -> None:
    """Hugging Face's ResNet from a config (its masks sit on convs and batch norms, no norm
    point): compiled after an unmasked copy was, the masked model gives the eager masked
    outputs, not the copy's (it gave the copy's before the marks)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="bottleneck"
    )
    model = transformers.ResNetForImageClassification(cfg).eval().double()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    plain = torch.compile(copy.deepcopy(model), backend="aot_eager")(pixel_values=x).logits
    fp.apply_masks(model, {"pixel_values": x[:1]})
    with torch.no_grad():
        for m in fp.find_masks(model).values():
            m.mask[:2] = 0.0
    want = model(pixel_values=x).logits
    got = torch.compile(model, backend="aot_eager")(pixel_values=x).logits
    assert not torch.allclose(want, plain)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


class _Attention(nn.Module):
    """``nn.MultiheadAttention`` (its heads masked through its registered module forward,
    not through pre-hooks: it calls its ``out_proj`` weights, not the module) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        y, _ = self.mha(x, x, x, need_weights=False)
        return self.head(y.mean(1))


def _hooked_nets() -> dict[str, tuple[nn.Module, Any, dict[str, Any]]]:
    nets: dict[str, tuple[nn.Module, Any, dict[str, Any]]] = {
        name: (arch.build(), arch.example_input(1), {}) for name, arch in ARCHS.items()
    }
    nets["multihead_attention"] = (_Attention(), torch.randn(1, 5, 16), {})
    nets["hf_bert_block_gates"] = (tiny_hf.bert(), tiny_hf.token_inputs(1), {"blocks": True})
    return nets


def test_every_module_apply_masks_hooks_is_seen_by_the_compilers_guards() -> None:
    """After ``apply_masks``, every submodule that carries a forward hook or pre-hook has an
    instance ``forward`` (what a compiled graph's guards check: they skip hooks), on each zoo
    network, on ``nn.MultiheadAttention`` and on a Hugging Face BERT with block gates;
    ``remove_masks`` leaves none."""
    for name, (model, x, options) in _hooked_nets().items():
        fp.apply_masks(model, x, **options)
        hooked = [
            n for n, m in model.named_modules() if n and (m._forward_pre_hooks or m._forward_hooks)
        ]
        assert hooked, name
        assert [n for n in hooked if "forward" not in model.get_submodule(n).__dict__] == [], name
        fp.remove_masks(model)
        assert not [n for n, m in model.named_modules() if "forward" in m.__dict__], name


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.relu(self.a(x)))


def test_a_forward_another_tool_bound_on_both_twins_does_not_hide_the_masks() -> None:
    """Both twins' layers carry a ``forward`` another tool bound to them (the class's, as a
    method) before the masks: compiled after its unmasked twin, the masked model still gives
    the eager masked outputs (dynamo checks only the function behind a bound method, so the
    mark must not be one)."""
    torch.manual_seed(0)
    plain = _Two().double()
    model = copy.deepcopy(plain)
    x = torch.randn(3, 4, dtype=torch.float64)
    for net in (plain, model):
        for layer in (net.a, net.b):
            layer.forward = types.MethodType(nn.Linear.forward, layer)
    torch.compile(plain, backend="aot_eager")(x)
    fp.apply_masks(model, x[:1])
    with torch.no_grad():
        for m in fp.find_masks(model).values():
            m.mask[:3] = 0.0
    got = torch.compile(model, backend="aot_eager")(x)
    torch.testing.assert_close(got, model(x), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, plain(x))


def test_a_patch_of_the_class_forward_after_the_masks_is_run() -> None:
    """A class's ``forward`` patched after ``apply_masks`` (as kernel libraries patch Hugging
    Face classes) runs in the masked model, eager and compiled: the marks look it up at each
    call instead of keeping the one there was."""

    class Scaled(nn.Linear):
        pass

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Scaled(4, 8), nn.Linear(8, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(3, 4)
    fp.apply_masks(model, x[:1])
    before = model(x)
    Scaled.forward = lambda self, inp: 2 * nn.Linear.forward(self, inp)  # type: ignore[method-assign]
    want = model.b(torch.relu(2 * nn.Linear.forward(model.a, x)))
    torch.testing.assert_close(model(x), want)
    torch.testing.assert_close(torch.compile(model, backend="aot_eager")(x), want)
    assert not torch.allclose(want, before)


def test_a_block_gate_written_before_the_first_compiled_call_removes_its_block() -> None:
    """Hugging Face BERT with block gates: an entry written off before anything read the gate,
    then the model compiled, gives the eager outputs without that block; another entry written
    off after the compiled call is seen by the next one (the graph selects by the gate's value,
    not by a host copy read when it was traced)."""
    model = tiny_hf.bert().eval()
    x = tiny_hf.token_inputs(2)
    fp.apply_masks(model, tiny_hf.token_inputs(1), blocks=True)
    gate = fp.find_masks(model)["fisherprune_masks.blocks"]
    run = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        dense = model(**x).last_hidden_state
        gate.mask[0] = 0.0
        got = run(**x).last_hidden_state
        torch.testing.assert_close(got, model(**x).last_hidden_state, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got, dense, atol=1e-3)
        gate.mask[1] = 0.0
        torch.testing.assert_close(run(**x).last_hidden_state, _embeddings(model, x))


def _embeddings(model: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    """What a BERT with every block removed returns: its embeddings."""
    return model.embeddings(input_ids=inputs["input_ids"])


def test_the_marks_keep_every_forwards_signature_as_hugging_face_reads_it() -> None:
    """``inspect.signature(module.forward)`` of the model and of every module is what it was
    before ``apply_masks`` (Hugging Face's ``Trainer`` and ``generate`` pick a model's inputs
    from it), and a masked Llama generates the tokens the same model without masks does."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=100, num_key_value_heads=2, pad_token_id=0, **tiny_hf.SIZE
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = tiny_hf.token_inputs(1)
    before = {n: inspect.signature(m.forward) for n, m in model.named_modules()}
    want = model.generate(**ids, max_new_tokens=4, do_sample=False)
    fp.apply_masks(model, ids)
    after = {n: inspect.signature(m.forward) for n, m in model.named_modules() if n in before}
    assert after == before
    got = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


def test_a_masked_model_exports_with_torch_export_and_its_marks_are_bound_methods() -> None:
    """``torch.export.export`` of a masked model (it reads ``forward.__code__``) gives the
    masked outputs, and every mark is a method bound to its own module (what tools that rebind
    a copy's methods, as Accelerate's ``compile_regions`` does, expect)."""
    arch = ARCHS["resnet_basic"]
    torch.manual_seed(0)
    model = arch.build().eval()
    x = arch.example_input(2)
    fp.apply_masks(model, x[:1])
    with torch.no_grad():
        for m in fp.find_masks(model).values():
            m.mask[0] = 0.0
    marks = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m.__dict__.get("forward"), types.MethodType)
    ]
    assert marks and all(m.forward.__self__ is m for _, m in marks)
    exported = torch.export.export(model, (x,), strict=False)
    torch.testing.assert_close(exported.module()(x), model(x))


def _call(wrapped: Any, *args: Any, **kwargs: Any) -> Any:
    return wrapped(*args, **kwargs)


def test_a_norm_wrapped_by_another_tool_after_the_masks_is_unmasked_by_remove_masks() -> None:
    """Another tool wraps every module's ``forward`` after ``apply_masks`` and keeps what it
    wrapped (as Accelerate's hooks keep ``_old_forward``): after ``remove_masks`` the model
    gives the unmasked model's outputs, its norms normalising every channel again."""
    arch = ARCHS["transformer"]
    torch.manual_seed(0)
    model = arch.build().double().eval()
    x = arch.example_input(2)
    x = x.double() if x.is_floating_point() else x
    dense = model(x)
    fp.apply_masks(model, x[:1])
    with torch.no_grad():
        for m in fp.find_masks(model).values():
            m.mask[0] = 0.0
    for m in model.modules():
        m.forward = functools.partial(_call, m.forward)
    assert any(isinstance(m.forward.args[0], NormPoint) for m in model.modules())
    assert not torch.allclose(model(x), dense)
    fp.remove_masks(model)
    torch.testing.assert_close(model(x), dense)


@pytest.mark.parametrize("experts", [False, True], ids=["channels", "channels+experts"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_a_masked_moe_decoder_not_collecting_compiles_whole_to_the_eager_outputs(
    kind: str, experts: bool
) -> None:
    """Qwen3-MoE and Mixtral from their configs, part pruned (and one expert removed), masks
    not collecting (fine-tuning, evaluation): the compiled forward is one graph and gives the
    eager masked logits. The experts' inputs are tokens chosen by the router, which the
    compiled product serves when nothing is gathered; the removed expert's logit is masked from
    the gate's values (no host read: each read broke the graph, 27 to 30 graphs before)."""
    model, inputs = hf_moe(kind, "batched_mm")
    masks = fp.apply_masks(model, inputs, experts=experts)
    with torch.no_grad():
        for m in masks.values():
            m.collecting = False
            m.mask[0] = 0.0
        want = model(**inputs).logits
        got = torch.compile(model, backend="aot_eager")(**inputs).logits
    # (their RMS norms compute in float32, as Hugging Face's code does: to that precision)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not any(counters["graph_break"]), dict(counters["graph_break"])
