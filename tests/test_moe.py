"""Mixture-of-experts layers (issue 34): the experts' weights stacked in 3-D parameters
(E, out, in) and run by ``torch._grouped_mm``, by a product of weights gathered per token, or
by a loop over experts that adds each expert's rows back with ``index_add_``.

Each model is masked, pruned at random and checked against references outside the code under
test: the masked model's own output and PyTorch's ``FlopCounterMode`` on the shrunk model
(given ``SAME_AS_TORCH``, which counts ``_grouped_mm`` as ``mm`` per group; the reference for
that formula is ``FlopCounterMode`` on the same products written as one ``mm`` per expert).
CPU's ``_grouped_mm`` computes in float32 only: its models are compared at float32's
tolerance; the others in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import fisherprune as fp
from fisherprune.cost.formulas import grouped_mm_flops
from tests.counted import call, flops_per_example, hf_moe

pytestmark = pytest.mark.skipif(
    not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped matrix product"
)

ATOL64 = 1e-9  # float64 output difference, relative to max(1, max |expected|)
ATOL32 = 1e-5  # float32 (CPU's grouped kernel)


# ================================================================ helpers


def _prune_at_random(masks: fp.AppliedMasks, seed: int) -> None:
    """Zero 30-50% of every mask's entries (at least one block of ``keep_multiple``, never
    all), keeping a multiple of each mask's ``keep_multiple``."""
    gen = torch.Generator().manual_seed(seed)
    for m in masks.values():
        n, step = m.num_channels, m.keep_multiple
        k = round((0.3 + 0.2 * float(torch.rand(1, generator=gen))) * n / step) * step
        k = min(n - step, max(step, k))
        if k > 0:
            m.mask[torch.randperm(n, generator=gen)[:k]] = 0.0


def _assert_exact(
    model: nn.Module, masks: fp.AppliedMasks, inputs: object, atol: float
) -> nn.Module:
    """Prune at random; the shrunk model gives the masked model's output and FlopCounterMode
    on it equals computational_cost of the masked model. Returns the shrunk model."""
    _prune_at_random(masks, 0)
    with torch.no_grad():
        expected = call(model, inputs)
        cost = fp.computational_cost(model, inputs).total
        small = fp.shrink(model)
        actual = call(small, inputs)
    assert actual.shape == expected.shape
    scale = max(1.0, float(expected.abs().max()))
    assert float((actual - expected).abs().max()) <= atol * scale
    assert flops_per_example(small, inputs) == cost
    return small


# ================================================== a hand-written grouped-mm MoE
class Experts(nn.Module):
    """``num_experts`` gated MLPs (SwiGLU) stacked in two 3-D parameters, run three ways:
    ``"grouped"`` (tokens sorted by expert, one ``torch._grouped_mm`` per projection),
    ``"gathered"`` (each token-expert pair's weights gathered, one ``bmm``) and ``"loop"``
    (one ``F.linear`` per expert hit, the rows added back with ``index_add_``)."""

    def __init__(self, dim: int, width: int, num_experts: int, style: str) -> None:
        super().__init__()
        self.num_experts, self.style = num_experts, style
        self.gate_up = nn.Parameter(torch.randn(num_experts, 2 * width, dim) / math.sqrt(dim))
        self.down = nn.Parameter(torch.randn(num_experts, dim, width) / math.sqrt(width))
        self.act = nn.SiLU()

    def _mlp(self, h: Tensor) -> Tensor:  # (S, 2 * width) -> (S, width)
        gate, up = h.chunk(2, dim=-1)
        return self.act(gate) * up

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        # x (T, D); ids, weights (T, k): each token's experts and their routing weights
        k = ids.shape[1]
        if self.style == "loop":
            out = torch.zeros_like(x)
            for e in range(self.num_experts):
                tok, slot = torch.where(ids == e)
                h = self._mlp(F.linear(x[tok], self.gate_up[e]))
                y = F.linear(h, self.down[e]) * weights[tok, slot, None]
                out.index_add_(0, tok, y)
            return out
        flat = ids.reshape(-1)  # (T * k,)
        if self.style == "gathered":
            xs = x.repeat_interleave(k, dim=0)  # (T * k, D)
            h = self._mlp(torch.bmm(self.gate_up[flat], xs.unsqueeze(-1)).squeeze(-1))
            y = torch.bmm(self.down[flat], h.unsqueeze(-1)).squeeze(-1)
        else:
            order = torch.argsort(flat, stable=True)
            offs = torch.cumsum(torch.bincount(flat, minlength=self.num_experts), 0).int()
            xs = x[order // k]
            h = self._mlp(torch._grouped_mm(xs, self.gate_up.transpose(1, 2), offs=offs))
            y = torch._grouped_mm(h, self.down.transpose(1, 2), offs=offs)[order.argsort()]
        return (y * weights.reshape(-1, 1)).view(-1, k, y.shape[-1]).sum(1)


class MoEBlock(nn.Module):
    """Pre-norm residual block: a router (softmax, top-2) picks each token's experts."""

    def __init__(self, dim: int, width: int, num_experts: int, style: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(dim, width, num_experts, style)

    def forward(self, x: Tensor) -> Tensor:  # (N, L, D)
        n, length, d = x.shape
        h = self.norm(x).reshape(-1, d)
        probs = self.router(h).softmax(-1)
        weights, ids = probs.topk(2, dim=-1)
        return x + self.experts(h, ids, weights).view(n, length, d)


class MoENet(nn.Module):
    """Two MoE blocks between an input and an output projection."""

    def __init__(self, style: str, dim: int = 16, width: int = 12, num_experts: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(6, dim)
        self.blocks = nn.Sequential(*(MoEBlock(dim, width, num_experts, style) for _ in "ab"))
        self.out = nn.Linear(dim, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.blocks(self.inp(x)))


def _moe_net(style: str) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    dtype = torch.float32 if style == "grouped" else torch.float64
    x = torch.randn(2, 8, 6, generator=torch.Generator().manual_seed(1), dtype=dtype)
    return MoENet(style).to(dtype).eval(), x


def _widths(masks: fp.AppliedMasks) -> dict[str, tuple[int, int]]:
    """(channels, keep_multiple) of every mask, by its group's first parameter dim."""
    return {
        "{}[{}]".format(*masks.groups[k].params[0]): (m.num_channels, m.keep_multiple)
        for k, m in masks.items()
    }


@pytest.mark.parametrize("style", ["grouped", "gathered", "loop"])
def test_expert_and_hidden_widths_are_masked(style: str) -> None:
    """The hidden width (through router and experts) and each layer's experts' width are
    masked groups; in float32 grouped products keep multiples of 4 channels (16-byte rows).
    Only the experts themselves (the router's rows) are left whole."""
    model, x = _moe_net(style)
    masks = fp.apply_masks(model, x)
    mult = 4 if style == "grouped" else 1
    assert _widths(masks) == {
        "inp.weight[0]": (16, mult),
        "blocks.0.experts.gate_up[1]": (12, mult),
        "blocks.1.experts.gate_up[1]": (12, mult),
    }
    assert {p for s in masks.skipped if not s.expected for p, _ in s.params} == {
        "blocks.0.router.weight",
        "blocks.1.router.weight",
    }


@pytest.mark.parametrize("style", ["grouped", "gathered", "loop"])
def test_hand_written_moe_shrinks_exactly(style: str) -> None:
    """After a random prune the shrunk model's output equals the masked one's, FlopCounterMode
    on it equals computational_cost, and the 3-D expert weights lost the pruned rows."""
    model, x = _moe_net(style)
    masks = fp.apply_masks(model, x)
    small = _assert_exact(model, masks, x, ATOL32 if style == "grouped" else ATOL64)
    gate_up = small.blocks[0].experts.gate_up
    assert gate_up.shape[0] == 4 and gate_up.shape[1] < 24 and gate_up.shape[2] < 16


def test_grouped_mm_flops_equal_one_mm_per_expert() -> None:
    """grouped_mm_flops of (S, K) by (E, K, N) equals FlopCounterMode's count of the same
    products written as one ``mm`` per expert (uneven groups, an empty one included)."""
    a, b = torch.randn(11, 8), torch.randn(4, 8, 12)
    offs = torch.tensor([3, 3, 9, 11], dtype=torch.int32)
    with FlopCounterMode(display=False) as counter:
        start = 0
        for g, end in enumerate(offs.tolist()):
            a[start:end] @ b[g]
            start = end
    out = torch._grouped_mm(a, b, offs=offs)
    assert grouped_mm_flops(a.shape, b.shape, out_shape=out.shape) == counter.get_total_flops()
    batched = grouped_mm_flops(torch.Size([4, 5, 8]), b.shape, out_shape=torch.Size([4, 5, 12]))
    assert batched == 2 * 4 * 5 * 8 * 12


def test_prune_keeps_multiples_a_grouped_product_needs() -> None:
    """Pruning step by step never leaves a width a grouped product reads at a count its
    kernel refuses (a multiple of 4 in float32), and the model shrinks after every step."""
    model, x = _moe_net("grouped")
    masks = fp.apply_masks(model, x)
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        scores = {k: torch.rand(m.num_channels, generator=gen) for k, m in masks.items()}
        fp.prune(masks, scores, min_channels=4)
        for m in masks.values():
            assert m.kept % m.keep_multiple == 0
        with torch.no_grad():
            fp.shrink(model)(x)
        assert step < 5 or sum(m.num_channels - m.kept for m in masks.values()) >= 6


# ============================================= Hugging Face MoE decoders, tiny configs
HF_CASES = [
    (kind, experts)
    for kind in ("qwen3_moe", "mixtral")
    for experts in ("grouped_mm", "batched_mm", "eager")
]


@pytest.mark.parametrize(("kind", "experts"), HF_CASES)
@pytest.mark.filterwarnings("ignore:the model's Hugging Face config still describes")
def test_hf_moe_decoders_shrink_exactly(kind: str, experts: str) -> None:
    """Qwen3-MoE and Mixtral: the hidden width and every layer's experts' width are masked
    (only the router's experts and the vocabulary are not); after a random prune the shrunk
    model's logits equal the masked one's and FlopCounterMode equals computational_cost."""
    model, inputs = hf_moe(kind, experts)
    masks = fp.apply_masks(model, inputs)
    widths = sorted(m.num_channels for m in masks.values())
    assert widths == [2, 2, 16, 16, 32] if kind == "qwen3_moe" else [2, 2, 24, 24, 32]
    left = {p for s in masks.skipped for p, _ in s.params}
    assert left == {"lm_head.weight"} | {f"model.layers.{i}.mlp.gate.weight" for i in (0, 1)}
    _assert_exact(model, masks, inputs, ATOL32 if experts == "grouped_mm" else ATOL64)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_hf_moe_flops_are_prunable(kind: str) -> None:
    """At least 85% of a MoE decoder's FLOPs depend on a masked group (the issue's floor):
    the cost model with every mask entry 0 keeps under 15% of the dense cost."""
    model, inputs = hf_moe(kind, "grouped_mm")
    fp.apply_masks(model, inputs)
    cm = fp.CostModel(model, inputs)
    assert cm.dense_total() == flops_per_example(model, inputs)
    assert cm.total(np.zeros(cm.graph.n_entries)) <= 0.15 * cm.dense_total()


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_hf_moe_config_follows_and_reloads(kind: str, tmp_path) -> None:
    """Pruned alike in every layer, the shrunk model's config holds its hidden and experts'
    widths, and save_pretrained / from_pretrained gives back the masked model's logits."""
    model, inputs = hf_moe(kind, "batched_mm")
    masks = fp.apply_masks(model, inputs)
    with torch.no_grad():
        for m in masks.values():
            m.mask[: m.num_channels // 4] = 0.0
        expected = call(model, inputs)
    small = fp.shrink(model)
    field = "moe_intermediate_size" if kind == "qwen3_moe" else "intermediate_size"
    assert small.config.hidden_size == 24
    assert getattr(small.config, field) == (12 if kind == "qwen3_moe" else 18)
    small.save_pretrained(tmp_path)
    again = type(small).from_pretrained(tmp_path, dtype=torch.float64).eval()
    again.config._attn_implementation = "eager"
    again.config._experts_implementation = "batched_mm"
    with torch.no_grad():
        torch.testing.assert_close(call(again, inputs), expected, atol=ATOL64, rtol=0)
