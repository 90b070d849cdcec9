"""Which example each row of a tensor padded back from a ``PackedSequence`` is of.

``pad_packed_sequence`` pads the packed data in the packed order (longest sequence first) and
then, where the sequences were sorted, puts them back in the caller's order by
``index_select`` along the batch dim with the sequence's ``unsorted_indices``. Neither step
has a row rule of its own: the padded tensor's batch is not dim 0 of any input, and the second
is an index chosen by data (by the lengths), so the rows of whatever read the padded output
were not followed (its mask's signal was taken as approximate, each index of dim 0 for one
example: in the default time-first layout, each step for one example).

The tracer knows more: it sees every ``PackedSequence`` a module is called with or returns.
``PackedOrder`` remembers their data and their unsorting index, so that the padded output of
their data gets the packed order's map (sequence ``sorted_indices[b]`` at position ``b``) and
an ``index_select`` by their ``unsorted_indices`` gets the caller's order along its dim,
whatever the lengths. As ``fisherprune.masks.rows.PACKED`` does, sequence ``i`` in the caller's
order is taken for example ``i``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from fisherprune.masks.rows import Rows

__all__ = ["PackedOrder"]

aten = torch.ops.aten


class PackedOrder:
    """The ``PackedSequence`` s a trace met, for the rows of what is padded back from them.
    Keeps the tensors it remembers alive (they are known by ``id``)."""

    def __init__(self) -> None:
        self._data: dict[int, tuple[Tensor, Tensor | None]] = {}  # data -> its sorted_indices
        self._unsorting: dict[int, Tensor] = {}

    def note(self, value: Any) -> None:
        """Remember ``value`` if it is a ``PackedSequence``, or those in a tuple or list
        of them (a module's inputs or outputs)."""
        if isinstance(value, PackedSequence):
            self._data[id(value.data)] = (value.data, value.sorted_indices)
            if value.unsorted_indices is not None:
                self._unsorting[id(value.unsorted_indices)] = value.unsorted_indices
        elif isinstance(value, (tuple, list)):
            for v in value:
                if isinstance(v, PackedSequence):
                    self.note(v)

    def rows(self, func: Any, args: tuple, outs: list[Tensor]) -> list[Rows | None] | None:
        """The row maps of ``outs`` where this call pads a remembered sequence's data or puts
        its sequences back in order; None for any other call (the usual rules apply)."""
        packet = getattr(func, "overloadpacket", None)
        if packet is aten._pad_packed_sequence and id(args[0]) in self._data:
            batch_dim = 0 if args[2] else 1
            order = self._data[id(args[0])][1]
            n = outs[0].shape[batch_dim]
            example = torch.arange(n) if order is None else order.detach().cpu()
            return [_along(example, outs[0], batch_dim, order is not None), None]
        if packet is aten.index_select and id(args[2]) in self._unsorting:
            dim = args[1] % max(outs[0].dim(), 1)
            return [_along(torch.arange(outs[0].shape[dim]), outs[0], dim, False)]
        return None


def _along(example: Tensor, out: Tensor, dim: int, by_data: bool) -> Rows:
    """The map of ``out`` whose dim ``dim`` holds the examples ``example`` in order (the same
    for every index of the dims before it)."""
    if dim == 0:
        return Rows(example, by_data)
    return Rows(example.expand(*out.shape[:dim], example.numel()).contiguous(), by_data)
