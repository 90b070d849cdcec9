"""``fisherprune train --compile``: the training steps run through ``torch.compile`` with the
masks inside the graph. The reference is the same run in eager; ``aot_eager`` traces and
partitions as inductor does but builds no kernels, so these run in seconds on any CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_run import run_cli
from torch import nn
from torch._dynamo.utils import counters

import fisherprune as fp
from fisherprune.compile_regions import ISOLATED
from fisherprune.train.compiling import compiled
from fisherprune.train.config import TrainConfig

# the built-in digits CNN, 4 wide: prunes every 2 steps after 5 dense ones, then 6
# fine-tuning steps of the shrunk model distilled from the dense one
DIGITS = [
    "--data", "digits", "--model", "cnn", "--width", "4", "--pruning.burn_in", "5",
    "--pruning_iter", "2", "--eval_every", "4", "--fine_tune_steps", "6",
    "--checkpoint_every", "100", "--distill_alpha", "0.5", "--export_formats", "state_dict",
    "--threads", "1", "--progress", "none", "--dense_check", "warn",
]  # fmt: skip
COMPILED = ["--compile", "--compile_backend", "aot_eager"]


def _prunes(save: Path) -> list[tuple[int, str, list[int]]]:
    lines = (save / "metrics.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    return [(e["step"], e["mask"], e["channels"]) for e in events if e.get("kind") == "prune"]


def test_a_compiled_run_prunes_the_channels_the_eager_run_prunes(tmp_path: Path) -> None:
    torch._dynamo.reset()
    code, _, err = run_cli("train", *DIGITS, "--save_dir", tmp_path / "eager")
    assert code == 0, err
    code, _, err = run_cli("train", *DIGITS, *COMPILED, "--save_dir", tmp_path / "compiled")
    assert code == 0, err
    eager, compiled = _prunes(tmp_path / "eager"), _prunes(tmp_path / "compiled")
    assert eager and compiled == eager


def test_a_compiled_run_traces_whole_graphs(tmp_path: Path) -> None:
    torch._dynamo.reset()
    counters.clear()
    code, _, err = run_cli("train", *DIGITS, *COMPILED, "--save_dir", tmp_path)
    assert code == 0, err
    assert not counters["graph_break"], dict(counters["graph_break"])
    # the probe, dense, collecting, not collecting, the shrunk model
    assert counters["stats"]["unique_graphs"] <= 5


def test_a_backend_that_cannot_build_kernels_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch._inductor.config as inductor

    torch._dynamo.reset()
    monkeypatch.setattr(inductor.cpp, "cxx", ("/nonexistent/c++",))
    monkeypatch.setattr(inductor, "fx_graph_cache", False)
    code, _, err = run_cli("train", *DIGITS, "--compile", "--save_dir", tmp_path)
    assert code != 0
    assert "backend inductor could not compile on cpu" in err and "aot_eager" in err
    assert not (tmp_path / "checkpoints").exists()  # (nothing trained, nothing written)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("compile_backend", "nonesuch"),
        ("compile_mode", "reduce-overhead"),
        # a torch.compile backend, but one that replays the backward's hand-over as a CUDA graph
        ("compile_backend", "cudagraphs"),
    ],
)
def test_a_compile_setting_torch_does_not_take_is_refused(field: str, value: str) -> None:
    with pytest.raises(ValueError, match=field):
        TrainConfig(compile=True, **{field: value})


@pytest.mark.skipif(not ISOLATED, reason="this torch has no torch.compile(isolate_recompiles=)")
def test_runs_one_after_another_each_get_their_own_graphs_past_the_recompile_limit() -> None:
    """Ten masked models of one class, each compiled as a run compiles it: each is traced into
    a graph of its own (torch's limit of 8 graphs per ``forward`` would have run the ninth and
    tenth eager) and gives its eager outputs."""
    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(4, 6)
    try:
        for seed in range(10):
            torch.manual_seed(seed)
            model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
            masks = fp.apply_masks(model, x[:1])
            with torch.no_grad():
                next(iter(masks.values())).mask[seed % 8] = 0.0
            run = compiled(model, "aot_eager", "default")
            torch.testing.assert_close(run(x), model(x))
        assert counters["stats"]["unique_graphs"] == 10
    finally:
        torch._dynamo.reset()
