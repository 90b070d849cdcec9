"""What a side-by-side latency measurement found: each model's timed blocks, their median and
spread, the speed-up from paired rounds, and the conditions they were timed under.

Plain values with no torch in them, so that reports (``fisherprune train``'s summary and
``report.md``, ``fisherprune prune``'s ``report.json``) read and write them the same way.
``compare_latency`` (``fisherprune.export.latency``) makes them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

__all__ = ["LatencyComparison", "LatencyDistribution", "SpeedUp", "latency_text"]


def latency_text(seconds: float, spread: float) -> str:
    """``0.512 ms ±3%``: a median latency and its spread (a fraction of it)."""
    return f"{seconds * 1e3:.3f} ms ±{spread:.0%}"


def _quartiles(values: tuple[float, ...]) -> tuple[float, float]:
    """First and third quartile, by linear interpolation between the sorted values (the
    ``inclusive`` method: of 1..5, 2 and 4)."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


@dataclass(frozen=True)
class LatencyDistribution:
    """Seconds per call of one model in each timed block (``repeats`` calls in a row).

    Attributes:
        blocks: the seconds per call of every timed block, in the order of the rounds.
        repeats: calls per block.

    Raises:
        ValueError: fewer than 2 blocks (no spread can be estimated).
    """

    blocks: tuple[float, ...]
    repeats: int

    def __post_init__(self) -> None:
        if len(self.blocks) < 2:
            raise ValueError(f"a latency distribution needs 2 blocks or more, got {self.blocks}")

    @property
    def median(self) -> float:
        """The median block, in seconds per call."""
        return statistics.median(self.blocks)

    @property
    def quartiles(self) -> tuple[float, float]:
        """First and third quartile of the blocks, in seconds per call."""
        return _quartiles(self.blocks)

    @property
    def spread(self) -> float:
        """Half the interquartile range over the median: the ``±`` of ``text``."""
        q1, q3 = self.quartiles
        return (q3 - q1) / 2 / self.median

    def text(self) -> str:
        """``0.512 ms ±3%``: the median and ``spread``."""
        return latency_text(self.median, self.spread)

    def to_json(self) -> dict[str, Any]:
        """Median, quartiles, extremes and every block, in seconds per call."""
        q1, q3 = self.quartiles
        return {
            "median_s": self.median,
            "q1_s": q1,
            "q3_s": q3,
            "min_s": min(self.blocks),
            "max_s": max(self.blocks),
            "blocks_s": list(self.blocks),
            "repeats": self.repeats,
        }


@dataclass(frozen=True)
class SpeedUp:
    """How much faster one model ran than another, from rounds timed side by side.

    ``ratios[i]`` is the baseline's block over the other model's block of round ``i``: the two
    were timed next to each other, so load that lasts a round slows both and cancels.

    The speed-up is **resolved** when the interquartile range of the ratios lies wholly on one
    side of 1.0 (its first quartile above 1, or its third quartile below 1): in at least three
    rounds in four the same model was the faster. Otherwise the rounds disagree on which model
    is faster, and ``text`` names the spread instead of a ratio; ``spread`` (the larger
    distance from the median ratio to a quartile) is then at least the difference claimed
    (``|median - 1|``).

    Attributes:
        ratios: baseline seconds over the other's, one per round.

    Raises:
        ValueError: fewer than 2 ratios.
    """

    ratios: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.ratios) < 2:
            raise ValueError(f"a speed-up needs 2 rounds or more, got {self.ratios}")

    @property
    def median(self) -> float:
        """The median ratio: how many times faster the other model is."""
        return statistics.median(self.ratios)

    @property
    def quartiles(self) -> tuple[float, float]:
        """First and third quartile of the ratios."""
        return _quartiles(self.ratios)

    @property
    def spread(self) -> float:
        """The larger distance from the median ratio to one of its quartiles."""
        q1, q3 = self.quartiles
        return max(self.median - q1, q3 - self.median)

    @property
    def resolved(self) -> bool:
        """True when the ratios' interquartile range excludes 1.0 (see the class docstring)."""
        q1, q3 = self.quartiles
        return q1 > 1.0 or q3 < 1.0

    def text(self) -> str:
        """``1.73x (IQR 1.68-1.80x)`` when resolved; else ``no resolvable speed-up: spread
        ±18% covers the 6% difference``, with no ratio."""
        if not self.resolved:
            return (
                f"no resolvable speed-up: spread ±{self.spread:.0%} covers the "
                f"{abs(self.median - 1):.0%} difference"
            )
        q1, q3 = self.quartiles
        return f"{self.median:.2f}x (IQR {q1:.2f}-{q3:.2f}x)"

    def to_json(self) -> dict[str, Any]:
        """The median ratio, its quartiles, every ratio, ``resolved`` and ``text``."""
        q1, q3 = self.quartiles
        return {
            "median": self.median,
            "q1": q1,
            "q3": q3,
            "ratios": list(self.ratios),
            "resolved": self.resolved,
            "text": self.text(),
        }


@dataclass(frozen=True)
class LatencyComparison:
    """Models timed side by side, and under what conditions.

    Attributes:
        models: each model's distribution, by name; every one has a block per round.
        warmup: untimed calls per model before the first round.
        threads: ``torch.get_num_threads()`` while timing.
        allocator: the memory allocator's state (``allocator_state()``).
        device: where the inputs were (``"cpu"``, ``"cuda:0"``).
        load: the system's load average over the minute before timing (this process
            included), None where the platform has none; cpus: the CPUs this process may use.
            Two threads on a 2-CPU machine with other work running wait for each other: the
            figures then depend on that load.

    Raises:
        ValueError: no model, or models with different numbers of blocks.
    """

    models: dict[str, LatencyDistribution]
    warmup: int
    threads: int
    allocator: str
    device: str
    load: float | None
    cpus: int

    def __post_init__(self) -> None:
        if len({len(d.blocks) for d in self.models.values()}) != 1:
            raise ValueError("a comparison needs one model or more, timed in the same rounds")

    @property
    def rounds(self) -> int:
        """Timed rounds: blocks per model."""
        return len(next(iter(self.models.values())).blocks)

    def speedup(self, baseline: str = "dense", other: str = "pruned") -> SpeedUp:
        """How much faster ``other`` ran than ``baseline``, from their paired blocks.

        Raises:
            KeyError: a name that is not one of ``models``.
        """
        pairs = zip(self.models[baseline].blocks, self.models[other].blocks, strict=True)
        return SpeedUp(tuple(b / o for b, o in pairs))

    def conditions(self) -> str:
        """``2 threads, freed memory retained, load 1.3 on 2 CPUs``: what the timing ran under."""
        threads = f"{self.threads} thread{'s' * (self.threads != 1)}"
        load = "" if self.load is None else f", load {self.load:.1f} on {self.cpus} CPUs"
        return f"{threads}, {self.allocator}{load}"

    def context(self) -> str:
        """``9 rounds, 2 threads, ...``: the rounds and ``conditions``."""
        return f"{self.rounds} rounds, {self.conditions()}"

    def to_json(self) -> dict[str, Any]:
        """Every model's distribution and the conditions, as JSON-ready values."""
        return {
            "models": {n: d.to_json() for n, d in self.models.items()},
            "rounds": self.rounds,
            "warmup": self.warmup,
            "threads": self.threads,
            "allocator": self.allocator,
            "device": self.device,
            "load": self.load,
            "cpus": self.cpus,
        }
