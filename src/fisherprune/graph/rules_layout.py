"""Channel rules of operators that move or pick positions along dimensions: ``roll``,
padding, ``repeat``, ``index_select``, ``gather`` and advanced indexing (``x[:, idx]``,
``x[mask]``).

They share one principle. Along a dimension the operator does not touch, every index keeps
its label and its cover, wherever that dimension sits: padding the tokens of an (N, L, C)
tensor or rolling the windows of an (N, H, W, C) one keeps the channels of C. Along a
dimension it moves or picks by fixed positions (a shift, a pad width, an index tensor), a
channel is *stopped* (blocked and recorded as used there): the positions are numbers fixed
in the model's code or data, so removing a channel would move the others elsewhere in the
shrunk model than in the masked one. (Selecting one position, ``x[:, 0]``, and slicing are
``select`` and ``slice`` in ``rules.py``.)
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fisherprune.graph.rules import register_channel_rule
from fisherprune.graph.types import Labels, RuleContext, TensorInfo

__all__: list[str] = []  # rules only: they register themselves on import

aten = torch.ops.aten


def _stop_all(ctx: RuleContext, infos: list[TensorInfo | None], reason: str) -> None:
    """Stop every labelled dim of every tensor in ``infos``."""
    for info in infos:
        if info is None:
            continue
        for lab, cov in zip(info.labels, info.cover, strict=True):
            ctx.stop(lab, cov, reason)


def _blank_outputs(ctx: RuleContext) -> list[TensorInfo]:
    return [TensorInfo.blank(tuple(t.shape)) for t in ctx.out_tensors]


# --------------------------------------------------------------------------- roll
@register_channel_rule(aten.roll)
def _roll(ctx: RuleContext) -> list[TensorInfo]:
    """``torch.roll(x, shifts, dims)`` (Swin's shifted windows roll H and W).

    Every dim keeps its labels and covers (rolling moves values, a zero channel stays zero);
    along a rolled dim they are rolled with the values (``np.roll`` is the same permutation).
    A channel dim rolled by a nonzero shift is stopped: the shift is a fixed number, so with a
    channel removed the others would land elsewhere than in the masked model (even a shift
    that is a multiple of the size stops being one). With no ``dims`` the flattened tensor is
    rolled, which mixes every dim: all its channels are stopped.
    """
    x = ctx.info(ctx.args[0])
    nd = len(x.shape)
    shifts = [int(s) for s in ctx.arg("shifts")]
    dims = [int(d) % nd for d in ctx.arg("dims", [])] if nd else []
    if not dims:
        _stop_all(ctx, [x], f"{ctx.where()} rolls the flattened tensor (all dims mixed)")
        return _blank_outputs(ctx)
    lab, cov = list(x.labels), list(x.cover)
    reason = f"{ctx.where()} rolls channels by a fixed shift"
    for shift, d in zip(shifts, dims, strict=True):
        if lab[d] is None or shift == 0:
            continue
        ctx.stop(lab[d], cov[d], reason)
        lab[d] = np.roll(lab[d], shift)
        cov[d] = None if cov[d] is None else np.roll(cov[d], shift)
    return [TensorInfo(tuple(ctx.out_tensors[0].shape), lab, cov)]


# ---------------------------------------------------------------------------- pad
_PADS = [
    getattr(aten, n)
    for n in (
        "constant_pad_nd",
        "reflection_pad1d",
        "reflection_pad2d",
        "reflection_pad3d",
        "replication_pad1d",
        "replication_pad2d",
        "replication_pad3d",
    )
    if hasattr(aten, n)
]


@register_channel_rule(*_PADS)
def _pad(ctx: RuleContext) -> list[TensorInfo]:
    """Padding (``F.pad``): ``pad`` holds (before, after) amounts for the last dims, the
    last dim first; a negative amount crops.

    A dim with both amounts 0 keeps its labels, wherever it sits ((N, L, C) padded along L
    keeps C; an unbatched (C, H, W) keeps C). A padded or cropped dim holds positions: its
    new entries are no channel and the amounts are fixed numbers, so a channel there is
    stopped and the dim carries none. Covers are kept (reflection and replication copy
    values; constant padding adds zeros) unless the constant is not zero, which makes every
    channel nonzero somewhere.
    """
    x = ctx.info(ctx.args[0])
    nd = len(x.shape)
    pad = [int(p) for p in (ctx.arg("pad") if ctx.has_arg("pad") else ctx.arg("padding"))]
    value = ctx.arg("value", 0)
    lab, cov = list(x.labels), list(x.cover)
    reason = f"{ctx.where()} pads or crops channels at fixed positions"
    for i in range(min(len(pad) // 2, nd)):
        d = nd - 1 - i
        if pad[2 * i] == 0 and pad[2 * i + 1] == 0:
            continue
        ctx.stop(lab[d], cov[d], reason)
        lab[d], cov[d] = None, None
    if value is not None and value != 0:
        cov = [None] * nd
    return [TensorInfo(tuple(ctx.out_tensors[0].shape), lab, cov)]


# ----------------------------------------------------------------------- indexing
@register_channel_rule(aten.repeat)
def _repeat(ctx: RuleContext) -> list[TensorInfo]:
    """``x.repeat(*sizes)``: whole copies of ``x`` side by side along each dim (new leading dims
    carry none). A dim copied r times holds each of its channels r times, in the same order in
    every copy (DeBERTa's relative-position keys, one copy per example, beside queries whose
    heads are merged with the batch): it carries ``x``'s labels and covers tiled r times, so
    removing a channel removes it from every copy, as the shrunk model's smaller ``x`` does.
    A dim of one copied carries none, as ``expand`` 's broadcast dims: its copies are one value
    over the batch (SigLIP's pooling probe, ``probe.repeat(batch, 1, 1)``), and a batch of one
    must trace as a larger one does."""
    x = ctx.info(ctx.args[0])
    shape = tuple(ctx.out_tensors[0].shape)
    off = len(shape) - len(x.shape)
    lab: list[Labels] = [None] * len(shape)
    cov: list[Labels] = [None] * len(shape)
    for d, (a, c) in enumerate(zip(x.labels, x.cover, strict=True)):
        if x.shape[d] == 1:
            continue
        times = shape[d + off] // max(x.shape[d], 1)
        lab[d + off] = None if a is None else np.tile(a, times)
        cov[d + off] = None if c is None else np.tile(c, times)
    return [TensorInfo(shape, lab, cov, param=x.param)]


@register_channel_rule(aten.index_select)
def _index_select(ctx: RuleContext) -> list[TensorInfo]:
    """``x.index_select(dim, index)``: the other dims keep labels and covers (values are
    copied); a channel dim picked by index is stopped and the result's ``dim`` carries none."""
    x = ctx.info(ctx.args[0])
    d = int(ctx.arg("dim")) % max(len(x.shape), 1)
    _stop_all(ctx, [ctx.info(ctx.arg("index"))], f"{ctx.where()} indexes by these channels")
    lab, cov = list(x.labels), list(x.cover)
    if lab:
        ctx.stop(lab[d], cov[d], f"{ctx.where()} picks channels by index")
        lab[d], cov[d] = None, None
    return [TensorInfo(tuple(ctx.out_tensors[0].shape), lab, cov, param=x.param)]


@register_channel_rule(aten.gather)
def _gather(ctx: RuleContext) -> list[TensorInfo]:
    """``x.gather(dim, index)``: ``out[..., j, ..., k] = x[..., index[..., j, ..., k], ..., k]``.

    Along every other dim, out index k reads x index k: where ``index`` spans all of x there,
    the dim keeps x's labels and covers (and ``index``'s own labels there are tied to them:
    an index buffer is sliced with the channels); where it spans a prefix, a channel of x is
    stopped. Along ``dim`` a channel of x is stopped and the result carries none.
    """
    x, idx = ctx.info(ctx.args[0]), ctx.info(ctx.arg("index"))
    nd = len(x.shape)
    shape = tuple(ctx.out_tensors[0].shape)
    if len(idx.shape) != nd or len(shape) != nd:  # gather needs equal ranks; never guess
        _stop_all(ctx, [x, idx], f"{ctx.where()}: index of another rank")
        return _blank_outputs(ctx)
    d = int(ctx.arg("dim")) % max(nd, 1)
    lab: list[Labels] = [None] * nd
    cov: list[Labels] = [None] * nd
    for e in range(nd):
        if e != d and shape[e] == x.shape[e] and x.labels[e] is not None:
            lab[e], cov[e] = x.labels[e], x.cover[e]
            if idx.labels[e] is not None:
                ctx.atoms.union(idx.labels[e], x.labels[e])
            continue
        ctx.stop(x.labels[e], x.cover[e], f"{ctx.where()} picks channels by index")
        ctx.stop(idx.labels[e], idx.cover[e], f"{ctx.where()} indexes by these channels")
    return [TensorInfo(shape, lab, cov)]


@register_channel_rule(aten.index)
def _index(ctx: RuleContext) -> list[TensorInfo]:
    """Advanced indexing ``x[indices]`` (``x[:, idx]``, ``x[:, [0, 2]]``, ``x[mask]``).

    ``indices`` has one entry per leading dim of x (None: the whole dim; a bool mask covers
    as many dims as it has). Dims with no index tensor keep their labels and covers (values
    are copied); indexed dims give way to the broadcast index dims, which carry no channel,
    and a channel on an indexed dim is stopped. NumPy's placement: the index dims replace
    the indexed ones where those are adjacent, else they go first.
    """
    x = ctx.info(ctx.args[0])
    nd = len(x.shape)
    shape = tuple(ctx.out_tensors[0].shape)
    entries: list[Any] = list(ctx.arg("indices"))
    spans: list[tuple[list[int], bool]] = []  # (x dims of the entry, it is an index tensor)
    pos = 0
    for e in entries:
        n = e.dim() if isinstance(e, Tensor) and e.dtype in (torch.bool, torch.uint8) else 1
        spans.append((list(range(pos, pos + n)), isinstance(e, Tensor)))
        pos += n
    spans += [([d], False) for d in range(pos, nd)]
    indexed = [i for i, (_, is_t) in enumerate(spans) if is_t]
    idx_infos = [ctx.info(e) for e in entries if isinstance(e, Tensor)]
    _stop_all(ctx, idx_infos, f"{ctx.where()} indexes by these channels")
    reason = f"{ctx.where()} picks channels by index"
    for i in indexed:
        for d in spans[i][0]:
            ctx.stop(x.labels[d], x.cover[d], reason)
    kept = [spans[i][0][0] for i in range(len(spans)) if not spans[i][1]]
    n_index = len(shape) - len(kept)
    adjacent = bool(indexed) and indexed == list(range(indexed[0], indexed[-1] + 1))
    head = [d for d in kept if adjacent and d < spans[indexed[0]][0][0]]
    tail = [d for d in kept if d not in head]
    order: list[int | None] = [*head, *([None] * n_index), *tail]
    if n_index < 0 or any(d is not None and shape[j] != x.shape[d] for j, d in enumerate(order)):
        _stop_all(ctx, [x], f"{ctx.where()}: an indexing layout the trace does not know")
        return _blank_outputs(ctx)
    lab = [None if d is None else x.labels[d] for d in order]
    cov = [None if d is None else x.cover[d] for d in order]
    # rows gathered from a parameter (the experts' weights, by expert id) are parameter values
    return [TensorInfo(shape, lab, cov, param=x.param)]


@register_channel_rule(aten.index_add, aten.index_add_)
def _index_add(ctx: RuleContext) -> list[TensorInfo]:
    """``x.index_add_(dim, index, source)``: rows of ``source`` added into ``x`` at ``index``
    along ``dim`` (an expert's outputs summed into the tokens it was given). Along every other
    dim, source index k is added to x index k: their channels are tied, as an add ties them,
    and a channel index stays zero only where both were zeroed by the same mask entry. Along
    ``dim`` a channel of ``source`` is stopped; ``x`` keeps its own labels there."""
    x, src = ctx.info(ctx.args[0]), ctx.info(ctx.arg("source"))
    shape = tuple(ctx.out_tensors[0].shape)
    nd = len(x.shape)
    if len(src.shape) != nd or shape != x.shape:
        _stop_all(ctx, [x, src], f"{ctx.where()}: source of another rank")
        return _blank_outputs(ctx)
    d = int(ctx.arg("dim")) % max(nd, 1)
    _stop_all(ctx, [ctx.info(ctx.arg("index"))], f"{ctx.where()} indexes by these channels")
    ctx.stop(src.labels[d], src.cover[d], f"{ctx.where()} adds channels by index")
    lab, cov = list(x.labels), [None] * nd
    for e in range(nd):
        if e == d or src.shape[e] != x.shape[e]:
            continue
        a, b = x.labels[e], src.labels[e]
        if a is not None and b is not None:
            ctx.atoms.union(a, b)
            same = x.cover[e] is not None and src.cover[e] is not None
            cov[e] = np.where(x.cover[e] == src.cover[e], x.cover[e], -1) if same else None
        elif b is not None:  # added into an untracked tensor: the channel cannot be followed
            ctx.stop(b, src.cover[e], f"{ctx.where()} adds channels into an untracked tensor")
        elif a is not None:
            ctx.stop(a, x.cover[e], f"{ctx.where()} adds an untracked tensor to channels")
    return [TensorInfo(shape, lab, cov)]


# ---------------------------------------------------------------------- as_strided
@register_channel_rule(aten.as_strided, aten.as_strided_)
def _as_strided(ctx: RuleContext) -> list[TensorInfo]:
    """``as_strided`` with the input's own shape and a row-major order of its non-trivial dims
    (what autograd does to a pooled (N, C, 1, 1) before a squeeze, as in
    ``nn.AdaptiveAvgPool1d``): a layout fix, labels and covers unchanged. Any other size,
    order or offset reads memory in a new order: every channel is stopped."""
    x = ctx.info(ctx.args[0])
    size = [int(s) for s in ctx.args[1]]
    stride = [int(s) for s in ctx.args[2]]
    offset = ctx.args[3] if len(ctx.args) > 3 else ctx.kwargs.get("storage_offset")
    big = [s for n, s in zip(size, stride, strict=True) if n > 1]
    row_major = all(a > b for a, b in itertools.pairwise(big)) and (not big or big[-1] == 1)
    if tuple(size) == x.shape and row_major and offset in (None, 0):
        return [TensorInfo(x.shape, list(x.labels), list(x.cover), param=x.param)]
    _stop_all(ctx, [x], f"{ctx.where()} reads memory in a new order (as_strided)")
    return _blank_outputs(ctx)


# ------------------------------------------------------------------ packed sequences
@register_channel_rule(aten._pack_padded_sequence)
def _pack_padded(ctx: RuleContext) -> list[TensorInfo]:
    """``pack_padded_sequence(x, lengths, batch_first)``: the packed data's rows are the valid
    (step, example) positions of ``x``'s first two dims, its columns ``x``'s last dim (its
    channels pass through: packing moves whole feature vectors). The two mixed dims are
    stopped; the batch sizes carry no channel."""
    x = ctx.info(ctx.args[0])
    out = _blank_outputs(ctx)
    if x is None or len(x.shape) != 3:
        _stop_all(ctx, [x], f"{ctx.where()} packs a tensor that is not (N, L, C) / (L, N, C)")
        return out
    reason = f"{ctx.where()} packs positions by the sequence lengths"
    for d in (0, 1):
        ctx.stop(x.labels[d], x.cover[d], reason)
    data = out[0]
    out[0] = TensorInfo(data.shape, [None, x.labels[2]], [None, x.cover[2]])
    return out


@register_channel_rule(aten._pad_packed_sequence)
def _pad_packed(ctx: RuleContext) -> list[TensorInfo]:
    """``pad_packed_sequence``: the padded output's last dim is the packed data's columns
    (channels pass through when the padding value is 0: a zero channel stays zero; another
    value would fill a removed channel's padding, so they are stopped); its first two dims are
    steps and examples."""
    data = ctx.info(ctx.args[0])
    out = _blank_outputs(ctx)
    if data is None or len(data.shape) != 2:
        _stop_all(ctx, [data], f"{ctx.where()} unpacks data that is not (rows, C)")
        return out
    if float(ctx.arg("padding_value", 0.0)) != 0.0:
        ctx.stop(data.labels[1], data.cover[1], f"{ctx.where()} pads with a nonzero value")
        return out
    padded = out[0]
    labels = [None] * (len(padded.shape) - 1) + [data.labels[1]]
    cover = [None] * (len(padded.shape) - 1) + [data.cover[1]]
    out[0] = TensorInfo(padded.shape, labels, cover)
    return out
