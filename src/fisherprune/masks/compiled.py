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
* collecting: the input times ``mask + sink``, ``sink`` a leaf of zeros (float32, or the
  input's dtype where wider), shape (examples, positions), kept on the point per batch size,
  device and dtype. A leaf that requires grad cannot be made inside a compiled graph: the
  first call at a batch size multiplies without collecting, and the leaf is made where the
  signals are next folded, outside the graph (so the first compiled step at each batch size
  gathers no signal). Its gradient is then
  exactly the per-example dot the eager backward computes (the sum over every other dim of
  the output gradient times the input), in float32, computed by the compiled backward; a
  hook run after it is accumulated hands it to the point (``MaskPoint.accumulate``) and
  clears it. The forward reads nothing of what was gathered (each read would be a guard,
  failing at the next micro-batch): it marks its masks (``MaskLayer.open_pass``), and the next
  gradient added closes the pass before it, as the eager forward's ``start_pass`` does. The
  product is taken in float32 and cast back (one fused kernel): activations keep their dtype,
  the statistics are float32.

A norm point normalises with sums weighted by the kept positions
(``fisherprune.norms.normalise_masked``), with no index computed from the mask.

A backward that asks for some gradients only (``torch.autograd.grad(loss, params)``,
``loss.backward(inputs=...)``) does not reach the leaves, which no asked-for gradient depends
on: such steps gather no signal while compiled (eager ones do). And the masks' writes to Python
state are more than a ``torch.utils.checkpoint`` region may make: ``torch.compile`` runs the
function that checkpoints a masked block eager (its signal is the eager one). The leaves are
looked up by batch size, which fixes it: ``torch._dynamo.mark_dynamic`` on the batch dim of a
collecting model is refused by the compiler (``dynamic=True`` and the automatic dynamic shapes
after a batch size changes are not: one graph per size).

Other points (several masks on one dim, rows that are tokens or chosen by data, masks that
require grad as under ``torch.func``) take the eager path, breaking the graph there as before.
The sink's product saves the point's input for the backward: one more activation per masked
point than eager's aliasing identity while nothing is pruned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fisherprune.masks.rows import BATCH

#: the owners whose compiled calls lacked a leaf (``SinkOwner._wanted``), to be made outside
_PENDING: list[Any] = []

__all__ = [
    "SinkOwner",
    "compiled_product",
    "compiling",
    "covers_in_order",
    "make_pending_sinks",
    "masked_product",
    "position_multiplier",
]


def compiling() -> bool:
    """Whether ``torch.compile`` is tracing the code running now."""
    return torch.compiler.is_compiling()


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


class SinkOwner:
    """What owns compiled-path leaves (a ``MaskPoint``, or a ``MaskLayer`` called as a
    module): the leaves by (examples, device, dtype), the ones a compiled call lacked, and
    where their gradients go (``accumulate(g, None)``, which the owner defines)."""

    _sinks: dict[tuple[int, torch.device, torch.dtype], Tensor]
    #: the width of each leaf a compiled call lacked, by its key (each recorded once)
    _wanted: dict[tuple[int, torch.device, torch.dtype], int]

    def init_sinks(self) -> None:
        """Start with no leaves. Changes: the two attributes."""
        self._sinks, self._wanted = {}, {}

    def __getstate__(self) -> dict[str, Any]:
        """Copied and pickled without the leaves (their hooks are this owner's; a copy makes
        its own)."""
        base = getattr(super(), "__getstate__", None)  # (nn.Module's drops its own caches)
        state = base() if base is not None else None
        state = dict(state) if isinstance(state, dict) else dict(self.__dict__)
        return {**state, "_sinks": {}, "_wanted": {}}

    def drain_sink(self, sink: Tensor) -> None:
        """Hand the gradient just accumulated into ``sink`` (the per-example dot) to the
        masks, and clear it. Changes: the masks' gathered gradients."""
        g, sink.grad = sink.grad, None
        if g is not None:
            self.accumulate(g, None)  # type: ignore[attr-defined]


def compiled_product(point: Any, x: Tensor) -> Tensor | None:
    """``x`` times the masks of ``point`` (a ``MaskPoint``) as the compiled graph computes it
    (see the module), or None where this point takes the eager path."""
    if point.rows.kind != BATCH or any(m.mask.requires_grad for m in point._masks):
        return None
    mult = position_multiplier(point)
    if mult is None:
        return None
    return masked_product(point, x, mult, point._masks, point.dim, point.rows.dim)


def masked_product(
    owner: SinkOwner, x: Tensor, mult: Tensor, masks: Sequence[Any], dim: int, batch: int
) -> Tensor:
    """``x`` times ``mult`` (one entry per position of ``dim``), the examples along ``batch``;
    while any of ``masks`` collects, through ``owner``'s leaf, whose gradient is then the
    per-example dot (see the module)."""
    shape = [1] * x.dim()
    shape[dim] = mult.numel()
    if not (torch.is_grad_enabled() and any(m.collecting for m in masks)):
        return x * mult.to(x.dtype).view(shape)
    wide = torch.promote_types(x.dtype, torch.float32)
    key = (x.shape[batch], x.device, wide)
    sink = owner._sinks.get(key)
    if sink is None:  # made after this step (make_pending_sinks); this call gathers nothing
        if key not in owner._wanted:  # (once: each append would be a guard, a trace again)
            owner._wanted[key] = mult.numel()
            _PENDING.append(owner)
        for m in masks:
            m.mark_received()  # (the loss reaches them: the first step's check holds)
        return x * mult.to(x.dtype).view(shape)
    for m in masks:
        m.open_pass()
    full = mult.to(sink.dtype) + sink  # (examples, positions)
    if batch > dim % x.dim():
        full = full.t()
    shape[batch] = key[0]
    return (x.to(wide) * full.reshape(shape)).to(x.dtype)


def make_pending_sinks() -> None:
    """Make every leaf a compiled call lacked (``_PENDING``), outside any compiled graph:
    a leaf that requires grad cannot be made inside one. The next compiled call finds them
    (its guards on the owners' leaves fail, so it is traced again, whole). Called where the
    signals are folded (``update_pruning_signals``), which never runs compiled. Changes: the
    pending owners' leaves."""
    while _PENDING:
        owner = _PENDING.pop()
        for key, width in owner._wanted.items():
            n, device, dtype = key
            sink = torch.zeros(n, width, dtype=dtype, device=device, requires_grad=True)
            sink.register_post_accumulate_grad_hook(owner.drain_sink)
            owner._sinks[key] = sink
        owner._wanted.clear()
