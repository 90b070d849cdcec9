"""The channel rules that transformer-style models need (issue 16, item 4), on tiny models
written here from their published designs (nothing copied, nothing downloaded):

* a Swin block (shifted windows: ``roll``, window partition, relative position bias,
  LayerNorm, MLP) and a Swin-V2 block (cosine attention through ``F.normalize``, a learned
  logit scale, a continuous position bias MLP, post-norm);
* a token model, (N, L, C), whose hidden units pass through ``F.pad`` along L, a roll along L,
  slicing, the class token ``x[:, 0]``, ``index_select``, ``gather`` and ``x[:, idx]``;
* a pre-norm block using ``F.scaled_dot_product_attention`` (on CPU the fused
  ``_scaled_dot_product_flash_attention_for_cpu`` op);
* a detector-like model that returns no box (an output of shape (0, 4));
* GPT-2 from Hugging Face ``transformers`` (skipped when it is not installed), whose MLP is
  made of ``Conv1D`` layers, weights stored (in, out), with eager and with SDPA attention.

Each case is built in float64, masked by ``apply_masks`` on a batch of 2 and pruned at random;
its invariants are checked against references outside the code under test: the masked model's
own outputs (batch 3), ``FlopCounterMode`` on the shrunk model, and the groups each design
implies, written by hand below. Heads are not prunable yet (attention-head support is another
change); the MLP hidden units are, and must be exact.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

import fisherprune as fp
from fisherprune.cost.formulas import SAME_AS_TORCH
from fisherprune.export.modules import update_metadata
from fisherprune.graph import trace_model
from fisherprune.graph.rules_sdpa import FUSED_ATTENTION
from fisherprune.graph.types import RuleContext, TensorInfo

ATOL = 1e-10  # float64 output difference, relative to max(1, max |expected output|)
TRACE_BATCH = 2
CHECK_BATCH = 3

ParamDims = frozenset[tuple[str, int]]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads on a shared 2-core machine: use one, then
    restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ================================================================ Swin parts
def _window_partition(x: Tensor, ws: int) -> Tensor:
    """(N, H, W, C) -> (N * H/ws * W/ws, ws * ws, C): non-overlapping ws x ws windows."""
    n, h, w, c = x.shape
    x = x.view(n, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, ws * ws, c)


def _window_merge(windows: Tensor, ws: int, n: int, h: int, w: int) -> Tensor:
    """The inverse of ``_window_partition``: back to (N, H, W, C)."""
    c = windows.shape[-1]
    x = windows.view(n, h // ws, w // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, h, w, c)


def _relative_index(ws: int) -> Tensor:
    """(ws*ws * ws*ws,) index into a ((2ws-1)^2, heads) table of the offset between every
    pair of positions of a window."""
    rows, cols = torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")
    pos = torch.stack([rows.flatten(), cols.flatten()])  # (2, T)
    offset = pos[:, :, None] - pos[:, None, :] + (ws - 1)  # (2, T, T), each in [0, 2ws-2]
    return (offset[0] * (2 * ws - 1) + offset[1]).flatten()


def _shift_mask(size: int, ws: int, shift: int) -> Tensor:
    """(windows, T, T): 0 between positions of the same region of the rolled image, -100
    between regions that the roll brought together (they must not attend to each other)."""
    region = torch.zeros(1, size, size, 1)
    bands = (slice(0, size - ws), slice(size - ws, size - shift), slice(size - shift, size))
    for i, rows in enumerate(bands):
        for j, cols in enumerate(bands):
            region[:, rows, cols, :] = 3 * i + j
    ids = _window_partition(region, ws).squeeze(-1)  # (windows, T)
    return (ids[:, None, :] != ids[:, :, None]).double() * -100.0


def _log_coords_table(ws: int) -> Tensor:
    """(1, 2ws-1, 2ws-1, 2): Swin-V2's log-spaced relative coordinates."""
    r = torch.arange(-(ws - 1), ws, dtype=torch.float64) / (ws - 1) * 8
    table = torch.stack(torch.meshgrid(r, r, indexing="ij"), dim=-1)[None]
    return torch.sign(table) * torch.log2(table.abs() + 1.0) / math.log2(8)


class Mlp(nn.Module):
    """fc1 -> GELU -> fc2: the hidden units are the prunable channels."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class WindowAttention(nn.Module):
    """Multi-head self-attention inside each window, with a learned relative position bias
    (Swin) or, with ``cosine``, Swin-V2's scaled cosine attention and a continuous position
    bias computed by a small MLP from log-spaced coordinates."""

    def __init__(self, dim: int, heads: int, ws: int, *, cosine: bool = False) -> None:
        super().__init__()
        self.heads, self.cosine = heads, cosine
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("rel_index", _relative_index(ws))
        if cosine:
            self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(heads, 1, 1)))
            self.cpb_mlp = nn.Sequential(
                nn.Linear(2, 12), nn.ReLU(), nn.Linear(12, heads, bias=False)
            )
            self.register_buffer("coords_table", _log_coords_table(ws))
        else:
            self.bias_table = nn.Parameter(0.1 * torch.randn((2 * ws - 1) ** 2, heads))

    def _position_bias(self, t: int) -> Tensor:
        """(heads, T, T)."""
        if self.cosine:
            table = self.cpb_mlp(self.coords_table).view(-1, self.heads)
            return 16 * torch.sigmoid(table[self.rel_index].view(t, t, -1).permute(2, 0, 1))
        return self.bias_table[self.rel_index].view(t, t, -1).permute(2, 0, 1)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:  # x (B, T, C), mask (windows, T, T)
        b, t, c = x.shape
        qkv = self.qkv(x).reshape(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, heads, T, head_dim) each
        if self.cosine:
            attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
            attn = attn * torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
        else:
            attn = (q * (c // self.heads) ** -0.5) @ k.transpose(-2, -1)
        attn = attn + self._position_bias(t).unsqueeze(0)
        nw = mask.shape[0]
        attn = (attn.view(b // nw, nw, self.heads, t, t) + mask[None, :, None]).view(b, -1, t, t)
        out = (attn.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(out)


class SwinBlock(nn.Module):
    """A shifted-window block on (N, H, W, C): pre-norm (Swin) or, with ``v2``, post-norm
    with cosine attention (Swin-V2). The roll over H and W must keep the channels of C."""

    def __init__(
        self, dim: int = 16, heads: int = 2, ws: int = 4, size: int = 8, *, v2: bool = False
    ) -> None:
        super().__init__()
        self.ws, self.shift, self.v2 = ws, ws // 2, v2
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, ws, cosine=v2)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 2 * dim)
        self.register_buffer("attn_mask", _shift_mask(size, ws, self.shift))

    def _shifted_attention(self, x: Tensor) -> Tensor:
        n, h, w, _ = x.shape
        s = self.shift
        y = torch.roll(x, shifts=(-s, -s), dims=(1, 2))
        y = self.attn(_window_partition(y, self.ws), self.attn_mask)
        return torch.roll(_window_merge(y, self.ws, n, h, w), shifts=(s, s), dims=(1, 2))

    def forward(self, x: Tensor) -> Tensor:  # (N, H, W, C)
        if self.v2:
            x = x + self.norm1(self._shifted_attention(x))
            return x + self.norm2(self.mlp(x))
        x = x + self._shifted_attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SwinNet(nn.Module):
    """Patch embedding (a Linear on 3 input channels), one shifted-window block, a pooled
    head: (N, 8, 8, 3) -> (N, 5)."""

    def __init__(self, *, v2: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 16)
        self.block = SwinBlock(v2=v2)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.block(self.embed(x))).mean(dim=(1, 2)))


# ======================================================== the other models
class TokenNet(nn.Module):
    """(N, L, 6) tokens. fc1's 12 hidden units pass through F.pad along L (constant and, in
    (N, C, L) layout, replicate), a roll along L, a slice, the class token ``h[:, 0]``,
    ``index_select``, ``gather`` and ``h[:, idx]`` before fc2 reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 4)
        self.register_buffer("pick", torch.tensor([0, 2, 3]))

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.fc1(x))  # (N, L, 12)
        h = F.pad(h, (0, 0, 1, 2))  # (N, L + 3, 12): L padded, C untouched
        h = torch.roll(h, shifts=1, dims=1)
        h = F.pad(h.transpose(1, 2), (1, 1), mode="replicate").transpose(1, 2)  # (N, L + 5, 12)
        index = self.pick.view(1, -1, 1).expand(h.shape[0], -1, h.shape[2])
        parts = [
            h[:, 0],  # the class token
            h[:, 1:-1].mean(1),
            h.index_select(1, self.pick).mean(1),
            torch.gather(h, 1, index).mean(1),
            h[:, self.pick].mean(1),
        ]
        return sum(self.fc2(p) for p in parts)


class SdpaBlock(nn.Module):
    """A pre-norm transformer block on (N, L, 16) whose attention is
    ``F.scaled_dot_product_attention`` (causal), then a pooled head."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 2 * dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: Tensor) -> Tensor:
        n, length, c = x.shape
        qkv = self.qkv(self.norm1(x)).view(n, length, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(n, length, c))
        x = x + self.mlp(self.norm2(x))
        return self.head(x.mean(1))


class NoBoxes(nn.Module):
    """A detector-like model: class logits, and the boxes whose score passes a threshold that
    none passes, an output of shape (0, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 4, 1)
        self.cls = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        f = self.conv2(torch.relu(self.conv1(x)))  # (N, 4, H, W)
        boxes = f.flatten(2).transpose(1, 2).reshape(-1, 4)  # (N * H * W, 4)
        keep = boxes.sum(-1) > 1e9
        return self.cls(f.mean(dim=(2, 3))), boxes[keep]


# ============================================================== GPT-2
GPT2_CONFIG = {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 99, "n_positions": 16}


def _gpt2(attention: str) -> Callable[[int], nn.Module]:
    """A builder of GPT-2 with ``attention`` ("eager": matmul and softmax; "sdpa": the fused
    op), called positionally with token ids (keyword inputs are another change)."""

    def build(seed: int) -> nn.Module:
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(seed)
        config = transformers.GPT2Config(**GPT2_CONFIG, attn_implementation=attention)
        return transformers.GPT2LMHeadModel(config)

    return build


def _token_ids(batch: int, seed: int) -> tuple[Tensor]:
    return (torch.randint(0, GPT2_CONFIG["vocab_size"], (batch, 8), generator=_gen(seed)),)


# ================================================================ cases
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _linear_out(m: str, *, bias: bool = True) -> set[tuple[str, int]]:
    return {(f"{m}.weight", 0)} | ({(f"{m}.bias", 0)} if bias else set())


def _hidden(fc1: str, fc2: str) -> ParamDims:
    """The dims of channels fc1 makes and fc2 reads (Linear or conv): fc1's output rows and
    bias, fc2's input columns."""
    return frozenset(_linear_out(fc1) | {(f"{fc2}.weight", 1)})


def _gpt2_heads(layer: int) -> ParamDims:
    """GPT-2's attention heads: c_attn's columns and bias (q, k and v of each head, split
    from one Conv1D) and the rows of c_proj that read the heads."""
    m = f"transformer.h.{layer}.attn"
    return frozenset(
        {(f"{m}.c_attn.weight", 1), (f"{m}.c_attn.bias", 0), (f"{m}.c_proj.weight", 0)}
    )


def _gpt2_groups() -> dict[str, ParamDims]:
    out = {f"transformer.h.{i}.mlp.c_fc": _gpt2_hidden(i) for i in range(2)}
    out.update({f"transformer.h.{i}.attn.c_attn": _gpt2_heads(i) for i in range(2)})
    out["transformer.wte"] = _gpt2_width()
    return out


def _gpt2_width() -> ParamDims:
    """GPT-2's hidden width (the residual stream): the columns of the token and position
    embeddings (the token embedding is also the tied output layer), what each block adds to
    the stream (attention's and the MLP's c_proj: Conv1D columns and bias), what reads it
    (c_attn's and c_fc's rows) and every layer norm's weight and bias."""
    dims = {("transformer.wte.weight", 1), ("transformer.wpe.weight", 1)}
    dims |= {("transformer.ln_f.weight", 0), ("transformer.ln_f.bias", 0)}
    for i in range(GPT2_CONFIG["n_layer"]):
        b = f"transformer.h.{i}"
        for ln in ("ln_1", "ln_2"):
            dims |= {(f"{b}.{ln}.weight", 0), (f"{b}.{ln}.bias", 0)}
        for proj in ("attn.c_proj", "mlp.c_proj"):
            dims |= {(f"{b}.{proj}.weight", 1), (f"{b}.{proj}.bias", 0)}
        dims |= {(f"{b}.attn.c_attn.weight", 0), (f"{b}.mlp.c_fc.weight", 0)}
    return frozenset(dims)


def _gpt2_hidden(layer: int) -> ParamDims:
    """GPT-2's MLP hidden units: Conv1D weights are (in, out), so c_fc's columns and bias and
    c_proj's rows."""
    m = f"transformer.h.{layer}.mlp"
    return frozenset({(f"{m}.c_fc.weight", 1), (f"{m}.c_fc.bias", 0), (f"{m}.c_proj.weight", 0)})


@dataclass(frozen=True)
class Arch:
    """How to build one architecture, its inputs, and the channel groups its design implies
    (by producing module)."""

    build: Callable[[int], nn.Module]
    inputs: Callable[[int, int], tuple[Tensor, ...]]  # (batch, seed) -> positional inputs
    groups: dict[str, ParamDims]


def _floats(*shape: int) -> Callable[[int, int], tuple[Tensor, ...]]:
    def make(batch: int, seed: int) -> tuple[Tensor, ...]:
        return (torch.randn(batch, *shape, generator=_gen(seed), dtype=torch.float64),)

    return make


def _seeded(cls: Callable[[], nn.Module]) -> Callable[[int], nn.Module]:
    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return cls()

    return build


ARCHS: dict[str, Arch] = {
    "swin": Arch(
        _seeded(SwinNet),
        _floats(8, 8, 3),
        {"block.mlp.fc1": _hidden("block.mlp.fc1", "block.mlp.fc2")},
    ),
    "swinv2": Arch(
        _seeded(lambda: SwinNet(v2=True)),
        _floats(8, 8, 3),
        {
            "block.mlp.fc1": _hidden("block.mlp.fc1", "block.mlp.fc2"),
            "block.attn.cpb_mlp.0": _hidden("block.attn.cpb_mlp.0", "block.attn.cpb_mlp.2"),
        },
    ),
    "tokens": Arch(_seeded(TokenNet), _floats(5, 6), {"fc1": _hidden("fc1", "fc2")}),
    "sdpa": Arch(_seeded(SdpaBlock), _floats(6, 16), {"mlp.fc1": _hidden("mlp.fc1", "mlp.fc2")}),
    "no_boxes": Arch(_seeded(NoBoxes), _floats(3, 6, 6), {"conv1": _hidden("conv1", "conv2")}),
    "gpt2": Arch(_gpt2("eager"), _token_ids, _gpt2_groups()),
    "gpt2_sdpa": Arch(_gpt2("sdpa"), _token_ids, _gpt2_groups()),
}


@dataclass(frozen=True)
class Case:
    """One architecture, masked and pruned at random, with the masked model's outputs."""

    name: str
    masked: nn.Module  # float64, eval, masks applied and partly zeroed
    masks: fp.AppliedMasks
    x: tuple[Tensor, ...]  # the traced inputs (batch TRACE_BATCH)
    check: tuple[Tensor, ...]  # other inputs (batch CHECK_BATCH)
    expected: list[Tensor]  # the masked model's outputs on ``check``
    small: nn.Module  # fp.shrink(masked, x)


def _outputs(model: nn.Module, args: tuple[Tensor, ...]) -> list[Tensor]:
    with torch.no_grad():
        out = model(*args)
    return [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]


def _prune_at_random(masks: fp.AppliedMasks, seed: int) -> None:
    """Zero about 40% of the entries of every mask (at least one, never all)."""
    gen = _gen(seed)
    for m in masks.values():
        n = m.num_channels
        k = min(n - 1, max(1, round(0.4 * n)))
        m.mask[torch.randperm(n, generator=gen)[:k]] = 0.0


def _make_case(name: str) -> Case:
    arch = ARCHS[name]
    model = arch.build(0).double().eval()
    x, check = arch.inputs(TRACE_BATCH, 0), arch.inputs(CHECK_BATCH, 1)
    masks = fp.apply_masks(model, x)
    _prune_at_random(masks, 0)
    expected = _outputs(model, check)
    return Case(name, model, masks, x, check, expected, fp.shrink(model, x))


@pytest.fixture(scope="module")
def cases() -> Callable[[str], Case]:
    """``cases(name)``: the case, built on first use and kept for the module."""
    built: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in built:
            built[name] = _make_case(name)
        return built[name]

    return get


def _assert_close(actual: Tensor, expected: Tensor) -> None:
    assert actual.shape == expected.shape
    if expected.numel() == 0:
        return
    scale = max(1.0, float(expected.abs().max()))
    err = float((actual - expected).abs().max())
    assert err <= ATOL * scale, f"max abs error {err:.3g} > {ATOL * scale:.3g}"


def _flops_per_example(model: nn.Module, args: tuple[Tensor, ...]) -> float:
    """FlopCounterMode's count per example, with autograd enabled (its default), given
    torch's own flash-attention formula for CPU's fused attention op, which it lacks."""
    with FlopCounterMode(display=False, custom_mapping=dict(SAME_AS_TORCH)) as counter:
        model(*args)
    return counter.get_total_flops() / args[0].shape[0]


each_arch = pytest.mark.parametrize("name", list(ARCHS))


# ============================================================ invariants
@each_arch
def test_groups_are_the_design_ones(name: str, cases: Callable[[str], Case]) -> None:
    """apply_masks finds exactly the groups the design implies (the MLP hidden units; the
    continuous position bias MLP's too in Swin-V2; conv1 in the detector), each with the
    parameter dims written above."""
    case = cases(name)
    found = {g.producers[0]: frozenset(g.params) for g in case.masks.groups.values()}
    assert found == ARCHS[name].groups


@each_arch
def test_no_rule_failed_and_no_op_lacks_a_rule(name: str, cases: Callable[[str], Case]) -> None:
    """Every op on the way has a rule that ran (roll, pad, index, norm with p, fused attention):
    no skipped channels are put down to a missing or failing rule."""
    case = cases(name)
    reasons = [s.reason for s in case.masks.skipped]
    assert not [r for r in reasons if "has no channel rule" in r or "rule failed" in r], reasons


@each_arch
def test_shrunk_output_equals_masked_output(name: str, cases: Callable[[str], Case]) -> None:
    """The shrunk model's outputs equal the masked model's in float64, on inputs other than
    the traced ones."""
    case = cases(name)
    got = _outputs(case.small, case.check)
    assert len(got) == len(case.expected)
    for a, b in zip(got, case.expected, strict=True):
        _assert_close(a, b)


@each_arch
def test_shrunk_flops_equal_cost_of_masked_model(name: str, cases: Callable[[str], Case]) -> None:
    """FlopCounterMode on the shrunk model, per example, equals computational_cost of the
    masked one, and pruning lowered it (the check is not vacuous)."""
    case = cases(name)
    cost = fp.computational_cost(case.masked, case.check)
    assert _flops_per_example(case.small, case.check) == cost.total
    assert cost.total < fp.computational_cost(ARCHS[name].build(0).double(), case.check).total


@each_arch
def test_shrink_removes_parameters(name: str, cases: Callable[[str], Case]) -> None:
    """The shrunk model has fewer parameters than the masked one."""
    case = cases(name)
    n_small = sum(p.numel() for p in case.small.parameters())
    assert n_small < sum(p.numel() for p in case.masked.parameters())


# ------------------------------------------------------------------ roll
class RollNet(nn.Module):
    """conv1 -> roll -> conv2 on (N, 4, 6, 6), rolling ``dims`` by 2 (no dims: the
    flattened tensor)."""

    def __init__(self, dims: tuple[int, ...]) -> None:
        super().__init__()
        self.dims = dims
        self.conv1 = nn.Conv2d(4, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.conv1(x))
        if not self.dims:
            return self.conv2(torch.roll(h, 2))
        return self.conv2(torch.roll(h, shifts=[2] * len(self.dims), dims=self.dims))


def test_roll_over_spatial_dims_keeps_conv_channels_exact() -> None:
    """Rolling H and W keeps conv1's channels one group, and the shrunk model is exact."""
    torch.manual_seed(0)
    model = RollNet((2, 3)).double().eval()
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    masks = fp.apply_masks(model, x, strict=True)
    [mask] = masks.values()
    mask.mask[[1, 4]] = 0.0
    small = fp.shrink(model, x)
    assert small.conv1.out_channels == 4
    _assert_close(_outputs(small, (x,))[0], _outputs(model, (x,))[0])


@pytest.mark.parametrize("dims", [(1,), ()], ids=["channel-dim", "flattened"])
def test_roll_over_channels_blocks_them_with_a_reason(dims: tuple[int, ...]) -> None:
    """Rolling the channel dim (or the flattened tensor) by a fixed shift blocks conv1's
    channels, named with the roll."""
    model = RollNet(dims).double().eval()
    masks = fp.apply_masks(model, torch.randn(2, 4, 6, 6, dtype=torch.float64))
    assert not masks.groups
    [skip] = [s for s in masks.skipped if ("conv1.weight", 0) in s.params]
    assert "aten.roll" in skip.reason and "roll" in skip.reason.split("aten.roll", 1)[1]


class PooledTokens(nn.Module):
    """Swin's head: tokens (N, L, C) normalised, transposed and pooled by
    ``nn.AdaptiveAvgPool1d(1)`` (with autograd on, an in-place ``as_strided_`` fixes the
    pooled layout before the squeeze), then a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.pool(self.norm(self.embed(x)).transpose(1, 2))
        return self.head(torch.flatten(h, 1))


def test_adaptive_pool_over_tokens_keeps_the_width_prunable_and_exact() -> None:
    torch.manual_seed(0)
    model = PooledTokens().double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    masks = fp.apply_masks(model, x, strict=True)
    [mask] = masks.values()
    assert mask.num_channels == 8
    mask.mask[[0, 5]] = 0.0
    small = fp.shrink(model, x)
    assert small.head.in_features == 6
    _assert_close(_outputs(small, (x,))[0], _outputs(model.eval(), (x,))[0])


def test_as_strided_in_a_new_order_blocks_the_channels() -> None:
    class Restride(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: Tensor) -> Tensor:  # a transpose written as as_strided
            return self.b(torch.as_strided(self.a(x), (4, 4), (1, 4)))

    masks = fp.apply_masks(Restride(), torch.randn(4, 4))
    assert not masks.groups
    assert any("as_strided" in s.reason for s in masks.skipped)


# ------------------------------------------------------- pad, select, reduce
class ChannelPadNet(nn.Module):
    """conv1's channels padded with zero channels (a ResNet "option A" shortcut)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv2(F.pad(torch.relu(self.conv1(x)), (0, 0, 0, 0, 2, 2)))


def test_padding_the_channel_dim_blocks_it() -> None:
    """F.pad along the channel dim (fixed widths) blocks conv1's channels, naming the pad."""
    masks = fp.apply_masks(ChannelPadNet().double(), torch.randn(2, 3, 5, 5).double())
    [skip] = [s for s in masks.skipped if ("conv1.weight", 0) in s.params]
    assert "constant_pad_nd" in skip.reason and "pads" in skip.reason


class SelectChannelNet(nn.Module):
    """fc1's last hidden unit taken by position: for its shape only (as BART's encoder feeds
    ``inputs_embeds[:, :, -1]`` to its positional embedding), or for its value."""

    def __init__(self, use_value: bool) -> None:
        super().__init__()
        self.use_value = use_value
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)
        self.pos = nn.Parameter(torch.randn(6, 8))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.fc1(x))  # (N, L, 8)
        last = h[:, :, -1]
        h = h + self.pos[: last.shape[1]]
        if self.use_value:
            h = h * last.unsqueeze(-1)
        return self.fc2(h).sum(1)


def test_a_channel_selected_for_its_shape_only_stays_prunable() -> None:
    torch.manual_seed(0)
    model = SelectChannelNet(use_value=False).double().eval()
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    masks = fp.apply_masks(model, x, strict=True)
    [mask] = masks.values()
    mask.mask[[7, 2]] = 0.0  # the selected position's channel among them
    small = fp.shrink(model, x)
    assert small.fc1.out_features == 6
    _assert_close(_outputs(small, (x,))[0], _outputs(model, (x,))[0])


def test_a_channel_selected_for_its_value_blocks_the_width() -> None:
    masks = fp.apply_masks(SelectChannelNet(use_value=True).double(), torch.randn(2, 5, 4).double())
    [skip] = [s for s in masks.skipped if ("fc1.weight", 0) in s.params]
    assert "selects one channel by position" in skip.reason


class PickChannelsNet(nn.Module):
    """fc1's hidden units picked by position (``h[..., idx]``) before fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(3, 2)
        self.register_buffer("idx", torch.tensor([0, 5, 7]))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.relu(self.fc1(x))[..., self.idx])


def test_indexing_the_channel_dim_blocks_it() -> None:
    """Picking hidden units by index blocks them, naming the index op."""
    masks = fp.apply_masks(PickChannelsNet().double(), torch.randn(2, 4).double())
    assert not masks.groups
    [skip] = [s for s in masks.skipped if ("fc1.weight", 0) in s.params]
    assert "aten.index" in skip.reason and "picks channels" in skip.reason


REDUCTIONS_OVER_L: dict[str, Callable[[Tensor], Tensor]] = {
    "normalize": lambda h: F.normalize(h, dim=-1),
    "norm_p_float": lambda h: h / (1 + h.norm(2.0, -1, keepdim=True)),
    "vector_norm": lambda h: h * torch.linalg.vector_norm(h, 3, dim=-1, keepdim=True),
    "var": lambda h: h * h.var(-1, keepdim=True),
    "std_unbiased_false": lambda h: h * h.std(-1, unbiased=False, keepdim=True),
    "max_dim": lambda h: h - h.max(-1, keepdim=True).values,
    "var_mean": lambda h: h - torch.var_mean(h, -1, keepdim=True)[1],
}


class ReduceNet(nn.Module):
    """conv1d channels, a reduction along L (``fn``), conv1d: (N, 3, 7) -> (N, 2, 7)."""

    def __init__(self, fn: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.fn = fn
        self.conv1 = nn.Conv1d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv1d(6, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv2(self.fn(torch.relu(self.conv1(x))))


@pytest.mark.parametrize("fn", list(REDUCTIONS_OVER_L))
def test_reduction_along_length_keeps_channels_exact(fn: str) -> None:
    """A reduction over L (p given as a float, unbiased as a bool, two outputs...) keeps
    conv1's channels one prunable group, and the shrunk model equals the masked one."""
    torch.manual_seed(0)
    model = ReduceNet(REDUCTIONS_OVER_L[fn]).double().eval()
    x = torch.randn(2, 3, 7, dtype=torch.float64)
    masks = fp.apply_masks(model, x, strict=True)
    [mask] = masks.values()
    mask.mask[[0, 3]] = 0.0
    small = fp.shrink(model, x)
    assert small.conv1.out_channels == 4
    _assert_close(_outputs(small, (x,))[0], _outputs(model, (x,))[0])


@pytest.mark.parametrize("dim", [1, -2])
def test_norm_over_channels_blocks_them(dim: int) -> None:
    """``h.norm(2.0, dim=channels)`` blocks conv1's channels as a reduction across them (it
    used to crash with "'float' object is not iterable")."""
    model = ReduceNet(lambda h: h / (1 + h.norm(2.0, dim, keepdim=True))).double()
    masks = fp.apply_masks(model, torch.randn(2, 3, 7, dtype=torch.float64))
    [skip] = [s for s in masks.skipped if ("conv1.weight", 0) in s.params]
    assert "linalg_vector_norm" in skip.reason and "reduces across channels" in skip.reason


# ---------------------------------------------------------- fused attention
class OnlySdpa(nn.Module):
    """F.scaled_dot_product_attention and nothing else."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "no_grad"])
def test_sdpa_cost_equals_flop_counter(grad: bool) -> None:
    """fisherprune's FLOPs for SDPA on CPU are the two attention products, 2 * 2*N*H*L*S*E:
    what FlopCounterMode counts given torch's own flash-attention formula for the CPU op
    (without it, PyTorch 2.13 counts 0 for ``_scaled_dot_product_flash_attention_for_cpu``,
    with autograd on and off), and the fused op is what the trace saw."""
    q, k, v = (torch.randn(2, 2, 5, 4, generator=_gen(i)) for i in range(3))
    args = tuple(t.requires_grad_(grad) for t in (q, k, v))
    with FlopCounterMode(display=False) as bare, torch.set_grad_enabled(grad):
        OnlySdpa()(*args)
    assert bare.get_total_flops() == 0  # why the mapping is needed
    counter = FlopCounterMode(display=False, custom_mapping=dict(SAME_AS_TORCH))
    with counter, torch.set_grad_enabled(grad):
        OnlySdpa()(*args)
    ops = {getattr(r.op, "overloadpacket", None) for r in trace_model(OnlySdpa(), args).ops}
    assert ops & set(FUSED_ATTENTION)
    hand = 2 * 2 * 2 * 2 * 5 * 5 * 4  # 2 products x 2 FLOPs x N*H*L*S*E, for the batch of 2
    assert counter.get_total_flops() == hand
    assert fp.computational_cost(OnlySdpa(), args).total == hand / 2


class SingleHeadSdpa(nn.Module):
    """q, k, v projections reach fused attention with their channels labelled (one head, no
    split), then an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(8, 4)
        self.out = nn.Linear(4, 8)

    def forward(self, x: Tensor) -> Tensor:  # (N, L, 8)
        q, k, v = (p(x).unsqueeze(1) for p in (self.q, self.k, self.v))
        return self.out(F.scaled_dot_product_attention(q, k, v).squeeze(1))


def test_sdpa_passes_value_channels_and_contracts_query_key_channels() -> None:
    """Inside fused attention each output channel is a weighted sum of the same value channel,
    so v's channels and the output projection's inputs form one group; q and k's channels are
    contracted inside the op (no layer input to mask them at), reported with the op."""
    masks = fp.apply_masks(SingleHeadSdpa(), torch.randn(2, 5, 8))
    assert [(g.producers, g.consumers) for g in masks.groups.values()] == [(["v"], ["out"])]
    for proj in ("q", "k"):
        [skip] = [s for s in masks.skipped if (f"{proj}.weight", 0) in s.params]
        assert "scaled_dot_product" in skip.reason


# ------------------------------------------------------------ robustness
class Log1pNet(nn.Module):
    """fc1's hidden units go through ``log1p``, an op with no channel rule."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.log1p(torch.relu(self.fc1(x))))


def test_op_without_rule_is_skipped_and_reported() -> None:
    """An op with no channel rule blocks the channels reaching it, reported by op and module;
    apply_masks does not fail."""
    masks = fp.apply_masks(Log1pNet(), torch.randn(2, 4))
    [skip] = [s for s in masks.skipped if ("fc1.weight", 0) in s.params]
    assert skip.reason == "aten.log1p in <model> has no channel rule"


@torch.library.custom_op("fptest_rules::twice", mutates_args=())
def twice(x: Tensor) -> Tensor:
    """2 x, an op whose channel rule the tests below break on purpose."""
    return 2 * x


@twice.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


class TwiceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(twice(torch.relu(self.fc1(x))))


def _raises(ctx: RuleContext) -> list[TensorInfo]:
    raise TypeError("'float' object is not iterable")


def _wrong_count(ctx: RuleContext) -> list[TensorInfo]:
    return []


def _wrong_shape(ctx: RuleContext) -> list[TensorInfo]:
    return [TensorInfo.blank((1, 2, 3))]


BROKEN_RULES: dict[str, tuple[Callable[[RuleContext], Any], str]] = {
    "raises": (_raises, "raised TypeError: 'float' object is not iterable"),
    "wrong_count": (_wrong_count, "returned 0 tensor descriptions for 1 outputs"),
    "wrong_shape": (_wrong_shape, "output 0: not a TensorInfo of shape (2, 6)"),
}


@pytest.mark.parametrize("broken", list(BROKEN_RULES))
def test_a_failing_rule_blocks_and_reports_instead_of_crashing(broken: str) -> None:
    """A rule that raises, or returns what does not fit the outputs, becomes a blocked op:
    the reason names the op, the module and the error; apply_masks goes on."""
    rule, error = BROKEN_RULES[broken]
    fp.register_channel_rule(torch.ops.fptest_rules.twice)(rule)
    try:
        masks = fp.apply_masks(TwiceNet(), torch.randn(2, 4))
    finally:
        fp.unregister_channel_rule(torch.ops.fptest_rules.twice)
    [skip] = [s for s in masks.skipped if ("fc1.weight", 0) in s.params]
    assert skip.reason == f"fptest_rules.twice in <model>: its channel rule failed ({error})"


class Scale(nn.Module):
    """A per-unit scale that reshapes its weight by the attribute ``n``: no shrink rule."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight.view(1, self.n)


def test_a_module_without_shrink_rule_is_named_when_shrink_fails() -> None:
    """When the shrunk forward fails because a sliced module kept its old width, the
    ShrinkError names that module and its class, and the masked model is left as it was.
    (The mask is placed by hand: apply_masks keeps such a width whole, test_arch_2026.)"""
    model = nn.Sequential(nn.Linear(4, 6), fp.MaskLayer(6), nn.ReLU(), Scale(6), nn.Linear(6, 2))
    x = torch.randn(2, 4)
    model[1].mask[:2] = 0.0
    with pytest.raises(fp.ShrinkError, match=r"no shrink rule .*: 3 \(Scale\)"):
        fp.shrink(model, x)
    assert model[3].weight.shape == (6,)


def test_shrink_compares_an_empty_output_by_shape(cases: Callable[[str], Case]) -> None:
    """A model returning a (0, 4) tensor shrinks (shrink's own check compares shapes there),
    and its shrunk outputs keep that shape."""
    case = cases("no_boxes")
    assert [tuple(t.shape) for t in _outputs(case.small, case.check)] == [(3, 3), (0, 4)]


# ------------------------------------------------------------- Hugging Face
def test_gpt2_conv1d_attributes_follow_the_kept_units(cases: Callable[[str], Case]) -> None:
    """In the shrunk GPT-2, each MLP's c_fc and c_proj have ``nf`` / ``nx`` equal to the units
    its mask kept, and weights (in, out) of those sizes, the other side following the hidden
    width kept."""
    case = cases("gpt2")
    for i in range(GPT2_CONFIG["n_layer"]):
        [mask] = [m for n, m in case.masks.items() if f"h_{i}_mlp_c_fc" in n]
        kept = int(mask.mask.sum())
        assert 0 < kept < 4 * GPT2_CONFIG["n_embd"]
        mlp = case.small.transformer.h[i].mlp
        [width] = [m for n, m in case.masks.items() if n.endswith("transformer_wte:dim1")]
        d = int(width.mask.sum())  # the hidden width kept
        assert 0 < d < GPT2_CONFIG["n_embd"]
        assert (mlp.c_fc.nx, mlp.c_fc.nf) == (d, kept)
        assert (mlp.c_proj.nx, mlp.c_proj.nf) == (kept, d)
        assert mlp.c_fc.weight.shape == (d, kept)
        assert mlp.c_proj.weight.shape == (kept, d)


def test_conv1d_rule_by_name_follows_subclasses_and_refuses_a_duplicate() -> None:
    """The rule registered by the name "transformers.pytorch_utils.Conv1D" applies to a
    subclass (nearest in the MRO), and registering the class itself is refused as a
    duplicate once the name resolves."""
    transformers = pytest.importorskip("transformers")
    conv1d = transformers.pytorch_utils.Conv1D

    class Wider(conv1d):
        pass

    layer = Wider(6, 4)
    layer.weight = nn.Parameter(layer.weight[:, :3].detach())
    update_metadata(layer, {"weight": (4, 6)})
    assert (layer.nx, layer.nf) == (4, 3)
    with pytest.raises(ValueError, match="Conv1D already has a shrink rule"):
        fp.register_shrink_rule(conv1d)(lambda m, old: None)


def test_a_named_rule_of_a_package_not_loaded_imports_nothing() -> None:
    """A rule registered by the name of a class whose package is not loaded does nothing
    and imports nothing; a malformed name is refused."""
    name = "fp_absent_package.layers.Mixer"
    fp.register_shrink_rule(name)(lambda m, old: None)
    try:
        update_metadata(nn.Linear(2, 2), {})
        assert "fp_absent_package" not in sys.modules
        with pytest.raises(ValueError, match="already has a shrink rule"):
            fp.register_shrink_rule(name)(lambda m, old: None)
    finally:
        fp.unregister_shrink_rule(name)
    with pytest.raises(ValueError, match="qualified class name"):
        fp.register_shrink_rule("Mixer")


def test_fisherprune_does_not_import_transformers() -> None:
    """Importing fisherprune, masking and shrinking a plain model leaves ``transformers``
    unimported (Hugging Face support is optional)."""
    code = textwrap.dedent(
        """
        import sys, torch, fisherprune as fp
        net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
        x = torch.randn(2, 4)
        masks = fp.apply_masks(net, x)
        next(iter(masks.values())).mask[0] = 0.0
        fp.shrink(net, x)
        assert "transformers" not in sys.modules, "fisherprune imported transformers"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
