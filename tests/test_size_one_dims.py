"""Dimensions of size 1 through views: a batch of one beside a single key/value head.

Hugging Face's ``repeat_kv`` (used by sdpa whenever an attention mask is given, and by eager
attention) unsqueezes the key/value heads, expands the new dim and merges the two. With one
key/value head and one example, the batch, the key/value head and the new dim are all of size
1: matching them by size put the key/value head's label on the batch dim, so a pruned query
head left two copies of keys beside one query head, and the cost model raised from torch's
``sdpa_flop_count``. Every case here is checked against FlopCounterMode on the shrunk model
and the masked model's output, after a random prune."""

from __future__ import annotations

import pytest
import torch
from counted import assert_exact
from torch import nn

import fisherprune as fp
from fisherprune.graph.gqa import set_grouped_query_units

transformers = pytest.importorskip("transformers")

#: (query heads, key/value heads, grouped-query units)
KINDS = {"mqa": (2, 1, "kv"), "gqa_query": (4, 2, "query"), "gqa_kv": (4, 2, "kv")}


def _llama(kind: str, attention: str) -> nn.Module:
    heads, kv, units = KINDS[kind]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=60, hidden_size=16, intermediate_size=24, num_attention_heads=heads,
        num_key_value_heads=kv, num_hidden_layers=1, max_position_embeddings=32,
        attn_implementation=attention,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    set_grouped_query_units(model, units)
    return model.double().eval()


def _inputs(batch: int, padded: bool, seed: int = 0) -> dict:
    """Token ids of ``batch`` examples of 13 tokens; ``padded``: the first example's last
    token is padding (the attention mask makes sdpa repeat the key/value heads itself)."""
    ids = torch.randint(0, 60, (batch, 13), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(batch, 13, dtype=torch.long)
    if padded:
        mask[0, -1] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _query_masks(masks: fp.AppliedMasks) -> list[str]:
    return [n for n, g in masks.groups.items() if any("q_proj" in p for p in g.producers)]


#: (kind, attention, batch, padded): multi-query attention in every state of the batch and the
#: mask; grouped-query attention where its key/value heads are repeated (a mask, or eager)
CASES = [
    *(("mqa", "sdpa", batch, padded) for batch in (1, 2) for padded in (False, True)),
    ("mqa", "eager", 1, True),
    ("gqa_query", "sdpa", 1, True),
    ("gqa_query", "sdpa", 2, True),
    ("gqa_query", "eager", 1, True),
    ("gqa_kv", "sdpa", 1, True),
]


@pytest.mark.parametrize(("kind", "attention", "batch", "padded"), CASES)
def test_query_heads_prune_exactly_whatever_the_batch_and_mask(kind, attention, batch, padded):
    """The attention's heads are masked (nothing in the attention is left whole), and
    after a random prune (at least one head unit) the shrunk model gives the masked
    outputs and FlopCounterMode on it equals the masked cost."""
    heads, kv, units = KINDS[kind]
    model = _llama(kind, attention)
    x = _inputs(batch, padded)
    masks = fp.apply_masks(model, x)
    assert not [s for s in masks.skipped if "self_attn" in str(s)]
    names = _query_masks(masks)
    by_slot = units == "query" or kv == 1  # query slots (multi-query: every head)
    assert [masks[n].num_channels for n in names] == [heads // kv if by_slot else kv]
    small = assert_exact(model, masks, x)
    assert small.model.layers[0].self_attn.q_proj.out_features < heads * (16 // heads)


@pytest.mark.parametrize("kind", ["mqa", "gqa_query"])
def test_cost_of_another_example_than_the_masks_were_applied_with(kind):
    """The CLI's failure: masks applied with two unpadded examples, the cost (every marginal)
    taken on one padded example; it equals FlopCounterMode on the shrunk model there."""
    model = _llama(kind, "sdpa")
    masks = fp.apply_masks(model, _inputs(2, False))
    assert_exact(model, masks, _inputs(1, True, seed=1))


def test_a_formula_refusing_a_marginal_state_names_the_mask_and_operator():
    """A formula that asserts on its shapes (as torch's ``sdpa_flop_count`` does) while a
    marginal is evaluated gives a ValueError naming the operator, its module and the mask
    channel, not torch's bare AssertionError."""
    from fisherprune.cost.conventions import register_cost_formula, unregister_cost_formula

    def refuses_a_narrower_product(a, b, *_, out_shape=None, **__):
        assert a[1] in (4, 8), "inner width changed"
        return 2 * a[0] * a[1] * b[1]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 3, bias=False))
    x = torch.randn(2, 4)
    masks = fp.apply_masks(model, x)
    register_cost_formula("flops", torch.ops.aten.mm)(refuses_a_narrower_product)
    try:
        with pytest.raises(ValueError, match=r"aten\.mm in 2 .* channel 0 of mask .*inner width"):
            fp.computational_cost(model, x)
    finally:
        unregister_cost_formula("flops", torch.ops.aten.mm)
    assert len(masks) == 1
