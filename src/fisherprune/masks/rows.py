"""Which example each row of a tensor belongs to: row maps and their per-operator rules.

The per-example Fisher signal sums a mask's gradient over every position of one example
before squaring it (``fisherprune.masks.layer``). Where dim 0 of a mask's input is the batch,
row ``n`` is example ``n``; but a model may flatten its tokens first (``x.view(-1, H)`` before a
``Linear``, as Hugging Face mixture-of-experts blocks do: dim 0 is then N*L, example ``n``
owning rows ``n*L .. (n+1)*L - 1``), or select and reorder rows by data (``hidden[token_idx]``,
rows sorted by expert for a grouped matrix product), where the example of a row is known only
from the index that picked it.

A *row map* holds, for each index of dim 0 of a tensor, the example it belongs to (a long
tensor), and whether an index computed from data picked the rows. Maps flow from the model
inputs' batch dim through every operator by a rule registered per operator (the default:
an output whose dim 0 has the size of an input's with a map keeps that map); the tracer follows
them to say how each mask point's rows relate to examples (``RowLayout``), and, at run time,
``fisherprune.masks.row_tracker`` follows them inside the modules that select rows by data.
Rules compute on the maps' own device and never read a value back to the host.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from fisherprune.op_tables import enter_rule

__all__ = [
    "RowLayout",
    "Rows",
    "batch_dim",
    "classify_rows",
    "register_row_rule",
    "rows_after",
]

aten = torch.ops.aten


@dataclass(frozen=True)
class Rows:
    """The example of each row of a tensor (``example``, long, shape (rows,)) and whether an
    index computed from data chose the rows (``by_data``). The tracer also follows maps over
    several leading dims (``example`` of shape (d0, ..., dk): the example of each index of the
    tensor's first k+1 dims; ``fisherprune.masks.rows_nd``); the rules here see 1-dim maps."""

    example: Tensor
    by_data: bool = False


#: how the rows of a mask point's input relate to the examples of the batch
BATCH = "batch"  # row n is example n
TOKENS = "tokens"  # example n owns the n-th of N equal runs of consecutive rows
SELECTED = "selected"  # rows chosen or reordered by data: the map is followed at run time
UNKNOWN = "unknown"  # not known: each row is taken for one example (an approximate signal)
PACKED = "packed"  # the data of a PackedSequence: the map is read off it at run time
KINDS = (BATCH, TOKENS, SELECTED, UNKNOWN, PACKED)


@dataclass(frozen=True)
class RowLayout:
    """How the rows (dim 0) of one mask point's input relate to examples.

    ``kind``: one of ``"batch"``, ``"tokens"``, ``"selected"``, ``"unknown"`` (see above).
    ``scope``: for ``"selected"``, the module whose forward the run-time tracker follows the
    row maps in (its positional inputs have ``"batch"`` or ``"tokens"`` rows), else None.
    ``scope_args``: the layout (``"batch"`` or ``"tokens"``) of each of the scope's positional
    inputs the tracker starts from, by position.
    ``dim``: for ``"batch"``, the dim of the input that holds the batch (1 for PyTorch's
    sequence-first (L, N, E) tensors), else 0.
    """

    kind: str = BATCH
    scope: str | None = None
    scope_args: tuple[tuple[int, str], ...] = ()
    dim: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"RowLayout kind must be one of {KINDS}, got {self.kind!r}")
        if self.dim < 0 or (self.dim and self.kind != BATCH):
            raise ValueError(
                f"RowLayout dim must be 0, or a positive dim for kind 'batch'; got dim="
                f"{self.dim} with kind {self.kind!r}"
            )


def classify_rows(rows: Rows | None, batch: int) -> str:
    """The layout kind of a tensor whose dim 0 carries ``rows``, traced with ``batch``
    examples: ``"selected"`` when data chose the rows, ``"batch"`` / ``"tokens"`` when the map
    is 0, 1, ... N-1 / N runs of equal length in order, else ``"unknown"``."""
    if rows is None or rows.example.dim() != 1:
        return UNKNOWN
    if rows.by_data:
        return SELECTED
    ex = rows.example
    n = ex.numel()
    if batch < 1 or n % batch or ex.device.type == "meta":
        return BATCH if n == batch else UNKNOWN
    expected = torch.arange(batch).repeat_interleave(n // batch)
    if not torch.equal(ex.cpu(), expected):
        return UNKNOWN
    return BATCH if n == batch else TOKENS


def batch_dim(rows: Rows | None, batch: int) -> int | None:
    """The dim k > 0 that holds the batch of a tensor whose first k+1 dims carry ``rows``
    (traced with ``batch`` examples): example n is index n of dim k, whatever the indices of
    the dims before it (a sequence-first (L, N, E) tensor: k = 1); None for any other map."""
    if rows is None or rows.by_data or rows.example.dim() < 2:
        return None
    ex = rows.example
    if ex.shape[-1] != batch or ex.device.type == "meta":
        return None
    return ex.dim() - 1 if torch.equal(ex.cpu(), torch.arange(batch).expand(ex.shape)) else None


# ------------------------------------------------------------------ rules
RowsOf = Callable[[Any], "Rows | None"]
#: a rule: (operator, args, kwargs, the output tensor, its position among the outputs, the row
#: map of an input tensor or None) -> the output's row map or None
RowRule = Callable[[Any, tuple, dict, Tensor, int, RowsOf], "Rows | None"]
_RULES: dict[Any, RowRule] = {}


def register_row_rule(*ops: Any) -> Callable[[RowRule], RowRule]:
    """Register ``fn`` as the row rule of each operator packet in ``ops``.

    Raises:
        ValueError: an operator already has a row rule.
        TypeError: a key is not an operator.
    """

    return functools.partial(add_rule, _RULES, ops)


def add_rule(table: dict[Any, RowRule], ops: tuple[Any, ...], fn: RowRule) -> RowRule:
    """Enter ``fn`` in ``table`` under each operator packet of ``ops`` (see
    ``register_row_rule``, whose errors it raises)."""
    return enter_rule(table, ops, fn, "row")


def rows_after(
    func: Any,
    args: tuple,
    kwargs: dict,
    outs: Sequence[Tensor],
    rows_of: RowsOf,
    inputs: Sequence[Any] | None = None,
) -> list[Rows | None]:
    """The row map of each output tensor of one operator call (None: rows not followed).
    ``inputs``: ``(args, kwargs)`` flattened, when the caller has it (the default rule then
    does not flatten them again for each output)."""
    rule = _RULES.get(getattr(func, "overloadpacket", None))
    if rule is None:
        flat = tree_flatten((args, kwargs))[0] if inputs is None else inputs
        return [first_rows(flat, o, rows_of) for o in outs]
    return [rule(func, args, kwargs, o, i, rows_of) for i, o in enumerate(outs)]


def same_rows(
    _func: Any, args: tuple, kwargs: dict, out: Tensor, _i: int, rows_of: RowsOf
) -> Rows | None:
    """The default rule: ``first_rows`` of the call's inputs."""
    return first_rows(tree_flatten((args, kwargs))[0], out, rows_of)


def first_rows(inputs: Sequence[Any], out: Tensor, rows_of: RowsOf) -> Rows | None:
    """The map of the first tensor of ``inputs`` (a call's arguments, flattened) whose dims
    that the map covers (dim 0 for a 1-dim map) have the output's sizes."""
    if out.dim() == 0:
        return None
    for a in inputs:
        if isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == out.shape[0]:
            rows = rows_of(a)
            m = 0 if rows is None else rows.example.dim()
            if rows is not None and out.dim() >= m and a.shape[:m] == out.shape[:m]:
                return rows
    return None


def _dim_arg(args: tuple, kwargs: dict, pos: int, default: Any = 0) -> Any:
    return args[pos] if len(args) > pos else kwargs.get("dim", default)


def _moves_dim0(dims: Any, nd: int) -> bool:
    """Whether ``dims`` (an int, a list of them, or None for all) includes dim 0."""
    if dims is None:
        return True
    dims = [dims] if isinstance(dims, int) else list(dims)
    return not dims or any(d % max(nd, 1) == 0 for d in dims)


@register_row_rule(aten.view, aten._unsafe_view, aten.reshape, aten.flatten, aten.unflatten)
def _view(func: Any, args: tuple, kwargs: dict, out: Tensor, i: int, rows_of: RowsOf):
    """Rows kept, merged with the following dims (each row repeated) or split (a run of rows
    that one example owns becomes one row)."""
    x = args[0]
    rows = rows_of(x) if isinstance(x, Tensor) and x.dim() > 0 else None
    if rows is None or out.dim() == 0:
        return None
    n_in, n_out = x.shape[0], out.shape[0]
    if n_out == n_in:
        return rows
    if (
        n_in
        and n_out % n_in == 0
        and any(math.prod(x.shape[:j]) == n_out for j in range(2, x.dim() + 1))
    ):
        return Rows(rows.example.repeat_interleave(n_out // n_in), rows.by_data)
    if (
        n_out
        and n_in % n_out == 0
        and any(math.prod(out.shape[:j]) == n_in for j in range(2, out.dim() + 1))
    ):
        return Rows(rows.example.view(n_out, n_in // n_out)[:, 0], rows.by_data)
    return None


@register_row_rule(aten.index)
def _index(func: Any, args: tuple, kwargs: dict, out: Tensor, i: int, rows_of: RowsOf):
    """``x[idx]``: row r of the output is row ``idx[r]`` of ``x`` (a bool ``idx`` selects)."""
    x, indices = args[0], list(args[1])
    rows = rows_of(x)
    if rows is None or not indices:
        return None
    first = indices[0]
    if first is None:
        return rows if out.dim() and out.shape[0] == x.shape[0] else None
    if first.dim() != 1 or any(t is not None for t in indices[1:]):
        return None
    return Rows(rows.example[first.to(rows.example.device)], True)


@register_row_rule(aten.index_select)
def _index_select(func: Any, args: tuple, kwargs: dict, out: Tensor, i: int, rows_of: RowsOf):
    x, dim, index = args[0], args[1], args[2]
    rows = rows_of(x)
    if rows is None or dim % x.dim() != 0:
        return same_rows(func, args, kwargs, out, i, rows_of)
    return Rows(rows.example[index.to(rows.example.device)], True)


@register_row_rule(aten.slice)
def _slice(func: Any, args: tuple, kwargs: dict, out: Tensor, i: int, rows_of: RowsOf):
    x = args[0]
    dim = _dim_arg(args, kwargs, 1)
    rows = rows_of(x)
    if rows is None or dim % x.dim() != 0:
        return same_rows(func, args, kwargs, out, i, rows_of)
    start = args[2] if len(args) > 2 and args[2] is not None else 0
    end = args[3] if len(args) > 3 and args[3] is not None else x.shape[0]
    step = args[4] if len(args) > 4 else 1
    return Rows(rows.example[start:end:step], rows.by_data)


@register_row_rule(aten.transpose, aten.permute, aten.t, aten.movedim, aten.select)
def _moves_rows(func: Any, args: tuple, kwargs: dict, out: Tensor, i: int, rows_of: RowsOf):
    """Rows kept only when dim 0 stays where it is."""
    x = args[0]
    nd = max(x.dim(), 1)
    name = func.overloadpacket.__name__
    if name == "t":
        keep = x.dim() < 2
    elif name == "permute":
        keep = args[1][0] % nd == 0
    elif name == "select":
        keep = args[1] % nd != 0
    else:  # transpose, movedim: the two dims given
        a, b = args[1], args[2]
        a, b = (a[0], b[0]) if isinstance(a, (list, tuple)) else (a, b)
        keep = a % nd == b % nd or 0 not in (a % nd, b % nd)
    return same_rows(func, args, kwargs, out, i, rows_of) if keep else None


@register_row_rule(
    aten.sum, aten.mean, aten.amax, aten.amin, aten.prod, aten.any,
    aten.all, aten.logsumexp, aten.var, aten.std, aten.cumsum, aten.cumprod, aten.sort,
    aten.argsort, aten.topk, aten.flip, aten.roll, aten.cat, aten.stack, aten.split,
    aten.split_with_sizes, aten.chunk, aten.unbind, aten.narrow, aten.gather, aten.unsqueeze,
    aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, aten.argmax, aten.argmin,
)  # fmt: skip
def _along_dim(func: Any, args: tuple, kwargs: dict, out: Tensor, i: int, rows_of: RowsOf):
    """Operators along a dim (a reduction, a sort, a split, a concatenation...): rows kept
    unless that dim is dim 0, whose rows they mix, reorder or regroup."""
    x = args[0]
    first = x[0] if isinstance(x, (list, tuple)) and x else x
    if not isinstance(first, Tensor):
        return None
    name = func.overloadpacket.__name__
    pos = {"split": 2, "split_with_sizes": 2, "chunk": 2, "narrow": 1, "gather": 1}.get(name, 1)
    default = -1 if name in ("sort", "argsort", "topk") else 0
    dim = _dim_arg(args, kwargs, 2 if name == "topk" else pos, default)
    if name in ("sum", "mean", "amax", "amin", "any", "all", "prod", "argmax", "argmin") and (
        len(args) < 2 and "dim" not in kwargs
    ):
        dim = None  # a reduction over every dim
    if name in ("var", "std") and not isinstance(dim, (int, list, tuple)):
        dim = None
    if _moves_dim0(dim, first.dim() + (name in ("unsqueeze", "stack"))):
        return None
    return same_rows(func, args, kwargs, out, i, rows_of)


@register_row_rule(aten.nonzero, aten.masked_select, aten.unique_dim, aten._unique2)
def _data_sized(func: Any, args: tuple, kwargs: dict, out: Tensor, i: int, rows_of: RowsOf):
    """Outputs whose dim 0 counts what the data holds: no row of the input."""
    return None
