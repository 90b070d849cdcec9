"""apply_masks / shrink / computational_cost / plans / TorchScript on architectures outside the
zoo: ShuffleNetV2, MobileNetV3-small, EfficientNet-B0, ConvNeXt, RegNetX, ViT and a GroupNorm
ResNet (``zoo_foreign.py``).

Each (architecture, seed) case is built once per module (float64, eval mode), masked by
``apply_masks`` on a batch of 2, and pruned at random: every mask gets 30-50% of its entries
zeroed, at least one kept. The invariants are checked on other inputs (batch 1 and 3) against
references outside the code under test: the masked model's own output, PyTorch's
``FlopCounterMode``, and the channel groups each architecture's design implies (written by hand
below from the architecture, not read off the library's output). ONNX is left to
``test_export.py`` (slow); files are written under ``tmp_path`` only. apply_masks logs (not
warns) the channels it leaves unmasked on ShuffleNetV2, ConvNeXt and the ViT, as expected there.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import zoo_foreign as zf
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import fisherprune as fp
from fisherprune.cost.formulas import SAME_AS_TORCH
from fisherprune.graph.groups import ChannelGroup
from fisherprune.masks.points import MASKS_ATTR

pytestmark = pytest.mark.filterwarnings(
    "error::UserWarning"  # fisherprune's warnings (e.g. a mask that removes no channel): none here
)

ATOL = 1e-9  # float64 output difference, relative to max(1, max |expected output|)
ARCH_NAMES = list(zf.ARCHS)
SEEDS = (0, 1)  # model weights and random pruning
TRACE_BATCH = 2  # apply_masks / shrink / export trace on this batch
CHECK_BATCHES = (1, 3)  # outputs are compared on these (other draws than the traced batch)


# ================================================================ cases
@dataclass(frozen=True)
class Case:
    """One architecture, masked and pruned at random, and what the tests compare against."""

    arch: str
    seed: int
    masked: nn.Module  # float64, eval, masks applied and partly zeroed
    masks: fp.AppliedMasks
    x: Tensor  # the traced example input (batch TRACE_BATCH)
    inputs: dict[int, Tensor]  # batch size -> input
    expected: dict[int, Tensor]  # batch size -> the masked model's output
    small: nn.Module  # fp.shrink(masked, x)

    def fresh(self) -> nn.Module:
        """The same architecture newly built with other weights (float64, eval)."""
        return zf.ARCHS[self.arch](self.seed + 100).double().eval()


def _out(model: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    with torch.no_grad():
        return model(x)


def _prune_at_random(masks: fp.AppliedMasks, seed: int) -> None:
    """Zero 30-50% (at least one, at most all but one) of the entries of every mask."""
    gen = torch.Generator().manual_seed(seed)
    for name, m in masks.items():
        n = m.num_channels
        assert n >= 2, f"{name} has {n} entry: nothing to prune and keep"
        frac = 0.3 + 0.2 * float(torch.rand(1, generator=gen))
        k = min(n - 1, max(1, round(frac * n)))
        m.mask[torch.randperm(n, generator=gen)[:k]] = 0.0


def _make_case(arch: str, seed: int) -> Case:
    model = zf.ARCHS[arch](seed).double().eval()
    x = zf.image_input(TRACE_BATCH).double()
    masks = fp.apply_masks(model, x)
    _prune_at_random(masks, seed)
    inputs = {b: zf.image_input(b, seed=1 + i).double() for i, b in enumerate(CHECK_BATCHES)}
    expected = {b: _out(model, xb) for b, xb in inputs.items()}
    return Case(arch, seed, model, masks, x, inputs, expected, fp.shrink(model, x))


@pytest.fixture(scope="module")
def cases() -> Callable[[str, int], Case]:
    """``cases(arch, seed)``: the case, built on first use and kept for the module."""
    built: dict[tuple[str, int], Case] = {}

    def get(arch: str, seed: int) -> Case:
        if (arch, seed) not in built:
            built[arch, seed] = _make_case(arch, seed)
        return built[arch, seed]

    return get


def _assert_close(actual: Tensor, expected: Tensor, atol: float = ATOL) -> None:
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype == torch.float64
    scale = max(1.0, float(expected.abs().max()))
    err = float((actual - expected).abs().max())
    assert err <= atol * scale, f"max abs error {err:.3g} > {atol * scale:.3g}"


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if MASKS_ATTR not in name)


def _flops_per_example(model: nn.Module, x: Tensor) -> float:
    """FlopCounterMode's count, with autograd enabled (the default): in eval mode without
    autograd nn.MultiheadAttention takes a fused fast path that FlopCounterMode does not see."""
    with FlopCounterMode(display=False, custom_mapping=dict(SAME_AS_TORCH)) as counter:
        model(x)
    return counter.get_total_flops() / x.shape[0]


each_case = pytest.mark.parametrize(("arch", "seed"), [(a, s) for a in ARCH_NAMES for s in SEEDS])


# ============================================================ invariants
@each_case
def test_shrunk_output_equals_masked_output(
    arch: str, seed: int, cases: Callable[[str, int], Case]
) -> None:
    """The shrunk model's output equals the masked model's (float64, eval) at batch 1 and 3."""
    case = cases(arch, seed)
    for b, xb in case.inputs.items():
        _assert_close(_out(case.small, xb), case.expected[b])


@each_case
def test_shrunk_flops_equal_cost_of_masked_model(
    arch: str, seed: int, cases: Callable[[str, int], Case]
) -> None:
    """FlopCounterMode on the shrunk model, per example, equals computational_cost(masked)."""
    case = cases(arch, seed)
    x = case.inputs[3]
    assert _flops_per_example(case.small, x) == fp.computational_cost(case.masked, x).total


@each_case
def test_shrink_leaves_no_mask_and_fewer_parameters(
    arch: str, seed: int, cases: Callable[[str, int], Case]
) -> None:
    """The shrunk model has no MaskLayer, mask holder or mask hook, and fewer parameters."""
    case = cases(arch, seed)
    assert not any(isinstance(m, fp.MaskLayer) for m in case.small.modules())
    assert not hasattr(case.small, MASKS_ATTR)
    assert not any(m._forward_pre_hooks for m in case.small.modules())
    assert _n_params(case.small) < _n_params(case.masked)


@each_case
def test_plan_rebuilds_the_shrunk_model_from_a_fresh_one(
    arch: str, seed: int, cases: Callable[[str, int], Case], tmp_path: Path
) -> None:
    """PruningPlan.from_model, applied to a freshly built model (directly, and through
    to_dict -> JSON file -> load), then load_state_dict of the shrunk weights: same outputs."""
    case = cases(arch, seed)
    plan = fp.PruningPlan.from_model(case.masked, case.x)
    (tmp_path / "plan.json").write_text(json.dumps(plan.to_dict()))
    reloaded = fp.PruningPlan.load(tmp_path / "plan.json")
    for p in (plan, reloaded):
        fresh = p.apply(case.fresh())
        fresh.load_state_dict(case.small.state_dict())
        for b, xb in case.inputs.items():
            _assert_close(_out(fresh, xb), case.expected[b])


@each_case
@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")  # trace / save / load
# F.group_norm's batch-size check (a Python bool) becomes a constant in the trace
@pytest.mark.filterwarnings("ignore:Converting a tensor to a Python bool:torch.jit.TracerWarning")
def test_torchscript_export_round_trip(
    arch: str, seed: int, cases: Callable[[str, int], Case], tmp_path: Path
) -> None:
    """export_model(format="torchscript") then torch.jit.load: the masked model's outputs."""
    case = cases(arch, seed)
    path = fp.export_model(case.masked, tmp_path / "m.ts", case.x, format="torchscript")
    loaded = torch.jit.load(str(path))
    for b, xb in case.inputs.items():
        _assert_close(_out(loaded, xb), case.expected[b])


# ============================================ channel groups each design implies
def _group_of(masks: fp.AppliedMasks, producer: str) -> ChannelGroup:
    """The channel group that module ``producer`` produces."""
    found = [g for g in masks.groups.values() if producer in g.producers]
    assert len(found) == 1, f"{producer} produces {len(found)} masked groups"
    return found[0]


def _consumers(masks: fp.AppliedMasks) -> set[str]:
    return {c for g in masks.groups.values() for c in g.consumers}


def _not_masked_section(masks: fp.AppliedMasks) -> str:
    return masks.summary().partition("\nnot masked:\n")[2]


def test_shufflenetv2_depthwise_conv_is_masked_unless_it_reads_a_shuffled_tensor(
    cases: Callable[[str, int], Case],
) -> None:
    """A depthwise conv couples each output channel to its input channel, so it can lose a
    filter only with that input channel. After a channel shuffle (view-transpose-reshape)
    which input channel is which is not tracked: the depthwise conv of stage3.0.branch1, which
    reads the shuffled output of stage2, gets no mask; every other depthwise conv reads a
    freshly produced tensor (the stem, or its branch's first 1x1 conv) and is masked with it."""
    case = cases("shufflenetv2", 0)
    depthwise = [
        n
        for n, m in case.masked.named_modules()
        if isinstance(m, nn.Conv2d) and m.groups == m.in_channels > 1
    ]
    assert len(depthwise) == 7  # 2 stride-2 units x 2 + 3 stride-1 units x 1
    after_shuffle = "stage3.0.branch1.0.0"
    for name in depthwise:
        if name == after_shuffle:
            assert name not in _consumers(case.masks)
            assert f"{name}: grouped convolution of an untracked input" in (
                _not_masked_section(case.masks)
            )
        else:
            group = _group_of(case.masks, name)  # its output is its input's channels
            assert name in group.consumers
    assert _group_of(case.masks, "conv1.0") is _group_of(case.masks, "stage2.0.branch1.0.0")


def test_mobilenetv3_se_gate_is_masked_with_the_channels_it_multiplies(
    cases: Callable[[str, int], Case],
) -> None:
    """The squeeze-and-excitation gate (hardsigmoid) multiplies the depthwise conv's output
    channel by channel, so each SE block's fc2 output channels share the depthwise channels'
    mask, which fc1 reads too; the squeeze units (fc1 -> fc2) are a mask of their own."""
    case = cases("mobilenetv3", 0)
    se_blocks = [n for n, m in case.masked.named_modules() if isinstance(m, zf.SqueezeExcite)]
    assert se_blocks == ["blocks.0.block.1", "blocks.3.block.2", "blocks.4.block.2"]
    for se in se_blocks:
        seq, _, idx = se.rpartition(".")
        depthwise = f"{seq}.{int(idx) - 1}.0"
        gated = _group_of(case.masks, depthwise)
        assert f"{se}.fc2" in gated.producers
        assert {depthwise, f"{se}.fc1", f"{seq}.{int(idx) + 1}.0"} <= set(gated.consumers)
        squeeze = _group_of(case.masks, f"{se}.fc1")
        assert (squeeze.producers, squeeze.consumers) == ([f"{se}.fc1"], [f"{se}.fc2"])
        exp = case.masked.get_submodule(f"{se}.fc1").in_channels
        assert squeeze.num_channels == max(8, exp // 4)


def test_efficientnet_residual_mbconvs_share_their_projections_mask(
    cases: Callable[[str, int], Case],
) -> None:
    """Stochastic depth scales whole examples (the identity in eval mode), so a residual MBConv
    adds its projection's channels to its input's channel by channel: blocks 0 (with the stem),
    1-2 and 3-4 each share one mask for their output stream, and no mask joins two of them."""
    case = cases("efficientnet", 0)
    streams = [
        ("stem.0", "blocks.0.block.2.0"),  # block 0: no expansion, residual
        ("blocks.1.block.3.0", "blocks.2.block.3.0"),  # block 2 is residual
        ("blocks.3.block.3.0", "blocks.4.block.3.0"),  # block 4 is residual
    ]
    groups = [_group_of(case.masks, first) for first, _ in streams]
    for (_, second), group in zip(streams, groups, strict=True):
        assert second in group.producers
    assert len({id(g) for g in groups}) == 3


def test_convnext_masks_mlp_hidden_units_and_the_stream_of_each_stage(
    cases: Callable[[str, int], Case],
) -> None:
    """The MLP hidden units (Linear 4x expansion -> GELU -> Linear) are masked, one group per
    block, read by that block's pwconv2 only. Each stage's residual stream is one group: made
    by the stem or downsampling conv, the depthwise convs (which keep channels) and pwconv2,
    read by the depthwise convs, pwconv1 and what follows the stage. Stage 2's is normalised
    by ``nn.LayerNorm``; stage 1's by the channels-first ``LayerNorm2d`` too (the stem's and
    the downsampling's), recognised by what it computes: it was left unmasked before."""
    case = cases("convnext", 0)
    blocks = ["stage1.0", "stage1.1", "stage2.0", "stage2.1"]
    got = sorted((g.producers, g.consumers, g.num_channels) for g in case.masks.groups.values())
    dims = {b: case.masked.get_submodule(f"{b}.dwconv").in_channels for b in blocks}
    want = [([f"{b}.pwconv1"], [f"{b}.pwconv2"], 4 * dims[b]) for b in blocks]
    for first, stage, after in (("stem.0", "stage1", "down.1"), ("down.1", "stage2", "head")):
        inside = [f"{stage}.{i}" for i in (0, 1)]
        want.append(
            (
                [first] + [f"{b}.{m}" for b in inside for m in ("dwconv", "pwconv2")],
                [f"{b}.{m}" for b in inside for m in ("dwconv", "pwconv1")] + [after],
                dims[inside[0]],
            )
        )
    assert got == sorted(want)
    [stream1] = [g for g in case.masks.groups.values() if g.producers[0] == "stem.0"]
    assert set(stream1.norms) == {"stem.1", "stage1.0.norm", "stage1.1.norm", "down.0"}


@pytest.mark.parametrize("seed", SEEDS)
def test_regnetx_grouped_convs_are_masked_and_shrunk_in_whole_groups(
    seed: int, cases: Callable[[str, int], Case]
) -> None:
    """A grouped conv with a fixed group width (8) can only lose whole groups: each block's
    inner channels (a -> grouped b -> c) have one mask entry per group of 8 consecutive
    channels, and the shrunk grouped conv keeps 8 input channels per group, one group per
    kept entry."""
    case = cases("regnetx", seed)
    for block in ("s1.0", "s1.1", "s2.0", "s2.1"):
        width = case.masked.get_submodule(f"{block}.b.0").out_channels
        name, group = next(
            (n, g) for n, g in case.masks.groups.items() if f"{block}.a.0" in g.producers
        )
        assert f"{block}.b.0" in group.producers
        assert group.num_channels == width // zf.GROUP_WIDTH
        members = group.members[(f"{block}.b.0.weight", 0)]
        assert members.tolist() == [c // zf.GROUP_WIDTH for c in range(width)]
        kept = int(case.masks[name].mask.sum())
        conv = case.small.get_submodule(f"{block}.b.0")
        assert (conv.groups, conv.out_channels) == (kept, kept * zf.GROUP_WIDTH)
        assert conv.weight.shape[1] == zf.GROUP_WIDTH


def test_vit_masks_heads_mlp_hidden_units_and_the_hidden_width(
    cases: Callable[[str, int], Case],
) -> None:
    """Each encoder block's 2 heads are one group (made by its nn.MultiheadAttention, masked at
    its out_proj's input) and its MLP hidden units another (read by mlp.3); the LayerNormed
    residual stream is one group of 16 channels, written by the patch embedding, every
    attention's out_proj and MLP, read by every attention, MLP and the head."""
    case = cases("vit", 0)
    got = sorted((g.producers, g.consumers, g.num_channels) for g in case.masks.groups.values())
    blocks = [f"layers.{i}" for i in (0, 1)]
    assert got == sorted(
        [([f"{b}.mlp.0"], [f"{b}.mlp.3"], 64) for b in blocks]
        + [([f"{b}.self_attention"], [f"{b}.self_attention.out_proj"], 2) for b in blocks]
        + [
            (
                ["conv_proj"]
                + [f"{b}.{m}" for b in blocks for m in ("self_attention.out_proj", "mlp.3")],
                [f"{b}.{m}" for b in blocks for m in ("self_attention", "mlp.0")] + ["head"],
                16,
            )
        ]
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_gnresnet_groupnorm_channels_are_masked_and_shrunk_in_whole_groups(
    seed: int, cases: Callable[[str, int], Case]
) -> None:
    """GroupNorm normalises within groups, so channels go a whole group at a time, and channels
    tied by a residual add go in blocks that are whole groups of every GroupNorm on them: the
    stem/l1 stream (groups of 4) has 4 entries, l1's and l2's inner channels 4 and 6, the l2/l3
    stream (groups of 4 in l2, of 16 in l3) 2, l3's inner channels 2. The shrunk GroupNorms
    keep their group sizes."""
    case = cases("gnresnet", seed)
    expected = {"stem.0": 4, "l1.conv1": 4, "l2.conv1": 6, "l2.conv2": 2, "l3.conv1": 2}
    assert sorted(g.producers[0] for g in case.masks.groups.values()) == sorted(expected)
    for producer, entries in expected.items():
        assert _group_of(case.masks, producer).num_channels == entries
    dense = dict(case.masked.named_modules())
    for name, gn in case.small.named_modules():
        if isinstance(gn, nn.GroupNorm):
            size = dense[name].num_channels // dense[name].num_groups
            assert gn.num_channels == gn.num_groups * size == gn.weight.numel()
