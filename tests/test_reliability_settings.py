"""Settings that cannot work are refused before training (issue 19, item 6), and what the
target means is said at the start: at or above the dense cost, or 0 (prune to the floor)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from fisherprune.cli.main import main
from fisherprune.train.config import TrainConfig

RUN = [
    "train", "--model", "mlp", "--width", "8", "--depth", "1", "--pruning.burn_in", "6",
    "--pruning.iter", "1", "--fine_tune_steps", "3", "--progress", "plain",
    "--export_formats", "state_dict", "--dense_check", "warn",
]  # fmt: skip


def test_width_0_is_refused() -> None:
    with pytest.raises(ValueError, match="width must be an integer >= 1"):
        TrainConfig(width=0)


def test_resume_with_overwrite_is_refused() -> None:
    with pytest.raises(ValueError, match="resume and overwrite"):
        TrainConfig(resume=True, overwrite=True)


def test_min_channels_0_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The old trainer trained the whole run and failed at export (an emptied conv); now it is
    refused at the start: exit 2, one line, the save directory not even created."""
    save = tmp_path / "run"
    code = main([*RUN, "--pruning.min_channels", "0", "--save_dir", str(save)])
    err = capsys.readouterr().err
    assert code == 2 and "pruning_min_channels 0" in err and len(err.strip().splitlines()) == 1
    assert not save.exists()


def test_target_above_the_dense_cost_trains_and_reports_the_dense_phase(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing is pruned, but the dense model is trained, measured and reported (the old
    trainer skipped training and reported "dense: accuracy nan")."""
    save = tmp_path / "run"
    with pytest.warns(UserWarning, match="not below the starting cost"):
        code = main([*RUN, "--pruning.flops_target", "1e12", "--save_dir", str(save)])
    out = capsys.readouterr().out
    assert code == 0
    assert "at or above the dense cost" in out and "nothing will be pruned" in out
    result = json.loads((save / "result.json").read_text())
    assert math.isfinite(result["dense_metric"]) and result["prunes"] == 0
    assert result["steps"] == 6 + 3


def test_target_0_says_it_prunes_to_the_floor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With min_channels 3 the 8-unit layer stops at 3: the run says so at the start, and the
    final kept count is what it said."""
    save = tmp_path / "run"
    argv = [*RUN, "--pruning.flops_target", "0", "--pruning.min_channels", "3"]
    assert main([*argv, "--save_dir", str(save)]) == 0
    out = capsys.readouterr().out
    assert "target 0: no cost target; pruning every group down to its floor" in out
    assert "3 of 8 channels kept" in out
    final = json.loads((save / "metrics.jsonl").read_text().splitlines()[-1])
    assert list(final["kept"].values()) == [3]


@pytest.mark.parametrize(
    ("value", "message"),
    [("-5", r"pruning.flops_target must be >= 0 \(0: no target\), got -5"),
     ("lots", r"pruning.flops_target 'lots' is not a number or a percentage")],
)  # fmt: skip
def test_a_negative_or_non_numeric_target_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, message: str
) -> None:
    """Issue 35, point 5: ``--pruning.flops_target -5`` was read as "no target" and every group
    was pruned to its floor (0.9% of the FLOPs); now exit 2, one line naming the setting,
    before anything is written."""
    save = tmp_path / "run"
    code = main([*RUN, "--pruning.flops_target", value, "--save_dir", str(save)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not save.exists()
