"""A piecewise-linear map from a state's operators summed alone to its whole latency.

``fisherprune.calibrate.fit_latency_line`` times the dense model and copies of it at several
widths whole; each gives a knot (the copy's operators summed alone, its whole time), and a
state is priced by interpolating between the two knots around its operators' sum, so that a
target between two timed sizes is never priced by extrapolating a line past one of them.
Below the narrowest knot the last segment's slope goes on (and above the widest, the first's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LatencyCurve:
    """Knots ``(operators, price)`` in microseconds, ascending in both (at least two).

    Attributes:
        operators: the knots' operators summed alone, ascending.
        prices: the knots' whole times (what a state with those operators costs), ascending.
    """

    operators: tuple[float, ...]
    prices: tuple[float, ...]

    @classmethod
    def through(cls, knots: Sequence[tuple[float, float]]) -> LatencyCurve:
        """The curve through ``knots`` (``(operators, price)`` pairs, in any order).

        Raises:
            ValueError: fewer than two knots, a value that is not finite, an operators' sum or
                price below 0, or knots whose prices do not rise strictly with their
                operators (the message names them).
        """
        pts = sorted((float(s), float(p)) for s, p in knots)
        if len(pts) < 2:
            raise ValueError(f"a latency curve needs two knots or more, got {len(pts)}")
        arr = np.asarray(pts)
        if not np.isfinite(arr).all() or not (arr >= 0).all():
            raise ValueError(f"a latency curve's knots must be finite, not below 0: {pts}")
        if not ((np.diff(arr[:, 0]) > 0) & (np.diff(arr[:, 1]) > 0)).all():
            raise ValueError(
                f"a latency curve's prices must rise strictly with the operators, got {pts}"
            )
        return cls(tuple(arr[:, 0].tolist()), tuple(arr[:, 1].tolist()))

    def __call__(self, operators: float | np.ndarray) -> float | np.ndarray:
        """The price of states with ``operators`` summed alone (a number or an array)."""
        return _piecewise(operators, self.operators, self.prices)

    def operators_at(self, price: float) -> float:
        """The operators' sum the curve prices at ``price`` (its inverse)."""
        return float(_piecewise(price, self.prices, self.operators))

    def as_list(self) -> list[list[float]]:
        """The knots as ``[[operators, price], ...]`` (JSON), ascending."""
        return [[s, p] for s, p in zip(self.operators, self.prices, strict=True)]


def _segment_index(x: float | np.ndarray, xs: Sequence[float]) -> np.ndarray:
    """Per value of ``x``, the index ``i`` of the segment ``xs[i], xs[i + 1]`` that holds it
    (the first or last one beyond the ends)."""
    return np.clip(np.searchsorted(np.asarray(xs), x, side="right") - 1, 0, len(xs) - 2)


def _piecewise(
    x: float | np.ndarray, xs: Sequence[float], ys: Sequence[float]
) -> float | np.ndarray:
    """The piecewise-linear function through ``(xs, ys)`` (``xs`` ascending) at ``x``, its end
    segments extended."""
    i = _segment_index(x, xs)
    xa, ya = np.asarray(xs), np.asarray(ys)
    slope = (ya[i + 1] - ya[i]) / (xa[i + 1] - xa[i])
    out = ya[i] + slope * (np.asarray(x, dtype=np.float64) - xa[i])
    return float(out) if np.ndim(out) == 0 else out
