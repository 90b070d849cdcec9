"""Row maps over several leading dims, for tensors whose batch is not dim 0.

PyTorch's sequence-first layout ((L, N, E): ``nn.MultiheadAttention`` and
``nn.TransformerEncoderLayer`` with ``batch_first=False``, the default) puts the batch on dim 1:
no map of dim 0 alone says whose each index is. The tracer therefore follows maps over the
first k+1 dims (``Rows.example`` of shape (d0, ..., dk), the example of each index of them):
``x.transpose(0, 1)`` of a (N, L, E) input has the map (L, N) whose row l is 0, 1, ... N-1,
and ``fisherprune.masks.rows.batch_dim`` reads dim 1 as the batch off it.

Maps are kept canonical: no trailing dim along which the example does not change, so that a
map that depends on dim 0 alone is the 1-dim map every rule of ``fisherprune.masks.rows``
follows, and the rules here agree with those on 1-dim maps. Deciding that compares values, on
the host: only the tracer (``rows_after_nd``) follows these maps, never a step that trains.

A traced batch of one cannot tell the batch dim from any other dim of size one: there, a map
that is moved off dim 0 is not followed, and ``apply_masks`` traces the batch twice over to
read the layouts of the points left ``"unknown"`` (``graph.placement._rows_trace``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from fisherprune.masks.rows import (
    RowRule,
    Rows,
    RowsOf,
    add_rule,
    first_rows,
    rows_after,
)

__all__ = ["rows_after_nd"]

aten = torch.ops.aten

#: rules that follow maps of any number of dims, used in place of ``rows``' own by the tracer
_ND_RULES: dict[Any, RowRule] = {}


def rows_after_nd(
    func: Any,
    args: tuple,
    kwargs: dict,
    outs: Sequence[Tensor],
    rows_of: RowsOf,
    inputs: Sequence[Any] | None = None,
) -> list[Rows | None]:
    """``rows_after``, following maps over several leading dims too (trace time only).
    ``inputs``: ``(args, kwargs)`` flattened, when the caller has it."""
    rule = _ND_RULES.get(getattr(func, "overloadpacket", None))
    if rule is None:
        flat = tree_flatten((args, kwargs))[0] if inputs is None else inputs
        if not any(
            isinstance(a, Tensor) and (r := rows_of(a)) is not None and r.example.dim() > 1
            for a in flat
        ):
            return rows_after(func, args, kwargs, outs, rows_of, flat)
        return [first_rows(flat, o, rows_of) for o in outs]
    return [rule(func, args, kwargs, o, i, rows_of) for i, o in enumerate(outs)]


def _canonical(example: Tensor, by_data: bool) -> Rows:
    """``example`` without the trailing dims along which it does not change."""
    while example.dim() > 1 and torch.equal(example, example[..., :1].expand(example.shape)):
        example = example[..., 0]
    return Rows(example.contiguous(), by_data)


def _full(rows: Rows, x: Tensor) -> Tensor:
    """The map of ``rows`` with one dim per dim of ``x`` (size 1 on those it does not cover)."""
    ex = rows.example
    return ex.reshape(*ex.shape, *([1] * (x.dim() - ex.dim())))


def _from_full(full: Tensor, out: Tensor, by_data: bool) -> Rows | None:
    """The canonical map of ``out`` from one with a dim per dim of ``out`` (size 1 where it
    does not change); None where no dim of ``out`` larger than one carries it."""
    sized = [d for d in range(full.dim()) if full.shape[d] > 1]
    if not sized:
        return Rows(full.reshape(1), by_data) if out.dim() and out.shape[0] == 1 else None
    m = sized[-1] + 1
    return _canonical(full[(...,) + (0,) * (full.dim() - m)].expand(out.shape[:m]), by_data)


def _nd_rule(*ops: Any) -> Any:
    """Register a rule in ``_ND_RULES`` (duplicates refused as ``register_row_rule`` does)."""
    return functools.partial(add_rule, _ND_RULES, ops)


def _first(args: tuple, rows_of: RowsOf) -> tuple[Tensor, Rows] | None:
    """The first argument and its map, where it is a tensor with one."""
    x = args[0]
    rows = rows_of(x) if isinstance(x, Tensor) and x.dim() > 0 else None
    return None if rows is None else (x, rows)


@_nd_rule(aten.view, aten._unsafe_view, aten.reshape, aten.flatten, aten.unflatten)
def _reshaped(func: Any, args: tuple, kwargs: dict, out: Tensor, i: int, rows_of: RowsOf):
    """The map widened to the fewest first dims of the input whose sizes multiply to those of
    some first dims of the output, and reshaped to these."""
    got = _first(args, rows_of)
    if got is None or out.dim() == 0:
        return None
    x, rows = got
    m = rows.example.dim()
    prefixes = [math.prod(out.shape[:j]) for j in range(1, out.dim() + 1)]
    for k in range(m, x.dim() + 1):
        size = math.prod(x.shape[:k])
        if size and size in prefixes:
            j = prefixes.index(size) + 1
            ex = rows.example.reshape(*rows.example.shape, *([1] * (k - m)))
            ex = ex.expand(x.shape[:k]).reshape(out.shape[:j])
            return _from_full(ex.reshape(*ex.shape, *([1] * (out.dim() - j))), out, rows.by_data)
    return None


@_nd_rule(aten.transpose, aten.permute, aten.t)
def _permuted(func: Any, args: tuple, kwargs: dict, out: Tensor, i: int, rows_of: RowsOf):
    """The map's dims moved as the operator moves the input's."""
    got = _first(args, rows_of)
    if got is None:
        return None
    x, rows = got
    nd = x.dim()
    name = func.overloadpacket.__name__
    perm = list(range(nd))
    if name == "permute":
        perm = [d % nd for d in args[1]]
    elif name == "transpose" or nd == 2:  # transpose(a, b), or t of a matrix
        a, b = (args[1] % nd, args[2] % nd) if name == "transpose" else (0, 1)
        perm[a], perm[b] = perm[b], perm[a]
    return _from_full(_full(rows, x).permute(perm), out, rows.by_data)


@_nd_rule(aten.select)
def _selected(func: Any, args: tuple, kwargs: dict, out: Tensor, i: int, rows_of: RowsOf):
    """One index of a dim taken: the map at that index."""
    got = _first(args, rows_of)
    if got is None:
        return None
    x, rows = got
    full = _full(rows, x)
    d = args[1] % x.dim()
    return _from_full(
        full.select(d, args[2] % x.shape[d] if full.shape[d] > 1 else 0), out, rows.by_data
    )


@_nd_rule(
    aten.sum, aten.mean, aten.amax, aten.amin, aten.prod, aten.any, aten.all, aten.logsumexp,
    aten.var, aten.std, aten.argmax, aten.argmin,
)  # fmt: skip
def _reduced(func: Any, args: tuple, kwargs: dict, out: Tensor, i: int, rows_of: RowsOf):
    """A reduction over some dims: the map kept where it does not change along them (the mean
    over the L of a sequence-first (L, N, E) tensor), else not followed."""
    got = _first(args, rows_of)
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if got is None or dims is None or isinstance(dims, bool) or dims == []:
        return None  # every dim reduced
    x, rows = got
    dims = sorted({d % x.dim() for d in ([dims] if isinstance(dims, int) else dims)})
    full = _full(rows, x)
    for d in dims:
        if full.shape[d] > 1:
            if not torch.equal(full, full.narrow(d, 0, 1).expand(full.shape)):
                return None  # the reduction mixes examples
            full = full.narrow(d, 0, 1)
    if out.dim() < x.dim():
        full = full.squeeze(tuple(dims))
    return _from_full(full, out, rows.by_data)
