"""The streamed sums of a least-squares repair (``Sums``, ``CrossSums``) and its solutions a
block of output columns at a time (``Solution``).

With ``k`` kept input features (kept channels x kernel size for a conv, +1 for the bias), a
pass streams ``X^T X`` (k x k) and ``X^T Y`` (k x kept outputs) over the batches, each batch's
products in float32 (or float64 for a float64 layer; a bf16 / fp16 layer's rows are widened
first, one batch at a time: half-precision sums of thousands of rows lose the fit or overflow),
``X^T X`` summed in float64 (memory ``8 k^2`` bytes) and ``X^T Y`` in the products' dtype
(the sum of a few dozen float32 products rounds no worse than each product already does),
separately for the fitting rows and the held-out rows (``Sums``).

When the targets are the layer's own outputs of its dense inputs ``X_d`` (``Y = X_d W^T``, an
LM head's), ``X^T Y = (X^T X_d) W^T``: ``CrossSums`` holds the cross-Gram ``X^T X_d`` (k x
dense inputs) and makes ``X^T Y`` a block of columns at a time from the weight. An LM head's
``X^T Y`` is the width times the vocabulary (250 MiB in float32 at a 1B Llama's 2048 x
32000, for each of the fitting and held-out sums), its cross-Gram the width squared (32 MiB
in float64).

Memory: a solution, its errors and its write into the weight are computed a block of output
columns at a time (``Solution``, ``BLOCK_ELEMENTS``), from one factorisation of the system, so
no (features x outputs) float64 tensor is held: an output layer's is the width times the
vocabulary, twice its float32 weight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "BLOCK_ELEMENTS",
    "CrossSums",
    "DenseRows",
    "Gram",
    "Solution",
    "Sums",
    "column_blocks",
    "finite_rows",
    "row_squares",
    "widened",
]

#: the most float64 elements of one block of output columns (8 MiB) that the sums' products,
#: a solution and its errors are computed in (at least one column)
BLOCK_ELEMENTS = 2**20


def column_blocks(features: int, outputs: int) -> list[slice]:
    """``outputs`` columns in consecutive slices of at most ``BLOCK_ELEMENTS`` elements of
    ``features`` rows each (at least one column a slice)."""
    step = max(1, BLOCK_ELEMENTS // max(features, 1))
    return [slice(i, min(i + step, outputs)) for i in range(0, outputs, step)]


class Solution:
    """A fit's (features, outputs) coefficients, never held whole: ``columns(block)`` gives
    the float64 columns of one slice of the outputs.

    Args:
        columns: the coefficients of a slice of the output columns, (features, len(slice)).
        features: the rows of the coefficients.
        outputs: the columns of the coefficients.
    """

    def __init__(self, columns: Callable[[slice], Tensor], features: int, outputs: int) -> None:
        self.columns, self.features, self.outputs = columns, features, outputs

    @classmethod
    def of(cls, coef: Tensor) -> Solution:
        """A solution held whole already, (features, outputs)."""
        return cls(lambda block: coef[:, block], coef.shape[0], coef.shape[1])

    def blocks(self) -> Iterator[tuple[slice, Tensor]]:
        """Each slice of the output columns with its coefficients, one at a time."""
        for block in column_blocks(self.features, self.outputs):
            yield block, self.columns(block)


class Gram:
    """``X^T X``, ``Y^T Y`` and the row count of a least-squares problem, streamed, and its
    error from them and ``rhs`` (``X^T Y``'s columns, given by the subclass)."""

    def __init__(self) -> None:
        self.xtx = torch.empty(0, dtype=torch.float64)
        self.yty = 0.0
        self.count = 0

    def rhs(self, block: slice) -> Tensor:
        """Columns ``block`` of ``X^T Y`` in float64."""
        raise NotImplementedError

    def _add_gram(self, x: Tensor) -> None:
        """Add the rows ``x`` (rows, features; float32 or float64) to ``X^T X`` (made at the
        first rows, summed in float64) and to the row count."""
        if self.count == 0:
            self.xtx = x.new_zeros(x.shape[1], x.shape[1], dtype=torch.float64)
        self.xtx += (x.T @ x).double()
        self.count += x.shape[0]

    def error(self, coef: Solution) -> float:
        """``||Y - X coef||^2 / ||Y||^2``, a block of ``coef``'s columns at a time."""
        sq = self.yty
        for block, c in coef.blocks():
            sq += float((c * (self.xtx @ c - 2 * self.rhs(block))).sum())
        return max(sq, 0.0) / max(self.yty, 1e-300)


class Sums(Gram):
    """``X^T X``, ``X^T Y``, ``Y^T Y`` and the row count of a least-squares problem, streamed:
    each batch's products in float32 at least (half-precision rows widened), summed in float64
    but ``X^T Y`` (``rhs`` reads it in float64), summed in the products' dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.xty = torch.empty(0, dtype=torch.float64)

    def add(self, x: Tensor, y: Tensor) -> None:
        """Add the rows ``x`` (rows, features) with targets ``y`` (rows, outputs); ``X^T Y``
        and ``Y^T Y`` a block of output columns at a time (``column_blocks``)."""
        # float64 matmuls are several times slower on CPU: one batch's in float32 (or float64)
        x, y = widened(x), widened(y)
        if self.count == 0:
            self.xty = x.new_zeros(x.shape[1], y.shape[1])  # (the products' dtype)
        self._add_gram(x)
        for block in column_blocks(max(x.shape), y.shape[1]):  # (rows or features) x block
            self.xty[:, block] += x.T @ y[:, block]
            self.yty += float(y[:, block].double().square().sum())

    def rhs(self, block: slice) -> Tensor:
        """Columns ``block`` of ``X^T Y`` in float64."""
        return self.xty[:, block].double()


class CrossSums(Gram):
    """The sums of a problem whose targets are a linear layer's own outputs of other rows,
    ``Y = X_d W^T`` (``X_d``: its dense inputs, with a ones column when it has a bias, which
    ``W`` then holds): ``X^T Y = (X^T X_d) W^T`` is read a block of columns at a time
    (``rhs``) from the cross-Gram ``X^T X_d`` (features x dense features, summed in float64)
    and the weight, so no (features x outputs) matrix is held: an LM head's outputs are the
    vocabulary, its dense features the width. ``Y^T Y`` is summed from each row's sum of
    squares, given with the rows.

    Args:
        weight: ``W^T``'s columns of a slice of the outputs, (dense features, len(slice)) in
            float64, as the layer holds them when ``rhs`` reads them: the fit is solved
            before the weight changes.
    """

    def __init__(self, weight: Callable[[slice], Tensor]) -> None:
        super().__init__()
        self.weight = weight
        self.cross = torch.empty(0, dtype=torch.float64)

    def add_dense(self, x: Tensor, dense: Tensor, squares: Tensor) -> None:
        """Add the rows ``x`` (rows, features) whose targets are the layer's outputs of the
        rows ``dense`` (rows, dense features), with those targets' sums of squares
        ``squares`` (rows,)."""
        x, dense = widened(x), widened(dense)
        if self.count == 0:
            self.cross = x.new_zeros(x.shape[1], dense.shape[1], dtype=torch.float64)
        self._add_gram(x)
        self.cross += (x.T @ dense).double()
        self.yty += float(squares.sum())

    def rhs(self, block: slice) -> Tensor:
        """Columns ``block`` of ``X^T Y`` in float64, made from the weight's columns."""
        return self.cross @ self.weight(block)


def finite_rows(t: Tensor) -> Tensor:
    """Which rows of ``t`` (rows, columns) hold no NaN or inf. A row whose sum is finite holds
    none, so only the rows whose sum is not (one holding them, or a sum that overflowed) are
    checked element by element: finite data make no temporary of ``t``'s size (``isfinite``
    makes four, a float and three booleans: 55 MiB for an LM head's 256 x 32000 targets)."""
    finite = t.sum(1).isfinite()
    suspect = finite.logical_not().nonzero().squeeze(1)
    if suspect.numel():
        finite[suspect] = t[suspect].isfinite().all(1)
    return finite


def row_squares(y: Tensor, columns: Tensor | None) -> Tensor:
    """Each row's sum of squares of ``y`` (..., outputs) over ``columns`` (None: all), in
    float64, (..., 1): a block of columns widened at a time."""
    flat = y.reshape(-1, y.shape[-1])
    total = flat.new_zeros(flat.shape[0], dtype=torch.float64)
    n = y.shape[-1] if columns is None else columns.numel()
    for block in column_blocks(flat.shape[0], n):
        part = flat[:, block] if columns is None else flat[:, columns[block]]
        total += part.double().square().sum(1)
    return total.view(*y.shape[:-1], 1)


class DenseRows(NamedTuple):
    """What ``CrossSums`` fits one call's rows to, kept in place of the dense output: the
    dense call's input rows on every feature (with a ones column for the bias) and each row's
    sum of squares of the fitted outputs, (rows, 1) in float64."""

    inputs: Tensor
    squares: Tensor


def widened(t: Tensor) -> Tensor:
    """``t`` in float32 unless it is float32 or float64 already."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()
