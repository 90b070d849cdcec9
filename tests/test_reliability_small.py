"""The smaller cases of issue 19's sweep (item 8): each a clear one-line error or a working
command instead of a traceback, a wrong message or a silently dropped setting."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import fisherprune as fp
from fisherprune.cli.main import build_parser, main
from fisherprune.train import PruningTrainer
from fisherprune.train.config import TrainConfig
from fisherprune.train.trainer import PruningTrainer as DefinedTrainer


def _err(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_verbose_is_accepted_after_the_subcommand() -> None:
    parser = build_parser()
    assert parser.parse_args(["train", "-v"]).verbose is True
    assert parser.parse_args(["-v", "env"]).verbose is True
    assert parser.parse_args(["env"]).verbose is False


def test_a_directory_as_config_says_it_is_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _err(["train", "--config", str(tmp_path)], capsys)
    assert code == 2 and "is a directory" in err


@pytest.mark.parametrize("content", [os.urandom(300), b"PK\x03\x04garbage"])
def test_a_garbage_npz_is_not_given_numpys_allow_pickle_advice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    bad = tmp_path / "x.npz"
    bad.write_bytes(content)
    code, err = _err(["train", "--data", str(bad), "--save_dir", str(tmp_path / "r")], capsys)
    assert code == 2 and str(bad) in err and "allow_pickle" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_negative_list_value_reaches_its_check(capsys: pytest.CaptureFixture[str]) -> None:
    """--image_shape -1,8,8 is parsed as the flag's value (argparse took it for an option and
    said "expected one argument"), and the shape's own check answers."""
    code, err = _err(["train", "--image_shape", "-1,8,8"], capsys)
    assert code == 2 and "image_shape sizes must be positive integers" in err


def test_a_config_naming_both_spellings_of_a_setting_is_an_error(tmp_path: Path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"pruning.iter": 5, "pruning_iter": 7}))
    with pytest.raises(ValueError, match=r"'pruning.iter' and 'pruning_iter' both set"):
        TrainConfig.from_file(cfg)
    with pytest.raises(ValueError, match="both set steps"):
        TrainConfig.from_dict({"train.steps": 5, "steps": 7})


def test_a_command_line_flag_still_overrides_the_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"pruning.iter": 5}))
    assert TrainConfig.from_file(cfg, {"pruning_iter": 7}).pruning_iter == 7


def test_pruning_trainer_is_importable_from_fisherprune_train() -> None:
    assert PruningTrainer is DefinedTrainer


def test_computational_cost_of_a_batch_of_0_says_so() -> None:
    """It raised ZeroDivisionError."""
    model = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(ValueError, match="batch of 0 examples"):
        fp.computational_cost(model, torch.zeros(0, 4))
