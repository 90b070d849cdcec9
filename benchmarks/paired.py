"""Two methods compared seed by seed (the verdicts of ``one_shot_defaults.py``).

A seed fixes the trained network, its calibration batches and the random criterion's stream,
so two methods run on the same seed differ only by the method: their difference on that seed
is one paired observation, and the seed-to-seed spread of the networks cancels out of it.
``paired`` takes the methods' qualities keyed by seed, keeps the seeds both have, and gives
the mean difference with its two-sided Student t interval (``level``, default 95%):
``mean ± t(level, n - 1) * sd / sqrt(n)`` over the ``n`` common seeds, ``sd`` the sample
standard deviation of the differences. The interval narrows as seeds are added (as
``1 / sqrt(n)``, and ``t`` falls from 12.7 at two seeds to 2.26 at ten). One seed gives no
spread: its interval is unbounded. The test set is the same for every seed, so the interval
is over networks and calibration draws on that test set, not over test sets.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from scipy.stats import t as student_t

__all__ = ["Paired", "paired"]


@dataclass(frozen=True)
class Paired:
    """The mean over ``seeds`` common seeds of ``a - b`` (signed so that positive means ``a``
    is better) and the half-width ``half`` of its t interval."""

    mean: float
    half: float
    seeds: int

    @property
    def verdict(self) -> str:
        """``"ahead"`` when the interval lies above 0, ``"behind"`` when below, else
        ``"within noise"`` (the interval holds 0)."""
        if self.mean - self.half > 0:
            return "ahead"
        if self.mean + self.half < 0:
            return "behind"
        return "within noise"

    def __str__(self) -> str:
        seeds = f"{self.seeds} seed{'s' if self.seeds > 1 else ''}"
        return f"{self.mean:+.4g} ± {self.half:.2g} ({seeds})"


def paired(
    a: Mapping[str, float],
    b: Mapping[str, float],
    higher_is_better: bool = True,
    level: float = 0.95,
) -> Paired:
    """``a`` against ``b``, each a quality per seed, paired on the seeds both have.

    Args:
        a, b: quality by seed (any hashable seed key; the keys are matched exactly).
        higher_is_better: ``False`` for a metric such as perplexity: the difference is then
            ``b - a``, so that a positive mean still means ``a`` is better.
        level: the interval's two-sided coverage, in (0, 1).

    Returns:
        ``Paired``: the mean difference, its interval's half-width (``inf`` with one seed),
        and the number of seeds paired.

    Raises:
        ValueError: ``a`` and ``b`` have no seed in common, or ``level`` is not in (0, 1).
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError(f"no seed in common: {sorted(a)} against {sorted(b)}")
    sign = 1.0 if higher_is_better else -1.0
    diffs = [sign * (a[s] - b[s]) for s in seeds]
    n = len(diffs)
    if n == 1:
        return Paired(diffs[0], math.inf, 1)
    t = float(student_t.ppf(0.5 + level / 2, n - 1))
    return Paired(statistics.mean(diffs), t * statistics.stdev(diffs) / math.sqrt(n), n)
