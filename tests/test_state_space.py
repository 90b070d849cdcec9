"""State-space models (issue 34): a Mamba-style selective scan written here by hand from the
paper (Gu and Dao 2023, "Mamba", Algorithm 2 and section 3.4), and Hugging Face's
``MambaForCausalLM`` built from a tiny config (random weights, its pure-PyTorch path).

The SSM's inner width is one channel group: ``in_proj``'s output rows (both the scanned half
and the gate), the depthwise convolution, ``x_proj``'s inputs, ``dt_proj``'s outputs and bias,
``A_log``'s and ``D``'s rows and ``out_proj``'s inputs. The scan's state starts as a fresh
zero buffer and is written into preallocated tensors, which follow the width they meet.
References outside the code under test: the masked model's own output in float64 (the shrunk
model must equal it on other inputs) and ``FlopCounterMode`` on the shrunk model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.graph import ChannelGroup
from tests.counted import assert_exact, flops_per_example

ATOL = 1e-9  # float64 output difference, relative to max(1, max |expected|)


# ================================================================ helpers


def _prune(masks: fp.AppliedMasks, share: float, seed: int) -> None:
    """Zero ``share`` of every mask's entries (at least one, never all), chosen at random."""
    gen = torch.Generator().manual_seed(seed)
    for m in masks.values():
        n = m.num_channels
        k = min(n - 1, max(1, round(share * n)))
        m.mask[torch.randperm(n, generator=gen)[:k]] = 0.0


def _group_with(masks: fp.AppliedMasks, param: tuple[str, int]) -> ChannelGroup | None:
    return next((g for g in masks.groups.values() if param in g.params), None)


# ======================================================== a hand-written Mamba block
class SelectiveSSM(nn.Module):
    """A Mamba block (Gu and Dao 2023, Alg. 2): a gated projection to the inner width, a
    causal depthwise convolution (run as ``F.conv1d`` on the conv module's weight), the
    input-dependent step, B and C from ``x_proj`` split at fixed sizes, and a sequential scan
    over time whose state starts as zeros and whose outputs go into a preallocated buffer.
    ``literal_width`` writes the inner width into the code as a number (the buffers' size)."""

    def __init__(self, d: int, inner: int, state: int, rank: int, literal_width: bool) -> None:
        super().__init__()
        self.rank, self.state, self.kernel = rank, state, 3
        self.literal = inner if literal_width else 0
        self.in_proj = nn.Linear(d, 2 * inner)
        self.conv = nn.Conv1d(inner, inner, 3, groups=inner)
        self.x_proj = nn.Linear(inner, rank + 2 * state, bias=False)
        self.dt_proj = nn.Linear(rank, inner)
        a = torch.arange(1, state + 1, dtype=torch.float32).repeat(inner, 1)
        self.A_log = nn.Parameter(torch.log(a) + 0.1 * torch.randn(inner, state))
        self.D = nn.Parameter(torch.randn(inner))
        self.out_proj = nn.Linear(inner, d)

    def forward(self, x: Tensor) -> Tensor:
        b, length, _ = x.shape
        u, z = self.in_proj(x).chunk(2, dim=-1)  # (B, L, E) each
        e = self.literal or u.shape[-1]
        u = F.pad(u.transpose(1, 2), (self.kernel - 1, 0))  # causal: (B, E, L + k - 1)
        u = F.silu(F.conv1d(u, self.conv.weight, self.conv.bias, groups=e)).transpose(1, 2)
        dt, bm, cm = self.x_proj(u).split([self.rank, self.state, self.state], dim=-1)
        dt = F.softplus(self.dt_proj(dt))  # (B, L, E)
        a = -torch.exp(self.A_log)  # (E, N)
        h = u.new_zeros(b, e, self.state)  # (B, E, N)
        y = u.new_empty(b, length, e)
        for t in range(length):
            step = dt[:, t, :, None]  # (B, E, 1)
            h = torch.exp(step * a) * h + step * bm[:, t, None, :] * u[:, t, :, None]
            y[:, t] = (h @ cm[:, t, :, None]).squeeze(-1)
        return self.out_proj((y + u * self.D) * F.silu(z))


class TinySSMNet(nn.Module):
    """An input projection, two residual pre-norm Mamba blocks and a linear head."""

    def __init__(self, literal_width: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.norms = nn.ModuleList(nn.LayerNorm(16) for _ in range(2))
        self.blocks = nn.ModuleList(SelectiveSSM(16, 24, 4, 3, literal_width) for _ in range(2))
        self.head = nn.Linear(16, 5)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for norm, block in zip(self.norms, self.blocks, strict=True):
            h = h + block(norm(h))
        return self.head(h)


def _ssm_net(literal_width: bool = False) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model = TinySSMNet(literal_width).double().eval()
    return model, torch.randn(2, 7, 6, dtype=torch.float64), torch.randn(3, 5, 6).double()


INNER = [
    ("in_proj.weight", 0),
    ("in_proj.bias", 0),
    ("conv.weight", 0),
    ("conv.bias", 0),
    ("x_proj.weight", 1),
    ("dt_proj.weight", 0),
    ("dt_proj.bias", 0),
    ("A_log", 0),
    ("D", 0),
    ("out_proj.weight", 1),
]


def test_hand_written_ssm_inner_width_is_one_group_of_its_tensors() -> None:
    """Each block's inner width is one group of 24 channels holding exactly the tensors that
    index it (both halves of in_proj's rows: the group counts 24, its rows are 48)."""
    model, x, _ = _ssm_net()
    masks = fp.apply_masks(model, x)
    for i in range(2):
        g = _group_with(masks, (f"blocks.{i}.A_log", 0))
        assert g is not None and g.num_channels == 24
        want = {(f"blocks.{i}.{n}", d) for n, d in INNER}
        assert {p for p in g.params if p[0].startswith(f"blocks.{i}.")} == want


def test_hand_written_ssm_shrinks_exactly() -> None:
    """Inner and hidden widths pruned at random: shrunk == masked (float64, another batch and
    sequence length), FlopCounterMode on the shrunk model == computational_cost."""
    model, x, check = _ssm_net()
    masks = fp.apply_masks(model, x)
    assert_exact(model, masks, check)


def test_inner_width_written_as_a_number_is_kept_whole_and_the_rest_works() -> None:
    """With the buffers' size written into the code, the inner width cannot shrink: it is no
    group, one skipped entry says why in one line, and the hidden width still prunes exactly."""
    model, x, check = _ssm_net(literal_width=True)
    masks = fp.apply_masks(model, x)
    assert _group_with(masks, ("blocks.0.A_log", 0)) is None
    [why] = [s.reason for s in masks.skipped if ("blocks.0.A_log", 0) in s.params]
    assert "\n" not in why and "shrink" in why
    assert _group_with(masks, ("embed.weight", 0)) is not None
    assert_exact(model, masks, check)


class CachedConv(nn.Module):
    """A causal convolution that writes its input into a fresh zero buffer, left-padded by
    the kernel (as a cache's preallocated state is filled), then reads the buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 10)
        self.conv = nn.Conv1d(10, 6, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, L, 4)
        u = self.fc(x).transpose(1, 2)  # (B, 10, L)
        buf = u.new_zeros(u.shape[0], u.shape[1], u.shape[2] + 2)
        buf[:, :, 2:].copy_(u)
        return self.conv(torch.relu(buf))


def test_a_width_copied_into_a_fresh_buffer_is_followed_through_it() -> None:
    """fc's 10 outputs, copied into a zero buffer that the conv reads, are one prunable group
    (no longer 'copies channels into a tensor whose channels are not followed') and shrink
    exactly."""
    torch.manual_seed(0)
    model = CachedConv().double().eval()
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    masks = fp.apply_masks(model, x)
    g = _group_with(masks, ("fc.weight", 0))
    assert g is not None and g.num_channels == 10 and ("conv.weight", 1) in g.params
    assert_exact(model, masks, torch.randn(3, 8, 4, dtype=torch.float64))


class FunctionalDepthwise(nn.Module):
    """A depthwise convolution run as ``F.conv1d`` on one half of a projection's output, a
    tensor that no module receives as its input (as Hugging Face's Mamba runs its conv1d)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 12)
        self.dw = nn.Conv1d(6, 6, 3, groups=6, padding=1)
        self.out = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, L, 4)
        u, gate = self.fc(x).chunk(2, dim=-1)  # (B, L, 6) each
        u = u.transpose(1, 2)  # (B, 6, L)
        u = F.conv1d(u, self.dw.weight, self.dw.bias, padding=1, groups=u.shape[1])
        return self.out(u.transpose(1, 2) * torch.sigmoid(gate))


def test_a_depthwise_conv_no_module_input_holds_passes_its_channels_on() -> None:
    """The depthwise conv's channels are one group with fc's rows, masked at out's input only
    (the conv reads each channel for that channel alone), and they shrink exactly."""
    torch.manual_seed(0)
    model = FunctionalDepthwise().double().eval()
    masks = fp.apply_masks(model, torch.randn(2, 5, 4, dtype=torch.float64))
    g = _group_with(masks, ("dw.weight", 0))
    assert g is not None and g.num_channels == 6 and g.consumers == ["out"]
    assert_exact(model, masks, torch.randn(3, 7, 4, dtype=torch.float64))


# ============================================================ Hugging Face Mamba
def _hf_mamba() -> tuple[nn.Module, dict[str, Tensor], dict[str, Tensor]]:
    """A 2-layer MambaForCausalLM (hidden 32, inner 64, state 8, dt rank 4), float64, eval."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MambaConfig(
        vocab_size=100, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
        conv_kernel=4, time_step_rank=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(cfg).double().eval()
    gen = torch.Generator().manual_seed(1)
    x = {"input_ids": torch.randint(0, 100, (2, 12), generator=gen)}
    check = {"input_ids": torch.randint(0, 100, (3, 9), generator=gen)}
    return model, x, check


@pytest.mark.filterwarnings("ignore:the model's Hugging Face config still describes")
def test_hf_mamba_inner_and_hidden_widths_are_groups() -> None:
    """Every mixer's inner width (64, with A_log, D, the conv and dt_proj) is a group, as is
    the hidden width; only the vocabulary and the dt-rank and state widths (split from x_proj
    at fixed sizes) are left whole."""
    model, x, _ = _hf_mamba()
    masks = fp.apply_masks(model, x)
    for i in range(2):
        g = _group_with(masks, (f"backbone.layers.{i}.mixer.A_log", 0))
        assert g is not None and g.num_channels == 64
        for name in ("D", "conv1d.weight", "dt_proj.bias", "out_proj.weight"):
            assert any(p[0] == f"backbone.layers.{i}.mixer.{name}" for p in g.params)
    assert _group_with(masks, ("backbone.embeddings.weight", 1)) is not None
    assert all("split" in s.reason or "vocabulary" in s.reason for s in masks.skipped)


@pytest.mark.filterwarnings("ignore:the model's Hugging Face config still describes")
def test_hf_mamba_shrinks_exactly() -> None:
    """Shrunk == masked logits (float64, another batch and length), FlopCounterMode on the
    shrunk model == computational_cost of the masked one."""
    model, x, check = _hf_mamba()
    masks = fp.apply_masks(model, x)
    assert_exact(model, masks, check)


@pytest.mark.filterwarnings("ignore:the model's Hugging Face config still describes")
def test_hf_mamba_most_flops_are_prunable_and_30_percent_saves_over_a_third() -> None:
    """The bar of issue 34: >= 85% of the FLOPs in prunable groups, >= 35% of them saved
    (FlopCounterMode, dense vs shrunk) by removing 30% of every group."""
    model, x, _ = _hf_mamba()
    dense = flops_per_example(model, x)
    masks = fp.apply_masks(model, x)
    cm = fp.CostModel(model, x)
    assert 1 - cm.total(np.zeros(cm.graph.n_entries)) / cm.dense_total() >= 0.85
    _prune(masks, 0.3, 2)
    assert 1 - flops_per_example(fp.shrink(model, x), x) / dense >= 0.35


@pytest.mark.filterwarnings("ignore:the model's Hugging Face config still describes")
def test_hf_mamba_shrunk_generates_the_masked_models_tokens() -> None:
    """Greedy generation, which runs the cached one-token path (the conv state and the SSM
    state carried between steps), gives the same tokens from the shrunk and masked models."""
    model, x, _ = _hf_mamba()
    masks = fp.apply_masks(model, x)
    _prune(masks, 0.3, 3)
    prompt = x["input_ids"][:, :5]
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=4, do_sample=False)
        got = fp.shrink(model, x).generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)
