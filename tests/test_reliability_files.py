"""Filesystem errors are one-line messages naming the path and the cause, with a non-zero
exit and no partial file (issue 19, item 5)."""

from __future__ import annotations

import errno
import os
import shlex
from pathlib import Path

import pytest
import torch
from cli_run import run_cli
from torch import nn

import fisherprune as fp
from fisherprune.cli.main import main
from fisherprune.export import export_model, storage
from fisherprune.export.storage import os_error_text


def _masked() -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(1, 6)
    fp.apply_masks(model, x)
    return model, x


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (errno.ENOSPC, "disk full"),
        (errno.EROFS, "read-only file system"),
        (errno.EACCES, "permission denied"),
        (errno.ENOTDIR, "not a directory"),
    ],
)
def test_os_error_text_names_the_path_and_the_cause(code: int, words: str) -> None:
    text = os_error_text(OSError(code, os.strerror(code), "/x/model.pt"))
    assert text.startswith("/x/model.pt: ") and words in text


@pytest.mark.parametrize("fmt", ["state_dict", "torchscript"])
def test_export_to_a_full_disk_raises_enospc_naming_the_file_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """The writer fails with ENOSPC after writing part of the file: OSError(ENOSPC) naming the
    target, no file and no temporary file. (TorchScript went through torch.jit.save's own
    writer, which aborts the process on a full disk: it is now serialised in memory first.)"""

    def full(path: Path, data: bytes) -> None:
        path.write_bytes(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(storage, "write_file", full)
    model, x = _masked()
    target = tmp_path / "model.pt"
    with pytest.raises(OSError) as info:
        export_model(model, target, x, format=fmt)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(target)
    assert list(tmp_path.iterdir()) == []


def test_export_to_a_directory_says_it_is_one(tmp_path: Path) -> None:
    model, x = _masked()
    with pytest.raises(IsADirectoryError) as info:
        export_model(model, tmp_path, x)
    assert os_error_text(info.value).startswith(f"{tmp_path}: is a directory")


def test_cli_save_dir_under_a_file_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --save_dir whose parent is a regular file: exit 1, one line naming the path and
    saying a part of it is not a directory, no traceback."""
    (tmp_path / "f").write_text("")
    code = main(
        ["train", "--model", "mlp", "--width", "4", "--steps", "2", "--progress", "none",
         "--save_dir", str(tmp_path / "f" / "run")]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1, err
    assert len(err.strip().splitlines()) == 1 and "not a directory" in err
    assert str(tmp_path / "f") in err


@pytest.mark.parametrize("flag", ["--checkpoint", "--out"])
def test_cli_export_with_a_directory_says_it_is_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    run = tmp_path / "run"
    train = [
        "train", "--model", "mlp", "--width", "4", "--depth", "1", "--steps", "3",
        "--progress", "none", "--export_formats", "state_dict", "--save_dir", str(run),
    ]  # fmt: skip
    assert main(train) == 0
    ckpt = next((run / "checkpoints").glob("ckpt-*.pt"))
    args = {"--checkpoint": str(ckpt), "--out": str(tmp_path / "m.pt")}
    args[flag] = str(tmp_path)
    capsys.readouterr()
    code = main(["export", "--checkpoint", args["--checkpoint"], "--out", args["--out"]])
    err = capsys.readouterr().err
    assert code == 2 and "is a directory" in err and len(err.strip().splitlines()) == 1


def test_a_failed_export_after_a_run_names_the_command_that_exports_from_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--export_dir on a disk that fills at the end of a run: exit 1, one line that says so and
    names `fisherprune export --checkpoint <the run's last checkpoint> ...`; that command, run
    once the disk has room, writes the model (the export was lost with no way named)."""
    export = tmp_path / "export"
    write = storage.write_file

    def full_under_export(path: Path, data: bytes) -> None:
        if export in path.parents:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(path, data)

    monkeypatch.setattr(storage, "write_file", full_under_export)
    code, _, err = run_cli(
        "train", "--model", "mlp", "--width", "4", "--depth", "1", "--steps", "3",
        "--progress", "none", "--export_formats", "state_dict",
        "--save_dir", tmp_path / "run", "--export_dir", export,
    )  # fmt: skip
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "disk full" in err and "export with: fisherprune export --checkpoint" in err
    command = shlex.split(err.split("export with: ")[1])
    (ckpt,) = (tmp_path / "run" / "checkpoints").glob("ckpt-*.pt")
    assert command[:4] == ["fisherprune", "export", "--checkpoint", str(ckpt)]
    monkeypatch.undo()
    assert run_cli(*command[1:])[0] == 0
    assert (export / "model.pt").is_file() and not (tmp_path / "run" / "result.json").exists()
