"""Channel groups: the prunable channels of a traced model and where to mask them.

Each prunable component (one channel, see ``channels.py``) belongs to a group:
the components that touch exactly the same parameter dimensions (all output
channels of one conv, together with the BatchNorm after it, the convs that read
them, and every layer tied to them by residual adds) form one group with one
mask. A group is masked where it is consumed: at the input of every module that
contracts it (conv, linear), so that every consumer sees zero for a removed
channel; this is exact whatever lies between producer and consumer (BatchNorm
bias, sigmoid gates, residual adds), and it is where the Fisher signal is
defined (docs/design.md, "Where masks act").
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from fisherprune.graph.channels import ChannelGraph
from fisherprune.graph.trace import Trace
from fisherprune.graph.types import ModuleCall

__all__ = ["ChannelGroup", "MaskPointSpec", "Skipped", "find_groups"]

_EXPECTED = ("reaches the model output", "model input", "batch dimension")


@dataclass
class ChannelGroup:
    """Channels that share one mask.

    Attributes:
        name: readable name (the first producing parameter's module and dim).
        roots: component root of each channel, in channel order.
        params: parameter dims the group's channels live in: ``(name, dim)``.
        producers: modules whose outputs make these channels.
        consumers: modules whose inputs read them (where the mask acts), and
            ``"the output<key path>"`` for a model output that returns them.
        norms: registered norms (``fisherprune.norms``) that normalise them, whose statistics
            follow the mask (taken over the kept channels only).
        members: for each parameter dim ``(name, dim)`` the group touches, the channel
            of the group each index along that dim belongs to (-1: another group's).
    """

    name: str
    roots: np.ndarray
    params: list[tuple[str, int]]
    producers: list[str] = field(default_factory=list)
    consumers: list[str] = field(default_factory=list)
    norms: list[str] = field(default_factory=list)
    members: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    #: the channels kept must stay a multiple of this (a grouped matrix product's 16-byte
    #: alignment: 4 channels in float32, 8 in bfloat16); 1: any count
    multiple: int = 1

    @property
    def num_channels(self) -> int:
        return int(self.roots.size)

    @property
    def channel_width(self) -> int:
        """Parameter rows (or columns) each channel spans, the greatest common divisor over
        every parameter dim the group lives in: 1 for a conv or linear channel, ``head_dim``
        for an attention head (its rows of q / k / v, its columns of the output projection)."""
        counts = [
            np.bincount(ch[ch >= 0], minlength=self.num_channels) for ch in self.members.values()
        ]
        spans = [int(c) for cs in counts for c in cs if c > 0]
        return functools.reduce(math.gcd, spans, 0) or 1


@dataclass
class MaskPointSpec:
    """Where a mask multiplies: positional input ``arg`` of ``module``, along ``dim``.

    ``parts``: (group index, positions along dim, channel of the group at each position).
    ``norm``: the module is a registered norm normalising ``dim``: instead of multiplying its
    input, the mask makes it take its statistics over the kept channels only.
    ``output``: not a module input but the model's output tensor at this pytree key path
    (``module`` is then ``"<model>"``, ``arg`` -1): a width the model returns and also reads
    inside (the hidden width of a base model) is multiplied there too, so that a removed
    channel reads 0 in the output, as the shrunk model's zero-filled output does.
    """

    module: str
    arg: int
    dim: int
    size: int
    parts: list[tuple[int, np.ndarray, np.ndarray]]
    norm: bool = False
    output: str | None = None


@dataclass
class Skipped:
    """Channels left unmasked, and why."""

    params: list[tuple[str, int]]
    channels: int
    reason: str
    expected: bool

    def __str__(self) -> str:
        where = ", ".join(f"{n}[dim {d}]" for n, d in self.params[:4])
        more = f" (+{len(self.params) - 4} more)" if len(self.params) > 4 else ""
        return f"{self.channels} channel(s) of {where}{more}: {self.reason}"


def _module_of(param: str) -> str:
    return param.rpartition(".")[0] or "<model>"


def find_groups(
    trace: Trace, graph: ChannelGraph
) -> tuple[list[ChannelGroup], list[MaskPointSpec], list[Skipped]]:
    """Group the prunable channels of ``trace`` and say where each group is masked."""
    roots = graph.roots
    atoms = trace.atoms
    blocked = atoms.blocked_reasons(roots)
    multiples = atoms.multiples(roots)
    producers = set(atoms.producer_roots(roots).tolist())

    # parameter dims each component touches (its signature) and its first atom there
    sig: dict[int, set[int]] = defaultdict(set)
    first: dict[tuple[int, int], int] = {}
    for bi, b in enumerate(atoms.blocks):
        if b.kind != "param":
            continue
        r = roots[b.start : b.start + b.size]
        for idx, rr in enumerate(r.tolist()):
            sig[rr].add(bi)
            first.setdefault((rr, bi), idx)

    # consumer points per component, resolved to module inputs
    point_of: dict[tuple[str, int, int], list] = defaultdict(list)
    unhookable: dict[int, str] = {}
    outputs: dict[tuple[str, int], np.ndarray] = {}
    for cp in trace.consumers:
        r = roots[cp.labels]
        if cp.output is not None:
            outputs.setdefault(cp.output, r)
            continue
        if cp.hooked:
            continue  # masked by its module's own forward
        spot = _hook_spot(trace, cp)
        if spot is None and cp.passed_on:
            continue  # its channels' own uses are masked: removing them there removes them
        if spot is None:
            for rr in np.unique(r).tolist():
                unhookable.setdefault(
                    rr, f"{cp.what} reads it from a tensor that is not a module's positional input"
                )
            continue
        point_of[spot].append(r)

    norm_of = _norm_spots(trace, roots, unhookable)

    # a module called several times must see the same channel layout every time
    layout: dict[tuple[str, int, int], np.ndarray] = {}
    norm_layout: dict[tuple[str, int, int], np.ndarray] = {}
    for spot, rs, out in [(k, v, layout) for k, v in point_of.items()] + [
        (k, v, norm_layout) for k, v in norm_of.items()
    ]:
        base = rs[0]
        for other in rs[1:]:
            if other.shape != base.shape or not np.array_equal(other, base):
                for rr in np.unique(np.concatenate([base, other])).tolist():
                    unhookable.setdefault(
                        rr, f"module {spot[0]!r} is called several times with different channels"
                    )
        out[spot] = base

    groups_by_sig: dict[frozenset[int], list[int]] = defaultdict(list)
    skipped_by: dict[tuple[frozenset[int], str], int] = defaultdict(int)
    for rr in sorted(producers):
        if graph.followers[rr]:
            continue  # removed with the channels it is read through (a key/value head)
        s = frozenset(sig.get(rr, ()))
        reason = blocked.get(rr) or unhookable.get(rr)
        if reason is None and not graph.is_consumed(rr):
            reason = "never read by a layer"
        if reason is not None:
            skipped_by[(s, reason)] += 1
            continue
        groups_by_sig[s].append(rr)

    groups: list[ChannelGroup] = []
    group_of: dict[int, tuple[int, int]] = {}
    for s, rs in groups_by_sig.items():
        blocks = sorted(s, key=lambda bi: atoms.blocks[bi].start)
        params = [(atoms.blocks[bi].name, atoms.blocks[bi].dim) for bi in blocks]
        lead = blocks[0]
        rs = sorted(rs, key=lambda rr, lead=lead: first.get((rr, lead), 0))
        g = ChannelGroup(_group_name(params), np.asarray(rs, dtype=np.int64), params)
        g.producers = _producer_modules(trace, graph, np.asarray(rs))
        g.multiple = math.lcm(1, *(multiples.get(rr, 1) for rr in rs))
        for k, rr in enumerate(rs):
            group_of[rr] = (len(groups), k)
        channel_of = np.full(len(roots), -1, dtype=np.int64)
        channel_of[np.asarray(rs)] = np.arange(len(rs))
        for bi in blocks:
            b = atoms.blocks[bi]
            g.members[(b.name, b.dim)] = channel_of[roots[b.start : b.start + b.size]]
        groups.append(g)

    specs: list[MaskPointSpec] = []
    spots = (
        [(k, v, False, None) for k, v in layout.items()]
        + [(k, v, True, None) for k, v in norm_layout.items()]
        + [(("<model>", -1, dim), v, False, path) for (path, dim), v in outputs.items()]
    )
    for (module, arg, dim), r, norm, path in spots:
        by_group: dict[int, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
        for pos, rr in enumerate(r.tolist()):
            hit = group_of.get(rr)
            if hit is not None:
                by_group[hit[0]][0].append(pos)
                by_group[hit[0]][1].append(hit[1])
        if not by_group:
            continue
        parts = [(gi, np.asarray(p), np.asarray(c)) for gi, (p, c) in sorted(by_group.items())]
        specs.append(MaskPointSpec(module, arg, dim, int(r.size), parts, norm, path))
        where_name = module if path is None else f"the output{path}"
        for gi, _, _ in parts:
            where = groups[gi].norms if norm else groups[gi].consumers
            if where_name not in where:
                where.append(where_name)

    skipped = [
        Skipped(
            [(atoms.blocks[bi].name, atoms.blocks[bi].dim) for bi in sorted(s)],
            n,
            reason,
            any(reason.startswith(e) for e in _EXPECTED),
        )
        for (s, reason), n in skipped_by.items()
    ]
    return groups, specs, skipped


def _norm_spots(
    trace: Trace, roots: np.ndarray, unhookable: dict[int, str]
) -> dict[tuple[str, int, int], list[np.ndarray]]:
    """The components each registered norm normalises, by (module, 0, dim of its input); a norm
    that normalises something other than its first positional input blocks them (noted in
    ``unhookable``), since its hook could not see what it normalises."""
    spots: dict[tuple[str, int, int], list[np.ndarray]] = defaultdict(list)
    for use in trace.norm_uses:
        info = trace.calls[use.call].args[0] if trace.calls[use.call].args else None
        d = len(info.labels) - use.from_end if info is not None else -1
        lab = info.labels[d] if info is not None and d >= 0 else None
        if info is not None and use.norm_dims == 1 and not _same(lab, use.labels):
            # a norm over one dim that moves it last first (a channels-first LayerNorm2d):
            # the dim of its input that holds those labels (a norm over several dims
            # normalises its input's trailing ones only)
            d = next((i for i, at in enumerate(info.labels) if _same(at, use.labels)), -1)
            lab = info.labels[d] if d > 0 else None
        if lab is None or not _same(lab, use.labels):
            for rr in np.unique(roots[use.labels]).tolist():
                unhookable.setdefault(
                    rr, f"norm {use.module!r} normalises a tensor that is not its first input"
                )
            continue
        spots[(use.module, 0, d)].append(roots[use.labels])
    return spots


def _same(a: np.ndarray | None, b: np.ndarray) -> bool:
    return a is not None and (a is b or np.array_equal(a, b))


def _hook_spot(trace: Trace, cp) -> tuple[str, int, int] | None:
    """The innermost module call whose positional input holds exactly the consumed labels;
    failing that, the last submodule call the innermost one made before the consuming op
    whose input does (an expert's activation, read by the grouped product after it: the
    second trace of ``apply_masks`` checks that a mask there removes the channels)."""
    for ci in reversed(cp.calls):
        spot = _spot_in(trace.calls[ci], cp.labels)
        if spot is not None:
            return spot
    if not cp.calls or trace.calls[cp.calls[-1]].name == "<model>":
        return None
    inner = trace.calls[cp.calls[-1]]
    for call in reversed(trace.calls[cp.calls[-1] + 1 :]):
        if call.op_index <= cp.op_index and call.name.startswith(inner.name + "."):
            spot = _spot_in(call, cp.labels)
            if spot is not None:
                return spot
    return None


def _spot_in(call: ModuleCall, labels: np.ndarray) -> tuple[str, int, int] | None:
    """``(module, positional input, dim)`` of ``call`` holding exactly ``labels``, or None."""
    if call.name == "<model>":
        return None
    for ai, info in enumerate(call.args):
        if info is None:
            continue
        for d, lab in enumerate(info.labels):
            if d == 0 or lab is None or lab.shape != labels.shape:
                continue
            if lab is labels or np.array_equal(lab, labels):
                return (call.name, ai, d)
    return None


def _group_name(params: list[tuple[str, int]]) -> str:
    name, dim = params[0]
    return f"{_module_of(name)}:{'out' if dim == 0 else f'dim{dim}'}"


def _producer_modules(trace: Trace, graph: ChannelGraph, rs: np.ndarray) -> list[str]:
    mods: list[str] = []
    for arr in trace.atoms.producer_arrays():
        if np.isin(graph.roots[arr], rs).any():
            b, _ = trace.atoms.locate(int(arr[0]))
            m = _module_of(b.name)
            if m not in mods:
                mods.append(m)
    return mods
