"""benchmarks/paired.py and one_shot_defaults.verdicts: methods compared seed by seed with a
t interval on the mean paired difference, checked against intervals computed by hand (the t
quantiles from a printed table: t(0.975, 2) = 4.303, t(0.975, 4) = 2.776)."""

from __future__ import annotations

import math
import statistics
from types import ModuleType
from typing import Any

import pytest
from counted import benchmark_module

T_2, T_4 = 4.303, 2.776  # two-sided 95% Student t quantiles, 2 and 4 degrees of freedom


@pytest.fixture(scope="module")
def pairing() -> ModuleType:
    return benchmark_module("paired")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return benchmark_module("one_shot_defaults")


def test_interval_is_mean_plus_t_times_standard_error(pairing: ModuleType) -> None:
    """Differences 0.01, 0.02, 0.03: mean 0.02, sd 0.01, half-width 4.303 * 0.01 / sqrt(3)."""
    p = pairing.paired({"0": 0.91, "1": 0.92, "2": 0.93}, {"0": 0.90, "1": 0.90, "2": 0.90})
    assert p.seeds == 3
    assert p.mean == pytest.approx(0.02)
    assert p.half == pytest.approx(T_2 * 0.01 / math.sqrt(3), rel=1e-3)
    assert p.verdict == "within noise"  # 0.02 - 0.0248 < 0: the interval holds 0


def test_interval_narrows_with_seeds_and_separates(pairing: ModuleType) -> None:
    """The same differences repeated over five seeds (sd 0.00791, t 2.776): half-width 0.0098,
    so the interval [0.010, 0.030] lies above 0 where three seeds' did not."""
    a = {str(s): 0.9 + d for s, d in enumerate((0.01, 0.02, 0.03, 0.01, 0.03))}
    b = {str(s): 0.9 for s in range(5)}
    p = pairing.paired(a, b)
    sd = math.sqrt(sum((d - 0.02) ** 2 for d in (0.01, 0.02, 0.03, 0.01, 0.03)) / 4)
    assert p.half == pytest.approx(T_4 * sd / math.sqrt(5), rel=1e-3)
    assert p.verdict == "ahead"
    assert pairing.paired(b, a).verdict == "behind"


def test_pairs_only_the_seeds_both_ran(pairing: ModuleType) -> None:
    """Seeds 3 and 4 of ``a`` (a difference of 1.0 each) have no partner and are left out."""
    a = {"0": 0.5, "1": 0.5, "2": 0.5, "3": 1.5, "4": 1.5}
    p = pairing.paired(a, {"0": 0.4, "1": 0.4, "2": 0.4})
    assert p.seeds == 3
    assert p.mean == pytest.approx(0.1)
    assert p.half == pytest.approx(0.0, abs=1e-12)


def test_lower_is_better_flips_the_sign(pairing: ModuleType) -> None:
    """Perplexity 5 against 6 on every seed: ``a`` is better by 1."""
    p = pairing.paired({"0": 5.0, "1": 5.0}, {"0": 6.0, "1": 6.0}, higher_is_better=False)
    assert p.mean == pytest.approx(1.0)
    assert p.verdict == "ahead"


def test_one_seed_has_no_interval(pairing: ModuleType) -> None:
    p = pairing.paired({"0": 0.99}, {"0": 0.10})
    assert p.half == math.inf
    assert p.verdict == "within noise"


@pytest.mark.parametrize(
    ("a", "b", "level", "match"),
    [({"0": 1.0}, {"1": 1.0}, 0.95, "no seed in common"), ({"0": 1.0}, {"0": 1.0}, 1.0, "level")],
)
def test_bad_input_is_refused(
    pairing: ModuleType, a: dict, b: dict, level: float, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        pairing.paired(a, b, level=level)


def _cell(method: str, by_seed: list[float], dense: float = 0.99) -> dict[str, Any]:
    """A cell as ``one_shot_defaults.summary`` makes it, with the fields the verdicts read."""
    return {
        "net": "net",
        "target": 0.3,
        "method": method,
        "metric": "test accuracy",
        "higher_is_better": True,
        "test_examples": 1000,
        "mean": sum(by_seed) / len(by_seed),
        "sd": statistics.stdev(by_seed),
        "by_seed": {str(s): q for s, q in enumerate(by_seed)},
        "dense_by_seed": {str(s): dense for s in range(len(by_seed))},
    }


def test_verdict_behind_a_rival_ahead_on_every_seed(bench: ModuleType) -> None:
    """Taylor ahead by 0.02, 0.03, 0.04 (interval 0.03 ± 0.0248 above 0): BEHIND, though the
    spread of each method over seeds (0.01 to 0.05) is wider than the gap of the means."""
    cells = [
        _cell("fisher", [0.90, 0.93, 0.96]),
        _cell("taylor", [0.92, 0.96, 1.00]),
        _cell("random", [0.50, 0.60, 0.70]),
    ]
    (line,) = bench.verdicts(cells)
    assert "BEHIND taylor" in line
    assert "; ahead of random" in line


def test_verdict_within_noise_and_random_lost_nothing(bench: ModuleType) -> None:
    """Taylor ahead on the means by an interval that holds 0; random equal to fisher on the
    means and to the dense network: fisher is within noise of first, not ahead of random, and
    the line says random lost nothing against dense."""
    cells = [
        _cell("fisher", [0.98, 0.99, 1.00], dense=0.99),
        _cell("taylor", [1.00, 0.98, 1.00], dense=0.99),
        _cell("random", [1.00, 0.98, 0.99], dense=0.99),
    ]
    (line,) = bench.verdicts(cells)
    assert ": fisher 0.99, within noise" in line
    assert "NOT ahead of random (within noise)" in line
    assert "random not measurably below dense" in line


def test_verdict_first_pairs_unequal_seed_sets(bench: ModuleType) -> None:
    """Fisher on 5 seeds, taylor on the first 3: on those 3 fisher leads (0.95 against 0.94)
    though fisher's mean over all 5 (0.89) is below taylor's over its 3."""
    cells = [
        _cell("fisher", [0.95, 0.95, 0.95, 0.80, 0.80]),
        _cell("taylor", [0.94, 0.94, 0.94]),
        _cell("random", [0.70, 0.71, 0.72, 0.60, 0.61]),
    ]
    (line,) = bench.verdicts(cells)
    assert ", first; vs taylor +0.01 ± 0 (3 seeds)" in line
    assert "below dense" not in line


def _with_loss(cell: dict[str, Any], losses: list[float], dense: float) -> dict[str, Any]:
    """``cell`` with the test cross-entropy by seed that ``summary`` adds where rows have it."""
    by_seed = {str(s): v for s, v in enumerate(losses)}
    dense_by_seed = {s: dense for s in by_seed}
    extra = {"test_loss": sum(losses) / len(losses), "loss_by_seed": by_seed}
    return {**cell, **extra, "dense_loss_by_seed": dense_by_seed}


def test_verdict_on_test_loss_separates_what_accuracy_ties(bench: ModuleType) -> None:
    """Accuracy equal seed by seed (fisher within noise of random), but random's cross-entropy
    is higher on every seed by 0.020-0.022: on the loss fisher is ahead of random (lower is
    better), and random measurably above dense there."""
    acc = [0.97, 0.98, 0.99]
    cells = [
        _with_loss(_cell("fisher", acc), [0.10, 0.11, 0.12], dense=0.09),
        _with_loss(_cell("random", acc), [0.12, 0.131, 0.142], dense=0.09),
    ]
    (line,) = bench.verdicts(cells)
    on_accuracy, on_loss = line.split(". On test cross-entropy ")
    assert "NOT ahead of random (within noise)" in on_accuracy
    assert on_loss.startswith("0.11: first; ahead of random (+0.021 ± 0.0025 (3 seeds))")
    assert "above dense" not in on_loss


def test_no_loss_verdict_without_a_rival_that_recorded_it(bench: ModuleType) -> None:
    cells = [
        _with_loss(_cell("fisher", [0.9, 0.91, 0.92]), [0.1, 0.1, 0.1], dense=0.1),
        _cell("random", [0.8, 0.81, 0.82]),
    ]
    (line,) = bench.verdicts(cells)
    assert "cross-entropy" not in line


def test_verdict_on_kl_from_dense_where_loss_ties(bench: ModuleType) -> None:
    """Accuracy and cross-entropy equal seed by seed (random lost nothing against dense), but
    random moved the predictions further from the dense network's on every seed (KL 0.030-0.032
    against 0.010-0.012): on the KL divergence fisher is ahead of random. Differences 0.020,
    0.0205, 0.020: mean 0.020167, sd 0.000289, half-width 4.303 * 0.000289 / sqrt(3) = 0.00072."""
    acc, losses = [0.97, 0.98, 0.99], [0.10, 0.11, 0.12]
    kl = {"fisher": [0.010, 0.011, 0.012], "random": [0.030, 0.0315, 0.032]}
    cells = [
        {
            **_with_loss(_cell(m, acc), losses, dense=0.10),
            "test_kl": sum(kl[m]) / 3,
            "kl_by_seed": {str(s): v for s, v in enumerate(kl[m])},
        }
        for m in ("fisher", "random")
    ]
    (line,) = bench.verdicts(cells)
    _, on_loss, on_kl = line.split(". On ")
    assert "NOT ahead of random (within noise)" in on_loss
    assert on_kl.startswith("KL divergence from the dense network 0.011: first; ahead of random")
    assert on_kl.endswith("(+0.02017 ± 0.00072 (3 seeds))")


def test_kl_from_dense_is_the_mean_over_rows_of_the_class_divergence(bench: ModuleType) -> None:
    """``test_errors``' KL against a float64 loop over test rows: sum_c p_c log(p_c / q_c)
    with p the dense network's softmax and q the pruned one's, averaged over rows."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(7, 4, generator=g), torch.randint(0, 3, (7,), generator=g)
    split = bench.Split(x, y, x, y)
    model, dense = torch.nn.Linear(4, 3), torch.randn(7, 3, generator=g)
    got = bench.test_errors(model, split, dense)["test_kl"]
    with torch.no_grad():
        q = model(x).double().softmax(1)
    p = dense.double().softmax(1)
    want = sum(float((p[i] * (p[i] / q[i]).log()).sum()) for i in range(7)) / 7
    assert got == pytest.approx(want, rel=1e-5)
    assert "test_kl" not in bench.test_errors(model, split)


def test_timm_sweep_row_of_a_model_it_builds_passes_on_exact_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """benchmarks/timm_models.py's row for a model (here the test zoo's ConvNeXt, built in
    place of a timm one, in float64): both costs equal FlopCounterMode, the shrunk model
    equals the masked one, so it passes, with its groups and shares filled in."""
    import zoo_foreign

    timm_models = benchmark_module("timm_models")
    monkeypatch.setattr(
        timm_models, "build", lambda name, res: zoo_foreign.build_convnext(0).double().eval()
    )
    row = timm_models.measure("convnext", 32)
    assert row["status"] == "pass", row
    assert row["dense_cost_exact"] and row["cost_exact"] and row["max_diff"] <= 1e-9
    assert row["groups"] > 0 and 0 < row["saved_share"] < row["prunable_share"] <= 1
    assert "| convnext | 32 | pass |" in timm_models.table([row])
