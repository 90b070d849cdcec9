"""The built-in per-operator cost formulas that the cost conventions fall back on.

Formulas are pure functions of shapes: they receive the operator's arguments
with every tensor replaced by its (possibly pruned) ``torch.Size`` and the
output shape(s) as ``out_shape``; they return a number for the whole batch.
Which convention uses which, and what a user's registered formula changes, is
in ``fisherprune.cost.conventions``.

    torch_flops         PyTorch's own ``torch.utils.flop_counter`` formula of an op:
                        2 FLOPs per multiply-accumulate of conv / linear / matmul /
                        attention, bias and element-wise ops ignored.
    TWML                the seed's formulas (docs/design.md, "The cost model"): MatMul
                        ``n*m*(2k-1)``; Mul and BiasAdd one per output element; Conv
                        ``prod(out) * (prod(kernel) * Cin_per_group * 2 - 1)`` (the seed
                        counted 2-D conv only; we count every conv the same way);
                        ``a + b`` (AddV2) and everything else 0.
    elements_written    elements of every output (applied to ops that are not views).
    parameter_elements  elements of one parameter tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

__all__ = [
    "SAME_AS_TORCH",
    "TWML",
    "VIEWS",
    "Formula",
    "elements_written",
    "grouped_mm_flops",
    "parameter_elements",
    "torch_flops",
]

aten = torch.ops.aten
Formula = Callable[..., float]


def grouped_mm_flops(a: Any, b: Any, *_: Any, out_shape: Any = None, **__: Any) -> int:
    """FLOPs of ``torch._grouped_mm(a, b, offs)``, 2 per multiply-accumulate as ``mm`` and
    ``bmm`` count theirs (shapes only): each row of ``a`` meets one group's matrix.

    (S, K) by (E, K, N): ``2*S*K*N``; (G, S, K) by (G, K, N): ``2*G*S*K*N``; (S, K) by
    (K, N), the contracted dim split into groups: ``2*S*K*N``; (G, S, K) by (K, N), the
    output width split into groups: ``2*S*K*N``.
    """
    rows_and_k = math.prod(a[1:]) if len(a) == 3 and len(b) == 2 else math.prod(a)
    return 2 * rows_and_k * b[-1]


def _counts_grouped_heads() -> bool:
    """Whether PyTorch's attention formula counts key/value with fewer heads than the query
    (grouped-query attention, which the kernels broadcast); torch 2.11's refuses them with
    an AssertionError, whatever kernel ran."""
    try:
        flop_registry[aten._scaled_dot_product_flash_attention].__wrapped__(
            (1, 2, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1)
        )
    except AssertionError:
        return False
    return True


def _grouped_heads(formula: Formula) -> Formula:
    """``formula`` of an attention op taking (batch, heads, length, dim) query, key and value
    first, counting a key and value of fewer heads as broadcast to the query's, as the
    kernels run them (the count torch 2.13's own formula gives)."""

    def counted(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
        if len(q) == len(k) == len(v) == 4 and k[1] == v[1] < q[1] and q[1] % k[1] == 0:
            k, v = (k[0], q[1], *k[2:]), (v[0], q[1], *v[2:])  # (else torch's formula refuses)
        return formula(q, k, v, *args, **kwargs)

    return counted


#: the attention ops whose formula reads (batch, heads, length, dim) shapes first
_ATTENTION = tuple(
    getattr(aten, n)
    for n in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(aten, n)
)
#: those formulas, counting grouped-query attention where this torch's refuse it
_GROUPED: dict[Any, Formula] = (
    {}
    if _counts_grouped_heads()
    else {k: _grouped_heads(flop_registry[k].__wrapped__) for k in _ATTENTION}
)


#: ops with no formula in PyTorch's FLOP counter that compute what one with a formula does:
#: CPU's fused attention kernel is counted as the GPU flash kernel is (its two products,
#: ``q k^T`` and the weighted sum of ``v``); the grouped matrix product of mixture-of-experts
#: layers as ``mm`` per group (``grouped_mm_flops``). ``FlopCounterMode`` counts 0 for them on
#: CPU, with or without autograd, so compare with
#: ``FlopCounterMode(custom_mapping=SAME_AS_TORCH)``
SAME_AS_TORCH: Mapping[Any, Any] = MappingProxyType(
    {
        aten._scaled_dot_product_flash_attention_for_cpu: _GROUPED.get(
            aten._scaled_dot_product_flash_attention,
            flop_registry[aten._scaled_dot_product_flash_attention].__wrapped__,
        ),  # the shape formula itself, as custom_mapping takes it
        **({aten._grouped_mm: grouped_mm_flops} if hasattr(aten, "_grouped_mm") else {}),
        **_GROUPED,
    }
)


def _on_product(packet: Any) -> Callable[..., int]:
    """``packet``'s shape formula taking an added term first (``addmm``'s and ``baddbmm``'s
    ``self``), which PyTorch's formula ignores before it calls ``packet``'s wrapped formula,
    whose tree_map over the shapes took half of each evaluation: unwrapped here."""
    product = flop_registry[packet].__wrapped__
    return lambda _added, a, b, *_, out_shape=None, **__: product(a, b)


#: PyTorch formulas that count another op's (its registered formula, wrapped again), called
#: on that op's unwrapped formula: the same counts, less host time per prune decision
_UNWRAPPED: dict[Any, Formula] = {aten.addmm: _on_product(aten.mm)}
if aten.baddbmm in flop_registry:
    _UNWRAPPED[aten.baddbmm] = _on_product(aten.bmm)


def torch_flops(key: Any) -> Formula | None:
    """PyTorch's FLOP formula of operator packet ``key`` in our calling convention, or None
    (``SAME_AS_TORCH`` fills the ops PyTorch's counter leaves out)."""
    if key in _UNWRAPPED:
        return _UNWRAPPED[key]
    if key in _GROUPED:
        return _GROUPED[key]
    f = flop_registry.get(key)
    raw = getattr(f, "__wrapped__", None)  # the formula on shapes, under torch's shape_wrapper
    if raw is not None:  # (the cost model passes shapes: the wrapper's tree_map is host time)
        return lambda *args, out_shape=None, **kw: raw(*args, out_shape=out_shape, **kw)
    if f is not None:
        return lambda *args, out_shape=None, **kw: f(*args, out_val=out_shape, **kw)
    raw = SAME_AS_TORCH.get(key)
    if raw is not None:
        return lambda *args, out_shape=None, **kw: raw(*args, out_shape=out_shape, **kw)
    return None


def parameter_elements(shape: torch.Size) -> float:
    """Elements of a parameter tensor of ``shape``."""
    return float(math.prod(shape))


def _numel(shape: Any) -> int:
    return math.prod(shape) if shape is not None else 0


# ------------------------------------------------------------------ memory
VIEWS = frozenset(
    {
        getattr(aten, n).overloadpacket
        if hasattr(getattr(aten, n), "overloadpacket")
        else getattr(aten, n)
        for n in (
            "view",
            "_unsafe_view",
            "t",
            "transpose",
            "permute",
            "expand",
            "squeeze",
            "unsqueeze",
            "slice",
            "select",
            "split",
            "split_with_sizes",
            "unbind",
            "alias",
            "detach",
            "as_strided",
            "numpy_T",
            "lift_fresh",
            "chunk",
            "reshape",
            "flatten",
            "unflatten",
            "sym_size",
            "_local_scalar_dense",
            "item",
        )
    }
)


def elements_written(*_args: Any, out_shape: Any = None, **_kw: Any) -> float:
    """Elements of the op's output, or of all its outputs together."""
    if isinstance(out_shape, (tuple, list)) and out_shape and not isinstance(out_shape[0], int):
        return float(sum(_numel(s) for s in out_shape if s is not None))
    return float(_numel(out_shape))


# -------------------------------------------------------------------- twml
_TWML: dict[Any, Formula] = {}
TWML: Mapping[Any, Formula] = MappingProxyType(_TWML)  # read-only view, keyed by op packet


def _twml(*ops: Any) -> Callable[[Formula], Formula]:
    def deco(fn: Formula) -> Formula:
        for op in ops:
            _TWML[op.overloadpacket if hasattr(op, "overloadpacket") else op] = fn
        return fn

    return deco


@_twml(aten.mm)
def _twml_mm(a: Any, b: Any, *_: Any, out_shape: Any = None, **__: Any) -> float:
    n, k = a
    return float(n * b[1] * (2 * k - 1))


@_twml(aten.addmm)
def _twml_addmm(bias: Any, a: Any, b: Any, *_: Any, out_shape: Any = None, **__: Any) -> float:
    n, k = a
    return float(n * b[1] * (2 * k - 1) + n * b[1])  # MatMul + BiasAdd


@_twml(aten.bmm)
def _twml_bmm(a: Any, b: Any, *_: Any, out_shape: Any = None, **__: Any) -> float:
    bs, n, k = a
    return float(bs * n * b[2] * (2 * k - 1))


@_twml(aten.baddbmm)
def _twml_baddbmm(bias: Any, a: Any, b: Any, *_: Any, out_shape: Any = None, **__: Any) -> float:
    bs, n, k = a
    return float(bs * n * b[2] * (2 * k - 1) + bs * n * b[2])


@_twml(aten.convolution, aten._convolution)
def _twml_conv(
    x: Any,
    w: Any,
    bias: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    *_: Any,
    out_shape: Any = None,
    **__: Any,
) -> float:
    out = _numel(out_shape)
    macs = x[0] * _numel(x[2:]) * _numel(w) if transposed else out * _numel(w[1:])
    return float(2 * macs - out + (out if bias is not None else 0))


@_twml(aten.mul)
def _twml_mul(*_: Any, out_shape: Any = None, **__: Any) -> float:
    return float(_numel(out_shape))
