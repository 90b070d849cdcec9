"""The smaller cases of issue 19's sweep (item 8): each a clear one-line error or a working
command instead of a traceback, a wrong message or a silently dropped setting."""

from __future__ import annotations

import gzip
import io
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
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


@pytest.mark.parametrize(
    "content",
    # random bytes drawn from a seed: pytest-xdist's workers must collect the same test ids
    [random.Random(0).randbytes(300), b"PK\x03\x04garbage"],
    ids=["random-bytes", "zip-header"],
)
def test_a_garbage_npz_is_not_given_numpys_allow_pickle_advice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    bad = tmp_path / "x.npz"
    bad.write_bytes(content)
    code, err = _err(["train", "--data", str(bad), "--save_dir", str(tmp_path / "r")], capsys)
    assert code == 2 and str(bad) in err and "allow_pickle" not in err
    assert len(err.strip().splitlines()) == 1


def _bad_tables() -> dict[str, bytes]:
    """File name -> content of table files that cannot be used (tiny, deterministic)."""
    table = io.BytesIO()
    pq.write_table(pa.table({"x": [1.0, 2.0], "raw": [b"a", b"b"], "label": [0, 1]}), table)
    gz = gzip.compress(b"x,label\n" + b"".join(b"%d,%d\n" % (i, i % 2) for i in range(99)))
    return {
        "random.csv": random.Random(0).randbytes(300),
        "binary_row.csv": b"x,label\n1,0\n" + bytes(range(128, 200)) + b"\n2,1\n",
        "truncated.csv.gz": gz[: len(gz) // 2],
        "binary_column.parquet": table.getvalue(),
    }


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("random.csv", "not a CSV text file: byte 0x"),
        ("binary_row.csv", "not a CSV text file: byte 0x80 at offset 12"),
        ("truncated.csv.gz", "cannot decompress: Truncated compressed stream"),
        ("binary_column.parquet", "feature column 'raw' holds binary values"),
    ],
)
def test_an_unusable_table_file_is_one_line_naming_it_and_no_raw_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, words: str
) -> None:
    """Random bytes named .csv, a CSV row of binary bytes, a cut .csv.gz and a Parquet column
    of bytes: exit 2, one line of printable ASCII that names the file and the problem (the
    CSVs gave pyarrow's parse error with the raw bytes, the .csv.gz no file name, the
    Parquet column was one-hot encoded)."""
    bad = tmp_path / name
    bad.write_bytes(_bad_tables()[name])
    code, err = _err(["train", "--data", str(bad), "--save_dir", str(tmp_path / "r")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{bad}: {words}" in err
    assert err.isascii() and err.strip().isprintable(), err


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
