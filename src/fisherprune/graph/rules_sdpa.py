"""The channel rule of fused scaled-dot-product attention, for now: heads are not followed.

``F.scaled_dot_product_attention`` reaches the dispatcher as one fused operator: on CPU
``_scaled_dot_product_flash_attention_for_cpu``; on CUDA the flash, memory-efficient or
cuDNN kernel (the composite ``scaled_dot_product_attention`` too, should a backend not
decompose it). Without a rule it would be opaque: every channel reaching it blocked, its
output carrying none. This rule ties nothing it does not understand: the batch dim and the
query positions pass through; the heads and head channels of q, k and v, the key positions
and every channel of a mask or bias are stopped, with a reason naming the op. Whole heads
could be removed exactly (q, k, v and the output lose the same head); that is the work of
attention-head support, which replaces this rule: ``unregister_channel_rule(*FUSED_ATTENTION)``
and register its own, or delete this module.

Cost: ``flops`` takes PyTorch's ``torch.utils.flop_counter`` formulas as they are, so these
ops cost what ``FlopCounterMode`` counts for them. PyTorch 2.13 has formulas for the CUDA ops
(flash, efficient, cuDNN) but none for ``_scaled_dot_product_flash_attention_for_cpu``:
``FlopCounterMode`` counts SDPA on CPU as 0 FLOPs, with autograd on or off, and so does
``computational_cost``. Register a formula with ``register_cost_formula("flops", op)`` to
count it (``FlopCounterMode`` then needs the same one in its ``custom_mapping`` to agree).
"""

from __future__ import annotations

import torch

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
def _fused_attention_heads_not_followed(ctx: RuleContext) -> list[TensorInfo]:
    """q (N, H, L, E), k (N, H, S, E), v (N, H, S, Ev) -> out (N, H, L, Ev), then
    (for some kernels) logsumexp (N, H, L) and bookkeeping tensors.

    The batch dims of q, k and v are tied and passed through, as are q's query positions
    (each query's output depends on its own query only). Stopped: the heads (any dim between
    the batch and the last two), the head channels E and Ev (E also sets the default scale
    1/sqrt(E)), the key positions S (softmax normalises over them) and every dim of the other
    tensor inputs (mask, bias). Covers are dropped: a zero query still averages the values.
    """
    q, k, v = (ctx.info(t) for t in ctx.args[:3])
    reason = (
        f"{ctx.where()} is fused attention: its heads and head channels are not followed "
        "(softmax(q k^T / sqrt(E)) v mixes them)"
    )
    nq = len(q.shape)
    batch = q.labels[0] if nq > 2 else None
    for role, info in enumerate((q, k, v)):
        nd = len(info.shape)
        for d in range(nd):
            if d == 0 and nq > 2 and nd > 2:
                if role == 0 or info.labels[0] is None:
                    continue
                if batch is not None and info.labels[0].size == batch.size:
                    ctx.atoms.union(batch, info.labels[0])  # batch n of q attends to n of k, v
                    continue
            elif role == 0 and d == nd - 2:
                continue  # query positions pass through
            ctx.stop(info.labels[d], info.cover[d], reason)
    used = {id(t) for t in ctx.args[:3]}
    for t in ctx.in_tensors:
        if id(t) not in used:
            info = ctx.info(t)
            for lab, cov in zip(info.labels, info.cover, strict=True):
                ctx.stop(lab, cov, f"{ctx.where()}: attention mask or bias")
    outs = []
    for i, t in enumerate(ctx.out_tensors):
        shape = tuple(t.shape)
        lab_out: list[Labels] = [None] * len(shape)
        if i < 2 and nq >= 2 and len(shape) > nq - 2:  # the output, then logsumexp
            if nq > 2 and shape[0] == q.shape[0]:
                lab_out[0] = batch
            if shape[nq - 2] == q.shape[nq - 2]:
                lab_out[nq - 2] = q.labels[nq - 2]
        outs.append(TensorInfo(shape, lab_out, [None] * len(shape)))
    return outs
