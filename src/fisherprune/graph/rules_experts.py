"""The channel rule of grouped matrix products: the experts of a mixture-of-experts layer.

``torch._grouped_mm(a, b, offs)`` multiplies the rows of ``a`` (S, K) that ``offs`` gives to
group g by ``b[g]`` (K, N): one expert per group, the experts' weights stacked in one 3-D
parameter (E, K, N) (often a transposed view of (E, N, K), as Hugging Face's ``grouped_mm``
experts implementation passes them). A 3-D ``a`` (G, S, K) is a batch of G groups, as in
``bmm``. The contracted width ``K`` of the input is tied to ``b``'s dim -2 in every expert at
once (one stacked parameter cannot hold experts of different widths), the output width ``N``
is produced by ``b``'s dim -1, and the experts' dim stays whole here (it is not a channel of
the product). The kernels need rows of a multiple of 16 bytes, so ``K`` and ``N`` keep a
multiple of 4 channels in float32 (8 in bfloat16) when pruned (``Atoms.require_multiple``).
A 2-D ``b`` (``offs`` splitting the contracted dim into groups) blocks what it reads: its
groups would lose channels unevenly.

Cost: PyTorch 2.13's ``FlopCounterMode`` has no formula for ``_grouped_mm`` (it counts 0);
``fisherprune.cost.formulas.SAME_AS_TORCH`` gives it ``grouped_mm_flops``: ``2 * S * K * N``
(2-D by 3-D: every row meets one expert's matrix) or ``2 * G * S * K * N`` (3-D by 3-D), as
``mm`` and ``bmm`` count theirs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fisherprune.graph.rules import matmul_core, opaque, register_channel_rule
from fisherprune.graph.types import RuleContext, TensorInfo

__all__ = ["GROUPED_MM"]

aten = torch.ops.aten

#: the row alignment grouped matrix kernels need (CPU and CUDA): a width they read or write
#: stays a multiple of 16 bytes' worth of elements when pruned
_ALIGN_BYTES = 16

#: the grouped matrix products of this torch build
GROUPED_MM: tuple = tuple(getattr(aten, n) for n in ("_grouped_mm",) if hasattr(aten, n))


@register_channel_rule(*GROUPED_MM)
def _grouped_mm(ctx: RuleContext) -> list[TensorInfo]:
    a, b = ctx.info(ctx.args[0]), ctx.info(ctx.args[1])
    shape = tuple(ctx.out_tensors[0].shape)
    if len(b.shape) != 3 or len(a.shape) not in (2, 3):
        return opaque(ctx, f"{ctx.where()}: groups along the contracted dim are not supported")
    if isinstance(ctx.arg("bias"), Tensor):
        return opaque(ctx, f"{ctx.where()}: a bias passed to the grouped product")
    ctx.block(b.labels[0], "the experts of a grouped matrix product")
    out = matmul_core(ctx, a, b, shape, batch=False)
    align = _ALIGN_BYTES // ctx.in_tensors[0].element_size()
    for lab in (a.labels[-1], b.labels[-1]):  # the rows of a, b and the output
        if lab is not None:
            ctx.atoms.require_multiple(lab, align)
    if len(a.shape) == 3:
        ctx.block(a.labels[0], "the groups of a grouped matrix product")
        out.labels[0] = a.labels[0]
    return [out]
