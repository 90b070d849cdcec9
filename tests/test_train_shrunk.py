"""``fisherprune train`` fine-tunes the shrunk model: once pruning finishes the model is shrunk
in place with its optimizer state carried over, and what the run writes afterwards (checkpoints,
the export, the report) reads the smaller model. The reference is the same run fine-tuned on
the masked model (``--fine_tune_masked``), shrunk only at its export."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_run import run_cli
from counted import flops_per_example

from fisherprune.cli.export import pruned_from_checkpoint
from fisherprune.train.checkpoint import CheckpointManager

# the built-in digits CNN, 4 wide: 3 prunes reach 50% of its FLOPs by step 10 (a prune every 2
# steps after 5 dense ones), then 6 fine-tuning steps (11-16) distilled from the dense model
DIGITS = [
    "--data", "digits", "--model", "cnn", "--width", "4", "--pruning.burn_in", "5",
    "--pruning_iter", "2", "--eval_every", "4", "--fine_tune_steps", "6",
    "--checkpoint_every", "2", "--keep_checkpoints", "50", "--distill_alpha", "0.5",
    "--export_formats", "state_dict", "--threads", "1", "--progress", "plain",
    "--dense_check", "warn",
]  # fmt: skip


@dataclass
class Runs:
    shrunk: Path  # the default: fine-tuned shrunk
    masked: Path  # --fine_tune_masked
    out: str  # what the shrunk run printed


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    tmp = tmp_path_factory.mktemp("shrunk")
    code, out, err = run_cli("train", *DIGITS, "--save_dir", tmp / "shrunk")
    assert code == 0, err
    code, _, err = run_cli("train", *DIGITS, "--fine_tune_masked", "--save_dir", tmp / "masked")
    assert code == 0, err
    return Runs(tmp / "shrunk", tmp / "masked", out)


def _checkpoints(save: Path) -> dict[int, Path]:
    paths = CheckpointManager(save / "checkpoints", 50).paths()
    return {int(p.name[5:13]): p for p in paths}


def _final(save: Path) -> dict[str, Any]:
    return CheckpointManager.load(max(_checkpoints(save).items())[1])


def _result(save: Path) -> dict[str, Any]:
    return json.loads((save / "result.json").read_text())


def test_shrunk_fine_tuning_exports_the_masked_fine_tunings_model(runs: Runs) -> None:
    """The shrunk run exports the model the masked run exports: the same plan.json, the same
    tensors to float32 rounding, the same costs, parameter counts and final accuracy."""
    assert "shrunk the model in place" in runs.out
    plan = (runs.shrunk / "export" / "plan.json").read_text()
    assert plan == (runs.masked / "export" / "plan.json").read_text()
    a = torch.load(runs.shrunk / "export" / "model.pt", weights_only=True)
    b = torch.load(runs.masked / "export" / "model.pt", weights_only=True)
    assert a["plan"] == b["plan"] and a["plan"]["modules"], "nothing was pruned"
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for k, v in a["state_dict"].items():
        torch.testing.assert_close(v, b["state_dict"][k], rtol=1e-5, atol=1e-5, msg=k)
    ra, rb = _result(runs.shrunk), _result(runs.masked)
    for key in ("dense_cost", "final_cost", "dense_params", "final_params", "prunes", "steps"):
        assert ra[key] == rb[key], key
    assert ra["final_metric"] == pytest.approx(rb["final_metric"], abs=1 / 360)  # one eval row


def test_checkpoints_after_the_shrink_hold_the_small_model_at_the_final_cost(runs: Runs) -> None:
    """The shrunk run's checkpoints after the shrink hold no masks and fewer weights than the
    masked run's, record the shrink, and rebuild a model whose FlopCounterMode count is the
    run's final cost; the masked run's checkpoints keep their masks."""
    shrunk, masked = _final(runs.shrunk), _final(runs.masked)
    assert shrunk["pruner"]["shrunk"] and not masked["pruner"]["shrunk"]
    assert not any(k.endswith(".mask") for k in shrunk["model"])
    assert any(k.endswith(".mask") for k in masked["model"])
    size = sum(v.numel() for k, v in shrunk["model"].items() if k.endswith("weight"))
    dense = sum(v.numel() for k, v in masked["model"].items() if k.endswith("weight"))
    assert size < dense
    model, example, plan = pruned_from_checkpoint(str(max(_checkpoints(runs.shrunk).items())[1]))
    assert plan is not None
    assert flops_per_example(model, example) == _result(runs.shrunk)["final_cost"]


def test_resume_after_the_shrink_ends_with_the_uninterrupted_weights(
    runs: Runs, tmp_path: Path
) -> None:
    """A run stopped after a checkpoint written after the shrink (the later ones gone, as a
    kill leaves it) and resumed ends with bit for bit the uninterrupted run's final weights
    and export: masks, held optimizer state, teacher and weights come back in that order."""
    steps = _checkpoints(runs.shrunk)
    after = [s for s, p in steps.items() if CheckpointManager.load(p)["pruner"]["shrunk"]]
    cut = min(after)
    assert cut < max(steps), "no fine-tuning step after the first checkpoint of the shrink"
    save = tmp_path / "run"
    (save / "checkpoints").mkdir(parents=True)
    for s, p in steps.items():
        if s <= cut:
            shutil.copy(p, save / "checkpoints" / p.name)
            shutil.copy(p.with_name(p.name + ".sha256"), save / "checkpoints")
    code, out, err = run_cli("train", *DIGITS, "--save_dir", save, "--resume")
    assert code == 0, err
    assert f"(step {cut})" in out and "shrunk the model in place" in out
    final, straight = _final(save)["model"], _final(runs.shrunk)["model"]
    assert final.keys() == straight.keys()
    assert [k for k in final if not torch.equal(final[k], straight[k])] == []
    a = torch.load(save / "export" / "model.pt", weights_only=True)["state_dict"]
    b = torch.load(runs.shrunk / "export" / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in b)
