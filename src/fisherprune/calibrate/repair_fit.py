"""One layer's least-squares repair: the streamed sums and the solve (``LayerFit``).

With ``k`` kept input features (kept channels x kernel size for a conv, +1 for the bias), a
pass streams ``X^T X`` (k x k) and ``X^T Y`` (k x kept outputs) over the batches, each batch's
products in float32 (or float64 for a float64 layer; a bf16 / fp16 layer's rows are widened
first, one batch at a time: half-precision sums of thousands of rows lose the fit or overflow)
and their sum in float64 (memory ``8 k^2`` bytes), separately
for the fitting rows and the held-out rows (``Sums``). Then, from those sums alone, by
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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from fisherprune.calibrate.repair_residual import ResidualWatch
from fisherprune.calibrate.repair_rows import linear_rows, out_in_weight, rows_reader

__all__ = ["RIDGES", "LayerFit", "Sums", "widened"]

#: the ridge values ``ridge=None`` chooses from, by the held-out rows' error
RIDGES = (1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)
#: ``ridge=None`` gives up at most this share of the best held-out gain for a larger ridge
GAIN_SLACK = 0.1


class Sums:
    """``X^T X``, ``X^T Y``, ``Y^T Y`` and the row count of a least-squares problem, streamed:
    each batch's products in float32 at least (half-precision rows widened), their sum in
    float64."""

    def __init__(self) -> None:
        self.xtx = self.xty = torch.empty(0, dtype=torch.float64)
        self.yty = 0.0
        self.count = 0

    def add(self, x: Tensor, y: Tensor) -> None:
        """Add the rows ``x`` (rows, features) with targets ``y`` (rows, outputs)."""
        if self.count == 0:
            self.xtx = x.new_zeros(x.shape[1], x.shape[1], dtype=torch.float64)
            self.xty = x.new_zeros(x.shape[1], y.shape[1], dtype=torch.float64)
        # float64 matmuls are several times slower on CPU: one batch's in float32 (or float64)
        x, y = widened(x), widened(y)
        self.xtx += (x.T @ x).double()
        self.xty += (x.T @ y).double()
        self.yty += float(y.double().square().sum())
        self.count += x.shape[0]

    def error(self, coef: Tensor) -> float:
        """``||Y - X coef||^2 / ||Y||^2``."""
        sq = self.yty - 2 * float((coef * self.xty).sum()) + float((coef * (self.xtx @ coef)).sum())
        return max(sq, 0.0) / max(self.yty, 1e-300)


def widened(t: Tensor) -> Tensor:
    """``t`` in float32 unless it is float32 or float64 already."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


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
        #: dense outputs of the current batch's calls, waiting for the pruned pass's inputs
        self.targets: list[Tensor] = []
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
            self.add(x, out.detach())
        elif self.watch is not None:
            self.pending.append(x if self.pruned else out.detach())
            self.watch.watch(self, out)
        elif not self.pruned:
            self.targets.append(out.detach())
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

    def add(self, x: Tensor, y: Tensor) -> None:
        """Add one call's rows (input ``x``, target output ``y``) to the sums; rows holding
        NaN or inf are left out and counted in ``nonfinite``."""
        if self.rows is linear_rows and self.dim != x.dim() - 1:
            self.invalid = "the mask is not on the features (last) dim"
        if self.invalid is not None:
            return
        x, y = self.rows(self.mod, x, y, self.kept, self.sample, self.tokens)
        if self.outputs is not None:
            y = y[:, self.outputs]
        if self.mod.bias is not None:
            x = torch.cat([x, x.new_ones(x.shape[0], 1)], 1)
        finite = x.isfinite().all(1) & y.isfinite().all(1)
        if not bool(finite.all()):  # one NaN would make every sum NaN: its rows are left out
            self.nonfinite += int(finite.logical_not().sum())
            x, y = x[finite], y[finite]
        (self.held_sums if self.held else self.sums).add(x, y)

    @property
    def count(self) -> int:
        """Fitting rows seen."""
        return self.sums.count

    def sample(self, n: int) -> Tensor:
        """``positions`` of ``n`` output positions, at random without replacement."""
        return torch.randperm(n, generator=self.generator)[: self.positions]

    def current(self) -> Tensor:
        """The layer's weights as the fit's unknowns: (features, out). Only the kept rows and
        columns are widened to float64, never the whole weight (an output layer's is the
        vocabulary times the width)."""
        w = out_in_weight(self.mod).detach()
        if self.outputs is not None:
            w = w[self.outputs]
        cols = w[:, self.kept].reshape(w.shape[0], -1).double()
        if self.mod.bias is not None:
            bias = self.mod.bias.detach()
            bias = bias if self.outputs is None else bias[self.outputs]
            cols = torch.cat([cols, bias.double()[:, None]], 1)
        return cols.T

    def _solve(self, a: Tensor, b: Tensor, ridge: float, prior: Tensor) -> Tensor:
        """``(a + lambda I)^-1 (b + lambda prior)`` with ``lambda = ridge * mean diagonal of
        a``: the least-squares solution pulled towards ``prior`` (the unrepaired layer)."""
        lam = ridge * float(torch.diagonal(a).mean())
        a = a + lam * torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
        b = b + lam * prior
        x, info = torch.linalg.solve_ex(a, b)
        if int(info) != 0:  # singular (a dead input with ridge 0): the minimum-norm solution
            x = torch.linalg.lstsq(a.cpu(), b.cpu(), driver="gelsd").solution.to(a.device)
        return x

    def weights_coef(self, ridge: float) -> Tensor:
        """Every kept weight (and the bias) refitted: (features, out)."""
        return self._solve(self.sums.xtx, self.sums.xty, ridge, self.current())

    def scales_coef(self, ridge: float) -> Tensor:
        """One scale per kept input channel (all its kernel taps) times the current weights,
        and the bias refitted (Kwon et al.'s mask tuning): (features, out). With ``Z_c`` the
        output contribution of channel c, ``Z_c^T Z_d`` is read off the streamed sums as the
        block sums of ``X^T X * (W^T W)`` over the taps, so no more data is needed."""
        k, taps = self.kept.numel(), self.kernel
        n_w = k * taps
        w = self.current()[:n_w]  # (n_w, out)
        sums = self.sums
        xtx, xty = sums.xtx[:n_w, :n_w], sums.xty[:n_w]
        if self.mod.bias is not None:  # centre: the bias absorbs the means
            n = sums.xtx[n_w, n_w]
            mu, nu = sums.xtx[:n_w, n_w] / n, sums.xty[n_w] / n
            xtx = xtx - n * torch.outer(mu, mu)
            xty = xty - n * torch.outer(mu, nu)
        gram = (xtx * (w @ w.T)).view(k, taps, k, taps).sum((1, 3))  # (k, k)
        rhs = (xty * w).sum(1).view(k, taps).sum(1)  # (k,)
        scale = self._solve(gram, rhs[:, None], ridge, torch.ones_like(rhs[:, None]))[:, 0]
        coef = w * scale.repeat_interleave(taps)[:, None]
        if self.mod.bias is not None:
            coef = torch.cat([coef, (nu - coef.T @ mu)[None]])
        return coef

    def solve_and_set(
        self, ridge: float | None, rows_per_weight: float
    ) -> tuple[str, float, float, float]:
        """Refit the kept weights and bias (``"weights"``) when the pass saw at least
        ``rows_per_weight`` rows per feature, else one scale per kept channel (``"scales"``:
        ``k`` unknowns, which a small calibration set cannot overfit as it can ``k x out``);
        zero the removed columns. ``ridge=None``: the value of ``RIDGES`` with the least
        held-out error (with no held-out rows, 0.1). Returns the mode, the relative errors on
        the fitting rows before and after, and the ridge. Changes the module's ``weight`` (and
        ``bias``) in place, unless the fit is no better on the fitting rows, or on the held-out
        rows when there are any; releases the sums."""
        full = self.count >= rows_per_weight * self.features
        solve = self.weights_coef if full else self.scales_coef
        mode = "weights" if full else "scales"
        held = self.held_sums if self.held_sums.count else None
        if ridge is None and held is not None:
            ridge, coef = _conservative(solve, held, held.error(self.current()))
        else:
            ridge = 0.1 if ridge is None else ridge
            coef = solve(ridge)
        now = self.current()
        before, after = self.sums.error(now), self.sums.error(coef)
        worse = not after < before or (held is not None and not held.error(coef) < held.error(now))
        self.sums, self.held_sums = Sums(), Sums()
        if worse:  # a ridge fit loses only on nearly singular data or out of sample
            return mode, before, before, ridge
        w, bias = out_in_weight(self.mod), self.mod.bias
        n_w = self.kept.numel() * self.kernel
        rows = torch.arange(w.shape[0], device=w.device) if self.outputs is None else self.outputs
        with torch.no_grad():
            new = coef[:n_w].T.reshape(rows.numel(), self.kept.numel(), *w.shape[2:])
            removed = torch.ones(w.shape[1], dtype=torch.bool, device=w.device)
            removed[self.kept] = False
            w[:, removed] = 0  # removed columns stay zero, as the mask has them
            w[rows[:, None], self.kept] = new.to(w.dtype)
            if bias is not None:
                bias[rows] = coef[n_w].to(bias.dtype)
        return mode, before, after, ridge


def _conservative(
    solve: Callable[[float], Tensor], held: Sums, unrepaired: float
) -> tuple[float, Tensor]:
    """The largest ridge of ``RIDGES`` (the fit closest to the unrepaired layer) whose held-out
    error keeps ``1 - GAIN_SLACK`` of the best ridge's gain over ``unrepaired``, and its fit:
    the one-standard-error rule of cross-validation in spirit, since a layer's held-out rows
    come from the calibration text while the model meets other text, where the fit's
    compensation for removed channels transfers less well the further it moves the weights."""
    errors = [held.error(solve(r)) for r in RIDGES]  # one solution alive at a time
    best = min(errors)
    bar = best + GAIN_SLACK * max(unrepaired - best, 0.0)
    ridge = max(r for r, e in zip(RIDGES, errors, strict=True) if e <= bar)
    return ridge, solve(ridge)  # solved again rather than six (features x outputs) kept
