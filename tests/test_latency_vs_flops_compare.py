"""benchmarks/latency_vs_flops.py's comparison: the FLOPs-targeted quality at a latency-targeted
model's measured share, interpolated by hand between the grid points (the dense model the widest,
at share 1), and a written run compared again from what it stored."""

from __future__ import annotations

from types import ModuleType

import pytest
from counted import benchmark_module


@pytest.fixture(scope="module")
def lvf() -> ModuleType:
    return benchmark_module("latency_vs_flops")


def _grid(lvf: ModuleType) -> list:
    return [lvf.GridPoint(0.9, 0.85, 0.96), lvf.GridPoint(0.8, 0.75, 0.90)]


def test_a_share_above_the_grid_is_compared_against_the_dense_model(lvf: ModuleType) -> None:
    """At share 0.925, halfway between the 90% FLOPs model (0.85, 0.96) and the dense one
    (1.0, 0.98): 0.97; without the dense point the share lies outside the grid."""
    got = lvf.comparison(lvf.with_dense(_grid(lvf), 0.98), 0.925, 0.975, higher=True)
    assert got["flops_quality"] == pytest.approx(0.97)
    assert got["difference"] == pytest.approx(0.005)
    assert [b["share"] for b in got["bracket"]] == [0.85, 1.0]
    alone = lvf.comparison(_grid(lvf), 0.925, 0.975, higher=True)
    assert alone["difference"] is None and "outside the FLOPs grid's 0.750-0.850" in alone["note"]


def test_lower_is_better_flips_the_difference(lvf: ModuleType) -> None:
    """Perplexity 30 against 28 interpolated (share 0.8 between 0.75 at 29 and 0.85 at 27):
    the latency-targeted model is worse by 2, so the difference is -2."""
    grid = [lvf.GridPoint(0.9, 0.85, 27.0), lvf.GridPoint(0.8, 0.75, 29.0)]
    got = lvf.comparison(grid, 0.8, 30.0, higher=False)
    assert got["flops_quality"] == pytest.approx(28.0)
    assert got["difference"] == pytest.approx(-2.0)


def test_recompare_adds_the_dense_point_to_a_written_run(lvf: ModuleType) -> None:
    """A row left out of the grid before (share 0.925 above the 90% model's 0.85) is compared
    after ``recompare``, from the run's stored grid and dense quality; a refused row stays."""
    grid = [{"flops_target": g.flops_target, "share": g.share, "quality": g.quality}
            for g in _grid(lvf)]  # fmt: skip
    row = {"net": "n", "seed": 0, "target": 0.9, "metric": "test accuracy",
           "higher_is_better": True, "measured_share": 0.925, "quality": 0.975,
           "flops_quality": None, "difference": None, "bracket": [], "note": "outside",
           "latency_seconds": 1.0, "flops_seconds": 1.0, "test_examples": 1000}  # fmt: skip
    refused = {"net": "n", "seed": 0, "target": 0.5, "metric": "test accuracy",
               "refused": "out of reach: its floor is 60%, every mask", "difference": None,
               "latency_seconds": 0.0, "flops_seconds": 1.0}  # fmt: skip
    data = {"rows": [row, refused], "runs": [{"net": "n", "seed": 0, "dense_quality": 0.98,
                                               "grid": grid}]}  # fmt: skip
    again = lvf.recompare(data)
    assert again["dense_in_grid"] is True
    assert again["rows"][0]["difference"] == pytest.approx(0.005)
    assert again["rows"][1]["difference"] is None
    compared = {c["target"]: c["compared"] for c in again["cells"]}
    assert compared == {0.9: 1, 0.5: 0}
