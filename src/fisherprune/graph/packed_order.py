"""Which example each row of a tensor padded back from a ``PackedSequence`` is of.

``pad_packed_sequence`` pads the packed data in the packed order (longest sequence first) and
then, where the sequences were sorted, puts them back in the caller's order by
``index_select`` along the batch dim with the sequence's ``unsorted_indices``. Neither step
has a row rule of its own: the padding is built of ``full``, slices and copies (the operator
is composite: it never reaches the tracer's dispatch whole), and the second is an index
chosen by data (by the lengths). So the rows of whatever read the padded output were not
followed (its mask's signal was taken as approximate, each index of dim 0 for one example: in
the default time-first layout, each step for one example).

The tracer knows more: it sees every ``PackedSequence`` a module is called with or returns.
``PackedOrder`` remembers their data and their unsorting index; ``PaddedRows`` (a
``TorchFunctionMode``, which sees ``_pad_packed_sequence`` whole) gives the padded output of
their data the packed order's map (sequence ``sorted_indices[b]`` at position ``b``, or ``b``
where the sequences came sorted), and ``PackedOrder.rows`` gives an ``index_select`` by their
``unsorted_indices`` the caller's order along its dim, whatever the lengths. As
``fisherprune.masks.rows.PACKED`` does, sequence ``i`` in the caller's order is taken for
example ``i``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence
from torch.overrides import TorchFunctionMode

from fisherprune.masks.rows import Rows

__all__ = ["PackedOrder", "PaddedRows"]

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

    def padded(self, args: tuple, padded: Tensor) -> Rows | None:
        """The map of the padded output of ``_pad_packed_sequence(*args)``, where its data is a
        remembered sequence's (None otherwise): the packed order along the batch dim."""
        if not args or id(args[0]) not in self._data:
            return None
        batch_dim = 0 if (args[2] if len(args) > 2 else False) else 1
        order = self._data[id(args[0])][1]
        n = padded.shape[batch_dim]
        example = torch.arange(n) if order is None else order.detach().cpu()
        return _along(example, padded, batch_dim, order is not None)

    def rows(self, func: Any, args: tuple, outs: list[Tensor]) -> list[Rows | None] | None:
        """The row maps of ``outs`` where this call puts a remembered sequence's sequences back
        in the caller's order; None for any other call (the usual rules apply)."""
        if getattr(func, "overloadpacket", None) is aten.index_select and (
            id(args[2]) in self._unsorting
        ):
            dim = args[1] % max(outs[0].dim(), 1)
            return [_along(torch.arange(outs[0].shape[dim]), outs[0], dim, False)]
        return None


class PaddedRows(TorchFunctionMode):
    """While a trace runs: gives each tensor ``_pad_packed_sequence`` pads back from a
    remembered sequence its map (``PackedOrder.padded``), through ``set_rows``."""

    def __init__(self, order: PackedOrder, set_rows: Callable[[Tensor, Rows], None]) -> None:
        super().__init__()
        self.order, self.set_rows = order, set_rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") == "_pad_packed_sequence":
            rows = self.order.padded(tuple(args), out[0])
            if rows is not None:
                self.set_rows(out[0], rows)
        return out


def _along(example: Tensor, out: Tensor, dim: int, by_data: bool) -> Rows:
    """The map of ``out`` whose dim ``dim`` holds the examples ``example`` in order (the same
    for every index of the dims before it)."""
    if dim == 0:
        return Rows(example, by_data)
    return Rows(example.expand(*out.shape[:dim], example.numel()).contiguous(), by_data)
