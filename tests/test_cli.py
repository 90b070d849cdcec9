"""The ``fisherprune`` command line and the trainer behind it, end to end on tiny data made here.

Runs call ``fisherprune.cli.main.main`` in-process (fast); a subprocess is used only for the
console script itself and for ``kill -9`` / ``--resume``. Every run writes under ``tmp_path``.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import fisherprune
from fisherprune.cli.export import model_from_checkpoint
from fisherprune.cli.main import build_parser, main
from fisherprune.cli.train import config_from_args
from fisherprune.export import load_aoti_export, storage
from fisherprune.train.checkpoint import CheckpointManager
from fisherprune.train.config import TrainConfig
from fisherprune.train.models import build_model
from fisherprune.train.scaling import model_from_meta

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 120  # seconds: every subprocess wait is bounded

# Fast settings shared by the training runs: burn-in of 5 steps, one prune every 2 steps.
FAST = [
    "--pruning.burn_in", "5",
    "--pruning_iter", "2",
    "--eval_every", "10",
    "--fine_tune_steps", "5",
    "--export_formats", "state_dict",
    "--threads", "1",
    "--progress", "plain",
    "--dense_check", "warn",  # a 5-step dense phase is not meant to learn
]  # fmt: skip
MLP8 = ["--model", "mlp", "--width", "8", "--depth", "1"]
# mlp with 4 inputs, one hidden layer and 3 outputs: every hidden unit costs 2*4 + 2*3 flops.
FLOPS_PER_UNIT = 14.0


# ============================================================================ helpers
@dataclass
class Cli:
    code: int
    out: str
    err: str


def run_cli(*argv: Any) -> Cli:
    """Run ``fisherprune`` in-process, as the console script would: exit code, stdout, stderr.

    An exception escaping ``main`` is shown as the interpreter would (traceback, exit 1). The
    thread count is restored afterwards (``--threads 1`` sets it process-wide).
    """
    threads = torch.get_num_threads()
    out, err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main([str(a) for a in argv])
            except SystemExit as e:  # argparse: usage errors, --help, --version
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:
                err.write(traceback.format_exc())
                code = 1
    finally:
        torch.set_num_threads(threads)
    return Cli(code, out.getvalue(), err.getvalue())


def _table(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows of 4 float features and a learnable label in 0..2."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0).astype(np.int64)
    return x, y


def _write_csv(path: Path, x: np.ndarray, y: np.ndarray, label: str = "label") -> Path:
    lines = [f"a,b,c,d,{label}"]
    lines += [",".join(f"{v:.6f}" for v in row) + f",{int(t)}" for row, t in zip(x, y, strict=True)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _write_parquet(path: Path, x: np.ndarray, y: np.ndarray) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    cols = {name: x[:, j] for j, name in enumerate("abcd")}
    pq.write_table(pa.table({**cols, "label": y}), path)
    return path


def _write_images(path: Path, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """An .npz of ``n`` 8x8 "images" (stored as (n, 8, 8)) whose class is the bright quadrant."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, size=n)
    x = rng.normal(scale=0.5, size=(n, 8, 8)).astype(np.float32)
    for i, c in enumerate(y):
        r, q = divmod(int(c), 2)
        x[i, 4 * r : 4 * r + 4, 4 * q : 4 * q + 4] += 1.5
    np.savez(path, x=x, y=y)
    return x, y


def _write_sequences(path: Path, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """An .npz of ``n`` sequences of 6 steps of 4 features (stored as (n, 6, 4)) whose class
    is the pair of steps that stands out."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, size=n)
    x = rng.normal(scale=0.5, size=(n, 6, 4)).astype(np.float32)
    for i, c in enumerate(y):
        x[i, 2 * int(c) : 2 * int(c) + 2] += 1.5
    np.savez(path, x=x, y=y)
    return x, y


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _tmp_files(root: Path) -> list[Path]:
    return [p for p in _files(root) if p.name.endswith(".tmp")]


def _result(save_dir: Path) -> dict[str, Any]:
    return json.loads((save_dir / "result.json").read_text())


def _latest_checkpoint(save_dir: Path) -> Path:
    path = CheckpointManager(save_dir / "checkpoints", 1).latest()
    assert path is not None, f"no checkpoint in {save_dir}"
    return path


def _eval_outputs(model: Any, x: torch.Tensor) -> torch.Tensor:
    if isinstance(model, nn.Module):
        model.eval()
    with torch.no_grad():
        return model(x)


# ======================================================= 1. training from records on disk
@dataclass
class Trained:
    """A finished run: where it wrote, what it printed, a fresh (unpruned) model of the same
    architecture, and the inputs and labels of the data."""

    save_dir: Path
    cli: Cli
    fresh: Callable[[], nn.Module]
    x: torch.Tensor
    y: torch.Tensor


def _train_format(name: str, tmp: Path) -> Trained:
    save = tmp / "run"
    x, y = _table(200, seed=1)
    fresh: Callable[[], nn.Module] = lambda: build_model("mlp", (4,), 3, 8, 1)  # noqa: E731
    if name == "csv":
        args = ["--data", _write_csv(tmp / "train.csv", x, y), *MLP8]
    elif name == "parquet":
        args = ["--data", _write_parquet(tmp / "train.parquet", x, y), *MLP8]
    elif name == "npz_cnn":
        xi, y = _write_images(tmp / "images.npz", 200, seed=2)
        x = xi.reshape(200, 1, 8, 8)
        args = ["--data", tmp / "images.npz", "--image_shape", "1,8,8", "--model", "cnn"]
        args += ["--width", "4"]
        fresh = lambda: build_model("cnn", (1, 8, 8), 3, 4, None)  # noqa: E731
    elif name == "npz_lstm":  # sequences read by the built-in recurrent model
        x, y = _write_sequences(tmp / "sequences.npz", 200, seed=2)
        args = ["--data", tmp / "sequences.npz", "--model", "lstm", "--width", "8"]
        fresh = lambda: build_model("lstm", (6, 4), 3, 8, None)  # noqa: E731
    elif name == "data_spec":
        # the label column is "target": only the spec says so (the default is "label")
        _write_csv(tmp / "table.csv", x, y, label="target")
        spec = {"source": "table.csv", "label": "target", "eval_fraction": 0.25}
        (tmp / "spec.json").write_text(json.dumps(spec))
        args = ["--data_spec", tmp / "spec.json", *MLP8]
    elif name == "eval_file":
        xe, ye = _table(60, seed=3)
        args = ["--data", _write_csv(tmp / "train.csv", x, y)]
        args += ["--eval_data", _write_csv(tmp / "eval.csv", xe, ye), *MLP8]
        x, y = xe, ye  # what the run evaluates on
    else:
        raise AssertionError(name)
    cli = run_cli("train", *args, "--train.steps", "40", *FAST, "--save_dir", save)
    assert cli.code == 0, cli.err
    if name not in ("npz_cnn", "npz_lstm"):  # a table's model carries its standardisation
        meta = CheckpointManager.load(_latest_checkpoint(save))["model_meta"]
        fresh = lambda: model_from_meta(meta)  # noqa: E731
    return Trained(save, cli, fresh, torch.from_numpy(x), torch.from_numpy(np.asarray(y)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Trained]:
    """``trained(name)``: the run on data format ``name``, trained once per module."""
    cache: dict[str, Trained] = {}

    def get(name: str) -> Trained:
        if name not in cache:
            cache[name] = _train_format(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


FORMATS = ["csv", "parquet", "npz_cnn", "npz_lstm", "data_spec", "eval_file"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_train_reaches_the_flops_target(trained: Callable[[str], Trained], fmt: str) -> None:
    """A run on records from disk ends at or below the default target (50% of the dense cost)."""
    r = _result(trained(fmt).save_dir)
    assert r["prunes"] > 0
    assert r["final_cost"] <= 0.5 * r["dense_cost"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_train_writes_report_metrics_plan_model(
    trained: Callable[[str], Trained], fmt: str
) -> None:
    """A run writes report.md, metrics.jsonl, result.json, export/plan.json and export/model.pt,
    and leaves no temporary file behind."""
    save = trained(fmt).save_dir
    for rel in ("report.md", "metrics.jsonl", "result.json", "export/plan.json", "export/model.pt"):
        assert (save / rel).is_file(), rel
    assert _tmp_files(save) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_exported_state_dict_reloads_to_the_masked_model(
    trained: Callable[[str], Trained], fmt: str
) -> None:
    """export/model.pt rebuilt with load_state_dict_export into a fresh model gives the outputs
    of the pruned, masked model of the final checkpoint."""
    t = trained(fmt)
    small = fisherprune.load_state_dict_export(t.save_dir / "export" / "model.pt", t.fresh())
    masked, _ = model_from_checkpoint(str(_latest_checkpoint(t.save_dir)))
    x = t.x[:64]
    torch.testing.assert_close(_eval_outputs(small, x), _eval_outputs(masked, x))


def test_exported_model_scores_the_recorded_eval_accuracy(
    trained: Callable[[str], Trained],
) -> None:
    """With a separate eval file, the reloaded export's accuracy on that file is the final
    accuracy recorded in result.json."""
    t = trained("eval_file")
    small = fisherprune.load_state_dict_export(t.save_dir / "export" / "model.pt", t.fresh())
    acc = float((_eval_outputs(small, t.x).argmax(1) == t.y).float().mean())
    assert acc == pytest.approx(_result(t.save_dir)["final_metric"], abs=1.5 / len(t.y))


# ============================================================================= 2. bad inputs
def _bad_inputs(tmp: Path) -> dict[str, Path]:
    x, y = _table(40, seed=0)
    d = tmp / "data"
    d.mkdir()
    paths = {"dir": d, "good": _write_csv(d / "good.csv", x, y)}
    paths["nolabel"] = d / "nolabel.csv"
    paths["nolabel"].write_text("a,b,y\n1,2,0\n3,4,1\n")
    paths["text"] = d / "text.csv"
    paths["text"].write_text("a,b,label\n1,2,0\n3,x,1\n4,5,1\n")
    paths["empty"] = d / "empty.csv"
    paths["empty"].write_text("")
    paths["header"] = d / "header.csv"
    paths["header"].write_text("a,b,label\n")
    paths["negative"] = d / "negative.csv"
    paths["negative"].write_text("a,b,label\n1,2,0\n3,4,-1\n5,6,1\n")
    paths["badkey"] = d / "badkey.json"
    paths["badkey"].write_text(json.dumps({"pruning_iter": 3, "bogus": 1}))
    paths["badtype"] = d / "badtype.json"
    paths["badtype"].write_text(json.dumps({"momentum": "high"}))
    paths["badspec"] = d / "badspec.json"
    paths["badspec"].write_text(json.dumps({"source": "good.csv", "lable": "label"}))
    paths["notckpt"] = d / "notckpt.pt"
    paths["notckpt"].write_text("not a checkpoint")
    return paths


def _case(case: str, argv: str, needles: list[str], **kw: Any) -> Any:
    """A bad command line; ``{name}`` stands for the path ``_bad_inputs`` made for ``name``."""
    return pytest.param(argv.split(), needles, id=case, **kw)


BAD = [
    _case("missing file", "train --data {dir}/nope.csv", ["nope.csv"]),
    _case("missing label column", "train --data {nolabel}", ["nolabel.csv", "'label'"]),
    _case("non-numeric value", "train --data {text}", ["text.csv", "'x'", "'b'", "row 2"]),
    _case("empty file", "train --data {empty}", ["empty.csv", "empty"]),
    _case("header only", "train --data {header}", ["header.csv", "no data rows"]),
    _case("negative label", "train --data {negative}", ["negative.csv", "-1", "row 2"]),
    _case("unknown flag", "train --data {good} --bogus 1", ["--bogus"]),
    _case("unknown config key", "train --config {badkey}", ["'bogus'"]),
    _case("missing config file", "train --config {dir}/no.json", ["no.json"]),
    _case("decay 1.5", "train --data {good} --pruning.decay 1.5", ["decay", "1.5"]),
    _case("bad flops target", "train --data {good} --pruning.flops_target lots", ["'lots'"]),
    _case("cnn on a table", "train --data {good} --model cnn", ["--model cnn"]),
    _case("unknown model", "train --data {good} --model nosuch", ["'nosuch'"]),
    _case(
        "model module missing",
        "train --data {good} --model nonexistent.module:fn",
        ["nonexistent.module"],
    ),
    _case("not an int", "train --data {good} --train.steps ten", ["--train.steps", "'ten'"]),
    _case("unknown data spec key", "train --data_spec {badspec}", ["badspec.json", "'lable'"]),
    _case(
        "export missing checkpoint",
        "export --checkpoint {dir}/no.pt --out {dir}/m.pt",
        ["no.pt"],
    ),
    _case("flops of a non-checkpoint", "flops --checkpoint {notckpt}", ["notckpt.pt"]),
    _case(
        "unknown score convention",
        "train --data {good} --pruning.score_convention seconds",
        ["pruning_score_convention", "'seconds'"],
    ),
    _case(
        "freeze with a format other than torchscript",
        "export --checkpoint {dir}/no.pt --format onnx --freeze --out {dir}/m.onnx",
        ["--freeze", "torchscript"],
    ),
    _case(
        "round_to below 1",
        "train --data {good} --pruning.round_to 0",
        ["pruning_round_to", "0"],
    ),
    _case(
        "config value of the wrong type",
        "train --data {good} --config {badtype}",
        ["momentum"],
    ),
]


@pytest.mark.parametrize(("argv", "needles"), BAD)
def test_bad_input_exits_2_with_one_error_line(
    tmp_path: Path, argv: list[str], needles: list[str]
) -> None:
    """A bad input exits with code 2 and one error line on stderr naming the file, column, row
    or flag, without a traceback and without writing any file."""
    paths = _bad_inputs(tmp_path)
    save = tmp_path / "run"
    args: list[Any] = [a.format(**paths) for a in argv]
    if args[0] == "train":
        args += ["--train.steps", "20", *FAST, *(MLP8 if "--model" not in args else [])]
        args += ["--save_dir", save]
    cli = run_cli(*args)
    lines = cli.err.strip().splitlines()
    assert "Traceback" not in cli.err, cli.err
    assert cli.code == 2, cli.err
    assert lines and "error:" in lines[-1], cli.err
    # one line; argparse's own errors come after its usage summary
    assert len(lines) == 1 or lines[0].startswith("usage:"), cli.err
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])
    assert not save.exists() or _files(save) == []
    assert _tmp_files(tmp_path) == []


def test_export_failing_midway_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If writing export/model.pt fails halfway (here: the file writer writes some bytes, then
    raises ENOSPC), neither model.pt nor a temporary file is left in the export directory, and
    the one-line error says the disk is full."""
    real_write = storage.write_file

    def failing_write(path: Path, data: bytes) -> None:
        if path.name.startswith(".model.pt."):  # the state_dict export, not a checkpoint
            Path(path).write_bytes(b"partial")
            raise OSError(28, "No space left on device")
        real_write(path, data)

    monkeypatch.setattr(storage, "write_file", failing_write)
    x, y = _table(200, seed=1)
    save = tmp_path / "run"
    cli = run_cli(
        "train", "--data", _write_csv(tmp_path / "t.csv", x, y), *MLP8, "--train.steps", "20",
        *FAST, "--save_dir", save,
    )  # fmt: skip
    assert cli.code != 0 and "model.pt: disk full" in cli.err, cli.err
    assert not (save / "export" / "model.pt").exists()
    assert _tmp_files(tmp_path) == []


def test_resume_from_another_models_checkpoint_exits_2(tmp_path: Path) -> None:
    """--resume with a checkpoint whose model does not match the configured one is a usage
    error: exit 2, one line, no traceback."""
    x, y = _table(60, seed=0)
    data = _write_csv(tmp_path / "t.csv", x, y)
    save = tmp_path / "run"
    base = ["train", "--data", data, "--model", "mlp", "--depth", "1", *FAST, "--save_dir", save]
    assert run_cli(*base, "--width", "8", "--train.steps", "10").code == 0
    cli = run_cli(*base, "--width", "6", "--train.steps", "20", "--resume")
    assert "Traceback" not in cli.err, cli.err
    assert cli.code == 2
    assert len(cli.err.strip().splitlines()) == 1


# ================================================================================== 3. flags
def _config(*argv: Any) -> TrainConfig:
    args = build_parser().parse_args(["train", *(str(a) for a in argv)])
    return config_from_args(args)


@pytest.mark.parametrize(
    ("dotted", "underscore", "value", "field", "expected"),
    [
        ("--pruning.iter", "--pruning_iter", "7", "pruning_iter", 7),
        ("--pruning.burn_in", "--pruning_burn_in", "11", "pruning_burn_in", 11),
        ("--pruning.flops_target", "--pruning_flops_target", "30%", "pruning_flops_target", "30%"),
        ("--pruning.decay", "--pruning_decay", "0.5", "pruning_decay", 0.5),
    ],
)
def test_dotted_and_underscore_flags_set_the_same_config(
    dotted: str, underscore: str, value: str, field: str, expected: Any
) -> None:
    """The seed's dotted flag and its underscore spelling build the same config, with the
    value given (not the default)."""
    a, b = _config(dotted, value), _config(underscore, value)
    assert getattr(a, field) == expected != getattr(TrainConfig(), field)
    assert a == b


@pytest.mark.parametrize(
    ("file_key", "flag"), [("pruning.iter", "--pruning_iter"), ("pruning_iter", "--pruning.iter")]
)
def test_command_line_flag_overrides_config_file(tmp_path: Path, file_key: str, flag: str) -> None:
    """A flag given on the command line wins over the same setting in --config (in either
    spelling); the file's other settings stay."""
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({file_key: 3, "train.steps": 50, "pruning_decay": 0.8}))
    c = _config("--config", cfg, flag, "9")
    assert (c.pruning_iter, c.steps, c.pruning_decay) == (9, 50, 0.8)


@pytest.mark.parametrize(("target", "absolute"), [("25%", 56.0), ("100", 100.0), ("0.4", 89.6)])
def test_flops_target_relative_fraction_and_absolute(
    tmp_path: Path, target: str, absolute: float
) -> None:
    """A percentage, a fraction and an absolute --pruning.flops_target each stop pruning at most
    one channel below the target (mlp of 16 units: 224 flops, 14 per unit)."""
    x, y = _table(200, seed=1)
    data = _write_csv(tmp_path / "t.csv", x, y)
    cli = run_cli(
        "train", "--data", data, "--model", "mlp", "--width", "16", "--depth", "1",
        "--train.steps", "40", *FAST, "--pruning.flops_target", target,
        "--save_dir", tmp_path / "run",
    )  # fmt: skip
    assert cli.code == 0, cli.err
    r = _result(tmp_path / "run")
    assert r["dense_cost"] == 16 * FLOPS_PER_UNIT
    assert absolute - FLOPS_PER_UNIT < r["final_cost"] <= absolute


def test_round_to_and_score_convention_reach_the_export(tmp_path: Path) -> None:
    """--pruning.round_to 4 --pruning.score_convention memory: the run reaches its target, every
    pruned layer of the exported plan keeps a multiple of 4 units, and the shrunk export gives
    the outputs of the masked checkpoint."""
    x, y = _table(200, seed=1)
    save = tmp_path / "run"
    cli = run_cli(
        "train", "--data", _write_csv(tmp_path / "t.csv", x, y), "--model", "mlp",
        "--width", "16", "--depth", "1", "--pruning.round_to", "4",
        "--pruning.score_convention", "memory", "--train.steps", "60", *FAST,
        "--save_dir", save,
    )  # fmt: skip
    assert cli.code == 0, cli.err
    r = _result(save)
    assert r["prunes"] > 0 and r["final_cost"] <= 0.5 * r["dense_cost"]
    plan = json.loads((save / "export" / "plan.json").read_text())
    counts = [
        len(kept)
        for tensors in plan["modules"].values()
        for spec in tensors.values()
        for kept in spec["kept"].values()
    ]
    assert counts and all(c % 4 == 0 and c < 16 for c in counts), counts
    fresh = model_from_meta(CheckpointManager.load(_latest_checkpoint(save))["model_meta"])
    small = fisherprune.load_state_dict_export(save / "export" / "model.pt", fresh)
    masked, _ = model_from_checkpoint(str(_latest_checkpoint(save)))
    xt = torch.from_numpy(x[:64])
    torch.testing.assert_close(_eval_outputs(small, xt), _eval_outputs(masked, xt))


def _train_user_model(tmp_path: Path, builder: str, *extra: str) -> tuple[Cli, Path, np.ndarray]:
    x, y = _table(200, seed=1)
    data = _write_csv(tmp_path / "t.csv", x, y)
    save = tmp_path / "run"
    cli = run_cli(
        "train", "--data", data, "--model", f"tests._user_model:{builder}", "--width", "10",
        "--train.steps", "40", *FAST, *extra, "--save_dir", save,
    )  # fmt: skip
    return cli, save, x


@pytest.mark.parametrize("builder", ["build", "build_sequential"])
def test_user_model_from_package_module_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, builder: str
) -> None:
    """--model tests._user_model:<builder> trains the user's network (a module, or a bare
    nn.Sequential; width passed through), and its export reloads into a fresh network from the
    same builder with the outputs of the masked model."""
    monkeypatch.syspath_prepend(str(REPO))
    from tests import _user_model

    cli, save, x = _train_user_model(tmp_path, builder)
    assert cli.code == 0, cli.err
    r = _result(save)
    assert r["dense_cost"] == 10 * FLOPS_PER_UNIT and r["prunes"] > 0
    # the user's network between the scaling modules of the table's training rows
    fresh = model_from_meta(CheckpointManager.load(_latest_checkpoint(save))["model_meta"])
    assert isinstance(fresh.model, type(getattr(_user_model, builder)((4,), 3, 10)))
    small = fisherprune.load_state_dict_export(save / "export" / "model.pt", fresh)
    masked, _ = model_from_checkpoint(str(_latest_checkpoint(save)))
    xt = torch.from_numpy(x[:64])
    torch.testing.assert_close(_eval_outputs(small, xt), _eval_outputs(masked, xt))


# ============================================================================ 4. checkpoints
@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[str, str]]]:
    """A 23-step run with --checkpoint_every 5 --keep_checkpoints 2, and every os.replace
    (src, dst) made while it ran."""
    tmp = tmp_path_factory.mktemp("ckpt")
    x, y = _table(200, seed=1)
    data = _write_csv(tmp / "t.csv", x, y)
    replaced: list[tuple[str, str]] = []
    real = os.replace

    def spy(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
        replaced.append((str(src), str(dst)))
        real(src, dst, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "replace", spy)
        cli = run_cli(
            "train", "--data", data, *MLP8, "--train.steps", "23", *FAST,
            "--fine_tune_steps", "100", "--checkpoint_every", "5", "--keep_checkpoints", "2",
            "--save_dir", tmp / "run",
        )  # fmt: skip
    assert cli.code == 0, cli.err
    return tmp / "run", replaced


def test_only_the_newest_checkpoints_are_kept(
    checkpointed: tuple[Path, list[tuple[str, str]]],
) -> None:
    """--keep_checkpoints 2 leaves exactly the two newest checkpoints (the last periodic one and
    the final step), each loadable and with its hash file, and no temporary file."""
    save, _ = checkpointed
    files = sorted(p.name for p in (save / "checkpoints").iterdir())
    ckpts = ["ckpt-00000020.pt", "ckpt-00000023.pt"]
    assert files == sorted(ckpts + [f"{n}.sha256" for n in ckpts])
    for name in ckpts:
        state = CheckpointManager.load(save / "checkpoints" / name)
        assert state["state"]["step"] == int(name[5:13])
    assert _tmp_files(save) == []


def test_checkpoints_are_written_atomically(
    checkpointed: tuple[Path, list[tuple[str, str]]],
) -> None:
    """Every checkpoint appears by renaming a temporary file from the same directory onto its
    name (never written in place)."""
    save, replaced = checkpointed
    by_dst = {Path(dst).name: Path(src) for src, dst in replaced}
    for step in (5, 10, 15, 20, 23):
        src = by_dst.get(f"ckpt-{step:08d}.pt")
        assert src is not None, f"checkpoint of step {step} not renamed into place"
        assert src.parent == save / "checkpoints" and src.name.endswith(".tmp")


# --------------------------------------------------------------------- kill -9 and resume
KILL_ARGS = [
    "--model", "tests._user_model:slow", "--width", "16",
    "--train.steps", "120", "--checkpoint_every", "10",
    "--pruning.burn_in", "20", "--pruning_iter", "5", "--pruning.flops_target", "25%",
    "--fine_tune_steps", "200", "--eval_every", "10",
    "--export_formats", "state_dict", "--threads", "1", "--progress", "plain", "--seed", "3",
]  # fmt: skip


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _ckpt_steps(save: Path) -> list[int]:
    return [int(p.name[5:13]) for p in CheckpointManager(save / "checkpoints", 1).paths()]


@dataclass
class Kill:
    at: int  # newest checkpoint step when killed
    prunes: int  # prunes the newest checkpoint holds
    shrunk: bool  # the newest checkpoint holds the model shrunk for the fine-tuning


@dataclass
class Resumed:
    resumed: Path  # killed with kill -9 twice, resumed with --resume after each
    straight: Path  # the same run, uninterrupted
    kills: dict[str, Kill]  # by phase (KILL_AT)


# KILL_ARGS prune to the target by step 80, where the model is shrunk in place and fine-tunes
# to the step cap, 120: killed once a checkpoint at step >= 40 exists (pruning), resumed, and
# killed again once one at step >= 90 exists (fine-tuning the shrunk model)
KILL_AT = {"pruning": 40, "fine-tuning": 90}


def _kill_when_checkpointed(proc: subprocess.Popen, save: Path, step: int) -> str:
    """Wait until ``save`` holds a checkpoint at ``step`` or later, then SIGKILL ``proc``.

    Returns "" on success, else why not.
    """
    deadline = time.monotonic() + TIMEOUT
    while not any(s >= step for s in _ckpt_steps(save)):
        if proc.poll() is not None:
            return f"the run exited ({proc.returncode}) before a checkpoint at step >= {step}"
        if time.monotonic() > deadline:
            return f"no checkpoint at step >= {step} within {TIMEOUT} s"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    return ""


def _run_killed(
    run: list[str], save: Path, step: int, log: Path, meanwhile: Callable[[], Any]
) -> Kill:
    """Start ``run``, SIGKILL it once ``save`` holds a checkpoint at ``step`` or later (calling
    ``meanwhile`` in this process while it runs); what its newest checkpoint held."""
    why: list[str] = []
    with log.open("w") as out:
        proc = subprocess.Popen(run, stdout=out, stderr=subprocess.STDOUT, env=_subprocess_env())
        try:
            watcher = threading.Thread(
                target=lambda: why.append(_kill_when_checkpointed(proc, save, step))
            )
            watcher.start()
            meanwhile()
            watcher.join(TIMEOUT)
            proc.wait(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=TIMEOUT)
    assert why == [""], [*why, log.read_text()]
    assert proc.returncode == -signal.SIGKILL
    assert not (save / "result.json").exists(), "the run ended before it was killed"
    at_kill = CheckpointManager.load(_latest_checkpoint(save))
    history = at_kill["pruner"]["history"]
    return Kill(max(_ckpt_steps(save)), len(history), bool(at_kill["pruner"]["shrunk"]))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Resumed:
    """Run KILL_ARGS in a subprocess and SIGKILL it while pruning; --resume it and SIGKILL it
    again while it fine-tunes the shrunk model; then finish it with --resume. Meanwhile run
    the same settings uninterrupted in-process."""
    tmp = tmp_path_factory.mktemp("kill")
    x, y = _table(200, seed=1)
    data = _write_csv(tmp / "t.csv", x, y)
    argv = ["train", "--data", str(data), *KILL_ARGS]
    resumed_dir, straight = tmp / "resumed", tmp / "straight"
    run = [sys.executable, "-m", "fisherprune", *argv, "--save_dir", str(resumed_dir)]
    clis: list[Cli] = []

    def uninterrupted() -> None:
        with pytest.MonkeyPatch.context() as mp:
            mp.syspath_prepend(str(REPO))
            clis.append(run_cli(*argv, "--save_dir", straight))

    kills = {
        "pruning": _run_killed(run, resumed_dir, KILL_AT["pruning"], tmp / "1.log", uninterrupted)
    }
    assert clis[0].code == 0, clis[0].err
    kills["fine-tuning"] = _run_killed(
        [*run, "--resume"], resumed_dir, KILL_AT["fine-tuning"], tmp / "2.log", lambda: None
    )
    assert "resumed from" in (tmp / "2.log").read_text()
    done = subprocess.run(
        [*run, "--resume"], capture_output=True, text=True, timeout=TIMEOUT, env=_subprocess_env()
    )
    assert done.returncode == 0, done.stderr
    assert f"resumed from {resumed_dir / 'checkpoints'}" in done.stdout, done.stdout
    return Resumed(resumed_dir, straight, kills)


def _masks(save: Path) -> dict[str, list[float]]:
    """The final checkpoint's masks, as its pruner saved them (the model has none once it is
    shrunk for the fine-tuning)."""
    state = CheckpointManager.load(_latest_checkpoint(save))
    return {k: v["mask"].tolist() for k, v in state["pruner"]["masks"].items()}


def test_kills_landed_while_pruning_and_while_fine_tuning_the_shrunk_model(
    resumed: Resumed,
) -> None:
    """The first kill came with pruning under way and the model not yet shrunk; the second,
    in the resumed run, after the shrink (its newest checkpoint holds the small model)."""
    straight = CheckpointManager.load(_latest_checkpoint(resumed.straight))
    prunes = len(straight["pruner"]["history"])
    first, second = resumed.kills["pruning"], resumed.kills["fine-tuning"]
    assert 0 < first.prunes < prunes and not first.shrunk, first
    assert first.at < second.at < 120 and second.shrunk and second.prunes == prunes, second


def test_kill_9_and_resume_gives_the_masks_of_an_uninterrupted_run(resumed: Resumed) -> None:
    """A run killed with SIGKILL while pruning, resumed, killed again while fine-tuning the
    shrunk model and resumed with --resume, ends with exactly the masks and prune sequence of
    the same run left alone."""
    final = CheckpointManager.load(_latest_checkpoint(resumed.resumed))
    straight = CheckpointManager.load(_latest_checkpoint(resumed.straight))
    history = [(e["step"], e["mask"], e["channel"]) for e in final["pruner"]["history"]]
    expected = [(e["step"], e["mask"], e["channel"]) for e in straight["pruner"]["history"]]
    assert final["pruner"]["shrunk"] and straight["pruner"]["shrunk"]
    assert history == expected
    assert _masks(resumed.resumed) == _masks(resumed.straight)


def test_kill_9_and_resume_gives_the_weights_of_an_uninterrupted_run(resumed: Resumed) -> None:
    """After two kill -9s and --resumes, every tensor of the final model (weights, masks,
    signals) is bit for bit that of the uninterrupted run: optimizer state, RNG and data
    position resume."""
    final = CheckpointManager.load(_latest_checkpoint(resumed.resumed))["model"]
    straight = CheckpointManager.load(_latest_checkpoint(resumed.straight))["model"]
    assert final.keys() == straight.keys()
    different = [k for k in final if not torch.equal(final[k], straight[k])]
    assert different == []


def test_resumed_run_metrics_log_matches_uninterrupted(resumed: Resumed) -> None:
    """After kill -9 and --resume, metrics.jsonl holds each prune and eval once, as in the
    uninterrupted run (the steps replayed after the checkpoint are not logged twice)."""

    def events(save: Path) -> list[tuple[Any, ...]]:
        rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
        return [(m["kind"], m["step"], m.get("channel")) for m in rows if m["kind"] != "final"]

    assert events(resumed.resumed) == events(resumed.straight)


# ============================================================================ 5. subcommands
def _flops_table(out: str) -> tuple[float, dict[str, float]]:
    total = re.match(r"flops per example: ([\d,]+) \(dense ([\d,]+)", out)
    assert total is not None, out
    layers: dict[str, float] = {}
    section = out.split("\nlayer ")[1].split("\n\n")[0]
    for line in section.splitlines()[1:]:
        name, value, _share = line.split()
        layers[name] = float(value.replace(",", ""))
    return float(total.group(1).replace(",", "")), layers


def test_flops_of_a_built_in_model_prints_the_total_and_per_layer_table() -> None:
    """`fisherprune flops --model cnn --input-shape 1,8,8` prints the cost per example, equal to
    the library's count and to the sum of its per-layer table."""
    cli = run_cli("flops", "--model", "cnn", "--input-shape", "1,8,8")
    assert cli.code == 0, cli.err
    total, layers = _flops_table(cli.out)
    model = build_model("cnn", (1, 8, 8), 10)
    example = torch.zeros(1, 1, 8, 8)
    fisherprune.apply_masks(model, example)
    assert total == fisherprune.CostModel(model, example, "flops").total()
    assert total == sum(layers.values())
    assert "features.0.0" in layers and "classifier" in layers


def test_flops_of_a_checkpoint_is_the_runs_final_cost(trained: Callable[[str], Trained]) -> None:
    """`fisherprune flops --checkpoint` of a run's final checkpoint reports the pruned cost
    recorded in result.json."""
    t = trained("npz_cnn")
    cli = run_cli("flops", "--checkpoint", _latest_checkpoint(t.save_dir))
    assert cli.code == 0, cli.err
    total, _ = _flops_table(cli.out)
    assert total == _result(t.save_dir)["final_cost"] < _result(t.save_dir)["dense_cost"]


@pytest.mark.parametrize("freeze", [[], ["--freeze"]])
def test_export_torchscript_of_a_checkpoint_loads_and_matches(
    trained: Callable[[str], Trained], tmp_path: Path, freeze: list[str]
) -> None:
    """`fisherprune export --format torchscript [--freeze]` of the final checkpoint (written
    while the shrunk model fine-tuned) writes a file torch.jit.load reads, whose outputs are
    the run's export's (frozen: with no parameters left)."""
    t = trained("npz_cnn")
    ckpt = _latest_checkpoint(t.save_dir)
    assert CheckpointManager.load(ckpt)["pruner"]["shrunk"]
    out = tmp_path / "small.pt"
    argv = ["export", "--checkpoint", ckpt, "--format", "torchscript", "--out", out, *freeze]
    cli = run_cli(*argv)
    assert cli.code == 0, cli.err
    loaded = torch.jit.load(str(out))
    assert (list(loaded.parameters()) == []) == bool(freeze)
    exported = fisherprune.load_state_dict_export(t.save_dir / "export" / "model.pt", t.fresh())
    x = t.x[:32]
    torch.testing.assert_close(_eval_outputs(loaded, x), _eval_outputs(exported, x))
    assert _tmp_files(tmp_path) == []


def test_export_aoti_of_a_checkpoint_loads_and_matches(
    trained: Callable[[str], Trained], tmp_path: Path
) -> None:
    """`fisherprune export --format aoti` writes a .pt2 package that load_aoti_export reads,
    whose outputs are the masked checkpoint model's; a name without .pt2 exits 2. (This CNN's
    1-channel input is what torch 2.13 miscompiled when the package was compiled under
    no_grad.)"""
    t = trained("npz_cnn")
    ckpt = _latest_checkpoint(t.save_dir)
    bad = run_cli("export", "--checkpoint", ckpt, "--format", "aoti", "--out", tmp_path / "m.pt")
    assert bad.code == 2 and ".pt2" in bad.err
    out = tmp_path / "small.pt2"
    cli = run_cli("export", "--checkpoint", ckpt, "--format", "aoti", "--out", out)
    assert cli.code == 0, cli.err
    loaded = load_aoti_export(out)
    masked, _ = model_from_checkpoint(str(ckpt))
    x = t.x[:32]
    torch.testing.assert_close(_eval_outputs(loaded, x), _eval_outputs(masked, x))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.pt2"]


def test_env_prints_the_torch_version() -> None:
    """`fisherprune env` prints the torch version (for bug reports)."""
    cli = run_cli("env")
    assert cli.code == 0, cli.err
    assert any(line.startswith(f"torch: {torch.__version__} ") for line in cli.out.splitlines())
    assert cli.out.startswith(f"fisherprune: {fisherprune.__version__}\n")


def test_version_flag_in_process() -> None:
    """`fisherprune --version` prints the package version and exits 0."""
    cli = run_cli("--version")
    assert (cli.code, cli.out) == (0, f"fisherprune {fisherprune.__version__}\n")


def test_console_script_prints_version() -> None:
    """The installed `fisherprune` console script runs (`--version`)."""
    script = Path(sys.executable).with_name("fisherprune")
    if not script.exists():
        pytest.skip(f"no console script beside {sys.executable}")
    done = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"fisherprune {fisherprune.__version__}"


# ============================================================================ 6. output mode
@pytest.mark.parametrize("progress", ["plain", "auto"])
def test_no_carriage_returns_when_plain_or_not_a_terminal(tmp_path: Path, progress: str) -> None:
    """With --progress plain, or auto on a stdout that is not a terminal, the output is whole
    lines: no carriage return."""
    x, y = _table(200, seed=1)
    data = _write_csv(tmp_path / "t.csv", x, y)
    cli = run_cli(
        "train", "--data", data, *MLP8, "--train.steps", "30", *FAST, "--progress", progress,
        "--save_dir", tmp_path / "run",
    )  # fmt: skip
    assert cli.code == 0, cli.err
    assert "step 10:" in cli.out
    assert "\r" not in cli.out


def test_summary_lines_name_accuracy_flops_parameters_latency_files(
    trained: Callable[[str], Trained],
) -> None:
    """The end-of-run summary gives dense and pruned accuracy, FLOPs and parameters (as in
    result.json), the latency, and the files written."""
    t = trained("csv")
    r = _result(t.save_dir)
    out = t.cli.out
    dense = re.search(
        r"^dense: +accuracy ([\d.]+), ([\d,]+) flops/example, ([\d,]+) param", out, re.M
    )
    pruned = re.search(
        r"^pruned: accuracy ([\d.]+), ([\d,]+) flops/example \([\d.]+%\), ([\d,]+) param", out, re.M
    )
    assert dense and pruned, out
    num = lambda s: float(s.replace(",", ""))  # noqa: E731
    assert math.isclose(num(dense.group(1)), r["dense_metric"], abs_tol=1e-4)
    assert (num(dense.group(2)), num(dense.group(3))) == (r["dense_cost"], r["dense_params"])
    assert math.isclose(num(pruned.group(1)), r["final_metric"], abs_tol=1e-4)
    assert (num(pruned.group(2)), num(pruned.group(3))) == (r["final_cost"], r["final_params"])
    assert re.search(r"^latency \(CPU, \d+ threads?, .*rounds\): batch 1 .* ms", out, re.M), out
    assert re.search(r"^  state_dict: .*model\.pt$", out, re.M), out
    assert re.search(r"^  report: .*report\.md$", out, re.M), out


def test_cnn_run_reports_the_latency_as_served_next_to_the_eager_one(
    trained: Callable[[str], Trained],
) -> None:
    """A CNN run also times dense and pruned as served (frozen TorchScript, channels-last):
    result.json has positive times at batch 1 and 64 and the median of the rounds' paired
    ratios as the speed-up, and the report and the summary show them (a ratio, or that the
    rounds' spread covers it)."""
    t = trained("npz_cnn")
    lat = _result(t.save_dir)["latency"]
    for bs in (1, 64):
        dense, pruned = lat[f"served_dense_b{bs}_ms"], lat[f"served_pruned_b{bs}_ms"]
        assert dense > 0 and pruned > 0
        blocks = lat[f"served_blocks_b{bs}_ms"]
        ratios = [d / p for d, p in zip(blocks["dense"], blocks["pruned"], strict=True)]
        assert lat[f"served_speedup_b{bs}"] == pytest.approx(statistics.median(ratios))
    assert "| CPU latency as served, batch 64 |" in (t.save_dir / "report.md").read_text()
    served = (
        r"^latency as served \(frozen TorchScript.*batch 64 [\d.]+ ms ±\d+% -> [\d.]+ ms ±\d+%, "
        r"([\d.]+x \(IQR|no resolvable speed-up: spread ±\d+% covers)"
    )
    assert re.search(served, t.cli.out, re.M), t.cli.out


def test_untraceable_model_ends_with_eager_latency_and_state_dict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model torch.jit.trace rejects (its graph changes between calls) still ends its run
    (exit 0) with the eager latency, the state_dict export and the report; one line says the
    latency as served was skipped and why, one that the TorchScript export was, and neither
    result.json nor the report claims a served figure."""
    monkeypatch.syspath_prepend(str(REPO))
    cli, save, _ = _train_user_model(
        tmp_path, "untraceable", "--export_formats", "state_dict,torchscript"
    )
    assert cli.code == 0, cli.err
    assert cli.out.count("skipped the latency as served: TracingCheckError") == 1, cli.out
    assert "skipped torchscript export: TracingCheckError" in cli.out, cli.out
    assert (save / "export" / "model.pt").is_file()
    assert not (save / "export" / "model.torchscript.pt").exists()
    lat = _result(save)["latency"]
    assert lat["dense_b64_ms"] > 0 and not any(k.startswith("served_") for k in lat)
    report = (save / "report.md").read_text()
    assert "as served, batch" not in report and "could not be traced" in report


# ========================================================================== criteria
def test_train_with_the_l1_criterion_prunes_by_weight_norm(tmp_path: Path) -> None:
    """``--pruning.criterion l1`` trains, prunes and exports with the L1 criterion: the run's
    one prune (step 6) removes the hidden unit whose producing weights have the smallest L1 norm
    in the checkpoint of that step (read from the saved weights, not from fisherprune)."""
    x, y = _table(60, seed=0)
    data = _write_csv(tmp_path / "t.csv", x, y)
    save = tmp_path / "run"
    argv = ["train", "--data", data, *MLP8, *FAST, "--save_dir", save]
    cli = run_cli(*argv, "--pruning.criterion", "l1", "--train.steps", "6")
    assert cli.code == 0, cli.err
    after = CheckpointManager.load(save / "checkpoints" / "ckpt-00000006.pt")
    weights = after["model"]
    (w_key,) = [k for k, v in weights.items() if k.endswith("weight") and v.shape[:1] == (8,)]
    l1 = weights[w_key].abs().sum(1)
    (mask_key,) = [k for k in weights if k.endswith(".mask")]
    removed = (weights[mask_key] < 0.5).nonzero().flatten().tolist()
    assert removed == [int(l1.argmin())]
    events = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [e["channel"] for e in events if e["kind"] == "prune"] == removed


def test_resume_with_another_criterion_exits_2(tmp_path: Path) -> None:
    """A run pruned by Fisher does not resume ranking by L1: exit 2, one line naming the
    criterion."""
    x, y = _table(60, seed=0)
    data = _write_csv(tmp_path / "t.csv", x, y)
    save = tmp_path / "run"
    base = ["train", "--data", data, *MLP8, *FAST, "--save_dir", save]
    assert run_cli(*base, "--train.steps", "10").code == 0
    cli = run_cli(*base, "--train.steps", "20", "--resume", "--pruning.criterion", "l1")
    assert cli.code == 2, cli.err
    assert "criterion" in cli.err and "Traceback" not in cli.err
