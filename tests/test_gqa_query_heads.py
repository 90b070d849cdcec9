"""Query heads pruned one by one under grouped-query attention (by query slot: the j-th query
head of every key/value head, so every key/value head keeps as many, as Hugging Face's
``repeat_kv`` needs) and under multi-query attention (one key/value head, which stays)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from test_heads import ATOL_F64, GQAttention, LlamaBlock, _flops
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.graph.gqa import set_grouped_query_units

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 100, (3, 7), generator=torch.Generator().manual_seed(0))


def _hf(kind: str, units: str = "query") -> tuple[nn.Module, dict, int, int]:
    """A tiny model of ``kind`` in float64 whose grouped-query attention is pruned in ``units``,
    its keyword inputs, its query and kv head counts."""
    t = transformers
    torch.manual_seed(0)
    common = dict(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, intermediate_size=96,
        max_position_embeddings=64,
    )  # fmt: skip
    x = {"input_ids": IDS}
    if kind == "llama":
        cfg = t.LlamaConfig(num_attention_heads=8, num_key_value_heads=2, **common)
        model, attention = t.LlamaForCausalLM(cfg), "eager"
    elif kind == "mistral":
        cfg = t.MistralConfig(
            num_attention_heads=8, num_key_value_heads=2, num_labels=3, pad_token_id=0, **common
        )
        model, attention = t.MistralForSequenceClassification(cfg), "sdpa"
        x = {"input_ids": IDS, "attention_mask": torch.ones_like(IDS)}
        x["attention_mask"][0, 5:] = 0  # a padded example: sdpa with repeat_kv and a mask
    elif kind == "qwen2":
        cfg = t.Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **common)
        model, attention = t.Qwen2ForCausalLM(cfg), "eager"
    else:  # multi-query attention; sdpa with enable_gqa (no mask)
        cfg = t.GemmaConfig(num_attention_heads=4, num_key_value_heads=1, head_dim=16, **common)
        model, attention = t.GemmaForCausalLM(cfg), "sdpa"
    model.config._attn_implementation = attention
    set_grouped_query_units(model, units)
    return model.double().eval(), x, cfg.num_attention_heads, cfg.num_key_value_heads


KINDS = ["llama", "mistral", "qwen2", "gemma"]


@functools.cache
def _slot_pruned(kind: str) -> tuple[nn.Module, dict, nn.Module, float, int, int]:
    """``kind`` pruned by query slot, slot 1 of every layer zeroed (no kv head): the masked
    model, its inputs, the shrunk model, the masked model's cost, the head counts."""
    model, x, heads, kv = _hf(kind)
    masks = fp.apply_masks(model, x)
    with torch.no_grad():
        for name in _query_masks(masks):
            masks[name].mask[1] = 0.0
    cost = fp.computational_cost(model, x).total
    return model, x, fp.shrink(model, x), cost, heads, kv


def _query_masks(masks: fp.AppliedMasks) -> list[str]:
    return [n for n, g in masks.groups.items() if any("q_proj" in p for p in g.producers)]


def _logits(model: nn.Module, x: dict) -> Tensor:
    with torch.no_grad():
        return model(**x).logits


@pytest.mark.parametrize("kind", KINDS)
def test_query_slots_are_the_head_units_of_every_layer(kind):
    """One mask per layer, one channel per query slot (heads / kv heads), made by q_proj
    alone: the key/value heads are not part of it."""
    model, x, heads, kv = _hf(kind)
    masks = fp.apply_masks(model, x)
    names = _query_masks(masks)
    assert len(names) == 2
    for n in names:
        assert masks[n].num_channels == heads // kv
        assert [p.rsplit(".", 1)[-1] for p in masks.groups[n].producers] == ["q_proj"]


@pytest.mark.parametrize("kind", KINDS)
def test_shrunk_model_with_fewer_query_heads_gives_the_masked_outputs(kind):
    model, x, small, _, heads, kv = _slot_pruned(kind)
    hd = 16 if kind == "gemma" else 64 // heads
    attn = small.model.layers[0].self_attn
    assert attn.q_proj.out_features == (heads - kv) * hd  # one query head per kv head gone
    assert attn.k_proj.out_features == kv * hd  # every key/value head stays
    assert attn.num_key_value_groups == heads // kv - 1
    torch.testing.assert_close(_logits(small, x), _logits(model, x), atol=ATOL_F64, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_cost_of_query_slots_equals_flop_counter_on_the_shrunk_model(kind):
    _, x, small, cost, _, _ = _slot_pruned(kind)
    assert cost == _flops(small, x)


@pytest.mark.parametrize(
    ("kind", "round_to", "block"),
    [("mistral", 1, 1), ("qwen2", 1, 1), ("gemma", 1, 1), ("llama", 32, 2)],
)
def test_uniform_slot_pruning_round_trips_through_save_pretrained(kind, round_to, block, tmp_path):
    """prune(uniform=True) takes as many slots from every layer, so the shrunk model's config
    (num_attention_heads, num_key_value_heads) describes it and from_pretrained (no fisherprune
    code) gives the same logits. LlamaConfig wants hidden_size % num_attention_heads == 0, so
    two of its four slots go: a slot spans 16 rows of q_proj (one head of 8 per key / value
    head), and round_to counts rows (32: two slots)."""
    model, x, heads, kv = _hf(kind)
    masks = fp.apply_masks(model, x)
    slots = {n: masks[n] for n in _query_masks(masks)}
    g = torch.Generator().manual_seed(0)
    scores = {n: torch.rand(m.num_channels, generator=g) for n, m in slots.items()}
    assert fp.prune(slots, scores, uniform=True, round_to=round_to) is not None
    small = fp.shrink(model, x)
    assert (small.config.num_attention_heads, small.config.num_key_value_heads) == (
        heads - block * kv,
        kv,
    )
    small.save_pretrained(tmp_path)
    attention = model.config._attn_implementation  # eager and sdpa differ by ~1e-8
    back = type(model).from_pretrained(tmp_path, attn_implementation=attention).eval().double()
    torch.testing.assert_close(_logits(back, x), _logits(small, x), atol=1e-12, rtol=0)


def test_multi_query_attention_heads_are_prunable_by_default():
    """With one key/value head the query heads are the units, whatever the grouped-query
    setting: no channel of the attention is left unmasked (before, the rotary product and the
    split into one head blocked q, k and v)."""
    model, x, heads, _ = _hf("gemma", units="kv")
    masks = fp.apply_masks(model, x)
    assert [masks[n].num_channels for n in _query_masks(masks)] == [heads, heads]
    assert not [s for s in masks.skipped if "self_attn" in str(s)]


# ------------------------------------------------------ hand-written grouped-query attention
class _Fused(GQAttention):
    """Grouped-query attention written with fused attention: ``enable_gqa=True`` or the
    key/value heads repeated by ``repeat_interleave``."""

    def __init__(self, how: str, heads: int, kv_heads: int) -> None:
        super().__init__(24, heads, kv_heads, 6)
        self.how = how

    def forward(self, x: Tensor) -> Tensor:
        n, length, _ = x.shape
        q, k, v = (
            p(x).view(n, length, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        if self.how == "enable_gqa":
            o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(o.transpose(1, 2).reshape(n, length, -1))


def _block(how: str, kv_heads: int = 2) -> tuple[nn.Module, Tensor]:
    """LLaMA's block with the attention ``how``; the attention layer is pruned by query slot."""
    torch.manual_seed(0)
    model = LlamaBlock()
    if how != "expand":  # LlamaBlock's own attention repeats by expand + reshape
        model.self_attn = _Fused(how, 6, kv_heads)
    set_grouped_query_units(model.self_attn, "query")
    return model.double().eval(), torch.randn(3, 5, 24, dtype=torch.float64)


@pytest.mark.parametrize("how", ["expand", "enable_gqa", "repeat_interleave"])
def test_hand_written_gqa_sheds_a_query_slot_exactly(how):
    """Slot 0 zeroed: the shrunk block gives the masked outputs, its FLOPs the masked cost,
    and its num_heads attribute follows (its key/value heads stay)."""
    model, x = _block(how)
    masks = fp.apply_masks(model, x[:1])
    (name,) = _query_masks(masks)
    heads, kv = model.self_attn.num_heads, model.self_attn.num_key_value_heads
    assert masks[name].num_channels == heads // kv
    with torch.no_grad():
        masks[name].mask[0] = 0.0
        want = model(x)
    cost = fp.computational_cost(model, x).total
    small = fp.shrink(model, x[:1])
    with torch.no_grad():
        torch.testing.assert_close(small(x), want, atol=ATOL_F64, rtol=0)
    assert (small.self_attn.num_heads, small.self_attn.num_key_value_heads) == (heads - kv, kv)
    assert cost == _flops(small, x)


def test_hand_written_multi_query_attention_prunes_query_heads():
    model, x = _block("enable_gqa", kv_heads=1)
    set_grouped_query_units(model.self_attn, "kv")  # multi-query: query heads whatever the mark
    masks = fp.apply_masks(model, x[:1])
    (name,) = _query_masks(masks)
    assert masks[name].num_channels == 6


def test_key_value_heads_go_with_the_last_query_slot_reading_them():
    """With every slot zeroed no query head reads the key/value heads: the cost counts their
    projections as gone too, as FlopCounterMode does on the block without attention."""
    model, x = _block("expand")
    masks = fp.apply_masks(model, x[:1])
    cm = fp.CostModel(model, x)
    entries = cm.entries()
    start = cm.entry_start[_query_masks(masks)[0]]
    entries[start : start + 2] = 0.0

    class _NoAttention(nn.Module):
        def forward(self, h: Tensor) -> Tensor:
            return torch.zeros_like(h)

    model.self_attn = _NoAttention()
    assert cm.total(entries) == _flops(model, x)


def test_unknown_grouped_query_units_are_refused():
    with pytest.raises(ValueError, match="must be one of"):
        set_grouped_query_units(nn.Linear(2, 2), "heads")
