"""``round_to`` counts weight rows: a channel that spans several (an attention head spans
``head_dim`` rows of q / k / v and columns of the output projection) is one channel of a mask
whose ``channel_width`` is that span, so a head mask keeps a multiple of
``round_to / gcd(round_to, head_dim)`` heads and every projection of the shrunk model still
has a multiple of ``round_to`` rows."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fisherprune as fp
from fisherprune.masks import MaskLayer
from fisherprune.pruner import prune

transformers = pytest.importorskip("transformers")

_SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    num_attention_heads=4,
    num_hidden_layers=2,
    intermediate_size=64,
    max_position_embeddings=64,
)
HEAD_DIM = 16


def _bert() -> nn.Module:
    return transformers.BertModel(transformers.BertConfig(**_SMALL), add_pooling_layer=False)


def _llama() -> nn.Module:  # grouped-query attention: 4 query heads over 2 key / value heads
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **_SMALL))


BUILDERS = {"bert": _bert, "llama": _llama}


def _ids(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 96, (n, 12), generator=g)}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_head_mask_spans_head_dim_rows_and_other_masks_one(name: str) -> None:
    torch.manual_seed(0)
    model = BUILDERS[name]().eval()
    masks = fp.apply_masks(model, _ids(1, torch.Generator().manual_seed(0)))
    widths = {k: m.channel_width for k, m in masks.items()}
    heads = {k for k in widths if "q_proj" in k or "query" in k}
    assert len(heads) == 2
    assert {widths[k] for k in heads} == {HEAD_DIM}
    assert {w for k, w in widths.items() if k not in heads} == {1}


@pytest.mark.parametrize(
    ("channel_width", "round_to", "removed"),
    [(64, 8, 1), (12, 8, 2), (16, 32, 2), (3, 8, 8), (1, 4, 4)],
)
def test_each_prune_removes_the_channels_of_round_to_rows(
    channel_width: int, round_to: int, removed: int
) -> None:
    """Starting from a kept count on a multiple, each prune removes ``round_to`` rows' worth:
    ``round_to / gcd(round_to, channel_width)`` channels."""
    assert removed == round_to // math.gcd(round_to, channel_width)
    mask = MaskLayer(48)
    mask.channel_width = channel_width
    scores = torch.arange(48, dtype=torch.float64)
    for _ in range(3):
        before = mask.kept
        event = prune({"m": mask}, {"m": scores}, round_to=round_to)
        assert event is not None and len(event.channels) == removed
        assert mask.kept == before - removed
        assert (mask.kept * channel_width) % round_to == 0


@pytest.mark.filterwarnings("ignore:the model.s Hugging Face config still describes")
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_round_to_8_prunes_heads_and_every_shrunk_width_is_a_multiple_of_8(name: str) -> None:
    """Four heads of 16: before heads counted as rows, round_to=8 could never remove one (no
    multiple of 8 heads below 4). Now heads go, every linear layer of the shrunk model has
    in and out widths that are multiples of 8, and it computes what the masked model does."""
    torch.manual_seed(0)
    model = BUILDERS[name]().eval()
    g = torch.Generator().manual_seed(1)
    batches = [(_ids(8, g), None) for _ in range(4)]
    example = {k: v[:1] for k, v in batches[0][0].items()}
    fp.prune_to_target(
        model, example, batches, 0.3, criterion="l1", round_to=8, reconstruct=False, seed=0
    )
    masks = fp.find_masks(model)
    heads = [m.kept for k, m in masks.items() if "q_proj" in k or "query" in k]
    full = 2 if name == "llama" else 4  # a Llama head mask counts key / value heads
    assert min(heads) < full
    x = _ids(3, g)
    small = fp.shrink(model, x)
    linears = [m for m in small.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.in_features % 8 == 0 and m.out_features % 8 == 0 for m in linears)
    with torch.no_grad():
        torch.testing.assert_close(small(**x)[0], model(**x)[0], rtol=1e-4, atol=1e-5)
