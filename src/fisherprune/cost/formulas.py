"""Per-operator cost formulas, one registry per cost convention.

Formulas are pure functions of shapes: they receive the operator's arguments
with every tensor replaced by its (possibly pruned) ``torch.Size`` and the
output shape(s) as ``out_shape``; they return a number for the whole batch.

Conventions:
    flops   2 FLOPs per multiply-accumulate of conv / linear / matmul / attention,
            bias and element-wise ops ignored: PyTorch's own
            ``torch.utils.flop_counter`` formulas, so the count equals
            ``FlopCounterMode`` on the physically shrunk network.
    macs    multiply-accumulates: ``flops / 2``.
    twml    the seed's formula (docs/design.md, "The cost model"): MatMul ``n*m*(2k-1)``;
            Mul and BiasAdd one per output element;
            Conv ``prod(out) * (prod(kernel) * Cin_per_group * 2 - 1)`` (the seed counted
            2-D conv only; we count every conv the same way);
            ``a + b`` (AddV2) and everything else 0.
    memory  elements written by every operator that is not a view: the activation
            memory traffic that Group Fisher Pruning normalises by.
    params  parameter elements (not per operator; see ``cost.model``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

__all__ = ["CONVENTIONS", "Formula", "formula_for", "register_cost_formula"]

aten = torch.ops.aten
Formula = Callable[..., float]
CONVENTIONS = ("flops", "macs", "twml", "memory", "params")
_REGISTRY: dict[str, dict[Any, Formula]] = {c: {} for c in CONVENTIONS}


def register_cost_formula(convention: str, *ops: Any) -> Callable[[Formula], Formula]:
    """Register a formula for ``ops`` under ``convention``; duplicates are rejected."""
    if convention not in _REGISTRY:
        raise ValueError(f"unknown cost convention {convention!r}; choose one of {CONVENTIONS}")

    def deco(fn: Formula) -> Formula:
        for op in ops:
            key = getattr(op, "overloadpacket", op)
            if not isinstance(key, torch._ops.OpOverloadPacket):
                raise TypeError(f"register_cost_formula expects ATen operators, got {op!r}")
            if key in _REGISTRY[convention]:
                raise ValueError(f"{key} already has a {convention!r} formula")
            _REGISTRY[convention][key] = fn
        return fn

    return deco


def formula_for(convention: str, op: Any) -> Formula | None:
    """The formula of ``op`` under ``convention``, or None if it costs nothing there."""
    key = getattr(op, "overloadpacket", None)
    if key is None:
        return None
    if convention == "flops":
        return _REGISTRY["flops"].get(key) or _torch_formula(key)
    if convention == "macs":
        f = formula_for("flops", op)
        return None if f is None else (lambda *a, **k: f(*a, **k) / 2)
    if convention == "memory":
        return None if key in _VIEWS else _written
    return _REGISTRY[convention].get(key)


def _torch_formula(key: Any) -> Formula | None:
    f = flop_registry.get(key)
    if f is None:
        return None
    return lambda *args, out_shape=None, **kw: f(*args, out_val=out_shape, **kw)


def _numel(shape: Any) -> int:
    return math.prod(shape) if shape is not None else 0


# ------------------------------------------------------------------ memory
_VIEWS = {
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


def _written(*_args: Any, out_shape: Any = None, **_kw: Any) -> float:
    if isinstance(out_shape, (tuple, list)) and out_shape and not isinstance(out_shape[0], int):
        return float(sum(_numel(s) for s in out_shape if s is not None))
    return float(_numel(out_shape))


# -------------------------------------------------------------------- twml
@register_cost_formula("twml", aten.mm)
def _twml_mm(a: Any, b: Any, *_: Any, out_shape: Any = None, **__: Any) -> float:
    n, k = a
    return float(n * b[1] * (2 * k - 1))


@register_cost_formula("twml", aten.addmm)
def _twml_addmm(bias: Any, a: Any, b: Any, *_: Any, out_shape: Any = None, **__: Any) -> float:
    n, k = a
    return float(n * b[1] * (2 * k - 1) + n * b[1])  # MatMul + BiasAdd


@register_cost_formula("twml", aten.bmm)
def _twml_bmm(a: Any, b: Any, *_: Any, out_shape: Any = None, **__: Any) -> float:
    bs, n, k = a
    return float(bs * n * b[2] * (2 * k - 1))


@register_cost_formula("twml", aten.baddbmm)
def _twml_baddbmm(bias: Any, a: Any, b: Any, *_: Any, out_shape: Any = None, **__: Any) -> float:
    bs, n, k = a
    return float(bs * n * b[2] * (2 * k - 1) + bs * n * b[2])


@register_cost_formula("twml", aten.convolution, aten._convolution)
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


@register_cost_formula("twml", aten.mul)
def _twml_mul(*_: Any, out_shape: Any = None, **__: Any) -> float:
    return float(_numel(out_shape))
