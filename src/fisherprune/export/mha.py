"""The shrunk form of ``nn.MultiheadAttention``: an attention whose inner width may differ from
its input width.

``nn.MultiheadAttention`` computes its heads in a width equal to ``embed_dim``, the width of its
input. Once heads are removed (the inner width is ``kept_heads * head_dim``) or the hidden width
is (the input width drops), the two differ, and PyTorch's module refuses the shapes.
``PrunedMultiheadAttention`` holds the same parameters under the same names (so a shrunk
``state_dict`` loads into it, and ``PruningPlan`` rebuilds it from a fresh model) and computes
the same function with ``fisherprune.attention.multihead_attention``; it is called as
``nn.MultiheadAttention`` is and returns ``(output, attention weights or None)``.

``PruningPlan.apply`` replaces an ``nn.MultiheadAttention`` it sliced by one (a module it did
not slice stays as it is).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from fisherprune.attention import multihead_attention
from fisherprune.export.modules import register_replacement, register_shrink_rule
from fisherprune.graph.module_forwards import MULTIHEAD_ATTENTION, register_module_forward

__all__ = ["PrunedMultiheadAttention"]


class PrunedMultiheadAttention(nn.Module):
    """Multi-head attention with ``num_heads`` heads of ``head_dim`` channels on inputs of
    ``embed_dim`` (``kdim``, ``vdim``) channels: ``nn.MultiheadAttention`` without the
    constraint ``num_heads * head_dim == embed_dim``.

    Args:
        embed_dim: width of the query input and of the output.
        num_heads: number of heads.
        head_dim: channels per head.
        dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first: as for
            ``nn.MultiheadAttention``.

    ``_qkv_same_embed_dim`` is always False, even when one packed ``in_proj_weight`` holds the
    projections: ``nn.TransformerEncoderLayer`` reads it, and only when it is False stays off its
    fused fast path, which assumes an inner width equal to ``embed_dim``.

    Example:
        >>> attn = PrunedMultiheadAttention(24, num_heads=3, head_dim=6, batch_first=True)
        >>> out, weights = attn(x, x, x)  # x: (N, L, 24); out: (N, L, 24)
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        head_dim: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        like = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = False  # keeps PyTorch's fused paths away (see the class)
        self.dropout, self.batch_first, self.add_zero_attn = dropout, batch_first, add_zero_attn
        inner = num_heads * head_dim
        if self.kdim == embed_dim and self.vdim == embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * inner, embed_dim, **like))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(inner, embed_dim, **like))
            self.k_proj_weight = nn.Parameter(torch.empty(inner, self.kdim, **like))
            self.v_proj_weight = nn.Parameter(torch.empty(inner, self.vdim, **like))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.zeros(3 * inner, **like))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(inner, embed_dim, bias=bias, **like)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, inner, **like))
            self.bias_v = nn.Parameter(torch.empty(1, 1, inner, **like))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """As ``nn.MultiheadAttention`` initialises."""
        for w in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
            if w is not None:
                nn.init.xavier_uniform_(w)
        for b in (self.bias_k, self.bias_v):
            if b is not None:
                nn.init.xavier_normal_(b)
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)
        nn.init.kaiming_uniform_(self.out_proj.weight, a=math.sqrt(5))

    @classmethod
    def from_module(cls, module: nn.Module) -> PrunedMultiheadAttention:
        """A ``PrunedMultiheadAttention`` holding ``module``'s parameters (the same tensors, not
        copies), its widths read off their shapes and its head size and options from its
        attributes (an ``nn.MultiheadAttention`` or one of these, possibly sliced)."""
        hd = module.head_dim
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.head_dim, new._qkv_same_embed_dim = hd, False
        new.dropout, new.batch_first = module.dropout, module.batch_first
        new.add_zero_attn = module.add_zero_attn
        for name in (
            "in_proj_weight",
            "q_proj_weight",
            "k_proj_weight",
            "v_proj_weight",
            "in_proj_bias",
        ):
            new.register_parameter(name, getattr(module, name, None))
        new.out_proj = module.out_proj
        new.bias_k, new.bias_v = module.bias_k, module.bias_v
        _set_input_widths(new)
        new.train(module.training)
        return new

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """As ``nn.MultiheadAttention.forward``: ``(output, weights or None)``."""
        return multihead_attention(
            self,
            query,
            key,
            value,
            key_padding_mask,
            need_weights,
            attn_mask,
            average_attn_weights,
            is_causal,
        )

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"kdim={self.kdim}, vdim={self.vdim}, batch_first={self.batch_first}"
        )


def _set_input_widths(m: nn.Module) -> None:
    """``embed_dim``, ``kdim``, ``vdim`` and ``num_heads`` from the weights' shapes (the head
    size stays)."""
    m.embed_dim = m.out_proj.weight.shape[0]
    if m.in_proj_weight is not None:
        m.kdim = m.vdim = m.in_proj_weight.shape[1]
        rows = m.in_proj_weight.shape[0] // 3
    else:
        m.kdim, m.vdim = m.k_proj_weight.shape[1], m.v_proj_weight.shape[1]
        rows = m.q_proj_weight.shape[0]
    m.num_heads = rows // m.head_dim


@register_shrink_rule(PrunedMultiheadAttention)
def _pruned_mha(m: nn.Module, old: dict[str, tuple[int, ...]]) -> None:
    _set_input_widths(m)


@register_replacement(nn.MultiheadAttention)
def _replace_mha(m: nn.Module) -> nn.Module:
    return PrunedMultiheadAttention.from_module(m)


# traced and masked as nn.MultiheadAttention is (its averaged weights carry no channel)
register_module_forward(PrunedMultiheadAttention, MULTIHEAD_ATTENTION)
