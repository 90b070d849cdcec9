"""``nn.MultiheadAttention``'s function, written head by head.

PyTorch's ``F.multi_head_attention_forward`` merges the heads with the batch
(``(L, N * heads, head_dim)``), packs the three input projections into one matrix product and
calls the output projection through ``F.linear``, so its heads cannot be followed channel by
channel, and a mask on the output projection's input never runs. ``multihead_attention``
computes the same function (same outputs and attention weights, within rounding) from the same
parameters, with the heads kept apart, ``(N, heads, L, head_dim)``, and the output projection
called as a module. The tracer runs it in place of ``nn.MultiheadAttention.forward`` (so each
head is one prunable channel and the hidden width passes through), a masked
``nn.MultiheadAttention`` runs it so that its head mask acts, and
``fisherprune.export.mha.PrunedMultiheadAttention`` (an attention whose inner width,
``heads * head_dim``, differs from its input width) has it as its forward.

The module only needs the attributes and parameters of ``nn.MultiheadAttention``:
``head_dim``, ``batch_first``, ``dropout``, ``add_zero_attn``, ``in_proj_weight`` (None when
the projections are apart, in ``q_proj_weight`` / ``k_proj_weight`` / ``v_proj_weight``),
``in_proj_bias``, ``bias_k``, ``bias_v`` and ``out_proj``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["multihead_attention"]


def multihead_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
    *,
    head_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``module(query, key, value, ...)`` as ``nn.MultiheadAttention`` computes it (the same
    arguments and the same ``(output, weights or None)``), heads kept apart.

    Args:
        head_weights: one weight per head (the heads' masks), or None; when the attention
            weights are averaged over the heads (``need_weights`` and ``average_attn_weights``),
            they are averaged with these weights, so that a head masked to 0 counts as a removed
            head does (the shrunk module averages over the heads it kept).

    Raises:
        ValueError: an ``attn_mask`` of a shape ``nn.MultiheadAttention`` does not accept,
            ``is_causal`` without an ``attn_mask``, or nested tensors.
    """
    if any(t.is_nested for t in (query, key, value)):
        raise ValueError(
            "fisherprune's multi-head attention takes no nested tensors; "
            "nn.TransformerEncoder makes them from src_key_padding_mask in inference: build it "
            "with enable_nested_tensor=False (or set its use_nested_tensor = False)"
        )
    batched = query.dim() == 3
    if not batched:  # (L, E): a batch of one
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif not module.batch_first:  # (L, N, E) -> (N, L, E)
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    if is_causal and attn_mask is None:
        raise ValueError(
            "is_causal is a hint that attn_mask is causal: pass attn_mask too (as "
            "nn.MultiheadAttention requires; nn.Transformer.generate_square_subsequent_mask "
            "makes one)"
        )
    n, tgt, src = query.shape[0], query.shape[1], key.shape[1]
    q, k, v = _projections(module, query, key, value)  # (N, L, H*D), (N, S, H*D) x2
    if module.bias_k is not None and module.bias_v is not None:
        k = torch.cat([k, module.bias_k.expand(n, 1, -1)], dim=1)
        v = torch.cat([v, module.bias_v.expand(n, 1, -1)], dim=1)
        src += 1
    hd = module.head_dim
    q = q.view(n, tgt, -1, hd).transpose(1, 2)  # (N, H, L, D)
    k = k.view(n, k.shape[1], -1, hd).transpose(1, 2)  # (N, H, S, D)
    v = v.view(n, v.shape[1], -1, hd).transpose(1, 2)
    heads = q.shape[1]
    if module.add_zero_attn:
        k = torch.cat([k, k.new_zeros(n, heads, 1, hd)], dim=2)
        v = torch.cat([v, v.new_zeros(n, heads, 1, hd)], dim=2)
        src += 1
    causal = is_causal and key_padding_mask is None and not need_weights
    mask = None if causal else _additive_mask(attn_mask, key_padding_mask, q, n, heads, src)
    p = module.dropout if module.training else 0.0
    weights = None
    if need_weights:
        scores = torch.matmul(q * math.sqrt(1.0 / hd), k.transpose(-2, -1))  # (N, H, L, S)
        if mask is not None:
            scores = scores + mask
        weights = F.softmax(scores, dim=-1)
        if p > 0.0:
            weights = F.dropout(weights, p=p)
        out = torch.matmul(weights, v)
    else:
        out = F.scaled_dot_product_attention(q, k, v, mask, dropout_p=p, is_causal=causal)
    out = module.out_proj(out.transpose(1, 2).reshape(n, tgt, heads * hd))  # (N, L, E)
    if weights is not None and average_attn_weights:
        weights = _average(weights, head_weights)
    if not batched:
        return out.squeeze(0), None if weights is None else weights.squeeze(0)
    return (out if module.batch_first else out.transpose(0, 1)), weights


def _projections(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The q, k, v projections, from the packed ``in_proj_weight`` (thirds of its rows: an
    equal split, which the tracer follows) or the
    separate ``q/k/v_proj_weight`` (``kdim`` / ``vdim`` other than the input width)."""
    bias = module.in_proj_bias
    if module.in_proj_weight is not None:
        ws = module.in_proj_weight.chunk(3)  # (3 * H * D, E): q, k, v rows
    else:
        ws = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
    bs = (None, None, None) if bias is None else bias.chunk(3)
    return (
        F.linear(query, ws[0], bs[0]),
        F.linear(key, ws[1], bs[1]),
        F.linear(value, ws[2], bs[2]),
    )


def _as_float(mask: Tensor, like: Tensor) -> Tensor:
    """A boolean mask (True: not attended) as an additive one; a float mask as it is."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill_(
            mask, float("-inf")
        )
    return mask.to(like.dtype)


def _additive_mask(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    q: Tensor,
    n: int,
    heads: int,
    src: int,
) -> Tensor | None:
    """``attn_mask`` ((L, S) or (N * heads, L, S)) and ``key_padding_mask`` ((N, S)) as one
    additive mask broadcasting to (N, heads, L, S); columns added by ``bias_k`` or
    ``add_zero_attn`` are attended."""
    total = None
    if attn_mask is not None:
        m = _as_float(attn_mask, q)
        if m.dim() == 3:
            if m.shape[0] != n * heads:
                raise ValueError(
                    f"a 3-D attn_mask must be (batch * num_heads, L, S) = ({n * heads}, ...), "
                    f"got {tuple(m.shape)}"
                )
            m = m.view(n, heads, m.shape[1], m.shape[2])
        elif m.dim() != 2:
            raise ValueError(f"attn_mask must be 2-D or 3-D, got {m.dim()}-D")
        total = F.pad(m, (0, src - m.shape[-1]))
    if key_padding_mask is not None:
        kpm = _as_float(key_padding_mask, q)
        kpm = F.pad(kpm, (0, src - kpm.shape[-1])).view(n, 1, 1, src)
        total = kpm if total is None else total + kpm
    return total


def _average(weights: Tensor, head_weights: Tensor | None) -> Tensor:
    """(N, H, L, S) -> (N, L, S): the mean over heads, or their ``head_weights`` average."""
    if head_weights is None:
        return weights.mean(dim=1)
    w = head_weights.to(weights).view(1, -1, 1, 1)
    return (weights * w).sum(dim=1) / w.sum().clamp_min(torch.finfo(weights.dtype).tiny)
