"""compare_latency: every latency is a distribution of blocks timed side by side in rounds, and
a speed-up is given as a ratio only where the rounds agree on which model is faster.

Most checks run models whose durations are scripted on a fake clock, so every median, quartile
and ratio is known by hand; the reports of ``fisherprune prune`` and ``fisherprune train`` are
checked against their own recorded blocks with numpy's percentiles.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fisherprune.export.latency as latency_module
from fisherprune.export import SpeedUp, compare_latency
from fisherprune.train.config import TrainConfig
from fisherprune.train.finish import RunOutput, _summary, finish_run
from fisherprune.train.progress import Progress
from fisherprune.train.result import TrainResult
from tests.test_cli import run_cli
from tests.test_cli_prune import _data_and_weights
from tests.test_train_parts import _trained_run

MS = 1e-3
RATIO = re.compile(r"\d\.\d\dx")  # a speed-up ratio as the reports print it


class _FakeClock:
    """Stands for the ``time`` module inside fisherprune.export.latency: its perf_counter
    reads a time that only the scripted models advance."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Scripted:
    """A model whose calls take the scripted durations, in order, and log its name."""

    def __init__(self, name: str, clock: _FakeClock, durations: list[float], log: list[str]):
        self.name, self.clock, self.log = name, clock, log
        self.durations: Iterator[float] = iter(durations)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(self.name)
        self.clock.now += next(self.durations)
        return x


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _FakeClock:
    fake = _FakeClock()
    monkeypatch.setattr(latency_module, "time", SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def _pair(clock: _FakeClock, dense_ms: list[float], pruned_ms: list[float]) -> dict[str, Any]:
    """dense and pruned models: one warm-up call of 1 ms each, then the given blocks."""
    log: list[str] = []
    return {
        "dense": _Scripted("dense", clock, [MS] + [t * MS for t in dense_ms], log),
        "pruned": _Scripted("pruned", clock, [MS] + [t * MS for t in pruned_ms], log),
    }


def _compare(models: dict[str, Any], rounds: int = 5) -> Any:
    return compare_latency(models, torch.zeros(1), repeats=1, warmup=1, rounds=rounds)


def test_median_quartiles_and_paired_ratios_equal_a_hand_computation(clock: _FakeClock) -> None:
    """Blocks 10, 12, 11, 30, 13 ms (dense) and 5, 6, 5, 7, 6 ms (pruned): medians 12 and 6 ms,
    quartiles 11-13 and 5-6 ms (so ±1/12 and ±1/12), round ratios 2, 2, 2.2, 30/7, 13/6 with
    median 13/6 and quartiles 2 and 2.2: resolved, printed as 2.17x (IQR 2.00-2.20x)."""
    timed = _compare(_pair(clock, [10, 12, 11, 30, 13], [5, 6, 5, 7, 6]))
    dense, pruned = timed.models["dense"], timed.models["pruned"]
    assert dense.blocks == pytest.approx([0.010, 0.012, 0.011, 0.030, 0.013])
    assert dense.median == pytest.approx(0.012) and pruned.median == pytest.approx(0.006)
    assert dense.quartiles == pytest.approx((0.011, 0.013))
    assert pruned.quartiles == pytest.approx((0.005, 0.006))
    assert dense.spread == pytest.approx(1 / 12) and pruned.spread == pytest.approx(1 / 12)
    assert dense.text() == "12.000 ms ±8%"
    speedup = timed.speedup("dense", "pruned")
    assert speedup.ratios == pytest.approx([2, 2, 2.2, 30 / 7, 13 / 6])
    assert speedup.median == pytest.approx(13 / 6)
    assert speedup.quartiles == pytest.approx((2.0, 2.2))
    assert speedup.resolved
    assert speedup.text() == "2.17x (IQR 2.00-2.20x)"


def test_overlapping_rounds_say_no_resolvable_speed_up_and_print_no_ratio(
    clock: _FakeClock,
) -> None:
    """Dense 10 ms every round, pruned 8, 12, 9, 11, 9.5 ms: ratios 1.25, 0.833, 1.111, 0.909,
    1.053, median 1.053 (a 5% difference) inside quartiles 0.909-1.111 (spread 0.144 below the
    median): unresolved; the text names both percentages and no ratio, the JSON keeps the
    ratio with resolved false."""
    timed = _compare(_pair(clock, [10] * 5, [8, 12, 9, 11, 9.5]))
    speedup = timed.speedup()
    assert speedup.median == pytest.approx(10 / 9.5)
    assert speedup.quartiles == pytest.approx((10 / 11, 10 / 9))
    assert not speedup.resolved
    assert speedup.text() == "no resolvable speed-up: spread ±14% covers the 5% difference"
    assert not RATIO.search(speedup.text())
    record = speedup.to_json()
    assert record["resolved"] is False and record["median"] == pytest.approx(10 / 9.5)


def test_a_slow_down_every_round_is_resolved_below_one(clock: _FakeClock) -> None:
    """Pruned slower than dense in every round (ratios all about 0.5) is a resolved result too,
    its third quartile below 1."""
    speedup = _compare(_pair(clock, [5, 5.1, 4.9, 5, 5.2], [10] * 5)).speedup()
    assert speedup.resolved and speedup.quartiles[1] < 1
    assert speedup.text().startswith("0.50x")


def test_rounds_alternate_the_order_of_the_models(clock: _FakeClock) -> None:
    """Three models, 4 rounds of 2 calls: after one warm-up call each (in the order given),
    even rounds call them in the order given and odd rounds in reverse."""
    log: list[str] = []
    models = {n: _Scripted(n, clock, [MS] * 9, log) for n in "abc"}
    timed = compare_latency(models, torch.zeros(1), repeats=2, warmup=1, rounds=4, min_rounds=3)
    forward, backward = ["a", "a", "b", "b", "c", "c"], ["c", "c", "b", "b", "a", "a"]
    assert log == ["a", "b", "c", *forward, *backward, *forward, *backward]
    assert timed.rounds == 4 and timed.warmup == 1


def test_a_slow_pair_stops_at_the_budget_but_never_below_min_rounds(clock: _FakeClock) -> None:
    """Calls of 2 s each against a 10 s budget: the rounds stop after min_rounds (5), though
    the budget ran out after the third; calls of 1 ms run all 9 rounds."""
    slow = compare_latency(
        _pair(clock, [2000] * 9, [2000] * 9), torch.zeros(1), repeats=1, budget_seconds=10
    )
    fast = compare_latency(_pair(clock, [1] * 9, [1] * 9), torch.zeros(1), repeats=1, warmup=1)
    assert slow.rounds == 5 and fast.rounds == 9


def test_repeats_make_a_block_last_block_seconds_by_the_median_warm_up_call(
    clock: _FakeClock,
) -> None:
    """Warm-up calls of 3, 4, 5 ms (dense) and 0.2, 1.2, 9 ms (pruned): the faster median is
    1.2 ms, so ceil(5 / 1.2) = 5 calls per block (the fastest call, 0.2 ms, would give 25)."""
    log: list[str] = []
    models = {
        "dense": _Scripted("dense", clock, [3 * MS, 4 * MS, 5 * MS] + [MS] * 100, log),
        "pruned": _Scripted("pruned", clock, [0.2 * MS, 1.2 * MS, 9 * MS] + [MS] * 100, log),
    }
    timed = compare_latency(models, torch.zeros(1), warmup=3, rounds=3, min_rounds=3)
    assert timed.models["dense"].repeats == 5
    assert log.count("dense") == 3 + 3 * 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_rounds": 2}, "min_rounds must be at least 3"),
        ({"rounds": 4}, "at most rounds"),
        ({"warmup": 0}, "warmup must be at least 1"),
        ({"repeats": 0}, "repeats and warmup must be at least 1"),
        ({"budget_seconds": 0}, "budget_seconds and block_seconds must be positive"),
    ],
)
def test_compare_latency_refuses_settings_that_cannot_give_a_spread(
    kwargs: dict[str, Any], message: str
) -> None:
    """Too few rounds, no warm-up, no calls or no time: a ValueError naming the setting."""
    with pytest.raises(ValueError, match=message):
        compare_latency({"f": lambda x: x}, torch.zeros(1), **kwargs)


@given(st.lists(st.floats(0.2, 5.0), min_size=3, max_size=15))
def test_an_unresolved_spread_is_never_narrower_than_the_difference(ratios: list[float]) -> None:
    """Whatever the rounds, an unresolved speed-up's spread covers |median - 1|, so its text
    never claims more than the rounds show."""
    speedup = SpeedUp(tuple(ratios))
    if not speedup.resolved:
        assert speedup.spread >= abs(speedup.median - 1) - 1e-12


def test_an_hf_model_called_with_keywords_is_timed_in_every_round() -> None:
    """A 6-layer Hugging Face BERT against a 1-layer one, called with keyword inputs: every
    model has one block per round, both keep their training flag, and the paired ratios put
    the deeper one (6x the layers) as the slower."""
    t = pytest.importorskip("transformers")
    ids = torch.randint(0, 100, (4, 32), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def bert(layers: int) -> nn.Module:
        config = t.BertConfig(
            vocab_size=100, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
            intermediate_size=256, max_position_embeddings=64,
        )  # fmt: skip
        return t.BertModel(config).train()

    torch.manual_seed(0)
    dense, small = bert(6), bert(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no waits for a second thread on a shared machine
    try:
        timed = compare_latency({"dense": dense, "pruned": small}, inputs, block_seconds=0.02)
    finally:
        torch.set_num_threads(threads)
    assert all(len(d.blocks) == timed.rounds >= 5 for d in timed.models.values())
    assert dense.training and small.training
    assert timed.speedup().median > 1, timed.speedup().ratios
    assert timed.device == "cpu" and timed.threads == 1


# ================================================================ allocator state
_CHILD = """
import os
from fisherprune.export import allocator_state, retain_freed_memory
print(allocator_state())
retain_freed_memory()
print(allocator_state())
os.environ["MALLOC_ARENA_MAX"] = "2"
print(allocator_state())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_allocator_state_says_when_freed_memory_is_retained() -> None:
    """In a fresh process (glibc): 'glibc malloc defaults', then 'freed memory retained' once
    retain_freed_memory has run, and a glibc tunable in the environment is named after it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("LD_PRELOAD", None)
    env.pop("GLIBC_TUNABLES", None)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "glibc malloc defaults",
        "freed memory retained",
        "freed memory retained (MALLOC_ARENA_MAX=2)",
    ]


# ======================================================================= the tools
def _check_distribution(
    dense_blocks: list[float], pruned_blocks: list[float], record: dict[str, Any]
) -> None:
    """The medians, paired ratio and resolution a report gives, recomputed from its blocks with
    numpy (linear percentiles: the inclusive quartiles)."""
    ratios = np.array(dense_blocks) / np.array(pruned_blocks)
    q1, q3 = np.percentile(ratios, [25, 75])
    assert record["speedup"] == pytest.approx(float(np.median(ratios)))
    assert record["resolved"] == bool(q1 > 1 or q3 < 1)
    assert record["iqr"] == pytest.approx([q1, q3])


def test_prune_report_carries_the_distribution_threads_and_allocator(tmp_path: Path) -> None:
    """fisherprune prune's report.json has every timed block of dense and pruned (at least 5
    rounds), medians and a paired speed-up that numpy gives from those blocks, its resolution,
    the threads and the allocator; the printed line names the threads and the allocator and
    gives the ratio exactly when it is resolved."""
    data, weights, _, _ = _data_and_weights(tmp_path)
    out = tmp_path / "out"
    cli = run_cli("prune", "mlp", "--width", "32", "--depth", "2", "--weights", weights,
                  "--data", data, "--target", "50%", "--rounds", "1", "--out", out)  # fmt: skip
    assert cli.code == 0, cli.err
    report = json.loads((out / "report.json").read_text())
    lat = report["latency"]
    dense, pruned = lat["models"]["dense"]["blocks_s"], lat["models"]["pruned"]["blocks_s"]
    assert len(dense) == len(pruned) == lat["rounds"] >= 5
    assert report["latency_seconds"]["dense"] == pytest.approx(statistics.median(dense))
    assert report["latency_seconds"]["pruned"] == pytest.approx(statistics.median(pruned))
    sp = lat["speedup"]
    _check_distribution(
        dense,
        pruned,
        {"speedup": report["speedup"], "resolved": sp["resolved"], "iqr": [sp["q1"], sp["q3"]]},
    )
    assert report["speedup_resolved"] == sp["resolved"]
    assert report["latency_threads"] == lat["threads"] == torch.get_num_threads()
    assert report["latency_allocator"] == lat["allocator"] != ""
    line = next(x for x in cli.out.splitlines() if "; latency " in x)
    threads = f"{lat['threads']} thread{'s' * (lat['threads'] != 1)}"  # 1 thread, 2 threads
    assert f"{threads}, {lat['allocator']}" in line, line
    assert lat["cpus"] >= 1 and f"load {lat['load']:.1f} on {lat['cpus']} CPUs" in line, line
    assert f"{lat['rounds']} rounds" in line
    assert bool(RATIO.search(line)) == sp["resolved"], line
    assert ("no resolvable speed-up" in line) != sp["resolved"], line


def test_train_result_carries_every_block_and_the_paired_speed_up(tmp_path: Path) -> None:
    """finish_run's latency has, for the eager and the served forms at batch 1 and 64, every
    block (at least 5 rounds), the medians and the paired speed-up numpy gives from them, and
    names the threads, the allocator and the device."""
    out = RunOutput(tmp_path / "run", tmp_path / "run" / "export", Progress(None, "none"), False)
    lat = finish_run(TrainConfig(), _trained_run(), out).latency
    assert lat["threads"] == torch.get_num_threads() and lat["device"] == "cpu"
    assert lat["allocator"] and lat["allocator"] in lat["conditions"]
    assert f"load {lat['load']:.1f} on {lat['cpus']} CPUs" in lat["conditions"]
    for prefix in ("", "served_"):
        for bs in (1, 64):
            blocks = lat[f"{prefix}blocks_b{bs}_ms"]
            assert len(blocks["dense"]) == len(blocks["pruned"]) >= 5
            for name in ("dense", "pruned"):
                median = statistics.median(blocks[name])
                assert lat[f"{prefix}{name}_b{bs}_ms"] == pytest.approx(median)
            key = f"{prefix}speedup_b{bs}"
            _check_distribution(
                blocks["dense"],
                blocks["pruned"],
                {"speedup": lat[key], "resolved": lat[f"{key}_resolved"], "iqr": lat[f"{key}_iqr"]},
            )


def _latency_entry(prefix: str, bs: int, resolved: bool) -> dict[str, Any]:
    text = "1.80x (IQR 1.70-1.90x)" if resolved else (
        "no resolvable speed-up: spread ±18% covers the 6% difference"
    )  # fmt: skip
    return {
        f"{prefix}dense_b{bs}_ms": 2.0,
        f"{prefix}pruned_b{bs}_ms": 1.1,
        f"{prefix}dense_b{bs}_spread": 0.03,
        f"{prefix}pruned_b{bs}_spread": 0.2,
        f"{prefix}speedup_b{bs}": 1.06,
        f"{prefix}speedup_b{bs}_resolved": resolved,
        f"{prefix}speedup_b{bs}_text": text,
        f"{prefix}blocks_b{bs}_ms": {"dense": [2.0] * 7, "pruned": [1.1] * 7},
    }


def test_train_summary_names_threads_and_allocator_and_drops_an_unresolved_ratio(
    tmp_path: Path,
) -> None:
    """The run's last lines: the latency line names the device, the conditions (threads,
    allocator, load) and the 7 rounds; batch 1 (resolved) gives its ratio, batch 64
    (unresolved) says so, with no ratio."""
    conditions = "2 threads, glibc malloc defaults, load 1.5 on 2 CPUs"
    latency = {"threads": 2, "device": "cpu", "conditions": conditions}
    latency |= _latency_entry("", 1, True) | _latency_entry("", 64, False)
    result = TrainResult(0.9, 0.8, "accuracy", 100.0, 50.0, 10, 5, latency, 30, 4)
    line = next(x for x in _summary(TrainConfig(), result, tmp_path) if x.startswith("latency"))
    head, batch1, batch64 = re.split(r": batch 1 |; batch 64 ", line)
    assert head == f"latency (CPU, {conditions}; median ±half IQR of 7 side-by-side rounds)"
    assert batch1 == "2.000 ms ±3% -> 1.100 ms ±20%, 1.80x (IQR 1.70-1.90x)"
    assert batch64.startswith("2.000 ms ±3% -> 1.100 ms ±20%, no resolvable speed-up: spread")
    assert not RATIO.search(batch64)
