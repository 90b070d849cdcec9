"""Run-time help for mask points whose input rows are not the batch (``fisherprune.masks.rows``).

``BatchProbe``: forward hooks on the model that hold the batch size of the call in progress
(read off the inputs' shapes as ``fisherprune.inputs`` reads it; None outside a call).
``RowScope``: forward hooks on a module that selects rows by data (a mixture-of-experts block's
experts); while a collecting step runs its forward, a ``RowTracker`` dispatch mode follows the
example of each row from the module's inputs to the mask points inside it.
``to_examples`` turns a point's layout into the reduction of its per-row mask gradients
(rows, C) to per-example ones (N, C), applied in backward before anything is squared.
None of these reads a value back to the host.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fisherprune.inputs import Inputs
from fisherprune.masks import tracing
from fisherprune.masks.rows import BATCH, SELECTED, TOKENS, Rows, rows_after

__all__ = [
    "BatchProbe",
    "RowScope",
    "RowTracker",
    "add_rows",
    "host_sizes",
    "packed_rows",
    "to_examples",
]

log = logging.getLogger("fisherprune")

#: maps per-row gradients (rows, C) to per-example ones (N, C)
ToExamples = Callable[[Tensor], Tensor]


class BatchProbe:
    """The number of examples of the model call in progress (None outside one).

    Changes (``install``): one forward pre-hook and one forward hook on the model."""

    def __init__(self) -> None:
        self.batch: int | None = None
        self._depth = 0

    def install(self, model: nn.Module) -> list[Any]:
        """Hook ``model``; returns the two handles (``remove()`` undoes each)."""
        return [
            model.register_forward_pre_hook(self._enter, with_kwargs=True),
            model.register_forward_hook(self._leave, always_call=True),
        ]

    def _enter(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._depth == 0:
            self.batch = _batch_of(args, kwargs)
        self._depth += 1

    def _leave(self, _module: nn.Module, _args: tuple, _out: Any) -> None:
        self._depth -= 1
        if self._depth <= 0:
            self._depth, self.batch = 0, None


def _batch_of(args: tuple, kwargs: dict) -> int | None:
    """The batch of one call's arguments (``fisherprune.inputs``' rule), or None."""
    for form, a, k in (("tuple", tuple(args), {}), ("dict", (), dict(kwargs))):
        if a or k:
            try:
                return Inputs(a, k, form).batch_size
            except ValueError:
                continue
    return None


class RowTracker(TorchDispatchMode):
    """Follows the row map of every tensor computed from the seeded ones (``rows_after``)."""

    def __init__(self) -> None:
        super().__init__()
        self._maps: dict[int, tuple[weakref.ref[Tensor], Rows]] = {}

    def seed(self, t: Tensor, rows: Rows) -> None:
        """Say that the rows of ``t`` belong to the examples ``rows.example``."""
        self._maps[id(t)] = (weakref.ref(t), rows)

    def rows_of(self, t: Any) -> Rows | None:
        """The row map of ``t``, if it was followed."""
        got = self._maps.get(id(t))
        return got[1] if got is not None and got[0]() is t else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, Tensor)]
        if outs:
            found = rows_after(func, args, kwargs, outs, self.rows_of)
            for o, rows in zip(outs, found, strict=True):
                if rows is not None:
                    self.seed(o, rows)
        return out


class RowScope:
    """Forward hooks on the module ``name`` whose forward selects rows by data: while a step
    that collects signals runs it, ``active`` is a ``RowTracker`` seeded with the rows of its
    positional inputs ``args`` (``(position, "batch" or "tokens")``), and ``batch`` the number
    of examples; both None otherwise.

    ``collecting``: whether any mask inside still collects (read at each call)."""

    def __init__(
        self,
        name: str,
        args: tuple[tuple[int, str], ...],
        probe: BatchProbe,
        collecting: Callable[[], bool],
    ) -> None:
        self.name, self.args, self.probe, self.collecting = name, args, probe, collecting
        self.active: RowTracker | None = None
        self.batch: int | None = None

    def install(self, module: nn.Module) -> list[Any]:
        """Hook ``module`` (after the hooks already there, so that it sees the inputs as its
        mask points made them); returns the handles."""
        return [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._leave, always_call=True),
        ]

    def _enter(self, _module: nn.Module, args: tuple) -> None:
        n = self.probe.batch
        if (
            self.active is not None
            or n is None
            or tracing.active() is not None
            or not torch.is_grad_enabled()
            or not self.collecting()
        ):
            return
        tracker = RowTracker()
        for pos, kind in self.args:
            x = args[pos] if pos < len(args) else None
            if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[0] % n:
                continue
            per = 1 if kind == BATCH else x.shape[0] // n
            tracker.seed(x, Rows(torch.arange(x.shape[0], device=x.device) // per))
        tracker.__enter__()
        self.active, self.batch = tracker, n

    def _leave(self, _module: nn.Module, _args: tuple, _out: Any) -> None:
        if self.active is not None:
            self.active.__exit__(None, None, None)
            self.active = self.batch = None


def _sum_runs(n: int, dot: Tensor) -> Tensor:
    """(n * L, C) -> (n, C): the sum of each example's run of L consecutive rows."""
    return dot.view(n, -1, dot.shape[-1]).sum(1)


def add_rows(example: Tensor, n: int, dot: Tensor) -> Tensor:
    """(rows, C) -> (n, C): each row added to its example's (``example``: of each row)."""
    return dot.new_zeros(n, dot.shape[-1]).index_add_(0, example.to(dot.device), dot)


def host_sizes(batch_sizes: Tensor) -> list[int]:
    """A ``PackedSequence`` 's step sizes as integers. PyTorch keeps ``batch_sizes`` in host
    memory whatever device the data is on, so reading it waits for no device (this is the one
    place such a read is made: ``tests/host_reads.py`` knows it).

    Raises:
        ValueError: ``batch_sizes`` is not on the CPU (not a PackedSequence's).
    """
    if batch_sizes.device.type != "cpu":
        raise ValueError(
            f"a PackedSequence's batch_sizes live on the CPU; got them on {batch_sizes.device}"
        )
    return batch_sizes.tolist()


def packed_rows(packed: PackedSequence) -> ToExamples:
    """The reduction of per-row gradients of ``packed.data`` to per-example ones: its rows are
    step after step the sequences still going, longest first (``batch_sizes`` of them), which
    ``sorted_indices`` maps back to the caller's examples. Nothing is computed until it is
    called (in the backward of a step that collects)."""
    return functools.partial(_add_packed_rows, packed.batch_sizes, packed.sorted_indices)


def _add_packed_rows(batch_sizes: Tensor, order: Tensor | None, dot: Tensor) -> Tensor:
    """(rows, C) -> (examples, C) for a ``PackedSequence`` with step sizes ``batch_sizes`` and
    ``order`` (sorted position -> example, or None: already in order)."""
    sizes = host_sizes(batch_sizes)
    position = torch.cat([torch.arange(n) for n in sizes])  # (within its step)
    if dot.device.type == "cuda":  # (from pinned memory: no wait for the device)
        position = position.pin_memory().to(dot.device, non_blocking=True)
    else:
        position = position.to(dot.device)
    example = position if order is None else order.to(dot.device)[position]
    return add_rows(example, sizes[0], dot)


def to_examples(
    kind: str, x: Tensor, probe: BatchProbe | None, scope: RowScope | None
) -> ToExamples | bool | None:
    """The reduction of a point's per-row gradients to per-example ones for input ``x`` of
    layout ``kind``: None where rows are examples already (``"batch"``), False where it cannot
    be known in this call (the caller falls back to one example per row, and says so)."""
    if kind == BATCH:
        return None
    if kind == TOKENS and probe is not None:
        n = probe.batch
        if n and x.dim() and x.shape[0] % n == 0:
            return None if x.shape[0] == n else functools.partial(_sum_runs, n)
    if kind == SELECTED and scope is not None and scope.active is not None:
        rows = scope.active.rows_of(x)
        if rows is not None and scope.batch is not None:
            return functools.partial(add_rows, rows.example, scope.batch)
    return False
