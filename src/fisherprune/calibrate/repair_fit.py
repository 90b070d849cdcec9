"""One layer's least-squares repair: its sums over the passes and the solve (``LayerFit``).

With ``k`` kept input features (kept channels x kernel size for a conv, +1 for the bias), a
pass streams ``X^T X`` (k x k) and ``X^T Y`` (k x kept outputs) over the batches, for the
fitting rows and the held-out rows (``calibrate.repair_sums``: an LM head's ``X^T Y`` is read
off a cross-Gram instead). Then, from those sums alone, by
``torch.linalg.solve`` in float64 with ``lambda = ridge * mean diagonal`` pulling towards the
unrepaired layer rather than towards 0:

* ``"weights"``, with at least ``rows_per_weight`` rows per feature: every kept weight and
  the bias, ``(X^T X + lambda I) W = X^T Y + lambda W_0``: a k x k system with ``outputs``
  right-hand sides;
* ``"scales"``, else: one scale per kept input channel and the bias (Kwon et al. 2022's mask
  tuning), a (kept channels) x (kept channels) system pulled towards scales of 1.

The ridge: a given value, or (``ridge=None``) the value of ``RIDGES`` whose solution has the
least error on the held-out rows, as ordinary cross-validation picks it (one solve per value,
and the chosen one's again rather than every solution kept: an output layer's is the width
times the vocabulary; no more data). On MiniLM a fixed small ridge overfits the calibration
text: the held-out rows choose 0.1-1, and the embeddings of other text come out closer to the
dense ones.

Memory: a solution, its errors and its write into the weight are computed a block of output
columns at a time (``repair_sums.Solution``), from one factorisation of the system.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from fisherprune.calibrate.repair_residual import ResidualWatch
from fisherprune.calibrate.repair_rows import linear_rows, out_in_weight, rows_reader
from fisherprune.calibrate.repair_sums import (
    CrossSums,
    DenseRows,
    Gram,
    Solution,
    Sums,
    finite_rows,
    row_squares,
    widened,
)

__all__ = ["RIDGES", "LayerFit", "factor_in_place"]

#: the ridge values ``ridge=None`` chooses from, by the held-out rows' error
RIDGES = (1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)
#: ``ridge=None`` gives up at most this share of the best held-out gain for a larger ridge
GAIN_SLACK = 0.1


class LayerFit:
    """The streamed sums of one layer's least-squares problem."""

    def __init__(self, mod: nn.Module, kept: Tensor, dim: int, positions: int) -> None:
        self.mod, self.kept, self.dim, self.positions = mod, kept, dim, positions
        self.generator = torch.Generator().manual_seed(0)  # its own stream: global RNG untouched
        #: why the layer turned out not to be fittable during the pass (None: it is)
        self.invalid: str | None = None
        reader = rows_reader(mod)
        if reader is None:
            raise TypeError(f"{type(mod).__name__} has no least-squares repair")
        self.rows = reader
        #: the current batch's token mask (``linear_rows``), or None
        self.tokens: Tensor | None = None
        self.kernel = int(out_in_weight(mod)[0, 0].numel())
        self.features = kept.numel() * self.kernel + (mod.bias is not None)
        # filled by the stage's pass and released by the solve: one stage's sums at a time
        self.sums, self.held_sums = Sums(), Sums()
        #: rows go to ``held_sums`` (the held-out batches' rows, for choosing the ridge)
        self.held = False
        #: fit on the dense pass's own inputs (the one-pass repair)
        self.dense_inputs = False
        #: dense outputs (``DenseRows`` with ``CrossSums``) of the current batch's calls,
        #: waiting for the pruned pass's inputs
        self.targets: list[Tensor | DenseRows] = []
        #: the forward running is the pruned model's
        self.pruned = False
        #: indices of the outputs the pruned model keeps (None: all): the others are removed
        #: downstream, so they are neither fitted nor changed
        self.outputs: Tensor | None = None
        #: its output is added straight to a residual stream (``repair_residual``): the target
        #: is then the dense sum less the pruned residual
        self.residual = False
        #: the watch of the current forward reporting that residual (None: not watched)
        self.watch: ResidualWatch | None = None
        #: this forward's calls still waiting for their residual: dense outputs (dense pass)
        #: or inputs (pruned pass)
        self.pending: list[Tensor] = []
        #: rows left out of the sums for holding NaN or inf (input or target)
        self.nonfinite = 0

    def hook(self, mod: nn.Module, args: tuple, out: Tensor) -> None:
        """Forward hook. Dense pass: keep this call's output as a target (with
        ``dense_inputs``, fit it on this call's input at once). Pruned pass (``pruned``): fit
        the dense target of the same call on this call's input. Watched for a residual: the
        output (dense) or the input (pruned) waits for ``residual_seen``."""
        x = args[0].detach()
        if self.dense_inputs:
            self.add(x, self._target(x, out))
        elif self.watch is not None:
            self.pending.append(x if self.pruned else out.detach())
            self.watch.watch(self, out)
        elif not self.pruned:
            self.targets.append(self._target(x, out))
        elif self.targets:
            self.add(x, self.targets.pop(0))
        else:
            self.invalid = "the pruned model calls it more often than the dense one"

    def residual_seen(self, r: Tensor) -> None:
        """The residual ``r`` the oldest waiting call's output is added to. Dense pass: the
        target becomes the dense sum ``o_d + r_d``; pruned pass: that sum less ``r`` (the
        pruned residual) is fitted on the waiting input, so that ``o + r`` matches the dense
        sum."""
        r = widened(r.detach())  # in half precision the difference would cancel to rounding
        if not self.pending:
            return
        if not self.pruned:
            self.targets.append(widened(self.pending.pop(0)) + r)
        elif self.targets:
            self.add(self.pending.pop(0), self.targets.pop(0) - r)
        else:
            self.invalid = "the pruned model calls it more often than the dense one"

    def end_forward(self) -> None:
        """After each forward: a call still waiting for its residual means the add was not
        seen in this model (the layer is then left as it is)."""
        if self.pending:
            self.invalid = "its output was not added to the same residual in every call"
            self.pending.clear()

    def cross_if_smaller(self) -> None:
        """Fit on ``CrossSums`` (``X^T Y`` read off the cross-Gram of the inputs and the dense
        inputs, and the weight) when the target is the layer's own dense output (an
        ``nn.Linear``'s forward, not added to a residual) and that cross-Gram (features x
        dense inputs, float64) is smaller than ``X^T Y`` (features x fitted outputs, float32):
        an LM head's. Changes ``sums`` and ``held_sums``: call before the pass, after
        ``residual`` and ``outputs`` are set."""
        dense = out_in_weight(self.mod).shape[1] + (self.mod.bias is not None)
        linear = type(self.mod).forward is nn.Linear.forward
        if linear and not self.residual and 2 * dense < self.out_rows.numel():
            self.sums = CrossSums(self.dense_columns)
            self.held_sums = CrossSums(self.dense_columns)

    def _target(self, x: Tensor, out: Tensor) -> Tensor | DenseRows:
        """What this dense call's rows are fitted to: its output, or with ``CrossSums`` its
        input's rows (``DenseRows``; an LM head's are the width, its outputs the vocabulary)."""
        if not isinstance(self.sums, CrossSums):
            return out.detach()
        every = torch.arange(x.shape[-1], device=x.device)
        squares = row_squares(out.detach(), self.outputs)
        inputs, squares = self.rows(self.mod, x, squares, every, self.sample, self.tokens)
        return DenseRows(self._with_ones(inputs), squares)

    def _with_ones(self, x: Tensor) -> Tensor:
        """Rows ``x`` with a ones column when the layer has a bias (its feature)."""
        return x if self.mod.bias is None else torch.cat([x, x.new_ones(x.shape[0], 1)], 1)

    def add(self, x: Tensor, y: Tensor | DenseRows) -> None:
        """Add one call's rows (input ``x``, target output ``y``, or the dense call's
        ``DenseRows`` with ``CrossSums``) to the sums; rows holding NaN or inf are left out
        and counted in ``nonfinite``."""
        if self.rows is linear_rows and self.dim != x.dim() - 1:
            self.invalid = "the mask is not on the features (last) dim"
        if self.invalid is not None:
            return
        if isinstance(y, DenseRows):  # its rows were read in the dense pass: x's alone here
            x = self.rows(self.mod, x, x[..., :1], self.kept, self.sample, self.tokens)[0]
            targets = list(y)
        else:
            # x: the pruned call's input, y: the dense call's output; a linear layer's rows are
            # all its dims but the features, a convolution's its examples
            lead = -1 if self.rows is linear_rows else 1
            if x.shape[:lead] != y.shape[:lead]:
                self.invalid = (
                    "its calls in the pruned forward read other rows than in the dense one "
                    "(rows routed by data: an expert's tokens change when channels go), so "
                    "no dense target matches them row by row"
                )
                return
            x, y = self.rows(self.mod, x, y, self.kept, self.sample, self.tokens)
            targets = [y if self.outputs is None else y[:, self.outputs]]
        x = self._with_ones(x)
        finite = finite_rows(x)
        for t in targets:
            finite &= finite_rows(t)
        if not bool(finite.all()):  # one NaN would make every sum NaN: its rows are left out
            self.nonfinite += int(finite.logical_not().sum())
            x, targets = x[finite], [t[finite] for t in targets]
        sums = self.held_sums if self.held else self.sums
        (sums.add_dense if isinstance(sums, CrossSums) else sums.add)(x, *targets)

    @property
    def count(self) -> int:
        """Fitting rows seen."""
        return self.sums.count

    def sample(self, n: int) -> Tensor:
        """``positions`` of ``n`` output positions, at random without replacement."""
        return torch.randperm(n, generator=self.generator)[: self.positions]

    @property
    def out_rows(self) -> Tensor:
        """The indices of the weight's output rows the fit solves for, in its column order."""
        w = out_in_weight(self.mod)
        return torch.arange(w.shape[0], device=w.device) if self.outputs is None else self.outputs

    def current_columns(self, block: slice) -> Tensor:
        """The layer's weights of the fit's output columns ``block`` as its unknowns:
        (features, len(block)) in float64. Only these rows' kept columns are widened."""
        return self._columns(block, self.kept)

    def dense_columns(self, block: slice) -> Tensor:
        """The layer's weights of the fit's output columns ``block`` on every input (and the
        bias): (dense inputs, len(block)) in float64, as ``CrossSums`` reads them."""
        return self._columns(block, None)

    def _columns(self, block: slice, inputs: Tensor | None) -> Tensor:
        rows = self.out_rows[block]
        w = out_in_weight(self.mod).detach()
        w = w[rows] if inputs is None else w[rows[:, None], inputs]
        cols = w.reshape(rows.numel(), -1).double()
        if self.mod.bias is not None:
            cols = torch.cat([cols, self.mod.bias.detach()[rows].double()[:, None]], 1)
        return cols.T

    def current(self) -> Solution:
        """The layer's weights as the fit's unknowns, (features, out), read a block of output
        columns at a time (``current_columns``): never the whole weight in float64 (an output
        layer's is the vocabulary times the width)."""
        return Solution(self.current_columns, self.features, self.out_rows.numel())

    def _solve(
        self, a: Tensor, b: Solution, ridge: float, prior: Solution, *, own: bool = False
    ) -> Solution:
        """``(a + lambda I)^-1 (b + lambda prior)`` with ``lambda = ridge * mean diagonal of
        a``: the least-squares solution pulled towards ``prior`` (the unrepaired layer). ``a``
        is factorised once here; each block of columns is solved when it is read. Memory: the
        ridge goes onto ``a``'s diagonal in place when the caller gives ``a`` up (``own``),
        else onto one copy, and that square is factorised over itself (``factor_in_place``),
        so one (features)^2 float64 square is held, not the system and its factors (204 MiB
        each for the 5175 kept inputs of a 1B Llama's first down_proj); a singular system
        (a dead input with ridge 0) is made again for its minimum-norm solution."""
        lam = ridge * float(torch.diagonal(a).mean())
        work = a if own else a.clone()
        work.diagonal().add_(lam)
        lu, pivots, info = factor_in_place(work)
        system = None
        if int(info) != 0:  # a dead input with ridge 0: the minimum-norm solution
            system = _system_again(a, work, lu, pivots, lam, own)
        del work

        def columns(block: slice) -> Tensor:
            rhs = b.columns(block) + lam * prior.columns(block)
            if system is not None:
                dev = system.device
                return torch.linalg.lstsq(system.cpu(), rhs.cpu(), driver="gelsd").solution.to(dev)
            return torch.linalg.lu_solve(lu, pivots, rhs)

        return Solution(columns, prior.features, prior.outputs)

    def weights_coef(self, ridge: float) -> Solution:
        """Every kept weight (and the bias) refitted: (features, out)."""
        sums = self.sums
        b = Solution(sums.rhs, self.features, self.out_rows.numel())
        return self._solve(sums.xtx, b, ridge, self.current())

    def scales_coef(self, ridge: float) -> Solution:
        """One scale per kept input channel (all its kernel taps) times the current weights,
        and the bias refitted (Kwon et al.'s mask tuning): (features, out). With ``Z_c`` the
        output contribution of channel c, ``Z_c^T Z_d`` is read off the streamed sums as the
        block sums of ``X^T X * (W^T W)`` over the taps, so no more data is needed; ``W W^T``
        and the right-hand side are summed a block of output columns at a time."""
        k, taps = self.kept.numel(), self.kernel
        n_w = k * taps
        sums, now, bias = self.sums, self.current(), self.mod.bias is not None
        xtx = sums.xtx[:n_w, :n_w]
        n = mu = None
        if bias:  # centre: the bias absorbs the means
            n = sums.xtx[n_w, n_w]
            mu = sums.xtx[:n_w, n_w] / n
            xtx = xtx - torch.outer(mu, mu).mul_(n)
        wwt, rhs = torch.zeros_like(xtx), xtx.new_zeros(n_w)
        for block, c in now.blocks():
            w, xty = c[:n_w], sums.rhs(block)
            if bias:
                xty = xty[:n_w] - torch.outer(mu, xty[n_w])  # n * outer(mu, nu)
            wwt.addmm_(w, w.T)  # no square of the block beside it
            rhs += (xty * w).sum(1)
        # one (n_w, n_w) float64 square at a time: the product made in ``wwt``'s place, the centred
        # copy let go, and the system given up to ``_solve`` for its ridge
        gram = wwt.mul_(xtx)
        del wwt, xtx
        if taps > 1:
            gram = gram.view(k, taps, k, taps).sum((1, 3))  # (k, k)
        rhs = rhs.view(k, taps).sum(1)[:, None]  # (k, 1)
        ones = Solution.of(torch.ones_like(rhs))
        scale = self._solve(gram, Solution.of(rhs), ridge, ones, own=True).columns(slice(None))
        scale = scale.repeat_interleave(taps, 0)  # (n_w, 1)

        def columns(block: slice) -> Tensor:
            coef = now.columns(block)[:n_w] * scale
            if bias:
                coef = torch.cat([coef, (sums.rhs(block)[n_w] / n - coef.T @ mu)[None]])
            return coef

        return Solution(columns, self.features, now.outputs)

    def solve_and_set(
        self, ridge: float | None, rows_per_weight: float
    ) -> tuple[str, float, float, float]:
        """Refit the kept weights and bias (``"weights"``) when the pass saw at least
        ``rows_per_weight`` rows per feature, else one scale per kept channel (``"scales"``:
        ``k`` unknowns, which a small calibration set cannot overfit as it can ``k x out``);
        zero the removed columns. ``ridge=None``: the value of ``RIDGES`` with the least
        held-out error (with no held-out rows, 0.1). Returns the mode, the relative errors on
        the fitting rows before and after, and the ridge. Changes the module's ``weight`` (and
        ``bias``) in place, a block of output rows at a time, unless the fit is no better on
        the fitting rows, or on the held-out rows when there are any; releases the sums."""
        full = self.count >= rows_per_weight * self.features
        solve = self.weights_coef if full else self.scales_coef
        mode = "weights" if full else "scales"
        held = self.held_sums if self.held_sums.count else None
        now = self.current()
        if ridge is None and held is not None:
            ridge, coef = _conservative(solve, held, held.error(now))
        else:
            ridge = 0.1 if ridge is None else ridge
            coef = solve(ridge)
        before, after = self.sums.error(now), self.sums.error(coef)
        worse = not after < before or (held is not None and not held.error(coef) < held.error(now))
        self.sums, self.held_sums = Sums(), Sums()
        if worse:  # a ridge fit loses only on nearly singular data or out of sample
            return mode, before, before, ridge
        w, bias = out_in_weight(self.mod), self.mod.bias
        n_w, rows = self.kept.numel() * self.kernel, self.out_rows
        with torch.no_grad():
            # each block's columns read only its own rows of the weight (every column of them
            # with ``CrossSums``), written after
            for block, c in coef.blocks():
                new = c[:n_w].T.reshape(rows[block].numel(), self.kept.numel(), *w.shape[2:])
                w[rows[block][:, None], self.kept] = new.to(w.dtype)
                if bias is not None:
                    bias[rows[block]] = c[n_w].to(bias.dtype)
            removed = torch.ones(w.shape[1], dtype=torch.bool, device=w.device)
            removed[self.kept] = False
            w[:, removed] = 0  # removed columns stay zero, as the mask has them
        return mode, before, after, ridge


def _conservative(
    solve: Callable[[float], Solution], held: Gram, unrepaired: float
) -> tuple[float, Solution]:
    """The largest ridge of ``RIDGES`` (the fit closest to the unrepaired layer) whose held-out
    error keeps ``1 - GAIN_SLACK`` of the best ridge's gain over ``unrepaired``, and its fit:
    the one-standard-error rule of cross-validation in spirit, since a layer's held-out rows
    come from the calibration text while the model meets other text, where the fit's
    compensation for removed channels transfers less well the further it moves the weights."""
    errors = [held.error(solve(r)) for r in RIDGES]  # one block of one solution at a time
    best = min(errors)
    bar = best + GAIN_SLACK * max(unrepaired - best, 0.0)
    ridge = max(r for r, e in zip(RIDGES, errors, strict=True) if e <= bar)
    return ridge, solve(ridge)  # solved again rather than six (features x outputs) kept


def factor_in_place(a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.linalg.lu_factor_ex`` of the symmetric square ``a`` (row-major), its factors
    written over it: LAPACK factorises a column-major matrix in place, and ``a``'s transpose
    is that layout of the same memory and the same matrix (to the rounding by which a
    computed Gram is not exactly symmetric). A backend that refuses an ``out`` aliasing the
    input gets the factors made apart. Returns ``(LU, pivots, info)``."""
    col = a.mT
    pivots = torch.empty(a.shape[0], dtype=torch.int32, device=a.device)
    info = torch.empty((), dtype=torch.int32, device=a.device)
    try:
        return torch.linalg.lu_factor_ex(col, out=(col, pivots, info))
    except RuntimeError:  # the factors apart
        return torch.linalg.lu_factor_ex(col)


def _system_again(
    a: Tensor, work: Tensor, lu: Tensor, pivots: Tensor, lam: float, own: bool
) -> Tensor:
    """The ridged system ``a + lam I`` that ``work`` held before it was factorised: ``work``
    itself where the factorisation did not happen in place, else made from ``a`` where the
    caller kept it, else multiplied back from the factors (``P L U``, to rounding)."""
    if lu.untyped_storage().data_ptr() != work.untyped_storage().data_ptr():
        return work
    if not own:
        system = a.clone()
        system.diagonal().add_(lam)
        return system
    p, lower, upper = torch.lu_unpack(lu, pivots)
    return (p @ (lower @ upper)).mT  # the factors are the transpose's
