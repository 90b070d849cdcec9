"""Attention heads as prunable channels: a width split into (heads, head_dim) makes each head
one channel (its q, k, v rows and the output projection's columns), a key/value head goes with
the query heads that read it (grouped-query attention), and rotary embeddings never split a
head. References: the masked model's own outputs in float64 (the shrunk model must equal them),
``FlopCounterMode`` on the shrunk model (given torch's flash-attention formula for CPU's fused
attention op, which it lacks), and hand counts of the widths each design implies."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import fisherprune as fp
from fisherprune.cost.formulas import SAME_AS_TORCH

ATOL_F64 = 1e-10


def _flops(model: nn.Module, inputs: dict | Tensor) -> float:
    """FlopCounterMode's count for one call (kwargs for a dict), per example."""
    counter = FlopCounterMode(display=False, custom_mapping=dict(SAME_AS_TORCH))
    with counter, torch.no_grad():
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    del out
    n = next(iter(inputs.values())).shape[0] if isinstance(inputs, dict) else inputs.shape[0]
    return counter.get_total_flops() / n


def _prune_thirds(masks: fp.AppliedMasks, seed: int) -> None:
    """Zero a random third of every mask (at least one kept)."""
    g = torch.Generator().manual_seed(seed)
    for m in masks.values():
        drop = torch.randperm(m.num_channels, generator=g)[: m.num_channels // 3]
        m.mask[drop] = 0.0


def _outputs(model: nn.Module, x: Tensor) -> Tensor:
    with torch.no_grad():
        return model(x)


# ------------------------------------------------- a LLaMA block written from its design
class RMSNorm(nn.Module):
    """x / rms(x) * w, written by hand as LLaMA writes it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class GQAttention(nn.Module):
    """Grouped-query attention with rotary embeddings: 4 query heads read 2 key/value heads."""

    def __init__(self, d: int = 24, heads: int = 4, kv_heads: int = 2, head_dim: int = 6) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(d, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # (N, L, d)
        n, length, _ = x.shape
        q = self.q_proj(x).view(n, length, -1, self.head_dim).transpose(1, 2)  # (N, H, L, D)
        k = self.k_proj(x).view(n, length, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(n, length, -1, self.head_dim).transpose(1, 2)
        pos = torch.arange(length, dtype=x.dtype)
        freq = 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2, dtype=x.dtype) / self.head_dim)
        angle = torch.cat([pos[:, None] * freq] * 2, dim=-1)  # (L, D)
        cos, sin = angle.cos(), angle.sin()
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rep = q.shape[1] // k.shape[1]
        k = k[:, :, None].expand(-1, -1, rep, -1, -1).reshape(n, -1, length, self.head_dim)
        v = v[:, :, None].expand(-1, -1, rep, -1, -1).reshape(n, -1, length, self.head_dim)
        att = (q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(n, length, -1)
        return self.o_proj(o)


class LlamaBlock(nn.Module):
    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(d)
        self.self_attn = GQAttention(d)
        self.post_attention_layernorm = RMSNorm(d)
        self.gate_proj, self.up_proj = nn.Linear(d, 20, bias=False), nn.Linear(d, 20, bias=False)
        self.down_proj = nn.Linear(20, d, bias=False)
        self.head = nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return self.head(x.mean(1))


def _llama_block() -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    return LlamaBlock().double().eval(), torch.randn(3, 5, 24, dtype=torch.float64)


def test_gqa_block_groups_are_kv_heads_with_their_query_heads() -> None:
    """Two groups of heads would be wrong: with GQA each key/value head is read by 2 query
    heads, so the group has one channel per kv head (2), holding 2 query heads' q rows, its k
    and v rows, and the o_proj columns of both query heads; the gated MLP's units are another
    group; rotary embeddings (which mix the two halves of a head) never split a head."""
    model, x = _llama_block()
    masks = fp.apply_masks(model, x[:1])
    groups = {tuple(g.producers): g for g in masks.groups.values()}
    heads = groups[("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")]
    assert heads.num_channels == 2 and heads.consumers == ["self_attn.o_proj"]
    assert groups[("gate_proj", "up_proj")].num_channels == 20


def test_gqa_block_shrinks_to_the_masked_outputs_and_flop_count() -> None:
    """Removing one kv head (and so its 2 query heads) and some MLP units: the shrunk block
    gives the masked outputs (float64), has q rows for 2 heads and k/v rows for 1, and
    FlopCounterMode on it equals the cost of the masked block, per example."""
    model, x = _llama_block()
    masks = fp.apply_masks(model, x[:1])
    _prune_thirds(masks, seed=1)
    heads = next(m for n, m in masks.items() if "q_proj" in n)
    heads.mask.copy_(torch.tensor([1.0, 0.0]))
    small = fp.shrink(model, x[:1])
    torch.testing.assert_close(_outputs(small, x), _outputs(model, x), atol=ATOL_F64, rtol=0)
    attn = small.self_attn
    assert attn.q_proj.out_features == 2 * 6 and attn.k_proj.out_features == 6
    assert (attn.num_heads, attn.num_key_value_heads) == (2, 1)  # the head counts follow
    assert fp.computational_cost(model, x).total == _flops(small, x)


def test_head_fisher_signal_equals_a_per_example_loop() -> None:
    """The signal of the kv-head mask is 1/2 mean_n g_n^2 with g_n the derivative of example
    n's loss w.r.t. one multiplier per kv head applied to o_proj's input columns of its query
    heads (float64 loop, one example at a time)."""
    model, x = _llama_block()
    y = torch.tensor([0, 2, 1])
    masks = fp.apply_masks(model, x[:1])
    model.double()  # the masks' signals in float64 too
    name = next(n for n in masks if "q_proj" in n)
    F.cross_entropy(model(x), y).backward()
    fp.update_pruning_signals(masks, decay=0)
    ref_model, _ = _llama_block()
    m = torch.ones(2, dtype=torch.float64, requires_grad=True)
    per_column = m.repeat_interleave(2 * 6)  # kv head -> its 2 query heads x head_dim columns
    ref_model.self_attn.o_proj.register_forward_pre_hook(lambda _m, a: (a[0] * per_column,))
    want = torch.zeros(2, dtype=torch.float64)
    for i in range(3):
        loss = F.cross_entropy(ref_model(x[i : i + 1]), y[i : i + 1])
        (g,) = torch.autograd.grad(loss, [m])
        want += 0.5 * g * g / 3
    assert float(want.abs().max()) > 0
    torch.testing.assert_close(masks[name].signal, want, rtol=1e-9, atol=1e-15)


# ----------------------------------------------- Hugging Face models from small configs
def _hf(kind: str, attention: str) -> tuple[nn.Module, dict]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = {"num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 37}
    small = {"hidden_size": 32, "vocab_size": 99}
    ids = torch.randint(0, 99, (3, 7), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    inputs["attention_mask"][0, 5:] = 0  # a padded example
    if kind == "bert":
        cfg = transformers.BertConfig(**small, **common)
        model = transformers.BertModel(cfg, add_pooling_layer=False)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(
            hidden_size=32, vocab_size=99, num_key_value_heads=2, **common
        )
        model = transformers.LlamaModel(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(
            hidden_size=32, vocab_size=99, num_key_value_heads=2, **common
        )
        model = transformers.Qwen2Model(cfg)
    elif kind == "vit":
        cfg = transformers.ViTConfig(hidden_size=32, image_size=16, patch_size=4, **common)
        model = transformers.ViTModel(cfg, add_pooling_layer=False)
        inputs = {"pixel_values": torch.randn(3, 3, 16, 16, dtype=torch.float64)}
    else:
        cfg = transformers.T5Config(
            d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, vocab_size=99
        )
        model = transformers.T5EncoderModel(cfg)
    model.config._attn_implementation = attention
    return model.double().eval(), inputs


QUERY = ("query", "q_proj", "q")  # the query projection's name in each design
HF = [("bert", "eager"), ("bert", "sdpa"), ("llama", "sdpa"), ("qwen2", "eager"),
      ("vit", "sdpa"), ("t5", "eager")]  # fmt: skip


@pytest.mark.parametrize(("kind", "attention"), HF)
def test_hf_heads_are_prunable_and_shrink_exactly(kind: str, attention: str) -> None:
    """A Hugging Face model called with its keyword inputs: every layer's heads are masked
    (one channel per head, per kv head with grouped-query attention; T5 shares its position
    bias across layers, which ties their heads); after a random third of every group is
    removed, the shrunk model's last hidden state equals the masked one's (float64) and
    FlopCounterMode on it equals computational_cost, per example."""
    model, inputs = _hf(kind, attention)
    masks = fp.apply_masks(model, inputs)
    heads = [
        g for g in masks.groups.values() if any("q" in p.rsplit(".", 1)[-1] for p in g.producers)
    ]
    per_layer = 2 if kind in ("llama", "qwen2") else 4
    assert heads and all(g.num_channels == per_layer for g in heads)
    assert len(heads) == (1 if kind == "t5" else 2)
    _prune_thirds(masks, seed=2)
    cost = fp.computational_cost(model, inputs).total
    small = fp.shrink(model)
    with torch.no_grad():
        got, want = small(**inputs).last_hidden_state, model(**inputs).last_hidden_state
    torch.testing.assert_close(got, want, atol=ATOL_F64, rtol=0)
    assert cost == _flops(small, inputs)
