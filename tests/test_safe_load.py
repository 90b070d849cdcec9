"""Loading nothing that can run code (issue 15): checkpoints, exports and plans are read as
tensors and plain data only; a file holding pickled Python objects is refused, naming the file,
and the code it carries never runs.

The crafted files below hold an object whose ``__reduce__`` calls ``_leave_marker``, which writes
a marker file under ``tmp_path``: the marker's absence after a refusal shows nothing ran, and
``test_crafted_file_runs_code_when_unpickled_freely`` shows the marker does appear when the same
file is unpickled without restriction. Every file is written under ``tmp_path``.
"""

from __future__ import annotations

import io
import pickle
import random
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fisherprune as fp
from fisherprune.cli.main import main
from fisherprune.export.safe_load import looks_pickled
from fisherprune.train.checkpoint import CheckpointManager, rng_state, set_rng_state
from fisherprune.train.models import build_model

WRITERS = ["torch.save", "pickle.dump"]
REFUSAL = "holds pickled Python objects"
WHY = "because loading them can run code"
FAST = [
    "--model", "mlp", "--width", "8", "--depth", "1",
    "--pruning.burn_in", "5", "--pruning_iter", "2", "--eval_every", "10",
    "--fine_tune_steps", "5", "--export_formats", "state_dict", "--threads", "1",
    "--progress", "plain",
]  # fmt: skip


def _leave_marker(path: str) -> str:
    """What the crafted pickle calls when it is loaded: the marker file is proof that code ran."""
    Path(path).write_text("code from a loaded file ran")
    return path


class _Payload:
    """Pickles as a call to ``_leave_marker(marker)``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _leave_marker, (str(self.marker),)


def _write(path: Path, obj: Any, writer: str) -> Path:
    if writer == "torch.save":
        torch.save(obj, path)
    else:
        with path.open("wb") as f:
            pickle.dump(obj, f)
    return path


def _crafted_checkpoint(directory: Path, marker: Path, writer: str = "torch.save") -> Path:
    """``directory/ckpt-00000010.pt``, shaped like a checkpoint, that runs code when unpickled."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {"model": {}, "pruner": {}, "rng": _Payload(marker)}
    return _write(directory / "ckpt-00000010.pt", state, writer)


def _assert_refused(message: str, path: Path) -> None:
    assert len(message.strip().splitlines()) == 1, message
    assert str(path) in message and REFUSAL in message and WHY in message, message


def _write_csv(path: Path) -> Path:
    """60 rows of 4 features and a 0/1 label: training data for a tiny mlp."""
    x = np.random.default_rng(0).normal(size=(60, 4))
    rows = [",".join(f"{v:.5f}" for v in r) + f",{int(r[0] > 0)}" for r in x]
    path.write_text("a,b,c,d,label\n" + "\n".join(rows) + "\n")
    return path


def _run_cli(*argv: Any) -> tuple[int, str]:
    """``fisherprune ARGV`` in-process: exit code and stderr (thread count restored)."""
    threads = torch.get_num_threads()
    err = io.StringIO()
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(err):
            code = main([str(a) for a in argv])
    finally:
        torch.set_num_threads(threads)
    return code, err.getvalue()


@pytest.fixture
def global_rngs() -> Iterator[None]:
    """Leave the process-wide random generators as the test found them."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


def _draws() -> list[Any]:
    """Numbers from every generator a checkpoint restores, including the cached Gaussians."""
    return [
        random.random(),
        random.gauss(0.0, 1.0),
        np.random.standard_normal(3).tolist(),
        np.random.randint(0, 2**31, size=4).tolist(),
        torch.rand(3).tolist(),
    ]


# ===================================================================== the crafted file
@pytest.mark.parametrize("writer", WRITERS)
def test_crafted_file_runs_code_when_unpickled_freely(tmp_path: Path, writer: str) -> None:
    """The crafted checkpoint does run code when unpickled without restriction: the refusals
    below are not vacuous."""
    marker = tmp_path / "pwned"
    path = _crafted_checkpoint(tmp_path / "checkpoints", marker, writer)
    assert not marker.exists()
    if writer == "torch.save":
        torch.load(path, weights_only=False)
    else:
        with path.open("rb") as f:
            pickle.load(f)
    assert marker.exists()


# ========================================================================== public API
@pytest.mark.parametrize("writer", WRITERS)
def test_checkpoint_with_pickled_objects_is_refused_and_nothing_runs(
    tmp_path: Path, writer: str
) -> None:
    """CheckpointManager.load refuses a checkpoint holding pickled objects with a one-line
    PickledObjectsError (a ValueError) naming the file; its code does not run."""
    marker = tmp_path / "pwned"
    path = _crafted_checkpoint(tmp_path / "checkpoints", marker, writer)
    with pytest.raises(fp.PickledObjectsError) as err:
        CheckpointManager.load(path)
    assert isinstance(err.value, ValueError)
    _assert_refused(str(err.value), path)
    assert not marker.exists()


@pytest.mark.parametrize("writer", WRITERS)
def test_export_with_pickled_objects_is_refused_and_model_unchanged(
    tmp_path: Path, writer: str
) -> None:
    """load_state_dict_export refuses an export holding pickled objects, naming the file; its
    code does not run and the fresh model is left as it was."""
    marker = tmp_path / "pwned"
    path = _write(tmp_path / "model.pt", {"state_dict": {}, "plan": _Payload(marker)}, writer)
    model = build_model("mlp", (4,), 3, 8, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(fp.PickledObjectsError) as err:
        fp.load_state_dict_export(path, model)
    _assert_refused(str(err.value), path)
    assert not marker.exists()
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("writer", WRITERS)
def test_plan_with_pickled_objects_is_refused(tmp_path: Path, writer: str) -> None:
    """PruningPlan.load refuses a pickle in place of the JSON plan, naming the file; its code
    does not run."""
    marker = tmp_path / "pwned"
    path = _write(tmp_path / "plan.json", {"format": 1, "modules": _Payload(marker)}, writer)
    with pytest.raises(fp.PickledObjectsError) as err:
        fp.PruningPlan.load(path)
    _assert_refused(str(err.value), path)
    assert not marker.exists()


def test_older_checkpoint_is_refused_saying_so_and_what_to_do(tmp_path: Path) -> None:
    """A checkpoint in the previous format (numpy's RNG state pickled as an ndarray) is refused;
    the message says an older fisherprune wrote it, which global it needs, and what to do."""
    old = {
        "model": {},
        "pruner": {},
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        },
    }
    path = tmp_path / "ckpt-00000010.pt"
    torch.save(old, path)
    with pytest.raises(fp.PickledObjectsError) as err:
        CheckpointManager.load(path)
    message = str(err.value)
    _assert_refused(message, path)
    assert "older fisherprune" in message and "numpy" in message, message
    assert "fisherprune export" in message and "--save_dir" in message, message


def test_file_that_is_no_pickle_is_not_called_pickled(tmp_path: Path) -> None:
    """A file that is neither a pickle nor a torch file is reported as unreadable in one line,
    not as holding pickled objects (the refusal names only real pickles)."""
    path = tmp_path / "ckpt-00000010.pt"
    path.write_text("not a checkpoint\n")
    with pytest.raises(ValueError, match="cannot read checkpoint") as err:
        CheckpointManager.load(path)
    assert not isinstance(err.value, fp.PickledObjectsError)
    assert len(str(err.value).splitlines()) == 1, str(err.value)


# ============================================================================ the CLI
@pytest.mark.parametrize("command", ["export", "flops"])
def test_cli_refuses_a_crafted_checkpoint(tmp_path: Path, command: str) -> None:
    """``fisherprune export|flops --checkpoint`` on a crafted checkpoint exits 2 with one error
    line naming the file; its code does not run and nothing is exported."""
    marker = tmp_path / "pwned"
    path = _crafted_checkpoint(tmp_path / "run" / "checkpoints", marker)
    out = tmp_path / "m.pt"
    extra = ["--out", out] if command == "export" else []
    code, err = _run_cli(command, "--checkpoint", path, *extra)
    assert code == 2, err
    assert err.startswith(f"fisherprune {command}: error: "), err
    _assert_refused(err, path)
    assert not marker.exists()
    assert not out.exists()


def test_cli_resume_refuses_a_crafted_checkpoint(tmp_path: Path) -> None:
    """``fisherprune train --resume`` in a run directory holding a crafted checkpoint exits 2
    with one error line naming it; its code does not run and the file is left in place."""
    data = _write_csv(tmp_path / "t.csv")
    marker = tmp_path / "pwned"
    save = tmp_path / "run"
    path = _crafted_checkpoint(save / "checkpoints", marker)
    code, err = _run_cli(
        "train", "--data", data, "--train.steps", "20", *FAST, "--save_dir", save, "--resume"
    )
    assert code == 2, err
    _assert_refused(err, path)
    assert not marker.exists()
    assert CheckpointManager(save / "checkpoints", 1).paths() == [path]


# =========================================================== what fisherprune writes
def test_checkpoint_round_trips_under_weights_only_with_identical_streams(
    tmp_path: Path, global_rngs: None
) -> None:
    """A checkpoint of rng_state() names no global torch refuses, loads with
    weights_only=True, and set_rng_state of it continues the python, numpy and torch streams
    exactly where they were saved (cached Gaussians included)."""
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0.0, 1.0)  # leaves python's second Gaussian cached
    np.random.standard_normal()  # and numpy's: has_gauss = 1
    path = CheckpointManager(tmp_path, keep=1).save(
        10, {"model": {}, "pruner": {}, "rng": rng_state()}
    )
    expected = _draws()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert _draws() != expected  # the streams were really moved away
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
    torch.load(path, weights_only=True)
    set_rng_state(CheckpointManager.load(path)["rng"])
    assert _draws() == expected


def test_trainer_checkpoint_loads_with_weights_only(tmp_path: Path) -> None:
    """Every part of a real training checkpoint (model, pruner, optimizer, history, RNG,
    config, metrics) is tensors and plain data: torch names no unsafe global in it."""
    data = _write_csv(tmp_path / "t.csv")
    save = tmp_path / "run"
    code, err = _run_cli("train", "--data", data, "--train.steps", "12", *FAST, "--save_dir", save)
    assert code == 0, err
    path = CheckpointManager(save / "checkpoints", 1).latest()
    assert path is not None
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
    state = torch.load(path, weights_only=True)
    assert state["pruner"]["history"], "the run pruned nothing: the history went untested"


def test_save_refuses_a_state_it_could_not_load_back(tmp_path: Path) -> None:
    """CheckpointManager.save of a state holding a numpy array raises TypeError naming the
    class, writes no file and keeps the older checkpoint."""
    manager = CheckpointManager(tmp_path, keep=1)
    kept = manager.save(5, {"model": {}, "pruner": {}})
    with pytest.raises(TypeError, match="numpy"):
        manager.save(10, {"model": {}, "pruner": {}, "extra": np.zeros(3)})
    assert sorted(tmp_path.iterdir()) == [kept, kept.with_name(kept.name + ".sha256")]


def test_a_plain_tensor_file_is_not_taken_for_pickled_objects(tmp_path: Path) -> None:
    """A ``torch.save`` file of tensors names only torch's own rebuild functions, which the
    weights-only loader allows: ``looks_pickled`` says no, so a damaged such file is called
    damaged, not a pickle of objects."""
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(3), "n": 2}, path)
    assert not looks_pickled(path)
