"""The channel rule of fused scaled-dot-product attention: whole heads, grouped-query too.

``F.scaled_dot_product_attention`` reaches the dispatcher as one fused operator: on CPU
``_scaled_dot_product_flash_attention_for_cpu``; on CUDA the flash, memory-efficient or
cuDNN kernel (the composite ``scaled_dot_product_attention`` too, should a backend not
decompose it). Head h of q reads head h // (H / Hkv) of k and v, so those heads are tied
(with the reshape rule's split into heads, each head is one prunable channel; grouped- and
multi-query attention as ``fisherprune.graph.gqa.tie_heads`` says); a per-head
additive bias (T5's relative positions) is tied to the heads too, and heads that get an
untracked bias with one entry per head (T5's cross-attention zeros, sized by the first block's
head count) stay whole. Channels inside a head are contracted (q, k) or passed to the output
(v).

Cost: PyTorch 2.13's ``FlopCounterMode`` has formulas for the CUDA kernels but none for
``_scaled_dot_product_flash_attention_for_cpu``: it counts SDPA on CPU as 0 FLOPs, with
autograd on or off. ``computational_cost`` counts the CPU kernel as torch counts its flash
kernel (the products ``q k^T`` and ``softmax(.) v``, per kept head): what ``FlopCounterMode``
counts on CUDA, or on CPU given ``custom_mapping=fisherprune.cost.formulas.SAME_AS_TORCH``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from fisherprune.graph.gqa import tie_heads
from fisherprune.graph.rules import register_channel_rule
from fisherprune.graph.types import Labels, RuleContext, TensorInfo

__all__ = ["FUSED_ATTENTION"]

aten = torch.ops.aten

#: the fused attention operators of this torch build: ``(query, key, value, ...)``,
#: each (N, ..., L, E), returning the output (N, ..., L, Ev) first
FUSED_ATTENTION: tuple = tuple(
    getattr(aten, n)
    for n in (
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    if hasattr(aten, n)
)


@register_channel_rule(*FUSED_ATTENTION)
def _sdpa(ctx: RuleContext) -> list[TensorInfo]:
    """Fused attention of q (..., H, Lq, E), k (..., Hkv, Lk, E), v (..., Hkv, Lk, Ev) ->
    (..., H, Lq, Ev): head h of q reads head h // (H / Hkv) of k and v (grouped-query
    attention when Hkv < H), so those heads are tied and the output's head dim is q's. q and
    k's E are contracted (consumed here); v's Ev and q's Lq carry through. Extra outputs
    (log-sum-exp and the like) keep q's leading dims."""
    q, k, v = (ctx.info(t) for t in ctx.args[:3])
    nd = len(q.shape)
    reason = f"{ctx.where()} mixes these channels inside fused attention"
    for d in range(nd - 2):  # batch and head dims
        hq, hk, hv = q.labels[d], k.labels[d], v.labels[d]
        if q.shape[d] % k.shape[d] or k.shape[d] != v.shape[d] or hq is None:
            for info in (q, k, v):
                ctx.block(info.labels[d], reason)
                ctx.consume(info.labels[d], info.cover[d], reason)
            continue
        rep = q.shape[d] // k.shape[d]
        for kv in (hk, hv):
            if kv is not None:
                tie_heads(ctx, hq, np.repeat(kv, rep) if rep > 1 else kv)
    mask = ctx.kwargs.get("attn_mask", ctx.args[3] if len(ctx.args) > 3 else None)
    if isinstance(mask, Tensor):  # an additive bias per head (T5's relative positions)
        mi = ctx.info(mask)
        off = nd - len(mi.shape)
        for d in range(max(0, -off), len(mi.shape)):
            e = d + off
            if mi.labels[d] is None:
                if 0 <= e < nd - 2 and mi.shape[d] == q.shape[e] > 1 and q.labels[e] is not None:
                    # a bias with one untracked entry per head (T5's zeros for cross-attention,
                    # made from a head count and reused by later blocks): the shrunk model
                    # would make it with the old count, so these heads must stay
                    why = f"{ctx.where()} adds an untracked bias with one entry per head"
                    ctx.block(q.labels[e], why)
                    ctx.consume(q.labels[e], q.cover[e], why)
                continue
            if e < nd - 2 and mi.shape[d] == q.shape[e] and q.labels[e] is not None:
                ctx.atoms.union(mi.labels[d], q.labels[e])
            else:
                ctx.block(mi.labels[d], reason)
                ctx.consume(mi.labels[d], mi.cover[d], reason)
    if q.labels[-1] is not None and k.labels[-1] is not None:
        ctx.atoms.union(q.labels[-1], k.labels[-1])
    for info in (q, k):
        ctx.consume(info.labels[-1], info.cover[-1], f"{ctx.where()} (q k^T)")
    if k.labels[-2] is not None and v.labels[-2] is not None:
        ctx.atoms.union(k.labels[-2], v.labels[-2])
    if v.labels[-1] is not None:
        ctx.atoms.mark_producer(v.labels[-1])
    outs = []
    for i, t in enumerate(ctx.out_tensors):
        shape = tuple(t.shape)
        lab: list[Labels] = [None] * len(shape)
        if len(shape) >= nd - 2 and shape[: nd - 2] == q.shape[: nd - 2]:
            lab[: nd - 2] = q.labels[: nd - 2]
        if i == 0 and len(shape) == nd:
            lab[-2], lab[-1] = q.labels[-2], v.labels[-1]
        outs.append(TensorInfo(shape, lab, [None] * len(shape)))
    return outs
