"""apply_masks over a zoo of architectures: groups, exactness, reduced references, cost, signals.

The expectations below (which channels form one group, who produces and who reads them, which
parameter dims they live in) were written by hand from the architectures in ``zoo.py``, before
looking at what the library reports. The reduced references are built independently: the same
zoo architecture with fewer channels, its weights copied from the original at the kept indices by
hand-written per-architecture slicing (no fisherprune export code).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
import zoo
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import fisherprune as fp
from fisherprune.cost.formulas import SAME_AS_TORCH
from fisherprune.graph import ChannelGraph, find_groups, trace_model
from fisherprune.graph.rules import _RULES
from fisherprune.graph.types import RuleContext, TensorInfo

# ------------------------------------------------------------------ tolerances
ATOL_F64 = 1e-10  # masked vs reduced reference outputs, float64
RTOL_F64 = 1e-10
SIGNAL_RTOL = 1e-8  # Fisher signal vs the per-example float64 loop
SIGNAL_ATOL = 1e-14
FLOP_REL = 1e-12  # cost model vs FlopCounterMode (both are integers per batch)

BATCH = 3
SEEDS = [0, 1, 2]  # random prunings per architecture
ARCH_NAMES = list(zoo.ARCHS)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP threads
    contending with other processes make each forward ~100x slower: use one, then restore.
    The first trace in a process imports parts of torch (about 1 s): done here, not in a test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    trace_model(nn.Linear(2, 2), torch.zeros(1, 2))  # pay torch's one-off lazy imports here
    yield
    torch.set_num_threads(before)


# ============================================================ expectations
ParamDims = frozenset[tuple[str, int]]


def _conv(m: str, *, bias: bool = False) -> set[tuple[str, int]]:
    """Output-channel dims of a conv / Linear named ``m``."""
    return {(f"{m}.weight", 0)} | ({(f"{m}.bias", 0)} if bias else set())


def _into(m: str) -> set[tuple[str, int]]:
    """Input-channel dim of a conv / Linear named ``m``."""
    return {(f"{m}.weight", 1)}


def _bn(m: str) -> set[tuple[str, int]]:
    return {(f"{m}.{p}", 0) for p in ("weight", "bias", "running_mean", "running_var")}


def _ln(m: str) -> set[tuple[str, int]]:
    return {(f"{m}.weight", 0), (f"{m}.bias", 0)}


@dataclass(frozen=True)
class Expected:
    """One group: the width key of its channels, producing and consuming modules, param dims."""

    producers: frozenset[str]
    consumers: frozenset[str]
    params: ParamDims


def _g(producers: list[str], consumers: list[str], params: set[tuple[str, int]]) -> Expected:
    return Expected(frozenset(producers), frozenset(consumers), frozenset(params))


def _expected_groups(arch: str) -> dict[str, Expected]:
    """Width key -> the group a careful reader expects for it."""
    arch = _SAME_AS.get(arch, arch)
    if arch == "resnet_basic":
        # stem and every second conv on the same residual stream: ONE group per stream
        return {
            "s1": _g(
                ["stem.0", "l1.conv2"],
                ["l1.conv1", "l2.conv1", "l2.down.0"],
                _conv("stem.0")
                | _bn("stem.1")
                | _conv("l1.conv2")
                | _bn("l1.bn2")
                | _into("l1.conv1")
                | _into("l2.conv1")
                | _into("l2.down.0"),
            ),
            "l1_mid": _g(
                ["l1.conv1"], ["l1.conv2"], _conv("l1.conv1") | _bn("l1.bn1") | _into("l1.conv2")
            ),
            "l2_mid": _g(
                ["l2.conv1"], ["l2.conv2"], _conv("l2.conv1") | _bn("l2.bn1") | _into("l2.conv2")
            ),
            "s2": _g(
                ["l2.conv2", "l2.down.0", "l3.conv2"],
                ["l3.conv1", "fc"],
                _conv("l2.conv2")
                | _bn("l2.bn2")
                | _conv("l2.down.0")
                | _bn("l2.down.1")
                | _conv("l3.conv2")
                | _bn("l3.bn2")
                | _into("l3.conv1")
                | _into("fc"),
            ),
            "l3_mid": _g(
                ["l3.conv1"], ["l3.conv2"], _conv("l3.conv1") | _bn("l3.bn1") | _into("l3.conv2")
            ),
        }
    if arch == "resnet_bottleneck":
        out = {
            "stem": _g(
                ["stem.0"],
                ["l1.conv1", "l1.down.0"],
                _conv("stem.0") | _bn("stem.1") | _into("l1.conv1") | _into("l1.down.0"),
            ),
            "s1": _g(
                ["l1.conv3", "l1.down.0"],
                ["l2.conv1", "l2.down.0"],
                _conv("l1.conv3")
                | _bn("l1.bn3")
                | _conv("l1.down.0")
                | _bn("l1.down.1")
                | _into("l2.conv1")
                | _into("l2.down.0"),
            ),
            "s2": _g(
                ["l2.conv3", "l2.down.0", "l3.conv3"],
                ["l3.conv1", "fc"],
                _conv("l2.conv3")
                | _bn("l2.bn3")
                | _conv("l2.down.0")
                | _bn("l2.down.1")
                | _conv("l3.conv3")
                | _bn("l3.bn3")
                | _into("l3.conv1")
                | _into("fc"),
            ),
        }
        for b in ("l1", "l2", "l3"):
            out[f"{b}_a"] = _g(
                [f"{b}.conv1"],
                [f"{b}.conv2"],
                _conv(f"{b}.conv1") | _bn(f"{b}.bn1") | _into(f"{b}.conv2"),
            )
            out[f"{b}_b"] = _g(
                [f"{b}.conv2"],
                [f"{b}.conv3"],
                _conv(f"{b}.conv2") | _bn(f"{b}.bn2") | _into(f"{b}.conv3"),
            )
        return out
    if arch == "densenet":
        # each layer's growth channels: one group, read by every later conv through the concat
        return {
            "stem": _g(
                ["stem"],
                ["dense1.conv", "dense2.conv", "trans_conv"],
                _conv("stem")
                | _bn("stem_bn")
                | _bn("dense1.bn")
                | _into("dense1.conv")
                | _bn("dense2.bn")
                | _into("dense2.conv")
                | _bn("trans_bn")
                | _into("trans_conv"),
            ),
            "g1": _g(
                ["dense1.conv"],
                ["dense2.conv", "trans_conv"],
                _conv("dense1.conv")
                | _bn("dense2.bn")
                | _into("dense2.conv")
                | _bn("trans_bn")
                | _into("trans_conv"),
            ),
            "g2": _g(
                ["dense2.conv"],
                ["trans_conv"],
                _conv("dense2.conv") | _bn("trans_bn") | _into("trans_conv"),
            ),
            "trans": _g(["trans_conv"], ["fc"], _conv("trans_conv") | _bn("head_bn") | _into("fc")),
        }
    if arch == "mobilenetv2":
        out = {
            "s1": _g(
                ["stem.0", "b1.project"],
                ["b1.expand", "b2.expand"],
                _conv("stem.0")
                | _bn("stem.1")
                | _conv("b1.project")
                | _bn("b1.bn3")
                | _into("b1.expand")
                | _into("b2.expand"),
            ),
            "s2": _g(
                ["b2.project", "b3.project"],
                ["b3.expand", "head.0"],
                _conv("b2.project")
                | _bn("b2.bn3")
                | _conv("b3.project")
                | _bn("b3.bn3")
                | _into("b3.expand")
                | _into("head.0"),
            ),
            "head": _g(["head.0"], ["fc"], _conv("head.0") | _bn("head.1") | _into("fc")),
        }
        for b in ("b1", "b2", "b3"):
            # expand output = depthwise input = depthwise output: one group
            out[f"{b}_hidden"] = _g(
                [f"{b}.expand", f"{b}.dw"],
                [f"{b}.dw", f"{b}.project"],
                _conv(f"{b}.expand")
                | _bn(f"{b}.bn1")
                | _conv(f"{b}.dw")
                | _bn(f"{b}.bn2")
                | _into(f"{b}.project"),
            )
        return out
    if arch == "vgg":
        return {
            "c1": _g(["conv1"], ["conv2"], _conv("conv1", bias=True) | _bn("bn1") | _into("conv2")),
            "c2": _g(["conv2"], ["conv3"], _conv("conv2", bias=True) | _bn("bn2") | _into("conv3")),
            # the last conv's channels own fc1 input columns (4 spatial positions each)
            "c3": _g(["conv3"], ["fc1"], _conv("conv3", bias=True) | _bn("bn3") | _into("fc1")),
            "fc1": _g(["fc1"], ["fc2"], _conv("fc1", bias=True) | _into("fc2")),
        }
    if arch == "mlp_skip":
        return {
            "d": _g(
                ["fc_in", "block1.fc2", "block2.fc2"],
                ["block1.fc1", "block2.fc1", "fc_out"],
                _conv("fc_in", bias=True)
                | _conv("block1.fc2", bias=True)
                | _conv("block2.fc2", bias=True)
                | _into("block1.fc1")
                | _into("block2.fc1")
                | _into("fc_out"),
            ),
            "h1": _g(
                ["block1.fc1"], ["block1.fc2"], _conv("block1.fc1", bias=True) | _into("block1.fc2")
            ),
            "h2": _g(
                ["block2.fc1"], ["block2.fc2"], _conv("block2.fc1", bias=True) | _into("block2.fc2")
            ),
        }
    if arch == "transformer":
        # a head: its q, k, v rows (split into (heads, head_dim) by a view) and the output
        # projection's columns that read it; one channel per head, never inside one
        heads = _conv("attn.q", bias=True) | _conv("attn.k", bias=True) | _conv("attn.v", bias=True)
        return {
            "heads": _g(["attn.q", "attn.k", "attn.v"], ["attn.out"], heads | _into("attn.out")),
            "hidden": _g(["mlp.fc1"], ["mlp.fc2"], _conv("mlp.fc1", bias=True) | _into("mlp.fc2")),
            # the residual stream (the hidden width): every producer that adds to it, every
            # layer norm on it (their statistics follow the mask), every reader
            "d": _g(
                ["embed", "attn.out", "mlp.fc2"],
                ["attn.q", "attn.k", "attn.v", "mlp.fc1", "head"],
                _conv("embed", bias=True)
                | _conv("attn.out", bias=True)
                | _conv("mlp.fc2", bias=True)
                | _ln("ln1")
                | _ln("ln2")
                | _ln("ln_f")
                | _into("attn.q")
                | _into("attn.k")
                | _into("attn.v")
                | _into("mlp.fc1")
                | _into("head"),
            ),
        }
    if arch == "se":
        return {
            "stem": _g(["stem.0"], ["conv1.0"], _conv("stem.0") | _bn("stem.1") | _into("conv1.0")),
            # the gated channels are tied to the SE gate (fc2 output) and read by the SE squeeze
            "c1": _g(
                ["conv1.0", "se.fc2"],
                ["se.fc1", "conv2.0"],
                _conv("conv1.0")
                | _bn("conv1.1")
                | _conv("se.fc2", bias=True)
                | _into("se.fc1")
                | _into("conv2.0"),
            ),
            "r": _g(["se.fc1"], ["se.fc2"], _conv("se.fc1", bias=True) | _into("se.fc2")),
            "c2": _g(["conv2.0"], ["fc"], _conv("conv2.0") | _bn("conv2.1") | _into("fc")),
        }
    raise AssertionError(arch)


_SAME_AS = {"transformer_sdpa": "transformer"}  # same modules and expectations
_HEAD = {
    "resnet_basic": "fc",
    "resnet_bottleneck": "fc",
    "densenet": "fc",
    "mobilenetv2": "fc",
    "vgg": "fc2",
    "mlp_skip": "fc_out",
    "transformer": "head",
    "transformer_sdpa": "head",
    "se": "fc",
}


def _expected_skipped(arch: str) -> list[tuple[ParamDims, int, str, bool]]:
    """(param dims, channels, reason fragment, expected flag) of every skipped entry."""
    head = _HEAD[arch]
    out = [(frozenset(_conv(head, bias=True)), zoo.NUM_CLASSES, "reaches the model output", True)]
    return out


def _match(masks: fp.AppliedMasks, arch: str) -> dict[str, str]:
    """Width key -> mask name, matching groups by their producers."""
    by_producers = {frozenset(g.producers): n for n, g in masks.groups.items()}
    out = {}
    for key, e in _expected_groups(arch).items():
        assert e.producers in by_producers, f"{arch}: no group produced by {sorted(e.producers)}"
        out[key] = by_producers[e.producers]
    return out


# ============================================================== helpers
def _build(arch: str, widths: dict[str, int] | None = None, seed: int = 0) -> nn.Module:
    return zoo.ARCHS[arch].build(widths, seed)


def _input(arch: str, batch: int = BATCH) -> Tensor:
    return zoo.ARCHS[arch].example_input(batch)


def _apply(arch: str, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, fp.AppliedMasks]:
    model = _build(arch).to(dtype)
    masks = fp.apply_masks(model, _input(arch).to(dtype))
    model.to(dtype)  # the masks' buffers too
    return model, masks


def _random_prune(masks: fp.AppliedMasks, seed: int) -> dict[str, Tensor]:
    """Zero random entries of every mask, keeping at least one; return kept indices by name."""
    gen = torch.Generator().manual_seed(seed)
    kept = {}
    with torch.no_grad():
        for name, m in masks.items():
            c = m.num_channels
            n_zero = int(torch.randint(1, c, (1,), generator=gen)) if c > 1 else 0
            drop = torch.randperm(c, generator=gen)[:n_zero]
            m.mask[drop] = 0.0
            kept[name] = torch.nonzero(m.mask > 0.5).flatten()
    return kept


def _flops_per_example(model: nn.Module, x: Tensor) -> float:
    counter = FlopCounterMode(display=False, custom_mapping=dict(SAME_AS_TORCH))
    with counter, torch.no_grad():
        model(x)
    return counter.get_total_flops() / x.shape[0]


# ------------------------------------------------- reduced references, by hand
Index = Tensor | None  # None: every index of that dim
Slices = dict[str, tuple[Index, ...]]


class _Slicer:
    """Per-parameter index lists, written per architecture; ``k(key)`` are the kept channels."""

    def __init__(self, arch: str, kept: dict[str, Tensor]) -> None:
        self.w = zoo.DEFAULT_WIDTHS[arch]
        self._kept = kept
        self.s: Slices = {}

    def k(self, key: str) -> Tensor:
        return self._kept.get(key, torch.arange(self.w[key]))

    def conv(self, m: str, out: Index, into: Index) -> None:  # also Linear
        self.s[f"{m}.weight"] = (out, into)
        self.s[f"{m}.bias"] = (out,)

    def bn(self, m: str, ix: Index) -> None:
        for p in ("weight", "bias", "running_mean", "running_var"):
            self.s[f"{m}.{p}"] = (ix,)


def _slices(arch: str, kept: dict[str, Tensor]) -> Slices:
    z = _Slicer(arch, kept)
    k = z.k
    arch = _SAME_AS.get(arch, arch)
    if arch == "resnet_basic":
        z.conv("stem.0", k("s1"), None)
        z.bn("stem.1", k("s1"))
        for b, cin, mid, cout in [
            ("l1", "s1", "l1_mid", "s1"),
            ("l2", "s1", "l2_mid", "s2"),
            ("l3", "s2", "l3_mid", "s2"),
        ]:
            z.conv(f"{b}.conv1", k(mid), k(cin))
            z.bn(f"{b}.bn1", k(mid))
            z.conv(f"{b}.conv2", k(cout), k(mid))
            z.bn(f"{b}.bn2", k(cout))
        z.conv("l2.down.0", k("s2"), k("s1"))
        z.bn("l2.down.1", k("s2"))
        z.conv("fc", None, k("s2"))
    elif arch == "resnet_bottleneck":
        z.conv("stem.0", k("stem"), None)
        z.bn("stem.1", k("stem"))
        for b, cin, cout in [("l1", "stem", "s1"), ("l2", "s1", "s2"), ("l3", "s2", "s2")]:
            z.conv(f"{b}.conv1", k(f"{b}_a"), k(cin))
            z.bn(f"{b}.bn1", k(f"{b}_a"))
            z.conv(f"{b}.conv2", k(f"{b}_b"), k(f"{b}_a"))
            z.bn(f"{b}.bn2", k(f"{b}_b"))
            z.conv(f"{b}.conv3", k(cout), k(f"{b}_b"))
            z.bn(f"{b}.bn3", k(cout))
            if b != "l3":
                z.conv(f"{b}.down.0", k(cout), k(cin))
                z.bn(f"{b}.down.1", k(cout))
        z.conv("fc", None, k("s2"))
    elif arch == "densenet":
        c0, g1 = z.w["stem"], z.w["g1"]
        cat1 = k("stem")  # channels of x after the stem
        cat2 = torch.cat([k("stem"), c0 + k("g1")])  # after dense1
        cat3 = torch.cat([k("stem"), c0 + k("g1"), c0 + g1 + k("g2")])  # after dense2
        z.conv("stem", k("stem"), None)
        z.bn("stem_bn", k("stem"))
        z.bn("dense1.bn", cat1)
        z.conv("dense1.conv", k("g1"), cat1)
        z.bn("dense2.bn", cat2)
        z.conv("dense2.conv", k("g2"), cat2)
        z.bn("trans_bn", cat3)
        z.conv("trans_conv", k("trans"), cat3)
        z.bn("head_bn", k("trans"))
        z.conv("fc", None, k("trans"))
    elif arch == "mobilenetv2":
        z.conv("stem.0", k("s1"), None)
        z.bn("stem.1", k("s1"))
        for b, cin, cout in [("b1", "s1", "s1"), ("b2", "s1", "s2"), ("b3", "s2", "s2")]:
            h = k(f"{b}_hidden")
            z.conv(f"{b}.expand", h, k(cin))
            z.bn(f"{b}.bn1", h)
            z.conv(f"{b}.dw", h, None)  # depthwise: (hidden, 1, 3, 3)
            z.bn(f"{b}.bn2", h)
            z.conv(f"{b}.project", k(cout), h)
            z.bn(f"{b}.bn3", k(cout))
        z.conv("head.0", k("head"), k("s2"))
        z.bn("head.1", k("head"))
        z.conv("fc", None, k("head"))
    elif arch == "vgg":
        z.conv("conv1", k("c1"), None)
        z.bn("bn1", k("c1"))
        z.conv("conv2", k("c2"), k("c1"))
        z.bn("bn2", k("c2"))
        z.conv("conv3", k("c3"), k("c2"))
        z.bn("bn3", k("c3"))
        # flatten of (c3, 2, 2): channel c owns fc1 columns 4c .. 4c + 3
        cols = (k("c3")[:, None] * 4 + torch.arange(4)).flatten()
        z.conv("fc1", k("fc1"), cols)
        z.conv("fc2", None, k("fc1"))
    elif arch == "mlp_skip":
        z.conv("fc_in", k("d"), None)
        for b, h in [("block1", "h1"), ("block2", "h2")]:
            z.conv(f"{b}.fc1", k(h), k("d"))
            z.conv(f"{b}.fc2", k("d"), k(h))
        z.conv("fc_out", None, k("d"))
    elif arch == "transformer":
        hd = z.w["head_dim"]
        rows = (k("heads")[:, None] * hd + torch.arange(hd)).flatten()  # a head's channels
        for p in ("q", "k", "v"):
            z.conv(f"attn.{p}", rows, None)
        d = k("d")
        z.conv("embed", d, None)
        for p in ("q", "k", "v"):
            z.conv(f"attn.{p}", rows, d)
        z.conv("attn.out", d, rows)
        z.conv("mlp.fc1", k("hidden"), d)
        z.conv("mlp.fc2", d, k("hidden"))
        for ln in ("ln1", "ln2", "ln_f"):
            z.bn(ln, d)
        z.conv("head", None, d)
    elif arch == "se":
        z.conv("stem.0", k("stem"), None)
        z.bn("stem.1", k("stem"))
        z.conv("conv1.0", k("c1"), k("stem"))
        z.bn("conv1.1", k("c1"))
        z.conv("se.fc1", k("r"), k("c1"))
        z.conv("se.fc2", k("c1"), k("r"))
        z.conv("conv2.0", k("c2"), k("c1"))
        z.bn("conv2.1", k("c2"))
        z.conv("fc", None, k("c2"))
    else:
        raise AssertionError(arch)
    return z.s


def _reduced_reference(arch: str, original: nn.Module, kept: dict[str, Tensor]) -> nn.Module:
    """The zoo architecture built with the kept widths, weights copied at the kept indices."""
    widths = {key: int(ix.numel()) for key, ix in kept.items()}
    ref = _build(arch, widths, seed=123).to(torch.float64)
    src = {k: v for k, v in original.state_dict().items() if not k.startswith("fisherprune_masks")}
    slices = _slices(arch, kept)
    dst = ref.state_dict()
    assert set(dst) == set(src)
    with torch.no_grad():
        for name, t in dst.items():
            v = src[name]
            for d, ix in enumerate(slices.get(name, ())):
                if ix is not None:
                    v = v.index_select(d, ix)
            assert v.shape == t.shape, f"{arch}: {name} sliced to {v.shape}, reference {t.shape}"
            t.copy_(v)
    return ref.eval()


def _prune_and_reference(arch: str, seed: int) -> tuple[nn.Module, nn.Module, Tensor]:
    """A float64 masked model with a random pruning, its reduced reference, and an input."""
    model, masks = _apply(arch, torch.float64)
    names = _match(masks, arch)
    kept_by_name = _random_prune(masks, seed + zlib.crc32(arch.encode()))
    kept = {key: kept_by_name[n] for key, n in names.items()}
    return model, _reduced_reference(arch, model, kept), _input(arch).double()


# ================================================================= groups
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_groups_are_the_expected_ones(arch: str) -> None:
    """Exactly the expected groups: same producers, consumers, parameter dims, channel counts."""
    _, masks = _apply(arch)
    widths = zoo.DEFAULT_WIDTHS[arch]
    got = {
        frozenset(g.producers): (frozenset(g.consumers), frozenset(g.params), g.num_channels)
        for g in masks.groups.values()
    }
    want = {
        e.producers: (e.consumers, e.params, widths[key])
        for key, e in _expected_groups(arch).items()
    }
    assert got == want
    assert set(masks) == set(masks.groups)
    for name, m in masks.items():
        assert m.num_channels == masks.groups[name].num_channels


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_skipped_are_the_expected_ones(arch: str) -> None:
    """Exactly the expected channels are left unmasked, each with the expected reason."""
    _, masks = _apply(arch)
    got = sorted((sorted(s.params), s.channels, s.reason, s.expected) for s in masks.skipped)
    want = _expected_skipped(arch)
    assert len(got) == len(want), masks.summary()
    for params, channels, fragment, expected in want:
        hits = [g for g in got if set(map(tuple, g[0])) == params]
        assert len(hits) == 1, f"{arch}: no skipped entry for {sorted(params)}\n{masks.summary()}"
        _, ch, reason, exp = hits[0]
        assert (ch, exp) == (channels, expected)
        assert fragment in reason


def _spec_index(arch: str, module: str) -> list[tuple[list[str], list[int], list[int]]]:
    """The library's mask point at ``module``: (group producers, positions, channels) per part."""
    model, x = _build(arch), _input(arch)
    trace = trace_model(model, x)
    groups, specs, _ = find_groups(trace, ChannelGraph(trace))
    [spec] = [s for s in specs if s.module == module]
    return [(groups[gi].producers, pos.tolist(), ch.tolist()) for gi, pos, ch in spec.parts]


def test_densenet_concat_positions_map_to_growth_channels() -> None:
    """At the transition conv, concat position p is stem channel p, then g1, then g2 channels."""
    w = zoo.DEFAULT_WIDTHS["densenet"]
    c0, g1, g2 = w["stem"], w["g1"], w["g2"]
    assert _spec_index("densenet", "trans_conv") == [
        (["stem"], list(range(c0)), list(range(c0))),
        (["dense1.conv"], list(range(c0, c0 + g1)), list(range(g1))),
        (["dense2.conv"], list(range(c0 + g1, c0 + g1 + g2)), list(range(g2))),
    ]


def test_vgg_flatten_columns_map_to_conv_channels() -> None:
    """At fc1, flattened column 4c + p (p a spatial position) belongs to conv3 channel c."""
    c3 = zoo.DEFAULT_WIDTHS["vgg"]["c3"]
    assert _spec_index("vgg", "fc1") == [
        (["conv3"], list(range(4 * c3)), [c for c in range(c3) for _ in range(4)]),
    ]


@pytest.mark.parametrize("arch", ["densenet", "vgg"])
def test_zeroing_one_channel_zeroes_exactly_its_positions(arch: str) -> None:
    """Zeroing channel k of a concat / flatten group zeroes exactly its positions at the reader."""
    model, masks = _apply(arch)
    names = _match(masks, arch)
    w = zoo.DEFAULT_WIDTHS[arch]
    if arch == "densenet":
        # trans_conv reads [stem | g1 | g2]; g2 is computed from g1, so compare [stem | g1] only
        key, reader, upstream = "g1", "trans_conv", w["stem"] + w["g1"]

        def positions(j: int) -> set[int]:
            return {w["stem"] + j}
    else:
        key, reader, upstream = "c3", "fc1", 4 * w["c3"]

        def positions(j: int) -> set[int]:
            return {4 * j + p for p in range(4)}

    seen: list[Tensor] = []
    handle = dict(model.named_modules())[reader].register_forward_pre_hook(
        lambda _m, args: seen.append(args[0].detach().clone())
    )
    with torch.no_grad():
        model(_input(arch))
        # a channel that is not already zero (ReLU) everywhere, so that zeroing it shows
        k = next(j for j in range(w[key]) if any(bool(seen[0][:, i].any()) for i in positions(j)))
        masks[names[key]].mask[k] = 0.0
        model(_input(arch))
    handle.remove()
    before, after = seen
    changed = {i for i in range(upstream) if not torch.equal(before[:, i], after[:, i])}
    assert changed == {i for i in positions(k) if bool(before[:, i].any())}
    assert all(bool((after[:, i] == 0).all()) for i in positions(k))


# ======================================================= exactness, removal
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_all_ones_masks_leave_outputs_unchanged(arch: str, grad: bool) -> None:
    """With every mask entry 1, the masked model's output equals the original's bit for bit."""
    x = _input(arch)
    with torch.no_grad():
        ref = _build(arch)(x)
    model, _ = _apply(arch)
    with torch.set_grad_enabled(grad):
        out = model(x)
    assert torch.equal(out.detach(), ref)


def _snapshot(model: nn.Module) -> dict:
    return {
        "params": [(n, id(p), p.detach().clone()) for n, p in model.named_parameters()],
        "buffers": [(n, id(b), b.clone()) for n, b in model.named_buffers()],
        "keys": list(model.state_dict()),
        "modules": [n for n, _ in model.named_modules()],
        "hooks": {n: len(m._forward_pre_hooks) for n, m in model.named_modules()},
    }


def _same(a: dict, b: dict) -> bool:
    def eq(x: list, y: list) -> bool:
        return len(x) == len(y) and all(
            n1 == n2 and i1 == i2 and torch.equal(t1, t2)
            for (n1, i1, t1), (n2, i2, t2) in zip(x, y, strict=True)
        )

    return (
        eq(a["params"], b["params"])
        and eq(a["buffers"], b["buffers"])
        and a["keys"] == b["keys"]
        and a["modules"] == b["modules"]
        and a["hooks"] == b["hooks"]
    )


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_remove_masks_restores_the_model_exactly(arch: str) -> None:
    """After apply, pruning, remove: same params, buffers, state_dict keys, hooks and outputs."""
    model, x = _build(arch), _input(arch)
    before = _snapshot(model)
    with torch.no_grad():
        ref = model(x)
    masks = fp.apply_masks(model, x)
    _random_prune(masks, 0)
    with torch.no_grad():
        changed = model(x)
    fp.remove_masks(model)
    assert not hasattr(model, "fisherprune_masks")
    assert _same(before, _snapshot(model))
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    assert not torch.equal(changed, ref)  # the pruning did act before removal


# ============================================================ vs reference
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_random_pruning_equals_reduced_reference(arch: str, seed: int) -> None:
    """A randomly pruned masked model computes what the physically reduced network computes."""
    model, ref, x = _prune_and_reference(arch, seed)
    with torch.no_grad():
        out, want = model(x), ref(x)
        dense = _build(arch).double()(x)
    torch.testing.assert_close(out, want, atol=ATOL_F64, rtol=RTOL_F64)
    assert not torch.allclose(out, dense)  # the pruning did change the function


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_cost_equals_flop_counter_on_reduced_reference(arch: str, seed: int) -> None:
    """computational_cost(masked).total is FlopCounterMode on the reduced network per example."""
    model, ref, x = _prune_and_reference(arch, seed)
    total = fp.computational_cost(model, x).total
    assert total == pytest.approx(_flops_per_example(ref, x), rel=FLOP_REL)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_dense_cost_equals_flop_counter(arch: str) -> None:
    """With all-ones masks the cost equals FlopCounterMode on the original model, per example."""
    x = _input(arch)
    model, _ = _apply(arch)
    want = _flops_per_example(_build(arch), x)
    assert fp.computational_cost(model, x).total == pytest.approx(want, rel=FLOP_REL)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_marginal_cost_is_the_flops_of_removing_that_channel(arch: str) -> None:
    """marginal[mask][k] equals FlopCounterMode(reference) minus the same with channel k removed."""
    model, masks = _apply(arch, torch.float64)
    names = _match(masks, arch)
    kept_by_name = _random_prune(masks, 7)
    x = _input(arch).double()
    report = fp.computational_cost(model, x)
    kept = {key: kept_by_name[n] for key, n in names.items()}
    base = _flops_per_example(_reduced_reference(arch, model, kept), x)
    for key, name in names.items():
        if kept[key].numel() < 2:
            continue
        k = int(kept[key][0])
        fewer = dict(kept)
        fewer[key] = kept[key][1:]
        without = _flops_per_example(_reduced_reference(arch, model, fewer), x)
        assert float(report.marginal[name][k]) == pytest.approx(base - without, rel=FLOP_REL), key


# ================================================================== signals
Places = dict[str, list[tuple[str, Tensor, Tensor]]]  # module -> (key, positions, channels)


def _places(arch: str) -> Places:
    """Where each group's mask multiplies: by hand, from the expected consumers."""
    w = zoo.DEFAULT_WIDTHS[arch]
    out: Places = {}
    for key, e in _expected_groups(arch).items():
        for mod in e.consumers:
            out.setdefault(mod, []).append((key, torch.arange(w[key]), torch.arange(w[key])))
    if arch == "densenet":
        c0, g1, g2 = w["stem"], w["g1"], w["g2"]
        out["dense2.conv"] = [
            ("stem", torch.arange(c0), torch.arange(c0)),
            ("g1", torch.arange(c0, c0 + g1), torch.arange(g1)),
        ]
        out["trans_conv"] = [
            *out["dense2.conv"],
            ("g2", torch.arange(c0 + g1, c0 + g1 + g2), torch.arange(g2)),
        ]
    if arch == "vgg":
        c3 = w["c3"]
        out["fc1"] = [("c3", torch.arange(4 * c3), torch.arange(c3).repeat_interleave(4))]
    if arch in ("transformer", "transformer_sdpa"):  # one mask entry per head, over its channels
        h, hd = w["heads"], w["head_dim"]
        out["attn.out"] = [("heads", torch.arange(h * hd), torch.arange(h).repeat_interleave(hd))]
    return out


def _hand_masked(arch: str, model: nn.Module, m: dict[str, Tensor]) -> list:
    """Forward pre-hooks multiplying each consumer's input by the hand-placed masks ``m``."""
    mods = dict(model.named_modules())
    dim = -1 if arch in ("mlp_skip", "transformer", "transformer_sdpa") else 1
    handles = []
    for mod, parts in _places(arch).items():

        def pre(_m: nn.Module, args: tuple, parts=parts) -> tuple:
            x = args[0]
            mult = torch.ones(x.shape[dim], dtype=x.dtype)
            for key, pos, ch in parts:
                mult = mult.index_put((pos,), m[key][ch])
            shape = [1] * x.dim()
            shape[dim] = -1
            return (x * mult.view(shape), *args[1:])

        handles.append(mods[mod].register_forward_pre_hook(pre))
    return handles


def _per_example_signals(arch: str, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """Delta_k = 1/2 mean_n (d loss_n / d m_k)^2 by a per-example float64 loop."""
    model = _build(arch).double()
    w = zoo.DEFAULT_WIDTHS[arch]
    keys = list(_expected_groups(arch))
    m = {k: torch.ones(w[k], dtype=torch.float64, requires_grad=True) for k in keys}
    handles = _hand_masked(arch, model, m)
    sq = {k: torch.zeros(w[k], dtype=torch.float64) for k in keys}
    for n in range(x.shape[0]):
        loss = F.cross_entropy(model(x[n : n + 1]), y[n : n + 1])
        grads = torch.autograd.grad(loss, [m[k] for k in keys])
        for k, g in zip(keys, grads, strict=True):
            sq[k] += g * g
    for h in handles:
        h.remove()
    return {k: 0.5 * s / x.shape[0] for k, s in sq.items()}


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_fisher_signal_equals_per_example_loop(arch: str) -> None:
    """After one mean-loss backward and decay=0, each group's signal is 1/2 mean_n g_n^2."""
    x = _input(arch, 4).double()
    y = torch.randint(0, zoo.NUM_CLASSES, (4,), generator=torch.Generator().manual_seed(3))
    model, masks = _apply(arch, torch.float64)
    names = _match(masks, arch)
    F.cross_entropy(model(x), y).backward()
    fp.update_pruning_signals(masks, decay=0)
    want = _per_example_signals(arch, x, y)
    for key, name in names.items():
        got = masks[name].signal
        assert got.dtype == torch.float64
        assert float(want[key].abs().max()) > 0, key  # the check is not vacuous
        torch.testing.assert_close(got, want[key], rtol=SIGNAL_RTOL, atol=SIGNAL_ATOL, msg=key)


# ================================================ consumers inside a module
class _PreActConv(nn.Module):
    """BN-ReLU, then a convolution done functionally with this module's own weight."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(cin)
        self.weight = nn.Parameter(0.2 * torch.randn(cout, cin, 3, 3))

    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(F.relu(self.bn(x)), self.weight, padding=1)


class _PreActNet(nn.Module):
    """conv1 (4 ch) -> _PreActConv (5 ch) -> spatial mean -> fc."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.block = _PreActConv(4, 5)
        self.fc = nn.Linear(5, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.block(self.conv1(x)).mean((2, 3)))


def test_functional_consumer_behind_batchnorm_is_skipped_not_masked_wrongly() -> None:
    """Channels a module reads through a BatchNorm before its functional conv are left
    unmasked with that reason (a mask at the module input would not remove them)."""
    torch.manual_seed(0)
    model, x = _PreActNet().eval(), zoo.image_input(BATCH)
    zoo.randomise_norms(model, 0)  # BN bias != 0, as after training
    masks = fp.apply_masks(model, x)
    assert all(g.producers != ["conv1"] for g in masks.groups.values())
    reasons = [s.reason for s in masks.skipped if ("conv1.weight", 0) in s.params]
    assert len(reasons) == 1 and "BatchNorm" in reasons[0] and "block" in reasons[0]


def test_functional_consumer_behind_batchnorm_raises_in_strict_mode() -> None:
    """strict=True refuses a model whose channels would be masked where they stay alive."""
    model, x = _PreActNet().eval(), zoo.image_input(BATCH)
    with pytest.raises(ValueError, match="BatchNorm"):
        fp.apply_masks(model, x, strict=True)
    assert not fp.find_masks(model)


# =========================================================== unsupported ops
class _OpNet(nn.Module):
    """conv1 (6 ch) -> ReLU -> ``op`` -> conv2 (4 ch) -> ReLU -> conv3 (2 ch) -> spatial mean."""

    def __init__(self, op: Callable[[Tensor], Tensor], cin2: int) -> None:
        super().__init__()
        self.op = op
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(cin2, 4, 3, padding=1)
        self.conv3 = nn.Conv2d(4, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.op(F.relu(self.conv1(x)))
        return self.conv3(F.relu(self.conv2(x))).mean((2, 3))


def _cumsum(x: Tensor) -> Tensor:
    return torch.cumsum(x, 1)


def _fixed_slice(x: Tensor) -> Tensor:
    return x[:, :3]


def _view_mixing(x: Tensor) -> Tensor:
    n, c, h, w = x.shape
    return x.view(n, c // 2, 2 * h, w)


def _flip(x: Tensor) -> Tensor:
    return torch.flip(x, [1])


UNSUPPORTED = {  # name: (op, conv2 input channels, op named in the reason)
    "cumsum": (_cumsum, 6, "aten.cumsum"),
    "fixed_slice": (_fixed_slice, 3, "aten.slice"),
    "view_mixing": (_view_mixing, 3, "aten.view"),
    "flip_no_rule": (_flip, 6, "aten.flip"),
}


def _op_net(case: str) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    op, cin2, _ = UNSUPPORTED[case]
    return _OpNet(op, cin2).eval(), zoo.image_input(BATCH)


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_op_leaves_channels_unmasked_and_named(case: str) -> None:
    """Channels through an op with no channel rule are skipped, naming the op; others are masked."""
    model, x = _op_net(case)
    with torch.no_grad():
        ref = model(x)
    masks = fp.apply_masks(model, x, strict=False)
    fragment = UNSUPPORTED[case][2]
    for g in masks.groups.values():
        assert ("conv1.weight", 0) not in g.params
    hits = [s for s in masks.skipped if ("conv1.weight", 0) in s.params]
    assert len(hits) == 1, masks.summary()
    assert fragment in hits[0].reason and not hits[0].expected
    assert hits[0].channels == 6
    assert [(g.producers, g.consumers) for g in masks.groups.values()] == [(["conv2"], ["conv3"])]
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    assert fp.computational_cost(model, x).total > 0


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_op_with_strict_raises_naming_it(case: str) -> None:
    """strict=True raises ValueError naming the op, and leaves the model without masks."""
    model, x = _op_net(case)
    with pytest.raises(ValueError, match=UNSUPPORTED[case][2]):
        fp.apply_masks(model, x, strict=True)
    assert not hasattr(model, "fisherprune_masks")
    assert all(not m._forward_pre_hooks for m in model.modules())


# ------------------------------------------------------- custom op extension
@torch.library.custom_op("fptest::double_it", mutates_args=())
def double_it(x: Tensor) -> Tensor:
    """An element-wise custom op (2x) that fisherprune knows nothing about."""
    return x * 2


@double_it.register_fake
def _double_it_fake(x: Tensor) -> Tensor:
    return torch.empty_like(x)


def _passthrough(ctx: RuleContext) -> list[TensorInfo]:
    """Channel rule for an element-wise, zero-preserving op: labels and covers pass through."""
    src = ctx.info(ctx.in_tensors[0])
    return [TensorInfo(src.shape, list(src.labels), list(src.cover))]


DOUBLE_IT = torch.ops.fptest.double_it


@pytest.fixture
def double_it_rule():
    """Register the pass-through rule for ``fptest::double_it`` for one test, then remove it."""
    fp.register_channel_rule(DOUBLE_IT)(_passthrough)
    try:
        yield
    finally:
        _RULES.pop(DOUBLE_IT, None)


def _custom_net() -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    return _OpNet(double_it, 6).eval(), zoo.image_input(BATCH)


def test_custom_op_without_rule_is_skipped_and_named() -> None:
    """A custom op with no rule blocks its channels; the reason names the op."""
    assert DOUBLE_IT not in _RULES
    model, x = _custom_net()
    masks = fp.apply_masks(model, x)
    [hit] = [s for s in masks.skipped if ("conv1.weight", 0) in s.params]
    assert "double_it" in hit.reason and "no channel rule" in hit.reason


def test_custom_op_reason_names_its_namespace() -> None:
    """The skipped reason names a custom op with its own namespace, not as an aten op."""
    model, x = _custom_net()
    masks = fp.apply_masks(model, x)
    [hit] = [s for s in masks.skipped if ("conv1.weight", 0) in s.params]
    assert "fptest" in hit.reason and "aten.double_it" not in hit.reason


@pytest.mark.usefixtures("double_it_rule")
def test_registered_rule_makes_custom_op_channels_prunable() -> None:
    """With a pass-through rule, conv1's channels through the custom op form a masked group."""
    model, x = _custom_net()
    with torch.no_grad():
        ref = model(x)
    masks = fp.apply_masks(model, x, strict=True)
    groups = {tuple(g.producers): g for g in masks.groups.values()}
    assert set(groups) == {("conv1",), ("conv2",)}
    assert groups[("conv1",)].consumers == ["conv2"]
    assert groups[("conv1",)].num_channels == 6
    assert not [s for s in masks.skipped if not s.expected]
    with torch.no_grad():
        assert torch.equal(model(x), ref)


@pytest.mark.usefixtures("double_it_rule")
def test_registered_rule_pruning_matches_zeroed_weights() -> None:
    """Zeroing a custom-op group channel equals zeroing that channel's conv2 input weights."""
    model, x = _custom_net()
    masks = fp.apply_masks(model, x)
    [name] = [n for n, g in masks.groups.items() if g.producers == ["conv1"]]
    with torch.no_grad():
        masks[name].mask[[1, 4]] = 0.0
        out = model(x)
    fp.remove_masks(model)
    with torch.no_grad():
        model.conv2.weight[:, [1, 4]] = 0.0
        torch.testing.assert_close(out, model(x), rtol=0, atol=1e-6)


@pytest.mark.usefixtures("double_it_rule")
def test_register_channel_rule_rejects_a_duplicate() -> None:
    """Registering a second rule for an op that has one is a ValueError."""
    with pytest.raises(ValueError, match="already has a channel rule"):
        fp.register_channel_rule(DOUBLE_IT)(_passthrough)


def test_register_channel_rule_rejects_a_non_op() -> None:
    """A key that is not an operator is a TypeError, and nothing is registered."""
    before = dict(_RULES)
    with pytest.raises(TypeError, match="expects ATen operators"):
        fp.register_channel_rule(torch.cumsum)(_passthrough)
    assert before == _RULES


def test_rule_fixture_cleans_up() -> None:
    """The registry holds no rule for the test custom op outside the fixture."""
    assert DOUBLE_IT not in _RULES


# ============================================================ apply / remove
def test_applying_masks_twice_raises() -> None:
    """A second apply_masks is a ValueError, and the first masks keep working unchanged."""
    model, x = _build("resnet_basic"), _input("resnet_basic")
    masks = fp.apply_masks(model, x)
    _random_prune(masks, 0)
    with torch.no_grad():
        out = model(x)
    before = _snapshot(model)
    with pytest.raises(ValueError, match="already has"):
        fp.apply_masks(model, x)
    assert _same(before, _snapshot(model))
    with torch.no_grad():
        assert torch.equal(model(x), out)


def test_remove_masks_without_masks_is_a_no_op() -> None:
    """remove_masks on a model that has no masks changes nothing."""
    model, x = _build("resnet_basic"), _input("resnet_basic")
    before = _snapshot(model)
    with torch.no_grad():
        ref = model(x)
    fp.remove_masks(model)
    fp.remove_masks(model)
    assert _same(before, _snapshot(model))
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_sequential_model_still_runs_after_apply_masks() -> None:
    """A top-level nn.Sequential computes the same output after apply_masks."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2)), zoo.vector_input(BATCH)
    with torch.no_grad():
        ref = model(x)
    fp.apply_masks(model, x)
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_apply_after_remove_works_again() -> None:
    """apply, remove, apply again gives the same groups as the first time."""
    model, x = _build("resnet_basic"), _input("resnet_basic")
    first = fp.apply_masks(model, x)
    fp.remove_masks(model)
    second = fp.apply_masks(model, x)
    assert list(first.groups) == list(second.groups)
    assert [g.params for g in first.groups.values()] == [g.params for g in second.groups.values()]
