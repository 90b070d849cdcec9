"""``nn.MultiheadAttention`` and the models built on it (a torchvision-style ViT,
``nn.TransformerEncoder``): each head is one prunable channel, the hidden width passes through,
and an attention that lost either becomes a ``PrunedMultiheadAttention``. References: PyTorch's
own ``nn.MultiheadAttention`` (the head-by-head function equals it in float64), the masked
model's outputs (the shrunk model must equal them), ``FlopCounterMode`` on the shrunk model, and
a per-example float64 loop through PyTorch's module for the Fisher signal of the head mask."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import fisherprune as fp
from fisherprune.attention import multihead_attention
from fisherprune.cost.formulas import SAME_AS_TORCH
from fisherprune.export import PrunedMultiheadAttention

ATOL_F64 = 1e-10


def _flops(model: nn.Module, x: Tensor) -> float:
    """FlopCounterMode's count for one call, per example (CPU's fused attention counted as
    torch counts its flash kernel)."""
    counter = FlopCounterMode(display=False, custom_mapping=dict(SAME_AS_TORCH))
    with counter, torch.no_grad():
        model(x)
    return counter.get_total_flops() / x.shape[0]


def _prune_thirds(masks: fp.AppliedMasks, seed: int) -> None:
    """Zero a random third of every mask (at least one kept)."""
    g = torch.Generator().manual_seed(seed)
    for m in masks.values():
        drop = torch.randperm(m.num_channels, generator=g)[: m.num_channels // 3]
        m.mask[drop] = 0.0


def _outputs(model: nn.Module, x: Tensor) -> Tensor:
    with torch.no_grad():
        return model(x)


# ------------------------------------------- the head-by-head function equals PyTorch's
def _mha_cases() -> list[tuple[str, dict, dict]]:
    """(id, module options, call options)."""
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    return [
        ("plain", {}, {}),
        ("batch_first", {"batch_first": True}, {}),
        ("no_weights", {}, {"need_weights": False}),
        ("per_head_weights", {}, {"average_attn_weights": False}),
        ("bool_mask", {}, {"attn_mask": causal}),
        ("float_mask_no_weights", {}, {"attn_mask": torch.randn(5, 5), "need_weights": False}),
        ("mask_per_head", {}, {"attn_mask": torch.randn(3 * 4, 5, 5)}),
        ("causal_hint", {}, {"attn_mask": causal, "is_causal": True, "need_weights": False}),
        ("padding", {"batch_first": True}, {"key_padding_mask": "pad"}),
        ("bias_kv_zero_attn", {"add_bias_kv": True, "add_zero_attn": True}, {"attn_mask": causal}),
        ("kdim_vdim", {"kdim": 7, "vdim": 9}, {}),
        ("no_bias", {"bias": False}, {"need_weights": False}),
        ("unbatched", {}, {"unbatched": True}),
    ]


@pytest.mark.parametrize(
    ("mod_kw", "call_kw"), [c[1:] for c in _mha_cases()], ids=[c[0] for c in _mha_cases()]
)
def test_head_by_head_function_equals_torch_attention(mod_kw: dict, call_kw: dict) -> None:
    """``multihead_attention(module, ...)`` gives PyTorch's output and attention weights
    (float64), for every option of the module and of the call."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 4, **mod_kw).double().eval()
    call = dict(call_kw)
    unbatched = call.pop("unbatched", False)
    shape = (5, 16) if unbatched else ((3, 5, 16) if m.batch_first else (5, 3, 16))
    q = torch.randn(shape, dtype=torch.float64)
    k = torch.randn(*shape[:-1], m.kdim, dtype=torch.float64)
    v = torch.randn(*shape[:-1], m.vdim, dtype=torch.float64)
    if mod_kw.get("kdim") is None:
        k = v = q  # self-attention
    if call.get("key_padding_mask") == "pad":
        pad = torch.zeros(3, 5, dtype=torch.bool)
        pad[0, 3:] = True
        call["key_padding_mask"] = pad
    for key in ("attn_mask",):
        if isinstance(call.get(key), Tensor) and call[key].is_floating_point():
            call[key] = call[key].double()
    want = m(q, k, v, **call)
    got = multihead_attention(m, q, k, v, **call)
    torch.testing.assert_close(got[0], want[0], atol=ATOL_F64, rtol=0)
    if want[1] is None:
        assert got[1] is None
    else:
        torch.testing.assert_close(got[1], want[1], atol=ATOL_F64, rtol=0)


# ------------------------------------------------- a torchvision-style ViT, written from it
class MLPBlock(nn.Sequential):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__(nn.Linear(d, hidden), nn.GELU(), nn.Dropout(0.0), nn.Linear(hidden, d))


class EncoderBlock(nn.Module):
    """torchvision's ``EncoderBlock``: pre-norm self-attention and MLP, residual adds."""

    def __init__(self, heads: int, d: int, hidden: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(d, heads, dropout=0.0, batch_first=True)
        self.dropout = nn.Dropout(0.0)
        self.ln_2 = nn.LayerNorm(d, eps=1e-6)
        self.mlp = MLPBlock(d, hidden)

    def forward(self, x: Tensor) -> Tensor:
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = self.dropout(y) + x
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    def __init__(self, length: int, layers: int, heads: int, d: int, hidden: int) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, length, d).normal_(std=0.02))
        self.dropout = nn.Dropout(0.0)
        self.layers = nn.Sequential(*(EncoderBlock(heads, d, hidden) for _ in range(layers)))
        self.ln = nn.LayerNorm(d, eps=1e-6)

    def forward(self, x: Tensor) -> Tensor:
        return self.ln(self.layers(self.dropout(x + self.pos_embedding)))


class VisionTransformer(nn.Module):
    """torchvision's ``VisionTransformer``: conv patch embedding reshaped by its
    ``hidden_dim`` attribute, class token, positional embedding, encoder blocks, final
    LayerNorm, a Linear head on the class token."""

    def __init__(
        self, image: int = 8, patch: int = 4, layers: int = 2, heads: int = 4, d: int = 16
    ) -> None:
        super().__init__()
        self.patch_size, self.hidden_dim = patch, d
        self.conv_proj = nn.Conv2d(3, d, kernel_size=patch, stride=patch)
        self.class_token = nn.Parameter(torch.randn(1, 1, d))
        length = (image // patch) ** 2 + 1
        self.encoder = Encoder(length, layers, heads, d, hidden=24)
        self.heads = nn.Sequential(nn.Linear(d, 5))

    def forward(self, x: Tensor) -> Tensor:
        n, _, h, w = x.shape
        x = self.conv_proj(x)  # (N, d, h/p, w/p), then the width written as torchvision does:
        x = x.reshape(n, self.hidden_dim, (h // self.patch_size) * (w // self.patch_size))
        x = x.permute(0, 2, 1)  # (N, P, d)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])


def _vit() -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    return VisionTransformer().double().eval(), torch.randn(3, 3, 8, 8, dtype=torch.float64)


def test_vit_groups_are_heads_per_block_the_hidden_width_and_mlp_units() -> None:
    """Per block one group of 4 heads masked at the attention's out_proj and one of 24 MLP
    units; one hidden-width group of 16 channels through the patch embedding, class token,
    positional embedding, every attention and MLP, and every LayerNorm."""
    model, x = _vit()
    masks = fp.apply_masks(model, x[:1])
    by_size = sorted(g.num_channels for g in masks.groups.values())
    assert by_size == [4, 4, 16, 24, 24]
    heads = [g for g in masks.groups.values() if g.num_channels == 4]
    assert [g.consumers for g in heads] == [
        [f"encoder.layers.{i}.self_attention.out_proj"] for i in range(2)
    ]
    hidden = next(g for g in masks.groups.values() if g.num_channels == 16)
    members = {p for p, _ in hidden.params}
    assert {"class_token", "encoder.pos_embedding", "conv_proj.weight"} <= members
    assert "encoder.layers.1.self_attention.in_proj_weight" in members
    assert not [s for s in masks.skipped if not s.expected]


def test_vit_shrinks_to_the_masked_outputs_and_flop_count(tmp_path: Path) -> None:
    """A third of every group removed: the shrunk ViT gives the masked outputs (float64), its
    attentions are PrunedMultiheadAttention of the kept widths, FlopCounterMode on it equals
    the cost of the masked model, and the plan rebuilds it from a fresh ViT."""
    model, x = _vit()
    masks = fp.apply_masks(model, x[:1])
    _prune_thirds(masks, seed=1)
    small = fp.shrink(model, x[:1])
    torch.testing.assert_close(_outputs(small, x), _outputs(model, x), atol=ATOL_F64, rtol=0)
    attn = small.encoder.layers[0].self_attention
    assert isinstance(attn, PrunedMultiheadAttention)
    assert (attn.num_heads, attn.head_dim, attn.embed_dim) == (3, 4, 11)
    assert attn.in_proj_weight.shape == (3 * 3 * 4, 11)
    assert small.hidden_dim == 11  # the attribute its reshape reads
    cost = fp.computational_cost(model, x).total
    assert cost == _flops(small, x)
    assert cost < 0.7 * fp.computational_cost(_vit()[0], x).total  # a third of everything went
    fp.PruningPlan.from_model(model, x[:1]).save(tmp_path / "plan.json")
    fresh = fp.PruningPlan.load(tmp_path / "plan.json").apply(_vit()[0])
    fresh.load_state_dict(small.state_dict())
    torch.testing.assert_close(_outputs(fresh, x), _outputs(small, x), atol=0, rtol=0)


def test_unpruned_attention_stays_torch_multihead_attention() -> None:
    """Pruning only the MLP units leaves every attention an ``nn.MultiheadAttention``."""
    model, x = _vit()
    masks = fp.apply_masks(model, x[:1])
    for name, m in masks.items():
        if masks.groups[name].num_channels == 24:
            m.mask[:5] = 0.0
    small = fp.shrink(model, x[:1])
    assert type(small.encoder.layers[0].self_attention) is nn.MultiheadAttention
    torch.testing.assert_close(_outputs(small, x), _outputs(model, x), atol=ATOL_F64, rtol=0)


def test_dense_cost_equals_flop_count_of_torch_multihead_attention() -> None:
    """The unmasked model's cost counts what PyTorch's own attention runs (autograd on, so
    that the fast path is off; heads, projections and products all counted)."""
    model, x = _vit()
    counter = FlopCounterMode(display=False, custom_mapping=dict(SAME_AS_TORCH))
    with counter:
        model(x)
    assert fp.computational_cost(model, x).total == counter.get_total_flops() / 3


def test_head_fisher_signal_equals_a_per_example_loop() -> None:
    """The head mask's signal is 1/2 mean_n g_n^2 with g_n the derivative of example n's loss
    w.r.t. one multiplier per head on that head's value rows of PyTorch's own module (the
    head's output is softmax(q k^T) v_h, so scaling v_h scales the head), float64."""
    model, x = _vit()
    y = torch.tensor([0, 2, 4])
    masks = fp.apply_masks(model, x[:1])
    model.double()  # the masks' signals in float64 too
    out_proj = "encoder.layers.1.self_attention.out_proj"
    name = next(n for n, g in masks.groups.items() if g.consumers == [out_proj])
    model.train()
    F.cross_entropy(model(x), y).backward()
    fp.update_pruning_signals(masks, decay=0)
    ref, _ = _vit()
    attn = ref.encoder.layers[1].self_attention
    m = torch.ones(4, dtype=torch.float64, requires_grad=True)
    d = attn.embed_dim
    w0, b0 = attn.in_proj_weight.detach().clone(), attn.in_proj_bias.detach().clone()
    want = torch.zeros(4, dtype=torch.float64)
    for i in range(3):
        rows = torch.cat([torch.ones(2 * d, dtype=torch.float64), m.repeat_interleave(4)])
        del attn.in_proj_weight, attn.in_proj_bias
        attn.in_proj_weight, attn.in_proj_bias = w0 * rows[:, None], b0 * rows
        loss = F.cross_entropy(ref(x[i : i + 1]), y[i : i + 1])
        (g,) = torch.autograd.grad(loss, [m])
        want += 0.5 * g * g / 3
    assert float(want.abs().max()) > 0
    torch.testing.assert_close(masks[name].signal, want, rtol=1e-9, atol=1e-15)


def test_masked_attention_acts_on_the_fast_path_too() -> None:
    """In eval without autograd, float32 (where PyTorch would run its fused fast path), the
    masked ViT still gives the shrunk ViT's output: the masks are not skipped."""
    model, x = _vit()
    model.float()
    x = x.float()
    masks = fp.apply_masks(model, x[:1])
    _prune_thirds(masks, seed=2)
    small = fp.shrink(model, x[:1])
    with torch.inference_mode():
        torch.testing.assert_close(model(x), small(x), atol=1e-5, rtol=1e-5)


def test_remove_masks_leaves_no_hook_on_the_attention() -> None:
    """``remove_masks`` takes away the attention's hooks with the masks."""
    model, x = _vit()
    before = copy.deepcopy(model)
    fp.apply_masks(model, x[:1])
    attn = model.encoder.layers[0].self_attention
    assert attn._forward_hooks and attn._forward_pre_hooks
    fp.remove_masks(model)
    assert not attn._forward_hooks and not attn._forward_pre_hooks
    torch.testing.assert_close(_outputs(model, x), _outputs(before, x), atol=0, rtol=0)


# ----------------------------------------------- nn.TransformerEncoder, all four layouts
class Classifier(nn.Module):
    def __init__(self, batch_first: bool, norm_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Linear(6, 16)
        layer = nn.TransformerEncoderLayer(
            16, 4, dim_feedforward=20, dropout=0.0, batch_first=batch_first, norm_first=norm_first
        )
        self.encoder = nn.TransformerEncoder(
            layer, 2, norm=nn.LayerNorm(16), enable_nested_tensor=False
        )
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:  # (N, L, 6)
        h = self.embed(x if self.batch_first else x.transpose(0, 1))
        h = self.encoder(h)
        return self.head(h.mean(1 if self.batch_first else 0))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [True, False])
def test_transformer_encoder_shrinks_to_the_masked_outputs_and_flop_count(
    batch_first: bool, norm_first: bool
) -> None:
    """Heads (4 per layer), MLP units and the hidden width are prunable in every layout; with a
    third of each removed the shrunk encoder gives the masked outputs (float64) and
    FlopCounterMode on it equals the masked model's cost."""
    torch.manual_seed(0)
    model = Classifier(batch_first, norm_first).double().eval()
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    masks = fp.apply_masks(model, x[:1])
    assert sorted(g.num_channels for g in masks.groups.values()) == [4, 4, 16, 20, 20]
    _prune_thirds(masks, seed=3)
    small = fp.shrink(model, x[:1])
    torch.testing.assert_close(_outputs(small, x), _outputs(model, x), atol=ATOL_F64, rtol=0)
    assert isinstance(small.encoder.layers[1].self_attn, PrunedMultiheadAttention)
    assert fp.computational_cost(model, x).total == _flops(small, x)


def test_averaged_attention_weights_leave_out_removed_heads() -> None:
    """A model that returns the attention weights averaged over heads: the masked model
    averages over its unmasked heads, so the shrunk one (averaging over the heads it kept)
    gives the same weights (float64)."""

    class WithWeights(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(6, 16)
            self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
            self.out = nn.Linear(16, 2)

        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            h = self.inp(x)
            y, w = self.attn(h, h, h)
            return self.out(y), w

    torch.manual_seed(0)
    model = WithWeights().double().eval()
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    masks = fp.apply_masks(model, x[:1])
    heads = next(m for n, m in masks.items() if masks.groups[n].consumers == ["attn.out_proj"])
    heads.mask[1] = 0.0
    small = fp.shrink(model, x[:1])
    with torch.no_grad():
        for a, b in zip(small(x), model(x), strict=True):
            torch.testing.assert_close(a, b, atol=ATOL_F64, rtol=0)
    assert small.attn.num_heads == 3


def test_pruned_attention_equals_torch_when_nothing_was_removed() -> None:
    """``PrunedMultiheadAttention.from_module`` of an untouched ``nn.MultiheadAttention`` is
    the same function (PyTorch's module as the reference, float64)."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 4, kdim=7, vdim=9, add_bias_kv=True).double().eval()
    q = torch.randn(5, 3, 16, dtype=torch.float64)
    k, v = torch.randn(6, 3, 7, dtype=torch.float64), torch.randn(6, 3, 9, dtype=torch.float64)
    p = PrunedMultiheadAttention.from_module(m)
    assert (p.kdim, p.vdim, p.head_dim) == (7, 9, 4)
    for a, b in zip(p(q, k, v), m(q, k, v), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL_F64, rtol=0)


class CrossAttention(nn.Module):
    """Queries from one stream (16 wide) attend to a memory of another width (10: ``kdim`` and
    ``vdim``), then a TransformerDecoderLayer (self- and cross-attention, sequence first)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_in, self.m_in = nn.Linear(6, 16), nn.Linear(4, 10)
        self.cross = nn.MultiheadAttention(16, 4, kdim=10, vdim=10)
        self.m_up = nn.Linear(10, 16)
        self.decoder = nn.TransformerDecoderLayer(16, 2, dim_feedforward=20, dropout=0.0)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:  # (N, L, 6), (N, S, 4)
        q, m = self.q_in(x.transpose(0, 1)), torch.tanh(self.m_in(memory.transpose(0, 1)))
        h = q + self.cross(q, m, m, need_weights=False)[0]
        h = self.decoder(h, self.m_up(m))
        return self.head(h.mean(0))


def test_cross_attention_and_decoder_shrink_to_the_masked_outputs_and_flop_count() -> None:
    """Cross-attention with kdim/vdim: its heads (4), the query stream (16) and the memory's
    width (10) are groups, as are the decoder's self- and cross-attention heads (2 each) and
    MLP units; a third of each removed, the shrunk model gives the masked outputs (float64)
    and FlopCounterMode on it equals the cost of the masked model."""
    torch.manual_seed(0)
    model = CrossAttention().double().eval()
    x, mem = torch.randn(3, 5, 6).double(), torch.randn(3, 7, 4).double()
    inputs = (x[:1], mem[:1])
    masks = fp.apply_masks(model, inputs)
    assert sorted(g.num_channels for g in masks.groups.values()) == [2, 2, 4, 10, 16, 20]
    _prune_thirds(masks, seed=4)
    small = fp.shrink(model, inputs)
    with torch.no_grad():
        torch.testing.assert_close(small(x, mem), model(x, mem), atol=ATOL_F64, rtol=0)
    assert (small.cross.kdim, small.cross.vdim, small.cross.num_heads) == (7, 7, 3)
    counter = FlopCounterMode(display=False, custom_mapping=dict(SAME_AS_TORCH))
    with counter, torch.no_grad():
        small(x, mem)
    assert fp.computational_cost(model, (x, mem)).total == counter.get_total_flops() / 3


def test_shrunk_attention_can_be_pruned_again() -> None:
    """A shrunk ViT (PrunedMultiheadAttention inside) is masked and shrunk once more: its heads
    and hidden width are groups again, and the twice-shrunk model gives the masked outputs
    (float64) and the FlopCounterMode count of its cost."""
    model, x = _vit()
    _prune_thirds(fp.apply_masks(model, x[:1]), seed=5)
    once = fp.shrink(model, x[:1])
    masks = fp.apply_masks(once, x[:1])
    assert sorted(g.num_channels for g in masks.groups.values()) == [3, 3, 11, 16, 16]
    _prune_thirds(masks, seed=6)
    twice = fp.shrink(once, x[:1])
    torch.testing.assert_close(_outputs(twice, x), _outputs(once, x), atol=ATOL_F64, rtol=0)
    attn = twice.encoder.layers[1].self_attention
    assert (attn.num_heads, attn.embed_dim, twice.hidden_dim) == (2, 8, 8)
    assert fp.computational_cost(once, x).total == _flops(twice, x)


def test_nested_tensors_are_refused_with_the_way_out() -> None:
    """Nested tensors (what nn.TransformerEncoder makes from a padding mask in inference) get
    an error naming enable_nested_tensor=False, not a crash inside the attention."""
    attn = PrunedMultiheadAttention(8, num_heads=2, head_dim=3, batch_first=True)
    x = torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)])
    with pytest.raises(ValueError, match="enable_nested_tensor=False"):
        attn(x, x, x)
