"""Channel rules: how labels flow through each ATen operator.

One registry keyed by operator (``aten.<name>`` packets). A rule receives a
``RuleContext`` and returns a ``TensorInfo`` for every tensor output, in order.
It may tie atoms together (``ctx.atoms.union``), mark layer outputs
(``mark_producer``), record consumers and block atoms that cannot be pruned.

An operator with no rule, or whose rule fails, blocks every channel that reaches it
(it is reported, never pruned wrongly). Rules of operators that move positions (roll,
padding, indexing) are in ``rules_layout``, fused attention's in ``rules_sdpa``. Register
a rule for a custom operator with::

    @register_channel_rule(torch.ops.mylib.myop)
    def _myop(ctx): ...
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fisherprune._errors import first_line
from fisherprune.graph.gqa import tie_heads
from fisherprune.graph.types import Labels, RuleContext, TensorInfo
from fisherprune.graph.unit_dims import carry_unit_dims
from fisherprune.op_tables import enter_rule

__all__ = [
    "ChannelRule",
    "apply_rule",
    "matmul_core",
    "opaque",
    "register_channel_rule",
    "registered_ops",
    "unregister_channel_rule",
]

log = logging.getLogger("fisherprune")
aten = torch.ops.aten
ChannelRule = Callable[[RuleContext], list[TensorInfo]]
_RULES: dict[Any, ChannelRule] = {}


def register_channel_rule(*ops: Any) -> Callable[[ChannelRule], ChannelRule]:
    """Register ``fn`` as the channel rule of each operator packet in ``ops``.

    Raises:
        ValueError: an operator already has a rule (rules never silently replace each other).
        TypeError: a key is not an operator.
    """

    def deco(fn: ChannelRule) -> ChannelRule:
        return enter_rule(_RULES, ops, fn, "channel")

    return deco


def unregister_channel_rule(*ops: Any) -> None:
    """Remove the channel rules of ``ops``: each then blocks every channel reaching it again.

    The inverse of ``register_channel_rule`` (for a test's cleanup, or to replace a rule,
    built-in ones included: register the new rule afterwards). Models traced earlier keep
    the groups they were given.

    Raises:
        ValueError: an operator has no rule (then nothing is removed).
        TypeError: a key is not an operator.
    """
    keys = []
    for op in ops:
        key = getattr(op, "overloadpacket", op)
        if not isinstance(key, torch._ops.OpOverloadPacket):
            raise TypeError(f"unregister_channel_rule expects ATen operators, got {op!r}")
        if key not in _RULES:
            raise ValueError(f"{key} has no channel rule")
        keys.append(key)
    for key in keys:
        del _RULES[key]


def registered_ops() -> list[Any]:
    """Every operator packet that has a channel rule."""
    return list(_RULES)


def apply_rule(ctx: RuleContext) -> list[TensorInfo]:
    """What the call's outputs carry, by the channel rule of its operator.

    Never raises for a rule's sake. An operator with no rule, a rule that raises, and a rule
    whose result does not fit the call's outputs all make the call opaque: every channel
    reaching it is blocked, with a reason that names the operator and the module (and the
    error, for a failing rule), and its outputs carry no channel. A failing rule may have
    tied some atoms before it failed; ties only ever keep channels together, and the block
    keeps every channel it saw.
    """
    key = getattr(ctx.func, "overloadpacket", None)
    rule = _RULES.get(key)
    if rule is None:
        return opaque(ctx, f"{ctx.where()} has no channel rule", report_params=True)
    try:
        outs = rule(ctx)
        problem = _misfit(outs, ctx.out_tensors)
    except Exception as e:  # a rule's bug must not stop apply_masks: block and report instead
        log.debug("the channel rule of %s failed", ctx.where(), exc_info=True)
        problem = f"raised {first_line(e)}"
    if problem is None:
        return outs
    return opaque(ctx, f"{ctx.where()}: its channel rule failed ({problem})")


def _misfit(outs: Any, tensors: Sequence[Tensor]) -> str | None:
    """Why a rule's result does not describe ``tensors``, or None when it does."""
    if not isinstance(outs, (list, tuple)) or len(outs) != len(tensors):
        n = len(outs) if isinstance(outs, (list, tuple)) else type(outs).__name__
        return f"returned {n} tensor descriptions for {len(tensors)} outputs"
    for i, (info, t) in enumerate(zip(outs, tensors, strict=True)):
        shape = tuple(t.shape)
        if not isinstance(info, TensorInfo) or tuple(info.shape) != shape:
            return f"output {i}: not a TensorInfo of shape {shape}"
        if len(info.labels) != len(shape) or len(info.cover) != len(shape):
            return f"output {i}: labels or covers for another number of dims than {len(shape)}"
        for d, size in enumerate(shape):
            for arr in (info.labels[d], info.cover[d]):
                if arr is not None and (not isinstance(arr, np.ndarray) or arr.size != size):
                    return f"output {i}: dim {d} has labels or covers of another size than {size}"
    return None


# ------------------------------------------------------------------ helpers
def _out_blank(ctx: RuleContext) -> list[TensorInfo]:
    return [TensorInfo.blank(tuple(t.shape)) for t in ctx.out_tensors]


def opaque(ctx: RuleContext, reason: str, report_params: bool = False) -> list[TensorInfo]:
    """Block every labelled dim of every input; outputs carry no channels. With
    ``report_params``, the first dim of each parameter the op reads counts as channels it
    produces, so that they are reported as not masked, for ``reason`` (an LSTM's or GRU's
    hidden units, which an op with no rule computes, would otherwise go unmentioned)."""
    for t in ctx.in_tensors:
        info = ctx.info(t)
        if report_params and info.param and info.labels and info.labels[0] is not None:
            ctx.atoms.mark_producer(info.labels[0])
        for lab, cov in zip(info.labels, info.cover, strict=True):
            if lab is not None:
                ctx.block(lab, reason)
                ctx.consume(lab, cov, reason)
    return _out_blank(ctx)


def _same_as_input(ctx: RuleContext, keep_cover: bool = True) -> list[TensorInfo]:
    src = ctx.info(ctx.in_tensors[0])
    outs = []
    for t in ctx.out_tensors:
        if tuple(t.shape) == src.shape:
            cover = list(src.cover) if keep_cover else [None] * len(src.shape)
            outs.append(TensorInfo(src.shape, list(src.labels), cover))
        else:
            outs.append(TensorInfo.blank(tuple(t.shape)))
    return outs


def _merge_cover(a: Labels, b: Labels, mode: str) -> Labels:
    """Cover of an element-wise result: which mask entry still zeroes each index."""
    if mode == "none":
        return None
    if mode == "either":  # a * b is zero when either is
        if a is None:
            return b
        if b is None:
            return a
        return np.where(a >= 0, a, b)
    # "both": a + b is zero only when both are zeroed by the same entry
    if a is None or b is None:
        return None
    return np.where(a == b, a, -1)


def _elementwise(ctx: RuleContext, operands: Sequence[Any], mode: str) -> list[TensorInfo]:
    """Broadcasting element-wise op: ties equal-size dims of all labelled operands."""
    out_shape = tuple(ctx.out_tensors[0].shape)
    nd = len(out_shape)
    labels: list[Labels] = [None] * nd
    cover: list[Labels] = [None] * nd
    infos = [ctx.info(o) for o in operands if isinstance(o, Tensor)]
    has_scalar_nonzero = any(
        isinstance(o, (int, float)) and o != 0 and not isinstance(o, bool) for o in operands[1:]
    )
    for d in range(nd):
        off = nd - d
        present: list[tuple[Labels, Labels]] = []
        unlabelled_full = False
        for info in infos:
            if len(info.shape) < off:
                continue
            dd = len(info.shape) - off
            if out_shape[d] == 1 and info.labels[dd] is not None and labels[d] is None:
                labels[d], cover[d] = info.labels[dd], info.cover[dd]  # one head: carried
            if info.shape[dd] != out_shape[d] or out_shape[d] == 1:
                continue  # broadcast along this dim: no tie
            if info.labels[dd] is None:
                unlabelled_full = True
            else:
                present.append((info.labels[dd], info.cover[dd]))
        if not present:
            continue
        base = present[0][0]
        for lab, _ in present[1:]:
            ctx.atoms.union(base, lab)
        if unlabelled_full:
            for lab, cov in present:
                ctx.block(lab, f"{ctx.where()} combines channels with an untracked tensor")
                ctx.consume(lab, cov, ctx.where())
        labels[d] = base
        cov = present[0][1]
        for _, c in present[1:]:
            cov = _merge_cover(cov, c, mode)
        if mode == "both" and (len(present) < len(infos) or has_scalar_nonzero):
            cov = None  # something else is added to these channels: zeroing them is not enough
        cover[d] = None if mode == "none" else cov
    outs = [TensorInfo(out_shape, labels, cover)]
    for t in ctx.out_tensors[1:]:
        outs.append(TensorInfo.blank(tuple(t.shape)))
    return outs


# ----------------------------------------------------------- element-wise
_ZERO_PRESERVING = [
    aten.relu,
    aten.relu_,
    aten.gelu,
    aten.silu,
    aten.silu_,
    aten.tanh,
    aten.hardtanh,
    aten.hardtanh_,
    aten.leaky_relu,
    aten.leaky_relu_,
    aten.elu,
    aten.elu_,
    aten.neg,
    aten.abs,
    aten.sqrt,
    aten.hardswish,
    aten.hardswish_,
    aten.mish,
    aten.relu6,
    aten.sign,
    aten.sin,
    aten.clone,
    aten.contiguous,
    aten.detach,
    aten.alias,
    aten._to_copy,
    aten.lift_fresh,
    aten.lift_fresh_copy,
    aten.dropout,
    aten.feature_dropout,
    aten.alpha_dropout,
    aten.native_dropout,
    aten.celu,
    aten.selu,
]
_NOT_ZERO_PRESERVING = [
    aten.sigmoid,
    aten.sigmoid_,
    aten.exp,
    aten.rsqrt,
    aten.hardsigmoid,
    aten.softplus,
    aten.log,
    aten.cos,
    aten.reciprocal,
    aten.erf,
    aten.pow,
    aten.log_sigmoid_forward,
    aten.masked_fill,
    aten.masked_fill_,
]


@register_channel_rule(*_ZERO_PRESERVING)
def _unary_zero(ctx: RuleContext) -> list[TensorInfo]:
    return _elementwise(ctx, ctx.args[:1], "either")


@register_channel_rule(*_NOT_ZERO_PRESERVING)
def _unary_nonzero(ctx: RuleContext) -> list[TensorInfo]:
    return _elementwise(ctx, ctx.args[:1], "none")


@register_channel_rule(aten.clamp, aten.clamp_, aten.clamp_min, aten.clamp_max)
def _clamp(ctx: RuleContext) -> list[TensorInfo]:
    bounds = [b for b in ctx.args[1:3] if isinstance(b, (int, float))]
    zero_ok = (
        all((b <= 0 if i == 0 else b >= 0) for i, b in enumerate(ctx.args[1:3]) if b is not None)
        if bounds
        else False
    )
    return _elementwise(ctx, ctx.args[:1], "either" if zero_ok else "none")


@register_channel_rule(aten.mul, aten.mul_)
def _mul(ctx: RuleContext) -> list[TensorInfo]:
    return _elementwise(ctx, ctx.args[:2], "either")


@register_channel_rule(aten.div, aten.div_)
def _div(ctx: RuleContext) -> list[TensorInfo]:
    out = _elementwise(ctx, ctx.args[:2], "none")
    a = ctx.info(ctx.args[0]) if isinstance(ctx.args[0], Tensor) else None
    if a is not None and a.shape == out[0].shape:
        out[0].cover = list(a.cover)  # x / y is zero where x is
    return out


@register_channel_rule(aten.add, aten.add_, aten.sub, aten.sub_)
def _add(ctx: RuleContext) -> list[TensorInfo]:
    return _elementwise(ctx, ctx.args[:2], "both")


@register_channel_rule(aten.where, aten.maximum, aten.minimum, aten.lerp, aten.addcmul)
def _other_elementwise(ctx: RuleContext) -> list[TensorInfo]:
    return _elementwise(ctx, [a for a in ctx.args if isinstance(a, Tensor)], "none")


@register_channel_rule(
    aten.zeros_like,
    aten.ones_like,
    aten.empty_like,
    aten.full_like,
    aten.rand_like,
    aten.randn_like,
)
def _like(ctx: RuleContext) -> list[TensorInfo]:
    return _same_as_input(ctx, keep_cover=False)


# ------------------------------------------------------------- contractions
def _grouped_conv_ties(ctx: RuleContext, in_ch: Labels, w_out: np.ndarray, groups: int) -> None:
    """Grouped conv: a group's input and output channels can only go together."""
    cin_g = (in_ch.size // groups) if in_ch is not None else 0
    cout_g = w_out.size // groups
    for g in range(groups):
        parts = [w_out[g * cout_g : (g + 1) * cout_g]]
        if in_ch is not None:
            parts.append(in_ch[g * cin_g : (g + 1) * cin_g])
        ctx.atoms.union_all(np.concatenate(parts))


@register_channel_rule(aten.convolution, aten._convolution)
def _conv(ctx: RuleContext) -> list[TensorInfo]:
    x, w, b = ctx.args[0], ctx.args[1], ctx.args[2]
    transposed, groups = bool(ctx.args[6]), int(ctx.args[8])
    xi, wi = ctx.info(x), ctx.info(w)
    out_dim, in_dim = (1, 0) if transposed else (0, 1)
    in_ch, in_cov = xi.labels[1], xi.cover[1]
    w_out = wi.labels[out_dim]
    for d in range(2, len(wi.shape)):
        ctx.block(wi.labels[d], "kernel dimension")
    if w_out is None:
        return opaque(ctx, f"{ctx.where()}: weight is computed inside forward")
    if groups == 1:
        if in_ch is not None and wi.labels[in_dim] is not None:
            ctx.atoms.union(in_ch, wi.labels[in_dim])
        out_ch = w_out
    else:
        # output channel o of group g is tied to input channels of group g
        if transposed:  # weight (Cin, Cout/g, ...): output labels are per group slices of dim 1
            ctx.atoms.union_all(w_out)
            return opaque(ctx, f"{ctx.where()}: grouped transposed convolution is not supported")
        _grouped_conv_ties(ctx, in_ch, w_out, groups)
        ctx.block(wi.labels[in_dim], "per-group kernel dimension")
        if in_ch is None:  # removing a group's outputs needs its inputs gone too
            ctx.block(w_out, f"{ctx.where()}: grouped convolution of an untracked input")
        out_ch = w_out
    # a grouped conv's group reads only its own inputs, tied to it: a use that passes them on
    ctx.consume(in_ch, in_cov, ctx.where(), passed_on=groups > 1)
    ctx.atoms.mark_producer(out_ch)
    if isinstance(b, Tensor):
        bi = ctx.info(b)
        if bi.labels[0] is not None:
            ctx.atoms.union(bi.labels[0], out_ch)
    shape = tuple(ctx.out_tensors[0].shape)
    labels: list[Labels] = [xi.labels[0], out_ch] + [None] * (len(shape) - 2)
    return [TensorInfo(shape, labels, [None] * len(shape))]


def matmul_core(
    ctx: RuleContext, a: TensorInfo, b: TensorInfo, shape: tuple[int, ...], batch: bool
) -> TensorInfo:
    """(..., n, k) @ (..., k, m): ties the k dims, output (..., n, m)."""
    ka, kb = a.labels[-1], b.labels[-2]
    if ka is not None and kb is not None:
        ctx.atoms.union(ka, kb)
    # a parameter's side needs no mask where the other side's does; two parameters (or views
    # of them: SigLIP's pooling probe, repeated over the batch) are summed over k with no
    # mask between them, so the contraction reads their k channels where they meet
    if not a.param or b.param:
        ctx.consume(ka, a.cover[-1], ctx.where())
    if not b.param:
        ctx.consume(kb, b.cover[-2], ctx.where())
    n_lab, m_lab = a.labels[-2], b.labels[-1]
    if m_lab is not None:
        ctx.atoms.mark_producer(m_lab)
    if a.param and n_lab is not None:  # W @ x: the weight's rows make the output's rows
        ctx.atoms.mark_producer(n_lab)
    labels: list[Labels] = [None] * len(shape)
    labels[-2], labels[-1] = n_lab, m_lab
    if batch:
        if a.labels[0] is not None and b.labels[0] is not None:
            tie_heads(ctx, a.labels[0], b.labels[0])  # heads merged with the batch: a reads b
        labels[0] = a.labels[0] if a.labels[0] is not None else b.labels[0]
    return TensorInfo(shape, labels, [None] * len(shape))


@register_channel_rule(aten.mm, aten.bmm)
def _mm(ctx: RuleContext) -> list[TensorInfo]:
    a, b = ctx.info(ctx.args[0]), ctx.info(ctx.args[1])
    shape = tuple(ctx.out_tensors[0].shape)
    return [matmul_core(ctx, a, b, shape, ctx.func.overloadpacket is aten.bmm)]


@register_channel_rule(aten.addmm, aten.baddbmm)
def _addmm(ctx: RuleContext) -> list[TensorInfo]:
    bias, a, b = (ctx.info(t) if isinstance(t, Tensor) else None for t in ctx.args[:3])
    shape = tuple(ctx.out_tensors[0].shape)
    out = matmul_core(ctx, a, b, shape, ctx.func.overloadpacket is aten.baddbmm)
    if bias is not None:
        for d in range(1, len(bias.shape) + 1):
            bl = bias.labels[-d]
            if bl is not None and bias.shape[-d] == shape[-d] and shape[-d] > 1:
                if out.labels[-d] is None:
                    return opaque(ctx, f"{ctx.where()}: bias on an untracked dimension")
                ctx.atoms.union(bl, out.labels[-d])
    return [out]


@register_channel_rule(aten.embedding)
def _embedding(ctx: RuleContext) -> list[TensorInfo]:
    w, idx = ctx.info(ctx.args[0]), ctx.info(ctx.args[1])
    ctx.block(w.labels[0], "embedding rows (vocabulary)")
    shape = tuple(ctx.out_tensors[0].shape)
    labels: list[Labels] = [*list(idx.labels), w.labels[1]]
    if w.labels[1] is not None:
        ctx.atoms.mark_producer(w.labels[1])
    return [TensorInfo(shape, labels, [None] * len(shape))]


# ------------------------------------------------------------- normalisation
def _tie_params_to(ctx: RuleContext, ch: Labels, params: Sequence[Any]) -> None:
    for p in params:
        if isinstance(p, Tensor):
            pi = ctx.info(p)
            if pi.labels and pi.labels[0] is not None and ch is not None:
                ctx.atoms.union(pi.labels[0], ch)


@register_channel_rule(
    aten.native_batch_norm,
    aten._native_batch_norm_legit_no_training,
    aten._native_batch_norm_legit,
    aten.batch_norm,
    aten._native_batch_norm_legit_functional,
)
def _batch_norm(ctx: RuleContext) -> list[TensorInfo]:
    x = ctx.info(ctx.args[0])
    _tie_params_to(ctx, x.labels[1], ctx.args[1:5])
    outs = [TensorInfo(x.shape, list(x.labels), [None] * len(x.shape))]
    for t in ctx.out_tensors[1:]:
        shape = tuple(t.shape)
        lab: list[Labels] = [None] * len(shape)
        if len(shape) == 1 and shape[0] == x.shape[1]:
            lab[0] = x.labels[1]
        outs.append(TensorInfo(shape, lab, [None] * len(shape)))
    return outs


@register_channel_rule(aten.native_group_norm)
def _group_norm(ctx: RuleContext) -> list[TensorInfo]:
    x = ctx.info(ctx.args[0])
    ch = x.labels[1]
    groups = int(ctx.args[6])
    _tie_params_to(ctx, ch, ctx.args[1:3])
    if ch is not None:
        per = ch.size // groups
        for g in range(groups):  # a normalisation group is removed whole or not at all
            ctx.atoms.union_all(ch[g * per : (g + 1) * per])
    outs = [TensorInfo(x.shape, list(x.labels), [None] * len(x.shape))]
    outs += [TensorInfo.blank(tuple(t.shape)) for t in ctx.out_tensors[1:]]
    return outs


@register_channel_rule(aten.native_layer_norm)
def _layer_norm(ctx: RuleContext) -> list[TensorInfo]:
    """Layer norm ties its weight and bias to the width it normalises. Inside a registered
    norm (``fisherprune.norms``) the width stays prunable (the norm's hook takes the statistics
    over the kept channels); elsewhere it is blocked, since one channel changes the rest."""
    x = ctx.info(ctx.args[0])
    nd, k = len(x.shape), len(ctx.args[1])
    reason = (
        f"{ctx.where()} normalises across this dimension (removing one changes the rest)"
        + ctx.norm_hint()
    )
    for d in range(nd - k, nd):
        _tie_params_to(ctx, x.labels[d], ctx.args[2:4])
        if not ctx.record_norm(x.labels[d], nd, d):
            ctx.stop(x.labels[d], x.cover[d], reason)
    outs = [TensorInfo(x.shape, list(x.labels), [None] * len(x.shape))]
    outs += [TensorInfo.blank(tuple(t.shape)) for t in ctx.out_tensors[1:]]
    return outs


# --------------------------------------------------------- pooling, reductions
def _spatial_ops(k: int, *names: str) -> dict[Any, int]:
    """``{packet: k}`` for the operators of this torch build among ``names``."""
    return {getattr(aten, n): k for n in names if hasattr(aten, n)}


# operators that resample the last k dims of (N, C, *spatial) or unbatched (C, *spatial)
_SPATIAL: dict[Any, int] = {
    **_spatial_ops(
        1,
        "max_pool1d",
        "avg_pool1d",
        "adaptive_avg_pool1d",
        "adaptive_max_pool1d",
        "upsample_nearest1d",
        "upsample_linear1d",
        "_upsample_nearest_exact1d",
    ),
    **_spatial_ops(
        2,
        "max_pool2d",
        "max_pool2d_with_indices",
        "avg_pool2d",
        "adaptive_avg_pool2d",
        "_adaptive_avg_pool2d",
        "adaptive_max_pool2d",
        "upsample_nearest2d",
        "upsample_bilinear2d",
        "upsample_bicubic2d",
        "_upsample_nearest_exact2d",
        "_upsample_bilinear2d_aa",
        "_upsample_bicubic2d_aa",
    ),
    **_spatial_ops(
        3,
        "max_pool3d",
        "max_pool3d_with_indices",
        "avg_pool3d",
        "adaptive_avg_pool3d",
        "_adaptive_avg_pool3d",
        "adaptive_max_pool3d",
        "upsample_nearest3d",
        "upsample_trilinear3d",
        "_upsample_nearest_exact3d",
    ),
}


@register_channel_rule(*_SPATIAL)
def _pool(ctx: RuleContext) -> list[TensorInfo]:
    """(*lead, *spatial) -> (*lead, *spatial'): the op's k spatial dims are resampled (their
    positions mixed: a channel there is stopped); the leading dims (batch and channels, or
    channels alone) pass through with their covers, since pooling and upsampling a zero
    channel give zero. Padding has its own rule (``rules_layout``)."""
    x = ctx.info(ctx.args[0])
    lead = len(x.shape) - _SPATIAL[ctx.func.overloadpacket]
    reason = f"{ctx.where()} mixes positions along this dimension"
    for d in range(max(lead, 0), len(x.shape)):
        ctx.stop(x.labels[d], x.cover[d], reason)
    outs = []
    for i, t in enumerate(ctx.out_tensors):
        shape = tuple(t.shape)
        lab: list[Labels] = [None] * len(shape)
        cov: list[Labels] = [None] * len(shape)
        if len(shape) == len(x.shape):
            for d in range(max(lead, 0)):
                if shape[d] == x.shape[d]:
                    lab[d] = x.labels[d]
                    cov[d] = x.cover[d] if i == 0 else None  # pooling indices are not zero
        outs.append(TensorInfo(shape, lab, cov))
    return outs


_ZERO_KEEPING_REDUCTIONS = frozenset(
    {
        aten.mean,
        aten.sum,
        aten.amax,
        aten.amin,
        aten.norm,
        aten.linalg_vector_norm,
        aten.max,
        aten.min,
    }
)


# reductions a hand-written norm takes its statistics with (a blocked one says how to register)
_NORM_STATISTICS = frozenset({aten.mean, aten.var, aten.var_mean, aten.std, aten.std_mean})


@register_channel_rule(
    aten.mean,
    aten.sum,
    aten.amax,
    aten.amin,
    aten.prod,
    aten.var,
    aten.std,
    aten.var_mean,
    aten.std_mean,
    aten.logsumexp,
    aten.norm,
    aten.linalg_vector_norm,
    aten.argmax,
    aten.argmin,
    aten.any,
    aten.all,
)
def _reduce(ctx: RuleContext) -> list[TensorInfo]:
    """A reduction blocks the channels of the dims it reduces; the other dims pass through
    (to every output of the reduced shape: ``var_mean`` and ``max.dim`` give two)."""
    x = ctx.info(ctx.args[0])
    nd = len(x.shape)
    dims = _reduced_dims(ctx, nd)
    shape = tuple(ctx.out_tensors[0].shape)
    zero_ok = ctx.func.overloadpacket in _ZERO_KEEPING_REDUCTIONS
    kept = [d for d in range(nd) if d not in dims]
    keepdim = len(shape) == nd
    reason = f"{ctx.where()} reduces across channels"
    if ctx.module_type and ctx.func.overloadpacket in _NORM_STATISTICS:
        reason += ctx.norm_hint()
    for d in dims:
        if x.labels[d] is not None and not ctx.record_norm(x.labels[d], nd, d):
            ctx.stop(x.labels[d], x.cover[d], reason)
    lab: list[Labels] = [None] * len(shape)
    cov: list[Labels] = [None] * len(shape)
    for j, d in enumerate(range(nd) if keepdim else kept):
        if d in dims:
            continue
        lab[j] = x.labels[d]
        cov[j] = x.cover[d] if zero_ok else None
    outs = [TensorInfo(shape, lab, cov)]
    for t in ctx.out_tensors[1:]:  # indices or a second statistic: same dims, no cover
        other = tuple(t.shape)
        outs.append(
            TensorInfo(other, list(lab), [None] * len(other))
            if other == shape
            else TensorInfo.blank(other)
        )
    return outs


def _reduced_dims(ctx: RuleContext, nd: int) -> set[int]:
    """The dims a reduction reduces, read by name from the overload's schema: its ``dim``
    (one int or a list); every dim when the overload has no ``dim`` (``sum(x)``,
    ``var(x, unbiased)``, ``norm(x, p)``), or it is None or empty."""
    dims = ctx.arg("dim")
    if isinstance(dims, int):
        dims = [dims]
    if not dims:
        return set(range(nd))
    return {int(d) % nd for d in dims} if nd else set()


@register_channel_rule(aten.max, aten.min)
def _max_min(ctx: RuleContext) -> list[TensorInfo]:
    """``max(x, other)`` is element-wise; ``max(x)`` and ``max(x, dim)`` are reductions."""
    if ctx.has_arg("other"):
        return _elementwise(ctx, ctx.args[:2], "none")
    return _reduce(ctx)


@register_channel_rule(
    aten._softmax, aten._log_softmax, aten.softmax, aten.log_softmax, aten.cumsum
)
def _softmax(ctx: RuleContext) -> list[TensorInfo]:
    x = ctx.info(ctx.args[0])
    d = int(ctx.args[1]) % len(x.shape)
    reason = f"{ctx.where()} mixes channels along its dimension"
    ctx.block(x.labels[d], reason)
    ctx.consume(x.labels[d], x.cover[d], reason)
    return [TensorInfo(x.shape, list(x.labels), [None] * len(x.shape))]


# -------------------------------------------------------------- shape ops
@register_channel_rule(aten.t, aten.transpose, aten.permute, aten.numpy_T)
def _permute(ctx: RuleContext) -> list[TensorInfo]:
    x = ctx.info(ctx.args[0])
    nd = len(x.shape)
    packet = ctx.func.overloadpacket
    if packet is aten.permute:
        order = [d % nd for d in ctx.args[1]]
    elif packet is aten.transpose:
        a, b = int(ctx.args[1]) % nd, int(ctx.args[2]) % nd
        order = list(range(nd))
        order[a], order[b] = order[b], order[a]
    else:
        order = list(reversed(range(nd)))
    shape = tuple(ctx.out_tensors[0].shape)
    return [
        TensorInfo(shape, [x.labels[d] for d in order], [x.cover[d] for d in order], param=x.param)
    ]


@register_channel_rule(
    aten.unsqueeze,
    aten.squeeze,
    aten.view,
    aten._unsafe_view,
    aten.reshape,
    aten.expand,
    aten.flatten,
    aten.unflatten,
)
def _view(ctx: RuleContext) -> list[TensorInfo]:
    x = ctx.info(ctx.args[0])
    shape = tuple(ctx.out_tensors[0].shape)
    if ctx.func.overloadpacket is aten.expand:
        lab: list[Labels] = [None] * len(shape)
        cov: list[Labels] = [None] * len(shape)
        off = len(shape) - len(x.shape)
        for d in range(len(x.shape)):
            if x.shape[d] == shape[d + off]:
                lab[d + off], cov[d + off] = x.labels[d], x.cover[d]
        return [TensorInfo(shape, lab, cov, param=x.param)]
    out = _reshape_labels(ctx, x, shape)
    out.param = x.param
    return [out]


def _reshape_labels(ctx: RuleContext, x: TensorInfo, shape: tuple[int, ...]) -> TensorInfo:
    """Map labels across a reshape (view, flatten, unflatten, split into heads and back).

    Both shapes are cut into their common factors: the sizes between the union of the two
    shapes' strides (a reshape that has none, such as (2, 3) -> (3, 2), keeps no channel).
    A source dimension split into several factors keeps its labels on the one factor they
    vary along: the inner one when the labels repeat periodically (heads merged with the
    batch, split back), the outer one when they repeat in blocks; when they vary along
    several, they are tied into blocks along the outermost factor: the split of a width into
    (heads, head_dim) makes each head one channel, never the channels inside a head. A target
    dimension merged from several factors takes the labels of its one labelled factor,
    repeated over the others (flatten); factors indexing the batch of the model input do not
    count, so heads merged with the batch (a batched matmul) keep their labels.
    """
    factors = _common_factors(x.shape, shape)
    if factors is None:
        return _reshape_blocked(
            ctx, x, shape, "reshapes channels across dimensions that do not align"
        )
    asked = ctx.args[1] if len(ctx.args) > 1 and isinstance(ctx.args[1], (list, tuple)) else ()
    inferred = {
        j
        for d, (lo, hi) in enumerate(_factor_spans(shape, factors))
        if d < len(asked) and asked[d] == -1
        for j in range(lo, hi)
    }
    src = _split_into_factors(ctx, x, factors, inferred)
    whole_src = {lo for lo, hi in _factor_spans(x.shape, factors) if hi - lo == 1}
    whole: set[int] = set()  # target dims that are a whole dim of x (nothing split there)
    lab: list[Labels] = [None] * len(shape)
    cov: list[Labels] = [None] * len(shape)
    for d, (lo, hi) in enumerate(_factor_spans(shape, factors)):
        parts = [j for j in range(lo, hi) if src[j][0] is not None]
        if len(parts) > 1:
            parts = [j for j in parts if not ctx.atoms.is_batch(src[j][0])] or parts[:1]
        if len(parts) > 1:
            reason = (
                f"{ctx.where()} merges channels of two dimensions into one: channels are not "
                "followed through it"
            )
            for j in parts:
                ctx.block(src[j][0], reason)
                ctx.consume(src[j][0], src[j][1], reason)
            continue
        if not parts:
            continue
        j = parts[0]
        if hi - lo == 1 and j in whole_src:
            whole.add(d)
        if (
            hi - lo == 1
            and d < len(asked)
            and asked[d] == shape[d]
            and not ctx.atoms.is_batch(src[j][0])
        ):
            ctx.record_width(src[j][0])  # a width written as a number: is it an attribute?
        inner = math.prod(factors[j + 1 : hi])
        outer = math.prod(factors[lo:j])
        lab[d] = np.tile(np.repeat(src[j][0], inner), outer)
        if src[j][1] is not None:
            cov[d] = np.tile(np.repeat(src[j][1], inner), outer)
    carry_unit_dims(ctx, x, shape, lab, cov)
    _split_single_head(ctx, shape, asked, lab, cov, whole)
    return TensorInfo(shape, lab, cov)


def _split_single_head(
    ctx: RuleContext,
    shape: tuple[int, ...],
    asked: Any,
    lab: list[Labels],
    cov: list[Labels],
    whole: set[int],
) -> None:
    """A width viewed as (1, head_dim) by a module that already split another width into
    several heads of that size (multi-query attention's one key/value head, after its query
    heads) is one head: its channels are one channel, labelled on the head dim of size 1, as
    the split of a width into several heads makes them (rotary embeddings then see no channel
    inside it). The head_dim must be a whole dim of the input (``whole``): a dim this very call
    split off a width holds heads, and a size-1 dim before it is a token dim (a LeViT-style
    attention downsampling's single query, ``view(b, -1, heads, key_dim)``), not a head."""
    for e in range(len(shape) - 1):
        head = lab[e + 1]
        if (
            e + 1 not in whole
            or shape[e] != 1
            or lab[e] is not None
            or head is None
            or e >= len(asked)
            or asked[e] not in (-1, 1)
            or not ctx.heads_split_before(shape[e + 1])
        ):
            continue
        if ctx.record_heads(head.reshape(1, -1).copy(), asked[e] == -1) is not None:
            continue  # the module cannot lose that head: its channels stay as they are
        c = cov[e + 1]
        lab[e], lab[e + 1] = head[:1].copy(), None
        cov[e] = c[:1].copy() if c is not None and bool((c == c[0]).all()) else None
        cov[e + 1] = None


def _common_factors(a: tuple[int, ...], b: tuple[int, ...]) -> list[int] | None:
    """The sizes, outermost first, that both shapes are products of runs of (None if none)."""
    total = math.prod(a)
    if total != math.prod(b) or total == 0:
        return None
    cuts = sorted(
        {math.prod(a[d:]) for d in range(len(a) + 1)}
        | {math.prod(b[d:]) for d in range(len(b) + 1)}
    )
    if any(hi % lo for lo, hi in itertools.pairwise(cuts)):
        return None
    return [hi // lo for lo, hi in itertools.pairwise(cuts)][::-1]


def _factor_spans(shape: tuple[int, ...], factors: list[int]) -> list[tuple[int, int]]:
    """For each dimension of ``shape``, the range of ``factors`` (outermost first) it spans."""
    spans, j = [], 0
    for size in shape:
        lo, prod = j, 1
        while prod < size:
            prod *= factors[j]
            j += 1
        spans.append((lo, j))
    return spans


def _split_into_factors(
    ctx: RuleContext, x: TensorInfo, factors: list[int], inferred: set[int]
) -> list[tuple[Labels, Labels]]:
    """Labels and covers of each factor of ``x``'s dimensions (see ``_reshape_labels``)."""
    out: list[tuple[Labels, Labels]] = [(None, None)] * len(factors)
    for d, (lo, hi) in enumerate(_factor_spans(x.shape, factors)):
        lab = x.labels[d]
        if lab is None or hi == lo:
            continue
        if hi - lo == 1:
            out[lo] = (lab, x.cover[d])
            continue
        sizes = factors[lo:hi]
        roots = ctx.atoms.find(lab).reshape(sizes)
        along = [k for k in range(len(sizes)) if _varies_along(roots, k)]
        keep = along[0] if len(along) == 1 else 0
        if len(along) > 1:  # blocks (heads): each one channel, if the module can lose heads
            found = _record_head_split(ctx, lab, sizes, lo, inferred)
            if isinstance(found, str):
                reason = f"{ctx.where()} {found}"
                ctx.block(lab, reason)
                ctx.consume(lab, x.cover[d], reason)
                continue
            keep = found
        index = [0] * len(sizes)
        index[keep] = slice(None)
        picked = lab.reshape(sizes)[tuple(index)]
        cover = None
        if x.cover[d] is not None:
            cv = x.cover[d].reshape(sizes)
            if _constant_except(cv, keep):
                cover = cv[tuple(index)]
        out[lo + keep] = (np.ascontiguousarray(picked), cover)
    return out


def _record_head_split(
    ctx: RuleContext, lab: np.ndarray, sizes: list[int], lo: int, inferred: set[int]
) -> int | str:
    """A width split into the factors ``sizes`` (outermost first) whose channels vary along
    several of them: heads, on one factor ``h``, each head one channel. The factors outside
    ``h`` are parts of a fused projection (``Wqkv(x).view(b, t, 3, -1, head_dim)``, the 3
    written into the code): head i of every part is one channel, which attention ties together
    anyway. Tried on the factor the code asked -1 for first, then from the innermost factor
    out; returns the factor the first split the module can make is recorded on, or why none
    can be (the outermost factor's reason)."""
    order = [h for h in range(len(sizes) - 1) if lo + h in inferred]
    order += [h for h in reversed(range(len(sizes) - 1)) if h not in order]
    refused = {}
    for h in order:
        parts = math.prod(sizes[:h])
        blocks = lab.reshape(parts, sizes[h], -1).transpose(1, 0, 2).reshape(sizes[h], -1)
        why = ctx.record_heads(blocks.copy(), lo + h in inferred, parts=parts)
        if why is None:
            return h
        refused[h] = why
    return refused[0]


def _varies_along(a: np.ndarray, axis: int) -> bool:
    """Whether ``a`` changes along ``axis``."""
    return bool((a != a.take([0], axis=axis)).any())


def _constant_except(a: np.ndarray, axis: int) -> bool:
    """Whether ``a`` does not change along any axis but ``axis``."""
    first = a[tuple(slice(None) if k == axis else slice(0, 1) for k in range(a.ndim))]
    return bool((a == first).all())


def _reshape_blocked(
    ctx: RuleContext, x: TensorInfo, shape: tuple[int, ...], why: str
) -> TensorInfo:
    """Block every labelled dimension of ``x``: the reshape keeps no channel."""
    reason = f"{ctx.where()} {why}"
    for lab, cov in zip(x.labels, x.cover, strict=True):
        if lab is not None:
            ctx.block(lab, reason)
            ctx.consume(lab, cov, reason)
    return TensorInfo.blank(shape)


@register_channel_rule(aten.slice)
def _slice(ctx: RuleContext) -> list[TensorInfo]:
    x = ctx.info(ctx.args[0])
    nd = len(x.shape)
    d = int(ctx.args[1]) % nd if len(ctx.args) > 1 else 0
    shape = tuple(ctx.out_tensors[0].shape)
    lab, cov = list(x.labels), list(x.cover)
    if shape[d] != x.shape[d]:
        if x.labels[d] is not None:
            reason = f"{ctx.where()} slices channels at fixed positions"
            ctx.block(x.labels[d], reason)
            ctx.consume(x.labels[d], x.cover[d], reason)
        lab[d], cov[d] = None, None
    return [TensorInfo(shape, lab, cov, param=x.param)]


@register_channel_rule(aten.select)
def _select(ctx: RuleContext) -> list[TensorInfo]:
    """One index of a dim. Of a channel dim, the channel at that position, which another
    channel takes once channels are removed: blocked, but only when something reads the
    result (``TensorInfo.on_use``), since code may take it for its shape alone (BART's
    encoder: ``embed_positions(inputs_embeds[:, :, -1])``)."""
    x = ctx.info(ctx.args[0])
    d = int(ctx.args[1]) % len(x.shape)
    on_use = ()
    if x.labels[d] is not None:
        on_use = ((x.labels[d], x.cover[d], f"{ctx.where()} selects one channel by position"),)
    keep = [e for e in range(len(x.shape)) if e != d]
    shape = tuple(ctx.out_tensors[0].shape)
    labels, cover = [x.labels[e] for e in keep], [x.cover[e] for e in keep]
    return [TensorInfo(shape, labels, cover, param=x.param, on_use=on_use)]


@register_channel_rule(aten.split, aten.split_with_sizes, aten.chunk, aten.unbind)
def _split(ctx: RuleContext) -> list[TensorInfo]:
    """Equal splits (``chunk``) tie index i of every piece, so pieces stay equal when pruned."""
    x = ctx.info(ctx.args[0])
    nd = len(x.shape)
    packet = ctx.func.overloadpacket
    if packet is aten.unbind:
        d = int(ctx.args[1]) % nd if len(ctx.args) > 1 else 0
    else:
        d = int(ctx.args[2]) % nd if len(ctx.args) > 2 else int(ctx.kwargs.get("dim", 0)) % nd
    sizes = [int(t.shape[d]) if packet is not aten.unbind else 1 for t in ctx.out_tensors]
    lab_d, cov_d = x.labels[d], x.cover[d]
    equal = len(set(sizes)) == 1 and packet in (aten.split, aten.chunk)
    outs = []
    if lab_d is not None:
        if equal and len(sizes) > 1:
            pieces = lab_d.reshape(len(sizes), sizes[0])
            for p in pieces[1:]:
                ctx.atoms.union(pieces[0], p)
        elif len(sizes) > 1 and not (
            packet is aten.split_with_sizes and ctx.record_split_sizes(lab_d, sizes)
        ):
            reason = (
                f"{ctx.where()} splits channels at fixed sizes (written into the code, or held "
                "by no single list attribute of the module that shrink could update)"
            )
            ctx.block(lab_d, reason)
            ctx.consume(lab_d, cov_d, reason)
    start = 0
    for t, s in zip(ctx.out_tensors, sizes, strict=True):
        shape = tuple(t.shape)
        if packet is aten.unbind:
            keep = [e for e in range(nd) if e != d]
            outs.append(TensorInfo(shape, [x.labels[e] for e in keep], [x.cover[e] for e in keep]))
            continue
        lab, cov = list(x.labels), list(x.cover)
        if lab_d is not None:
            lab[d] = lab_d[start : start + s]
            cov[d] = None if cov_d is None else cov_d[start : start + s]
        start += s
        outs.append(TensorInfo(shape, lab, cov, param=x.param))  # a parameter's pieces
    return outs


@register_channel_rule(aten.cat, aten.concat, aten.stack)
def _cat(ctx: RuleContext) -> list[TensorInfo]:
    tensors = [t for t in ctx.args[0] if isinstance(t, Tensor) and t.numel() > 0]
    infos = [ctx.info(t) for t in tensors]
    shape = tuple(ctx.out_tensors[0].shape)
    nd = len(shape)
    stack = ctx.func.overloadpacket is aten.stack
    d = int(ctx.args[1]) if len(ctx.args) > 1 else int(ctx.kwargs.get("dim", 0))
    d %= nd
    lab: list[Labels] = [None] * nd
    cov: list[Labels] = [None] * nd
    for e in range(nd):
        if e == d:
            continue
        src_e = e - 1 if stack and e > d else e
        present = [(i.labels[src_e], i.cover[src_e]) for i in infos if i.labels[src_e] is not None]
        if len(present) != len(infos) and present:
            for pl, pc in present:
                ctx.block(pl, f"{ctx.where()} joins channels with an untracked tensor")
                ctx.consume(pl, pc, ctx.where())
            continue
        if present:
            for pl, _ in present[1:]:
                ctx.atoms.union(present[0][0], pl)
            lab[e] = present[0][0]
            c = present[0][1]
            for _, pc in present[1:]:
                c = _merge_cover(c, pc, "both")
            cov[e] = c
    if not stack:
        parts_l, parts_c, complete = [], [], True
        for i in infos:
            if i.labels[d] is None:
                complete = False
                break
            parts_l.append(i.labels[d])
            parts_c.append(i.cover[d] if i.cover[d] is not None else np.full(i.shape[d], -1))
        if complete and infos:
            lab[d] = np.concatenate(parts_l)
            cov[d] = np.concatenate(parts_c).astype(np.int64)
        else:
            for i in infos:
                if i.labels[d] is not None:
                    ctx.block(i.labels[d], f"{ctx.where()} concatenates with an untracked tensor")
                    ctx.consume(i.labels[d], i.cover[d], ctx.where())
    return [TensorInfo(shape, lab, cov)]


# ------------------------------------------------- ops that carry no channels
@register_channel_rule(  # fresh buffers of one value: rules_buffers
    aten.arange,
    aten.randn,
    aten.rand,
    aten.scalar_tensor,
    aten.randint,
    aten.eye,
    aten.linspace,
    aten.fill_,
    aten.zero_,
    aten.normal_,
    aten.uniform_,
    aten._local_scalar_dense,
    aten.ne,
    aten.eq,
    aten.gt,
    aten.lt,
    aten.ge,
    aten.le,
    aten.isnan,
    aten.isinf,
    aten.logical_not,
    aten.sym_size,
    aten.is_nonzero,
    aten.equal,
    aten.item,
)
def _no_channels(ctx: RuleContext) -> list[TensorInfo]:
    return _out_blank(ctx)


@register_channel_rule(aten.copy_)
def _copy(ctx: RuleContext) -> list[TensorInfo]:
    """``dst.copy_(src)``: ``dst`` keeps its labels. Where ``dst`` carries channels, the
    copied channels are tied to them; where it does not (``dst`` is usually a slice of a
    fresh tensor, as in circular padding, whose other views the trace does not follow),
    the copied channels are stopped: their values go where pruning cannot follow them."""
    dst, src = ctx.info(ctx.args[0]), ctx.info(ctx.args[1])
    out = TensorInfo(dst.shape, list(dst.labels), [None] * len(dst.shape))
    if src is None:
        return [out]
    off = len(dst.shape) - len(src.shape)
    reason = f"{ctx.where()} copies channels into a tensor whose channels are not followed"
    for d, lab in enumerate(src.labels):
        if lab is None:
            continue
        target = dst.labels[d + off] if d + off >= 0 else None
        if target is not None and src.shape[d] == dst.shape[d + off]:
            ctx.atoms.union(target, lab)
        else:
            ctx.stop(lab, src.cover[d], reason)
    return [out]
