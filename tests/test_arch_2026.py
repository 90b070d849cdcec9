"""Attention patterns of recent vision and text architectures (issue 34), written here by hand
from the papers' descriptions: a LeViT-style attention-downsampling block whose query has one
token, and a MaxViT-style relative-position bias table indexed per head.

Each model is masked on a batch of 2, pruned at random, and checked against references outside
the code under test: the masked model's own output (float64) and PyTorch's
``FlopCounterMode`` on the shrunk model. Where a width cannot be followed, ``apply_masks`` must
say why in one line and keep that group whole, so that cost and shrink still work on the rest.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import test_hf_integration
import torch
import torch.nn.functional as F
import zoo
import zoo_foreign
from torch import Tensor, nn

import fisherprune as fp
from tests.counted import assert_exact, flops_per_example, prune_at_random

ATOL = 1e-9  # float64 output difference, relative to max(1, max |expected|)


# ================================================================ helpers


def producers(masks: fp.AppliedMasks) -> list[list[str]]:
    return [g.producers for g in masks.groups.values()]


# ====================================================== LeViT-style downsampling
class AttentionSubsample(nn.Module):
    """Attention downsampling (LeViT, Graham et al. 2021, sec. 4.2): the queries come from a
    subsampled grid of tokens, keys and values (a wider value per head) from every token."""

    def __init__(self, dim: int, out: int, key_dim: int, num_heads: int, res: int) -> None:
        super().__init__()
        self.num_heads, self.key_dim, self.val_dim = num_heads, key_dim, 2 * key_dim
        self.res = res
        self.kv = nn.Linear(dim, num_heads * (key_dim + self.val_dim))
        self.q = nn.Linear(dim, num_heads * key_dim)
        self.proj = nn.Linear(num_heads * self.val_dim, out)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        kv = self.kv(x).view(b, n, self.num_heads, -1)
        k, v = kv.split([self.key_dim, self.val_dim], dim=3)
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        sub = x.view(b, self.res, self.res, c)[:, ::2, ::2].reshape(b, -1, c)
        q = self.q(sub).view(b, -1, self.num_heads, self.key_dim).permute(0, 2, 1, 3)
        attn = (q @ k.transpose(-2, -1) * self.key_dim**-0.5).softmax(dim=-1)
        y = (attn @ v).transpose(1, 2).reshape(b, -1, self.num_heads * self.val_dim)
        return self.proj(F.hardswish(y))


class LeViTStage(nn.Module):
    """A patch embedding, one attention-downsampling block and a classifier on the mean."""

    def __init__(self, res: int, key_dim: int = 4, num_heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.down = AttentionSubsample(16, 24, key_dim, num_heads, res)
        self.head = nn.Linear(24, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.down(self.embed(x)).mean(1))


@pytest.mark.parametrize("res", [2, 3, 4])
def test_levit_downsampling_heads_are_pruned_exactly(res: int) -> None:
    """Queries of 1 (res 2 and 3: one token left by the stride-2 subsampling) or 4 tokens, with
    as many heads as channels per key (4 and 4, the case that put the head on the query's
    token dim): the heads are one group (q, k, v rows and the projection's columns), and after a
    random prune shrink equals the masked model and cost equals FlopCounterMode."""
    torch.manual_seed(res)
    model = LeViTStage(res).double().eval()
    x = torch.randn(2, res * res, 8, dtype=torch.float64)
    masks = fp.apply_masks(model, x)
    [heads] = [g for g in masks.groups.values() if "down.q" in g.producers]
    assert heads.producers == ["down.kv", "down.q"] and heads.num_channels == 4
    assert heads.channel_width == 4  # a head: 4 rows of q and k, 8 of v and projection columns
    assert_exact(model, masks, torch.randn(3, res * res, 8, dtype=torch.float64))


# ============================================== MaxViT-style relative-position bias
class RelPosBias(nn.Module):
    """A table of one learned bias per relative offset and head, gathered into a (heads,
    window, window) bias by a fixed index (Swin / MaxViT). ``fixed_shape``: the gathered
    table is viewed to a shape the module keeps as a tuple (heads count written in it)."""

    def __init__(self, window: int, num_heads: int, fixed_shape: bool) -> None:
        super().__init__()
        self.area = window * window
        self.bias_shape = (self.area, self.area, num_heads) if fixed_shape else None
        self.table = nn.Parameter(torch.randn((2 * window - 1) ** 2, num_heads))
        ij = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij"))
        rel = (ij.flatten(1)[:, :, None] - ij.flatten(1)[:, None, :]) + window - 1
        self.register_buffer("index", rel[0] * (2 * window - 1) + rel[1], persistent=False)

    def forward(self) -> Tensor:
        gathered = self.table[self.index.view(-1)]
        shape = self.bias_shape or (self.area, self.area, -1)
        return gathered.view(shape).permute(2, 0, 1).unsqueeze(0)


class WindowAttention(nn.Module):
    """Multi-head self-attention over one window with a relative-position bias per head; q, k
    and v from one projection viewed per head and chunked (timm's MaxViT writes it so)."""

    def __init__(self, dim: int, num_heads: int, window: int, fixed_shape: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.rel_pos = RelPosBias(window, num_heads, fixed_shape)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, self.num_heads, -1).transpose(1, 2).chunk(3, dim=3)
        attn = q @ k.transpose(-2, -1) * self.head_dim**-0.5 + self.rel_pos()
        return self.proj((attn.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1))


class MaxViTWindow(nn.Module):
    def __init__(self, fixed_shape: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.attn = WindowAttention(16, 4, 3, fixed_shape)
        self.fc = nn.Linear(16, 32)
        self.head = nn.Linear(32, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(F.gelu(self.fc(self.attn(self.embed(x)))).mean(1))


def test_relative_position_table_is_sliced_per_head() -> None:
    """A bias table viewed with -1 heads: each head's column of the table goes with its q, k,
    v rows; shrink slices the table and equals the masked model; cost equals FlopCounterMode."""
    torch.manual_seed(0)
    model = MaxViTWindow(fixed_shape=False).double().eval()
    masks = fp.apply_masks(model, torch.randn(2, 9, 8, dtype=torch.float64))
    [heads] = [g for g in masks.groups.values() if "attn.qkv" in g.producers]
    assert ("attn.rel_pos.table", 1) in heads.params and heads.num_channels == 4
    small = assert_exact(model, masks, torch.randn(3, 9, 8, dtype=torch.float64))
    assert small.attn.rel_pos.table.shape[1] < 4


def test_relative_position_table_with_a_fixed_shape_keeps_its_heads_whole() -> None:
    """A bias table viewed to a shape tuple the module keeps (the head count written in it,
    which shrink cannot update): apply_masks keeps the heads whole and says why in one line;
    the other groups (embedding, projection, MLP) stay masked, and shrink and cost work on them."""
    torch.manual_seed(0)
    model = MaxViTWindow(fixed_shape=True).double().eval()
    masks = fp.apply_masks(model, torch.randn(2, 9, 8, dtype=torch.float64))
    assert producers(masks) == [["embed"], ["attn.proj"], ["fc"]]
    [skip] = [s for s in masks.skipped if ("attn.rel_pos.table", 1) in s.params]
    assert skip.channels == 4 and "\n" not in skip.reason
    assert "shape '[9, 9, 4]' is invalid" in skip.reason and "kept whole" in skip.reason
    assert_exact(model, masks, torch.randn(3, 9, 8, dtype=torch.float64))


# ================================= MViT-v2-style attention: heads merged to output_dim
class PooledAttention(nn.Module):
    """torchvision's MViT-v2 attention cut down (no pooling): heads split by ``num_heads``,
    merged back by ``reshape(b, -1, self.output_dim)``, the query added as residual pooling."""

    def __init__(self, dim: int, output_dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = output_dim // num_heads
        self.output_dim = output_dim
        self.qkv = nn.Linear(dim, 3 * output_dim)
        self.project = nn.Linear(output_dim, output_dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).transpose(1, 3)
        q, k, v = qkv.unbind(dim=2)
        attn = (q * self.head_dim**-0.5) @ k.transpose(2, 3)
        x = attn.softmax(dim=-1) @ v + q
        return self.project(x.transpose(1, 2).reshape(b, -1, self.output_dim))


def test_heads_merged_to_an_output_dim_attribute_are_pruned_exactly() -> None:
    """MViT-v2 writes the merged heads' width as ``self.output_dim``: shrink sets it to the
    heads kept, so the heads are prunable and the shrunk model equals the masked one, with
    FlopCounterMode's count (before, every block's heads failed the trial shrink)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), PooledAttention(16, 24, 4), nn.Linear(24, 5))
    model = model.double().eval()
    masks = fp.apply_masks(model, torch.randn(2, 6, 8, dtype=torch.float64))
    [heads] = [g for g in masks.groups.values() if g.producers == ["1.qkv"]]
    assert heads.num_channels == 4
    small = assert_exact(model, masks, torch.randn(3, 6, 8, dtype=torch.float64))
    assert small[1].output_dim == small[1].project.in_features < 24


# ======================================= fused QKV, repeat of key/value heads (part 2)
class FusedQKV(nn.Module):
    """Self-attention from one fused q/k/v projection, split in two ways recent encoders
    write: ``"modernbert"``, ``view(b, t, 3, -1, head_dim).unbind(-3)`` (the 3 written into
    the code, the heads inferred); ``"eva"``, ``reshape(b, t, 3, num_heads, -1)`` then
    ``permute(2, 0, 3, 1, 4).unbind(0)`` (three parts unbound at fixed sizes)."""

    def __init__(self, dim: int, num_heads: int, style: str) -> None:
        super().__init__()
        self.head_dim, self.style = dim // num_heads, style
        if style == "eva":
            self.num_heads = num_heads
        self.Wqkv = nn.Linear(dim, 3 * dim)
        self.Wo = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        if self.style == "modernbert":
            q, k, v = self.Wqkv(x).view(b, t, 3, -1, self.head_dim).unbind(dim=-3)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        else:
            qkv = self.Wqkv(x).reshape(b, t, 3, self.num_heads, -1)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.Wo(y.transpose(1, 2).reshape(b, t, -1))


class RelativeKeys(nn.Module):
    """Disentangled attention as DeBERTa writes it: heads merged with the batch
    (``(b * heads, t, head_dim)``), and content-to-position scores against keys projected from
    relative-position embeddings once, ``repeat``-ed for every example."""

    def __init__(self, dim: int, num_heads: int, length: int) -> None:
        super().__init__()
        self.num_attention_heads = num_heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.pos_k = nn.Linear(dim, dim)
        self.rel = nn.Parameter(torch.randn(length, dim))
        self.out = nn.Linear(dim, dim)

    def heads(self, x: Tensor) -> Tensor:
        x = x.view(*x.shape[:-1], self.num_attention_heads, -1)
        return x.transpose(-3, -2).reshape(-1, x.shape[-3], x.shape[-1])

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        pos_k = self.heads(self.pos_k(self.rel)).repeat(b, 1, 1)
        scores = q @ k.transpose(-1, -2) + q @ pos_k.transpose(-1, -2)
        y = (scores.softmax(-1) @ v).view(b, self.num_attention_heads, t, -1)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class Encoder(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.embed, self.attn = nn.Linear(8, 16), attn
        self.head = nn.Linear(16, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.attn(self.embed(x)).mean(1))


@pytest.mark.parametrize(
    "attn",
    [
        pytest.param(lambda: FusedQKV(16, 4, "modernbert"), id="fused_modernbert"),
        pytest.param(lambda: FusedQKV(16, 4, "eva"), id="fused_eva"),
        pytest.param(lambda: RelativeKeys(16, 4, 6), id="repeat_deberta"),
    ],
)
def test_attention_heads_of_fused_and_repeated_projections_are_pruned_exactly(
    attn: Callable[[], nn.Module],
) -> None:
    """Each of the 4 heads is one channel of one group (its q, k, v rows, the repeated
    position keys' rows, and the output projection's columns), nothing is skipped for an
    unexpected reason, and after a random prune shrink equals the masked model and cost equals
    FlopCounterMode."""
    torch.manual_seed(0)
    model = Encoder(attn()).double().eval()
    masks = fp.apply_masks(model, torch.randn(2, 6, 8, dtype=torch.float64))
    [heads] = [g for g in masks.groups.values() if g.num_channels == 4]
    projection = "attn.Wo" if isinstance(model.attn, FusedQKV) else "attn.out"
    assert heads.channel_width == 4 and heads.consumers == [projection]
    assert not [s for s in masks.skipped if not s.expected]
    assert_exact(model, masks, torch.randn(3, 6, 8, dtype=torch.float64))


# ====================================== one trial for every group: same masks as before
BEFORE = json.loads((Path(__file__).parent / "masks_before_issue34.json").read_text())
#: masks found since, by later work: the stream of ConvNeXt's first stage, once channels-first
#: ``LayerNorm2d`` norms were recognised (it stayed unmasked then)
SINCE = {"foreign.convnext": {"fisherprune_masks.stem_0:out": 8}}


def _built(key: str) -> tuple[nn.Module, object]:
    """The model and example inputs ``key`` names in ``BEFORE`` (as they were recorded)."""
    kind, name = key.split(".")
    torch.manual_seed(0)
    if kind == "zoo":
        arch = zoo.ARCHS[name]
        return arch.build(seed=0).eval(), arch.example_input(2)
    if kind == "foreign":
        return zoo_foreign.ARCHS[name](0).eval(), zoo_foreign.image_input(2)
    build, inputs = test_hf_integration._models()[name]
    return build().eval(), inputs


@pytest.mark.parametrize("key", sorted(BEFORE))
def test_masks_found_are_those_found_before_groups_were_tried_together(key: str) -> None:
    """apply_masks finds the same masks, by name and width, as it did when each hidden-width
    group had a trial shrink of its own and other groups none (recorded with fisherprune at
    3b6eac9 in masks_before_issue34.json), on CNNs, hand-written and Hugging Face transformers,
    and those found since (``SINCE``)."""
    model, inputs = _built(key)
    masks = fp.apply_masks(model, inputs)
    assert {k: m.num_channels for k, m in masks.items()} == BEFORE[key] | SINCE.get(key, {})


def _hf_encoder(kind: str) -> tuple[nn.Module, dict[str, Tensor]]:
    """A 2-layer, 4-head ModernBERT or DeBERTa-v2 (relative attention, c2p and p2c) built
    from a tiny config, float64, eval mode, eager attention."""
    transformers = pytest.importorskip("transformers")
    small = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=40)
    common = dict(hidden_size=32, vocab_size=99, max_position_embeddings=64, **small)
    torch.manual_seed(0)
    if kind == "modernbert":
        cfg = transformers.ModernBertConfig(
            global_attn_every_n_layers=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            cls_token_id=1, sep_token_id=2, **common,
        )  # fmt: skip
        model = transformers.ModernBertModel(cfg)
    else:
        cfg = transformers.DebertaV2Config(
            relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
            max_relative_positions=16, **common,
        )  # fmt: skip
        model = transformers.DebertaV2Model(cfg)
    model.config._attn_implementation = "eager"
    ids = torch.randint(3, 99, (2, 8), generator=torch.Generator().manual_seed(0))
    return model.double().eval(), {"input_ids": ids}


@pytest.mark.parametrize("kind", ["modernbert", "deberta_v2"])
@pytest.mark.filterwarnings("ignore:the model's Hugging Face config still describes")
def test_hf_fused_and_repeated_attention_heads_are_pruned_exactly(kind: str) -> None:
    """Hugging Face ModernBERT (fused Wqkv viewed as (3, -1 heads, head_dim)) and DeBERTa-v2
    (position keys repeated per example): every layer's 4 heads are one masked group, no
    attention projection is left unmasked, and after a random prune the shrunk model's last
    hidden state equals the masked one's and FlopCounterMode equals computational_cost."""
    model, inputs = _hf_encoder(kind)
    masks = fp.apply_masks(model, inputs)
    heads = [g for g in masks.groups.values() if g.num_channels == 4]
    assert len(heads) == 2 and all(g.channel_width == 8 for g in heads)
    assert not [
        s for s in masks.skipped if any("attn" in p or "attention.self" in p for p, _ in s.params)
    ]
    prune_at_random(masks, 1)
    cost = fp.computational_cost(model, inputs).total
    small = fp.shrink(model)
    with torch.no_grad():
        got, want = small(**inputs).last_hidden_state, model(**inputs).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-9, rtol=0)
    assert cost == flops_per_example(small, inputs)
