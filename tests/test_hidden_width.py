"""The hidden width (the residual stream of a transformer) as one prunable group: removing
hidden channel c removes it from every layer that writes the stream (embeddings, attention
output projections, MLP down projections), every layer that reads it (q/k/v and MLP input
projections, the head) and every norm's weight and bias, and a masked norm normalises over
the kept channels only. References: the masked model's own outputs in float64 (the shrunk
model must equal them, in eval and in train mode), ``FlopCounterMode`` on the shrunk model,
and a per-example float64 loop for the Fisher signal."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
import zoo
from test_heads import GQAttention
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import fisherprune as fp
from fisherprune.cost.formulas import SAME_AS_TORCH
from tests.counted import assert_exact

ATOL_F64 = 1e-10
VOCAB, D = 11, 24


class RMSNorm(nn.Module):
    """x / rms(x) * w, written by hand as LLaMA writes it, with its epsilon in ``eps``."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TinyLlama(nn.Module):
    """Token embedding, one LLaMA block (RMSNorm, grouped-query attention with rotary
    embeddings, RMSNorm, gated MLP), a final RMSNorm and an LM head: (N, L) ids -> logits."""

    def __init__(self, norm: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D)
        self.input_layernorm = norm(D)
        self.self_attn = GQAttention(D)
        self.post_attention_layernorm = norm(D)
        self.gate_proj, self.up_proj = nn.Linear(D, 20, bias=False), nn.Linear(D, 20, bias=False)
        self.down_proj = nn.Linear(20, D, bias=False)
        self.norm = norm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed_tokens(ids)
        x = x + self.self_attn(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return self.lm_head(self.norm(x))


@pytest.fixture(autouse=True, scope="module")
def _rmsnorm_registered() -> Iterator[None]:
    """The hand-written RMSNorm registered as a user would, for this module's tests."""
    fp.register_norm(RMSNorm, kind="rms", eps="eps")
    yield
    fp.unregister_norm(RMSNorm)


def _llama() -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(1))
    return TinyLlama().double().eval(), ids


def _transformer() -> tuple[nn.Module, Tensor]:
    model = zoo.ARCHS["transformer"].build(None, 0).double().eval()
    return model, zoo.ARCHS["transformer"].example_input(3).double()


# name -> (build, width producer, its readers, its norms)
MODELS: dict[str, tuple[Callable[[], tuple[nn.Module, Tensor]], str, list[str], list[str]]] = {
    "transformer": (
        _transformer,
        "embed",
        ["attn.q", "attn.k", "attn.v", "mlp.fc1", "head"],
        ["ln1", "ln2", "ln_f"],
    ),
    "llama": (
        _llama,
        "embed_tokens",
        [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "gate_proj",
            "up_proj",
            "lm_head",
        ],
        ["input_layernorm", "post_attention_layernorm", "norm"],
    ),
}
each_model = pytest.mark.parametrize("name", list(MODELS))


def _width(masks: fp.AppliedMasks, producer: str) -> str:
    [name] = [n for n, g in masks.groups.items() if g.producers[0] == producer]
    return name


def _prune_thirds(masks: fp.AppliedMasks, seed: int) -> None:
    """Zero a random third of every mask (at least one kept)."""
    g = torch.Generator().manual_seed(seed)
    for m in masks.values():
        m.mask[torch.randperm(m.num_channels, generator=g)[: m.num_channels // 3]] = 0.0


def _out(model: nn.Module, x: Tensor | dict) -> Tensor:
    with torch.no_grad():
        out = model(**x) if isinstance(x, dict) else model(x)
    return out if isinstance(out, Tensor) else out.logits


def _flops(model: nn.Module, x: Tensor | dict) -> float:
    counter = FlopCounterMode(display=False, custom_mapping=dict(SAME_AS_TORCH))
    with counter:
        _out(model, x)
    n = next(iter(x.values())).shape[0] if isinstance(x, dict) else x.shape[0]
    return counter.get_total_flops() / n


@each_model
def test_width_is_one_group_read_by_every_reader_and_normalised_by_every_norm(name: str) -> None:
    """One group holds the hidden width: it is read (masked) at every layer reading the
    stream, its norms are recorded as normalising it, and its parameter dims include every
    norm's weight and the embedding's columns."""
    build, producer, readers, norms = MODELS[name]
    model, x = build()
    masks = fp.apply_masks(model, x[:1])
    g = masks.groups[_width(masks, producer)]
    assert g.num_channels == (zoo.DEFAULT_WIDTHS["transformer"]["d"] if name != "llama" else D)
    assert sorted(g.consumers) == sorted(readers)
    assert sorted(g.norms) == sorted(norms)
    dims = set(g.params)
    assert {(f"{n}.weight", 0) for n in norms} <= dims
    assert (f"{producer}.weight", 1 if name == "llama" else 0) in dims


@each_model
def test_all_ones_masks_leave_outputs_bit_identical(name: str) -> None:
    """Masks that prune nothing change nothing, bit for bit (the norm hooks pass through)."""
    build = MODELS[name][0]
    model, x = build()
    before = _out(model, x)
    fp.apply_masks(model, x[:1])
    assert torch.equal(_out(model, x), before)


@each_model
def test_remove_masks_removes_the_norm_hooks(name: str) -> None:
    """With the width pruned, remove_masks leaves the model giving its original outputs again,
    bit for bit: the norms' hooks are gone with the masks."""
    build = MODELS[name][0]
    model, x = build()
    before = _out(model, x)
    _prune_thirds(fp.apply_masks(model, x[:1]), 3)
    assert not torch.equal(_out(model, x), before)
    fp.remove_masks(model)
    assert torch.equal(_out(model, x), before)
    assert not any(m._forward_hooks for m in model.modules())


@each_model
@pytest.mark.parametrize("train", [False, True])
def test_shrunk_equals_masked(name: str, train: bool) -> None:
    """With a random third of every group pruned, the shrunk model gives the masked model's
    outputs (float64), in eval and in train mode (no dropout here): the masked norms
    normalise over the kept channels exactly as the shrunk norms do."""
    build, producer, _, norms = MODELS[name]
    model, x = build()
    masks = fp.apply_masks(model, x[:1])
    _prune_thirds(masks, 0)
    small = fp.shrink(model, x[:1])
    kept = int(masks[_width(masks, producer)].mask.sum())
    for n in norms:
        assert small.get_submodule(n).weight.shape == (kept,)
    model.train(train)
    small.train(train)
    torch.testing.assert_close(_out(small, x), _out(model, x), rtol=0, atol=ATOL_F64)


@each_model
def test_cost_equals_flop_counter_on_the_shrunk_model(name: str) -> None:
    """The cost model's FLOPs of the pruned model, per example, equal FlopCounterMode's on
    the shrunk model."""
    build = MODELS[name][0]
    model, x = build()
    masks = fp.apply_masks(model, x[:1])
    _prune_thirds(masks, 1)
    cm = fp.CostModel(model, x[:1])
    small = fp.shrink(model, x[:1])
    assert cm.total(cm.entries()) == pytest.approx(_flops(small, x[:1]), rel=1e-12)


def _loss(name: str, out: Tensor, i: int) -> Tensor:
    """Example ``i``'s loss: a fixed class per example (transformer) or per token (llama)."""
    if name == "llama":
        target = torch.arange(out.shape[1]).add(i) % VOCAB
        return F.cross_entropy(out[0], target)
    return F.cross_entropy(out, torch.tensor([i % 3]))


def _batch_loss(name: str, out: Tensor) -> Tensor:
    """The mean of the examples' losses (``_loss``) over the batch."""
    return sum(_loss(name, out[i : i + 1], i) for i in range(out.shape[0])) / out.shape[0]


@each_model
def test_width_fisher_signal_equals_a_per_example_loop(name: str) -> None:
    """The width mask's signal is 1/2 mean_n g_n^2, g_n the derivative of example n's loss
    w.r.t. one multiplier per hidden channel applied at the input of every layer reading
    the stream (float64 loop, one example at a time)."""
    build, producer, readers, _ = MODELS[name]
    model, x = build()
    masks = fp.apply_masks(model, x[:1])
    model.double()
    width = _width(masks, producer)
    _batch_loss(name, model(x)).backward()
    fp.update_pruning_signals(masks, decay=0)
    ref, _ = build()
    m = torch.ones(masks[width].num_channels, dtype=torch.float64, requires_grad=True)
    for r in readers:
        ref.get_submodule(r).register_forward_pre_hook(lambda _m, a: (a[0] * m,))
    want = torch.zeros_like(m)
    for i in range(3):
        (g,) = torch.autograd.grad(_loss(name, ref(x[i : i + 1]), i), [m])
        want += 0.5 * g * g / 3
    assert float(want.abs().max()) > 0
    torch.testing.assert_close(masks[width].signal, want.detach(), rtol=1e-9, atol=1e-15)


def test_an_unregistered_norm_blocks_the_width_and_says_how_to_register_it() -> None:
    """A norm class that is not registered and computes none of the forms ``detect_norms``
    recognises (here: scaling by the mean magnitude) leaves the width unprunable, for a
    reason that names the class and ``register_norm``."""

    class OtherRMSNorm(RMSNorm):
        def forward(self, x: Tensor) -> Tensor:
            return x / (x.abs().mean(-1, keepdim=True) + self.eps) * self.weight

    torch.manual_seed(0)
    model = TinyLlama(norm=OtherRMSNorm).double().eval()
    masks = fp.apply_masks(model, torch.zeros(1, 5, dtype=torch.long))
    assert not [g for g in masks.groups.values() if g.producers[0] == "embed_tokens"]
    [skip] = [s for s in masks.skipped if ("embed_tokens.weight", 1) in s.params]
    assert "OtherRMSNorm" in skip.reason and "register_norm" in skip.reason


# ----------------------------------------------- Hugging Face models from small configs
def _hf(kind: str) -> tuple[nn.Module, dict]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = {"num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 37}
    ids = torch.randint(0, 99, (3, 7), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    inputs["attention_mask"][0, 5:] = 0  # a padded example
    if kind == "bert":
        cfg = transformers.BertConfig(hidden_size=32, vocab_size=99, num_labels=3, **common)
        model = transformers.BertForSequenceClassification(cfg)
    else:
        cfg = transformers.LlamaConfig(
            hidden_size=32, vocab_size=99, num_key_value_heads=2, use_cache=False, **common
        )
        model = transformers.LlamaForCausalLM(cfg)
    return model.double().eval(), inputs


HF_WIDTH = {"bert": "bert.embeddings.word_embeddings", "llama": "model.embed_tokens"}


@pytest.mark.parametrize("kind", list(HF_WIDTH))
def test_hf_width_is_prunable_and_shrinks_exactly(kind: str) -> None:
    """BERT and LLaMA from tiny configs, called with keyword inputs: the hidden width is one
    group (with every norm), the shrunk model equals the masked one (float64), and the cost
    model's FLOPs equal FlopCounterMode's on the shrunk model."""
    model, inputs = _hf(kind)
    one = {k: v[:1] for k, v in inputs.items()}
    masks = fp.apply_masks(model, one)
    width = _width(masks, HF_WIDTH[kind])
    assert masks[width].num_channels == 32
    # two norms per layer, and the final norm (LLaMA) or the embeddings' norm (BERT)
    assert len(masks.groups[width].norms) == 2 * 2 + 1
    _prune_thirds(masks, 2)
    expected = _out(model, inputs)
    cm = fp.CostModel(model, one)
    small = fp.shrink(model, one)
    torch.testing.assert_close(_out(small, inputs), expected, rtol=0, atol=ATOL_F64)
    assert cm.total(cm.entries()) == pytest.approx(_flops(small, one), rel=1e-12)


class ShapeScaled(nn.Module):
    """A pre-LN residual MLP that scales its branch by 1/sqrt of the width it reads off the
    stream's shape: a number the trace cannot follow, which changes when the width shrinks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.ln = nn.Linear(6, 8), nn.LayerNorm(8)
        self.fc1, self.fc2, self.head = nn.Linear(8, 12), nn.Linear(12, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x)
        x = x + self.fc2(F.gelu(self.fc1(self.ln(x)))) * x.shape[-1] ** -0.5
        return self.head(x.mean(1))


def test_a_width_read_off_a_shape_is_not_offered() -> None:
    """A width the code reads back from a shape is left unmasked (removing a channel would
    change the output in a way masking cannot), for a reason that says so; the MLP's hidden
    units stay prunable."""
    torch.manual_seed(0)
    model = ShapeScaled().double().eval()
    masks = fp.apply_masks(model, torch.randn(1, 4, 6, dtype=torch.float64))
    assert [g.producers for g in masks.groups.values()] == [["fc1"]]
    [skip] = [s for s in masks.skipped if ("embed.weight", 0) in s.params]
    assert "reads this width from a tensor's shape" in skip.reason


class Uncopyable(ShapeScaled):
    """The block with a lock attribute, as a model holding a data loader or a thread might:
    it cannot be deep-copied."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x)
        x = x + self.fc2(F.gelu(self.fc1(self.ln(x))))
        return self.head(x.mean(1))


def test_a_width_that_cannot_be_checked_is_not_offered_and_nothing_is_left() -> None:
    """A width that cannot be checked because the model cannot be copied is left unmasked
    with the reason, without an exception; the MLP's hidden units stay prunable and
    remove_masks restores the model."""
    torch.manual_seed(0)
    model = Uncopyable().double().eval()
    x = torch.randn(1, 4, 6, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
    masks = fp.apply_masks(model, x)
    assert [g.producers for g in masks.groups.values()] == [["fc1"]]
    [skip] = [s for s in masks.skipped if ("embed.weight", 0) in s.params]
    assert "shrinking the model with one of these channels removed fails" in skip.reason
    fp.remove_masks(model)
    with torch.no_grad():
        assert torch.equal(model(x), before)


class HeadsBackToInputWidth(nn.Module):
    """Next-ViT's efficient attention: a grouped convolution (groups of ``hd`` channels, so
    its width goes ``hd`` channels at a time, as the heads do) feeds the tokens to q/k/v, and
    the heads' output is reshaped back to the width read off the input's shape, ``(B, N, C)``:
    the heads' width and the input width must shrink together. An MLP follows."""

    def __init__(self, c: int = 32, hd: int = 8) -> None:
        super().__init__()
        self.hd = hd
        self.stem = nn.Conv2d(3, c, 1)
        self.gconv = nn.Conv2d(c, c, 3, padding=1, groups=c // hd)
        self.q, self.k, self.v = nn.Linear(c, c), nn.Linear(c, c), nn.Linear(c, c)
        self.proj, self.head = nn.Linear(c, c), nn.Linear(c, 3)
        self.fc1, self.fc2 = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)

    def forward(self, x: Tensor) -> Tensor:
        t = self.gconv(F.relu(self.stem(x))).flatten(2).transpose(1, 2)
        b, n, c = t.shape
        q, k, v = (
            f(t).reshape(b, n, -1, self.hd).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        t = t + self.proj(o)
        return self.head((t + self.fc2(F.gelu(self.fc1(t)))).mean(1))


def test_two_widths_the_code_ties_are_not_offered_though_one_unit_each_matches() -> None:
    """The input width and the heads lose ``hd`` channels per unit: the trial that removes
    one unit of every group at once saw them still equal and passed, and a prune of a
    different number of heads failed to shrink. Each group now loses a different number of
    rows in that trial, so both are kept whole (neither can go alone), and any prune of
    what is left shrinks to the masked model's outputs."""
    torch.manual_seed(0)
    model = HeadsBackToInputWidth().double().eval()
    x = torch.randn(1, 3, 6, 6, dtype=torch.float64)
    masks = fp.apply_masks(model, x)
    offered = {p for g in masks.groups.values() for p in g.producers}
    assert offered == {"fc1"}, offered
    tied = [s for s in masks.skipped if "reads this width from a tensor's shape" in s.reason]
    assert {p for s in tied for p, _ in s.params} >= {"gconv.weight", "q.weight"}
    assert_exact(model, masks, torch.randn(2, 3, 6, 6, dtype=torch.float64))
