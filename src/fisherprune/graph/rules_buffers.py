"""Channel rules of operators that make a fresh buffer filled with one value: ``zeros``,
``ones``, ``full``, ``empty`` and their ``new_*`` forms.

Such a buffer holds the same value at every index, so nothing in it tells one channel from
another: combined element-wise with a tensor that carries channels (the zero initial state a
state-space scan multiplies and adds to, ``h = dA * h + dBx``), or written into with
``copy_`` (a cache's preallocated state, filled with the channels of a convolution's input),
it can follow that width, and the shrunk model, which makes the buffer again at its own
size, gives the same values in the kept channels.

So each dimension of such a buffer gets fresh atoms of its own (kind ``"fill"``), blocked by
nothing: operators then tie them to the channels they meet, and the buffer's later readers
(a scan's next step, the state returned in a cache) see those channels. A dimension that
meets nothing stays a free component, which is no channel group (it has no parameter and
no producer). Where the shrunk model could not make the buffer at the kept size (its size
written into the code as a number), the dry run of ``shrink`` that ``apply_masks`` makes
(``fisherprune.export.width_probe``) keeps the group whole and says why.

``empty`` is here too: its values are undefined, but a buffer made empty is one code fills
before reading; a channel it never fills is read nowhere the masked model's output depends on
more than the shrunk model's does.
"""

from __future__ import annotations

import torch

from fisherprune.graph.rules import register_channel_rule
from fisherprune.graph.types import Labels, RuleContext, TensorInfo

__all__: list[str] = []  # rules only: they register themselves on import

aten = torch.ops.aten

#: operators that make a new tensor holding one value everywhere (or undefined values)
FILL_OPS = (
    aten.empty,
    aten.zeros,
    aten.ones,
    aten.full,
    aten.empty_strided,
    aten.new_empty,
    aten.new_empty_strided,
    aten.new_zeros,
    aten.new_ones,
    aten.new_full,
)


@register_channel_rule(*FILL_OPS)
def _fill(ctx: RuleContext) -> list[TensorInfo]:
    """A fresh buffer: every dimension of size above one gets fresh, unblocked atoms, so that
    the buffer follows whatever width it is combined with or written with. A leading dim the
    size of the model inputs' batch indexes the batch (``torch.ones(batch, seq)``, CANINE's
    ``torch.zeros(input_shape)``): its atoms count as the batch's, as a batch of one, whose
    dim 0 gets none, traces it (else heads merged with that batch are refused at batch 2)."""
    batch = ctx.atoms.batch_size()
    outs = []
    for t in ctx.out_tensors:
        shape = tuple(t.shape)
        labels: list[Labels] = [
            ctx.atoms.new_block("fill", ctx.where(), d, s) if s > 1 else None
            for d, s in enumerate(shape)
        ]
        if shape and labels[0] is not None and shape[0] == batch:
            ctx.atoms.mark_batch(labels[0])
        outs.append(TensorInfo(shape, labels, [None] * len(shape)))
    return outs
