"""Masks inside ``torch.compile``: the same products and the same per-example Fisher signal,
with nothing the compiler must break its graph for.

In eager, a mask point keeps caches keyed on each mask buffer's version (so that a step of a
pruned model makes no small kernels and reads nothing back) and reports the per-example
gradient from the Python backward of an autograd function. Under ``torch.compile`` both break
the graph: a tensor's version is data to the compiler, and a backward that changes Python
objects cannot be traced. A 2-block encoder compiled with collecting masks broke into 29
graphs and ran 4.3x slower than compiled without masks (2.3x slower than eager with them).

So, while compiling, a mask point whose masks cover its dim in order (one mask entry per
position, or per run of positions: a head's) and whose input rows are the examples takes
this path instead:

* not collecting: the input times the mask (the compiler fuses the product into its
  neighbours; no version is read);
* collecting: the input times the mask through ``_Product``, an autograd function the
  compiler traces, forward and backward, into its graphs. Its backward computes the input's
  gradient and the per-example dot the eager backward computes (the sum over every other dim
  of the output gradient times the input: the product in the input's dtype, the sum in
  float32, or float64 for a float64 input) and passes the dot, shape (examples, positions),
  to ``fisherprune::hand_over``: a custom operator the compiled backward calls, not traces,
  which hands it to the point (``MaskPoint.accumulate``) by the point's key (an int, a
  constant of the graph; the points are held weakly; the operator is tagged
  ``cudagraph_unsafe``: a CUDA graph's replay would skip it, so torch's CUDA-graph modes leave
  the backward uncaptured). So the first compiled step gathers
  its signal, any batch size does (``torch._dynamo.mark_dynamic`` and ``dynamic=True``
  too: nothing is kept per size), and so does a backward that asks for some gradients only
  (``torch.autograd.grad(loss, params)``), wherever the input's gradient is needed, as in
  eager. The forward reads nothing of what was gathered (each read would be a guard,
  failing at the next micro-batch): it marks its masks (``MaskLayer.open_pass``), and the
  next gradient added closes the pass before it, as the eager forward's ``start_pass`` does.

Measured on torch 2.13 (CPU, the 12-block encoder of ``benchmarks/host_overhead.py``), a
compiled collecting step runs about 1.3x a compiled plain one (1.4x with the per-batch-size
leaves this replaced, whose first step at each size gathered nothing). The product itself a
custom operator (``torch.library.custom_op`` with ``register_autograd``) gathered the same
signal but ran 1.7x: the compiler cannot fuse an operator it only calls, and each call runs
Python.

A norm point normalises with sums weighted by the kept positions
(``fisherprune.norms.normalise_masked``), with no index computed from the mask.

A point whose input requires no grad (a mask on the model input, or after frozen layers) gives
``_Product`` a leaf that requires grad besides (``_ANCHOR``, which never receives one), so
that the loss's gradient still reaches it, inside the graph. The masks' writes to Python state
are more than a ``torch.utils.checkpoint`` region may make: ``torch.compile`` runs the
function that checkpoints a masked block eager (its signal is the eager one). A block gate
gathers through ``masked_product`` too (``masks.blocks``). Other points (several masks on one
dim, masks that require grad as under ``torch.func``, and while collecting, rows that are
tokens or chosen by data) take the eager path, breaking the graph there as before. The product
saves the point's input for the backward: one more activation per masked point than eager's
aliasing identity while nothing is pruned (inductor's partitioner keeps it too, measured on
torch 2.13).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fisherprune.masks.rows import BATCH

__all__ = [
    "SignalOwner",
    "compiled_product",
    "compiling",
    "covers_in_order",
    "masked_product",
    "position_multiplier",
]

#: the live owners by key: where ``fisherprune::hand_over`` finds them (held weakly)
_OWNERS: weakref.WeakValueDictionary[int, SignalOwner] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


#: whether ``torch.compile`` is tracing the code running now: torch's own function, not a
#: wrapper of it (asked at every masked layer's forward)
compiling = torch.compiler.is_compiling


def covers_in_order(parts: Sequence[tuple[Any, Tensor, Tensor]], size: int) -> bool:
    """Whether ``parts`` (mask, positions, entries) is one mask whose entry ``i`` multiplies
    position ``i`` of a dim of ``size``, for every position."""
    if len(parts) != 1:
        return False
    m, pos, idx = parts[0]
    return (
        pos.numel() == size
        and idx.numel() == m.num_channels
        and bool((pos == torch.arange(size)).all())
        and bool((idx == torch.arange(m.num_channels)).all())
    )


def position_multiplier(point: Any) -> Tensor | None:
    """The multiplier of each position of ``point``'s dim (shape ``(size,)``, the masks'
    dtype), from its masks by tensor operations alone; None where its masks do not cover the
    dim in order (one entry per position, or per ``point._block`` positions)."""
    if point._direct:
        return point.parts[0][0].mask
    if point._block is not None:
        return point.parts[0][0].mask.repeat_interleave(point._block)
    return None


class SignalOwner:
    """What the compiled backward hands per-example dots to (a ``MaskPoint``, or a
    ``MaskLayer`` called as a module): a key of its own, by which ``fisherprune::hand_over``
    finds it, and ``accumulate(g, None)``, which the owner defines."""

    _owner_key: int

    def init_owner(self) -> None:
        """Take a new key. Changes: ``_owner_key``; the registry of owners holds this one
        (weakly: a model dropped is freed as without masks)."""
        self._owner_key = next(_KEYS)
        _OWNERS[self._owner_key] = self

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy, or an owner unpickled, takes a new key: its compiled backward hands to it,
        not to the original."""
        base = getattr(super(), "__setstate__", None)  # (nn.Module's)
        if base is not None:
            base(state)
        else:
            self.__dict__.update(state)
        self.init_owner()


def _hand_over(dot: Tensor, key: int) -> None:
    """Hand ``dot`` (examples, positions) to the owner with ``key`` (``accumulate``), if it is
    alive. Changes: that owner's gathered gradients. Called by the compiled backward, never
    traced; ``dot`` is copied, since the compiled code may reuse its memory once this returns."""
    owner = _OWNERS.get(key)
    if owner is not None:
        g = dot.clone(memory_format=torch.contiguous_format)
        owner.accumulate(g, None)  # type: ignore[attr-defined]


def _hand_over_fake(dot: Tensor, key: int) -> None:
    """Nothing to compute while tracing."""


# defined by ``Library`` rather than ``torch.library.custom_op``, whose Python wrapper costs
# 5x more per call (8 against 1.6 us, torch 2.13 CPU), paid once per point in each backward
_LIB = torch.library.Library("fisherprune", "DEF")
# cudagraph_unsafe: a CUDA graph's replay would skip it (the signal lost after the capture), so
# torch.compile's CUDA-graph modes leave a graph that calls it uncaptured
_LIB.define("hand_over(Tensor dot, int key) -> ()", tags=(torch.Tag.cudagraph_unsafe,))
_LIB.impl("hand_over", _hand_over, "CompositeExplicitAutograd")
torch.library.register_fake("fisherprune::hand_over", _hand_over_fake, lib=_LIB)
# it returns nothing: without this, the compiler drops it from the backward as dead code
torch.fx.node.has_side_effect(torch.ops.fisherprune.hand_over.default)


def _examples_dot(g: Tensor, x: Tensor, dim: int, batch: int) -> Tensor:
    """``sum of g * x`` over every dim but ``batch`` and ``dim``, shape (examples, positions):
    the product in the inputs' dtype, the sum accumulated in float32 (float64 for float64)."""
    wide = torch.promote_types(x.dtype, torch.float32)
    others = [d for d in range(x.dim()) if d not in (batch, dim)]
    prod = g * x
    dot = prod.sum(others, dtype=wide) if others else prod.to(wide)
    return dot.t() if batch > dim else dot


#: a leaf that requires grad, given to ``_Product`` beside an input that requires none (a mask
#: after frozen layers), so that its output requires grad and its backward runs: the loss's
#: gradient reaches the mask as in eager. It never receives a gradient (the backward returns
#: None for it). Made once, outside any graph
_ANCHOR = torch.zeros((), requires_grad=True)


class _Product(torch.autograd.Function):
    """``x * mult`` whose backward also hands the per-example dot along ``batch`` and ``dim``
    (non-negative) to the owner with ``key`` (see the module); ``anchor``, when given, only
    makes the output require grad. Traced by the compiler."""

    @staticmethod
    def forward(ctx, x, mult, key, dim, batch, anchor=None):  # type: ignore[override]
        ctx.save_for_backward(x, mult)
        ctx.key, ctx.dim, ctx.batch = key, dim, batch
        return x * mult

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, mult = ctx.saved_tensors
        d = g.detach()  # (create_graph: the dot keeps no graph)
        d = d if d.dtype == x.dtype else d.to(x.dtype)
        torch.ops.fisherprune.hand_over(_examples_dot(d, x.detach(), ctx.dim, ctx.batch), ctx.key)
        return g * mult, None, None, None, None, None


def compiled_product(point: Any, x: Tensor) -> Tensor | None:
    """``x`` times the masks of ``point`` (a ``MaskPoint``) as the compiled graph computes it
    (see the module), or None where this point takes the eager path."""
    if any(m.mask.requires_grad for m in point._masks):
        return None
    if (
        point.rows.kind != BATCH
        and torch.is_grad_enabled()
        and any(m.collecting for m in point._masks)
    ):
        return None  # rows that are not the examples: the eager path maps them to examples
    mult = position_multiplier(point)
    if mult is None:
        return None
    return masked_product(point, x, mult, point._masks, point.dim, point.rows.dim)


def masked_product(
    owner: SignalOwner, x: Tensor, mult: Tensor, masks: Sequence[Any], dim: int, batch: int
) -> Tensor:
    """``x`` times ``mult`` (one entry per position of ``dim``), the examples along ``batch``;
    while any of ``masks`` collects, through ``_Product``, whose backward hands ``owner`` the
    per-example dot (see the module), after marking the masks (``open_pass``)."""
    dim, batch = dim % x.dim(), batch % x.dim()
    shape = [1] * x.dim()
    shape[dim] = mult.numel()
    mult = mult.to(x.dtype).view(shape)
    if not (torch.is_grad_enabled() and any(m.collecting for m in masks)):
        return x * mult
    for m in masks:
        m.open_pass()
    anchor = None if x.requires_grad else _ANCHOR
    return _Product.apply(x, mult, owner._owner_key, dim, batch, anchor)
