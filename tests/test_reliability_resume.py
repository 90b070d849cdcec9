"""Resume continues the same run or says why not (issue 19, item 2)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from fisherprune.cli.main import main
from fisherprune.train.config import TrainConfig
from fisherprune.train.resume_check import (
    ALLOWED_CHANGES,
    ResumeMismatchError,
    data_fingerprint,
    resume_changes,
)


def _csv(path: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(80, 4))
    y = (x[:, 0] > 0).astype(int)
    rows = ["a,b,c,d,label"] + [",".join(map(str, r)) + f",{t}" for r, t in zip(x, y, strict=True)]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_fingerprint_is_the_sha256_of_each_data_file(tmp_path: Path) -> None:
    data = _csv(tmp_path / "t.csv", 0)
    fp = data_fingerprint(TrainConfig(data=str(data)).to_dict())
    assert fp == {"data": hashlib.sha256(data.read_bytes()).hexdigest()}
    assert data_fingerprint(TrainConfig(data="digits").to_dict()) == {}


@pytest.mark.parametrize(
    "change",
    [
        {"pruning_flops_target": "25%"},
        {"seed": 7},
        {"data": "other.csv"},
        {"model": "resnet"},
        {"pruning_convention": "macs"},
    ],
)
def test_a_result_changing_setting_is_refused_with_its_old_and_new_value(change: dict) -> None:
    saved = TrainConfig().to_dict()
    now = {**saved, **change}
    ((name, _),) = change.items()
    with pytest.raises(ResumeMismatchError, match=rf"{name}: {saved[name]!r} in the checkpoint"):
        resume_changes(saved, {}, now, {}, "ckpt")


def test_allowed_changes_are_listed_and_not_refused() -> None:
    saved = TrainConfig().to_dict()
    now = {**saved, "steps": 500, "threads": 2, "resume": True}
    assert resume_changes(saved, {}, now, {}, "ckpt") == [
        "steps: None -> 500",
        "threads: None -> 2",
    ]
    assert {"steps", "eval_every", "threads"} <= set(ALLOWED_CHANGES)


def test_a_setting_the_checkpoint_predates_counts_at_its_default() -> None:
    """A checkpoint written before a setting existed (here ``pruning_latency_form``) resumes
    when the setting is at its default, and is refused when it is not."""
    now = TrainConfig().to_dict()
    saved = {k: v for k, v in now.items() if k != "pruning_latency_form"}
    defaults = TrainConfig().to_dict()
    assert resume_changes(saved, {}, now, {}, "ckpt", defaults=defaults) == []
    other = {**now, "pruning_latency_form": "torchscript"}
    with pytest.raises(ResumeMismatchError, match=r"pruning_latency_form: 'eager' in the"):
        resume_changes(saved, {}, other, {}, "ckpt", defaults=defaults)


def test_changed_data_content_is_refused(tmp_path: Path) -> None:
    saved = TrainConfig(data="t.csv").to_dict()
    with pytest.raises(ResumeMismatchError, match=r"content of t.csv changed"):
        resume_changes(saved, {"data": "aa"}, saved, {"data": "bb"}, "ckpt")
    assert resume_changes(saved, None, saved, {"data": "bb"}, "ckpt") == []  # older checkpoint


def test_cli_resume_with_another_seed_or_data_exits_2_listing_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The old trainer accepted --seed 7 (which redraws the eval split) and another --data
    file on --resume; now both are refused in one line, exit 2, and the checkpoints stay."""
    data = _csv(tmp_path / "t.csv", 0)
    base = [
        "train", "--model", "mlp", "--width", "4", "--depth", "1", "--steps", "8",
        "--pruning.burn_in", "4", "--progress", "none", "--export_formats", "state_dict",
        "--save_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    assert main([*base, "--data", str(data)]) == 0
    before = sorted((tmp_path / "run" / "checkpoints").iterdir())
    data.write_text(_csv(tmp_path / "u.csv", 1).read_text())  # same path, other rows
    capsys.readouterr()
    assert main([*base, "--data", str(data), "--resume", "--seed", "7"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "seed: 0 in the checkpoint, 7 now" in err and "content of" in err
    assert sorted((tmp_path / "run" / "checkpoints").iterdir()) == before


def test_round_to_is_compared_as_the_run_pruned_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run saved with ``--pruning.round_to 1`` resumes without the flag (unset resolves to
    1 under FLOPs), and one resumed with ``--pruning.round_to 2`` is refused naming both."""
    data = _csv(tmp_path / "t.csv", 0)
    base = [
        "train", "--model", "mlp", "--width", "4", "--depth", "1", "--steps", "8",
        "--pruning.burn_in", "4", "--progress", "none", "--export_formats", "state_dict",
        "--save_dir", str(tmp_path / "run"), "--data", str(data),
    ]  # fmt: skip
    assert main([*base, "--pruning.round_to", "1"]) == 0
    assert main([*base, "--resume"]) == 0
    capsys.readouterr()
    assert main([*base, "--resume", "--pruning.round_to", "2"]) == 2
    assert "pruning_round_to: 1 in the checkpoint, 2 now" in capsys.readouterr().err
