"""One layer's least-squares repair: the streamed sums and the solve (``LayerFit``).

With ``k`` kept input features (kept channels x kernel size for a conv, +1 for the bias), a
pass streams ``X^T X`` (k x k) and ``X^T Y`` (k x outputs) over the batches, each batch's
products in the layer's dtype and their sum in float64 (memory ``8 k^2`` bytes). Then, from
those sums alone, by ``torch.linalg.solve`` in float64 with ``lambda = ridge * mean diagonal``
pulling towards the unrepaired layer rather than towards 0:

* ``"weights"``, with at least ``rows_per_weight`` rows per feature: every kept weight and
  the bias, ``(X^T X + lambda I) W = X^T Y + lambda W_0``: a k x k system with ``outputs``
  right-hand sides;
* ``"scales"``, else: one scale per kept input channel and the bias (Kwon et al. 2022's mask
  tuning), a (kept channels) x (kept channels) system pulled towards scales of 1.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fisherprune.calibrate.repair_rows import REPAIRABLE

__all__ = ["LayerFit"]


class LayerFit:
    """The streamed sums of one layer's least-squares problem."""

    def __init__(self, mod: nn.Module, kept: Tensor, dim: int, positions: int) -> None:
        self.mod, self.kept, self.dim, self.positions = mod, kept, dim, positions
        self.generator = torch.Generator().manual_seed(0)  # its own stream: global RNG untouched
        #: why the layer turned out not to be fittable during the pass (None: it is)
        self.invalid: str | None = None
        self.rows = REPAIRABLE[type(mod)]
        #: the current batch's token mask (``linear_rows``), or None
        self.tokens: Tensor | None = None
        w = mod.weight
        self.kernel = int(w[0, 0].numel())
        self.features = kept.numel() * self.kernel + (mod.bias is not None)
        # allocated by the first call and released by the solve: one stage's sums at a time
        self.xtx = self.xty = torch.empty(0, dtype=torch.float64)
        self.yty = 0.0
        self.count = 0  # rows seen
        #: fit on the dense pass's own inputs (the one-pass repair)
        self.dense_inputs = False
        #: dense outputs of the current batch's calls, waiting for the pruned pass's inputs
        self.targets: list[Tensor] = []
        #: the forward running is the pruned model's
        self.pruned = False

    def hook(self, mod: nn.Module, args: tuple, out: Tensor) -> None:
        """Forward hook. Dense pass: keep this call's output as a target (with
        ``dense_inputs``, fit it on this call's input at once). Pruned pass (``pruned``): fit
        the dense target of the same call on this call's input."""
        x = args[0].detach()
        if self.dense_inputs:
            self.add(x, out.detach())
        elif not self.pruned:
            self.targets.append(out.detach())
        elif self.targets:
            self.add(x, self.targets.pop(0))
        else:
            self.invalid = "the pruned model calls it more often than the dense one"

    def add(self, x: Tensor, y: Tensor) -> None:
        """Add one call's rows (input ``x``, target output ``y``) to the sums."""
        if isinstance(self.mod, nn.Linear) and self.dim != x.dim() - 1:
            self.invalid = "the mask is not on the features (last) dim"
        if self.invalid is not None:
            return
        x, y = self.rows(self.mod, x, y, self.kept, self.sample, self.tokens)
        if self.mod.bias is not None:
            x = torch.cat([x, x.new_ones(x.shape[0], 1)], 1)
        if self.count == 0:
            self.xtx = x.new_zeros(x.shape[1], x.shape[1], dtype=torch.float64)
            self.xty = x.new_zeros(x.shape[1], y.shape[1], dtype=torch.float64)
        # one batch's products in the layer's dtype (float64 matmuls are several times slower
        # on CPU), summed over batches in float64
        self.xtx += (x.T @ x).double()
        self.xty += (x.T @ y).double()
        self.yty += float(y.double().square().sum())
        self.count += x.shape[0]

    def sample(self, n: int) -> Tensor:
        """``positions`` of ``n`` output positions, at random without replacement."""
        return torch.randperm(n, generator=self.generator)[: self.positions]

    def current(self) -> Tensor:
        """The layer's weights as the fit's unknowns: (features, out)."""
        w = self.mod.weight.detach().double()
        cols = w[:, self.kept].reshape(w.shape[0], -1)
        if self.mod.bias is not None:
            cols = torch.cat([cols, self.mod.bias.detach().double()[:, None]], 1)
        return cols.T

    def error(self, coef: Tensor) -> float:
        """``||Y - X coef||^2 / ||Y||^2`` from the streamed sums."""
        sq = self.yty - 2 * float((coef * self.xty).sum()) + float((coef * (self.xtx @ coef)).sum())
        return max(sq, 0.0) / max(self.yty, 1e-300)

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
        return self._solve(self.xtx, self.xty, ridge, self.current())

    def scales_coef(self, ridge: float) -> Tensor:
        """One scale per kept input channel (all its kernel taps) times the current weights,
        and the bias refitted (Kwon et al.'s mask tuning): (features, out). With ``Z_c`` the
        output contribution of channel c, ``Z_c^T Z_d`` is read off the streamed sums as the
        block sums of ``X^T X * (W^T W)`` over the taps, so no more data is needed."""
        k, taps = self.kept.numel(), self.kernel
        n_w = k * taps
        w = self.current()[:n_w]  # (n_w, out)
        xtx, xty = self.xtx[:n_w, :n_w], self.xty[:n_w]
        if self.mod.bias is not None:  # centre: the bias absorbs the means
            n = self.xtx[n_w, n_w]
            mu, nu = self.xtx[:n_w, n_w] / n, self.xty[n_w] / n
            xtx = xtx - n * torch.outer(mu, mu)
            xty = xty - n * torch.outer(mu, nu)
        gram = (xtx * (w @ w.T)).view(k, taps, k, taps).sum((1, 3))  # (k, k)
        rhs = (xty * w).sum(1).view(k, taps).sum(1)  # (k,)
        scale = self._solve(gram, rhs[:, None], ridge, torch.ones_like(rhs[:, None]))[:, 0]
        coef = w * scale.repeat_interleave(taps)[:, None]
        if self.mod.bias is not None:
            coef = torch.cat([coef, (nu - coef.T @ mu)[None]])
        return coef

    def solve_and_set(self, ridge: float, rows_per_weight: float) -> tuple[str, float, float]:
        """Refit the kept weights and bias (``"weights"``) when the pass saw at least
        ``rows_per_weight`` rows per feature, else one scale per kept channel (``"scales"``:
        ``k`` unknowns, which a small calibration set cannot overfit as it can ``k x out``);
        zero the removed columns. Returns the mode and the relative errors before and after.
        Changes the module's ``weight`` (and ``bias``) in place, unless the fit is no better;
        releases the sums."""
        before = self.error(self.current())
        full = self.count >= rows_per_weight * self.features
        coef = self.weights_coef(ridge) if full else self.scales_coef(ridge)
        mode = "weights" if full else "scales"
        after = self.error(coef)
        self.xtx = self.xty = torch.empty(0, dtype=torch.float64)
        if not after < before:  # the ridge fit can only lose on nearly singular data
            return mode, before, before
        w = self.mod.weight
        n_w = self.kept.numel() * self.kernel
        with torch.no_grad():
            new = coef[:n_w].T.reshape(w.shape[0], self.kept.numel(), *w.shape[2:])
            w.zero_()  # removed columns stay zero, as the mask has them
            w[:, self.kept] = new.to(w.dtype)
            if self.mod.bias is not None:
                self.mod.bias.copy_(coef[n_w].to(self.mod.bias.dtype))
        return mode, before, after
