"""The trainer's schedule and phases: the dense phase's length, the dense-model check, starting
from trained weights (--init_from) and the TensorBoard log."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_run import run_cli as _cli

import fisherprune
from fisherprune.graph import apply_masks
from fisherprune.train.checkpoint import CheckpointManager
from fisherprune.train.config import TrainConfig
from fisherprune.train.models import build_model
from fisherprune.train.pretrained import load_pretrained
from fisherprune.train.scaling import model_from_meta
from fisherprune.train.schedule import (
    build_optimizer,
    burn_in_steps,
    check_dense,
    statistics_steps,
)

QUICK = [
    "--model", "mlp", "--width", "8", "--depth", "1", "--pruning_iter", "2",
    "--eval_every", "10", "--fine_tune_steps", "5", "--export_formats", "state_dict",
    "--threads", "1", "--progress", "plain", "--dense_check", "warn",
]  # fmt: skip


def _table(path: Path, learnable: bool, n: int = 240) -> Path:
    """4 features, 3 classes: the class of the largest of the first three features, or
    labels drawn independently of the features."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = x[:, :3].argmax(1) if learnable else rng.integers(0, 3, n)
    np.savez(path, x=x, y=y.astype(np.int64))
    return path


def _latest(save: Path) -> dict:
    """The newest checkpoint of the run saved in ``save``."""
    path = CheckpointManager(save / "checkpoints", 3).latest()
    assert path is not None
    return CheckpointManager.load(path)


# ------------------------------------------------------------------------- schedule
def test_dense_phase_is_at_least_min_dense_steps_when_epochs_are_few() -> None:
    """3 epochs of 2 batches are 6 steps: the burn-in is min_dense_steps instead."""
    assert burn_in_steps(TrainConfig(epochs=3.0, min_dense_steps=300), 2) == 300
    assert burn_in_steps(TrainConfig(epochs=3.0, min_dense_steps=300), 500) == 1500
    assert burn_in_steps(TrainConfig(pruning_burn_in=7, min_dense_steps=300), 2) == 7


def test_statistics_steps_is_the_first_n_with_decay_to_the_n_at_most_5_percent() -> None:
    for decay in (0.5, 0.9, 0.95, 0.99):
        n = statistics_steps(decay)
        assert decay**n <= 0.05 < decay ** (n - 1)


def test_dense_check_compares_with_the_majority_class_and_chance() -> None:
    y = torch.tensor([0] * 8 + [1, 2])  # majority 80%, chance 33%
    assert not check_dense(0.82, y, 3).learned
    assert check_dense(0.9, y, 3).learned
    balanced = torch.arange(10) % 2
    assert not check_dense(0.52, balanced, 2).learned
    assert check_dense(0.6, balanced, 2).learned


def test_dense_check_compares_a_regressor_with_the_variance() -> None:
    y = torch.linspace(0, 1, 50)
    var = float(np.var(y.numpy()))
    assert not check_dense(var, y, None).learned
    assert check_dense(0.5 * var, y, None).learned


def test_untrained_dense_model_is_reported_and_stop_prunes_nothing(tmp_path: Path) -> None:
    """On labels unrelated to the features, warn records dense_learned false and the warning
    in result.json; stop (the default) exits with code 2 before the first prune, a checkpoint
    written."""
    data = _table(tmp_path / "noise.npz", learnable=False)
    code, out, _ = _cli("train", "--data", data, *QUICK, "--pruning.burn_in", "30",
                        "--save_dir", tmp_path / "warn")  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "warn" / "result.json").read_text())
    assert result["dense_learned"] is False
    assert "did not learn" in result["warnings"][0]
    assert "WARNING: the dense model did not learn" in out

    assert TrainConfig().dense_check == "stop"
    code, _, err = _cli("train", "--data", data, *QUICK, "--pruning.burn_in", "30",
                        "--dense_check", "stop", "--save_dir", tmp_path / "stop")  # fmt: skip
    assert code == 2 and "did not learn" in err and "nothing was pruned" in err
    assert not (tmp_path / "stop" / "result.json").exists()
    ckpt = _latest(tmp_path / "stop")
    assert ckpt["state"]["step"] == 30 and not ckpt["pruner"]["history"]


def test_learnable_table_passes_the_dense_check(tmp_path: Path) -> None:
    data = _table(tmp_path / "t.npz", learnable=True)
    code, _, _ = _cli("train", "--data", data, *QUICK, "--optimizer", "adam",
                      "--learning_rate", "0.01", "--dense_check", "stop",
                      "--save_dir", tmp_path / "run")  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["dense_learned"] is True and result["warnings"] == []


# ------------------------------------------------------------------------ init_from
def _pretrained(tmp_path: Path, width: int = 8) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(123)
    model = build_model("mlp", (4,), 3, width, 1)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    path = tmp_path / "pretrained.pt"
    torch.save(weights, path)
    return path, weights


def test_init_from_dense_phase_gathers_statistics_without_changing_weights(
    tmp_path: Path,
) -> None:
    """With --init_from, a run capped at the end of its dense phase ends with the file's
    weights unchanged, and with a non-zero pruning signal gathered."""
    data = _table(tmp_path / "t.npz", learnable=True)
    path, weights = _pretrained(tmp_path)
    burn_in = statistics_steps(TrainConfig().pruning_decay)
    code, out, err = _cli("train", "--data", data, *QUICK, "--init_from", path,
                          "--train.steps", burn_in, "--save_dir", tmp_path / "run")  # fmt: skip
    assert code == 0, err
    assert f"dense phase {burn_in} steps (statistics only)" in out
    ckpt = _latest(tmp_path / "run")
    for k, v in weights.items():  # the network sits inside the table's scaling
        assert torch.equal(ckpt["model"][f"model.{k}"], v), k
    signals = [m["signal"] for m in ckpt["pruner"]["masks"].values()]
    assert all(bool((s > 0).any()) for s in signals)


def test_init_from_accepts_a_fisherprune_checkpoint(tmp_path: Path) -> None:
    data = _table(tmp_path / "t.npz", learnable=True)
    code, _, _ = _cli("train", "--data", data, *QUICK, "--pruning.burn_in", "5",
                      "--train.steps", "8", "--save_dir", tmp_path / "first")  # fmt: skip
    assert code == 0
    ckpt_path = CheckpointManager(tmp_path / "first" / "checkpoints", 3).latest()
    saved = CheckpointManager.load(ckpt_path)["model"]
    code, _, err = _cli("train", "--data", data, *QUICK, "--init_from", ckpt_path,
                        "--train.steps", "3", "--save_dir", tmp_path / "second")  # fmt: skip
    assert code == 0, err
    again = _latest(tmp_path / "second")
    for k, v in saved.items():
        if not k.endswith(".signal"):
            assert torch.equal(again["model"][k], v), k


def test_init_from_accepts_the_dense_model_a_run_exported_and_refuses_its_pruned_one(
    tmp_path: Path,
) -> None:
    """``EXPORT_DIR/dense.pt`` (what the refusals below advise) starts a second run from the
    first run's dense weights (it was refused: "holds no state_dict"); the pruned model's
    export ``model.pt`` is refused naming dense.pt."""
    data = _table(tmp_path / "t.npz", learnable=True)
    code, _, err = _cli("train", "--data", data, *QUICK, "--pruning.burn_in", "5",
                        "--train.steps", "12", "--save_dir", tmp_path / "first")  # fmt: skip
    assert code == 0, err
    export = tmp_path / "first" / "export"
    dense = torch.load(export / "dense.pt", weights_only=True)["state_dict"]
    code, _, err = _cli("train", "--data", data, *QUICK, "--init_from", export / "dense.pt",
                        "--train.steps", "3", "--save_dir", tmp_path / "second")  # fmt: skip
    assert code == 0, err
    again = _latest(tmp_path / "second")["model"]
    for k, v in dense.items():
        assert torch.equal(again[k], v), k
    code, _, err = _cli("train", "--data", data, *QUICK, "--init_from", export / "model.pt",
                        "--save_dir", tmp_path / "third")  # fmt: skip
    assert code == 2 and "export of a pruned model" in err and "dense.pt" in err


def test_init_from_a_checkpoint_of_the_shrunk_model_says_what_to_give(tmp_path: Path) -> None:
    """A checkpoint written after its run shrank the model holds narrower weights than
    --model builds: refused, naming the checkpoint before the fine-tuning and dense.pt, and
    the model is left as it was."""
    model = build_model("mlp", (4,), 3, 8, 1)
    masks = apply_masks(model, torch.zeros(1, 4))
    small = {k: v[:2].clone() for k, v in model.state_dict().items() if v.dim() > 0}
    path = tmp_path / "ckpt.pt"
    torch.save({"model": small, "pruner": {"shrunk": True}}, path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"shrunk model.*dense\.pt"):
        load_pretrained(model, dict(masks), path)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_init_from_of_another_width_names_the_mismatched_shapes(tmp_path: Path) -> None:
    data = _table(tmp_path / "t.npz", learnable=True)
    path, _ = _pretrained(tmp_path, width=16)
    code, _, err = _cli("train", "--data", data, *QUICK, "--init_from", path,
                        "--save_dir", tmp_path / "run")  # fmt: skip
    assert code == 2
    assert "shapes differ" in err and "net.1.weight (16, 4) (model: (8, 4))" in err
    assert "Traceback" not in err


def test_init_from_with_foreign_keys_lists_them(tmp_path: Path) -> None:
    data = _table(tmp_path / "t.npz", learnable=True)
    path = tmp_path / "other.pt"
    torch.save({"encoder.weight": torch.zeros(2, 2)}, path)
    code, _, err = _cli("train", "--data", data, *QUICK, "--init_from", path,
                        "--save_dir", tmp_path / "run")  # fmt: skip
    assert code == 2 and "not in the model: encoder.weight" in err
    assert "missing from the file: model.net.1.bias" in err


def test_init_from_refuses_pickled_objects(tmp_path: Path) -> None:
    data = _table(tmp_path / "t.npz", learnable=True)
    path = tmp_path / "model.pt"
    torch.save(build_model("mlp", (4,), 3, 8, 1), path)  # a whole pickled module
    code, _, err = _cli("train", "--data", data, *QUICK, "--init_from", path,
                        "--save_dir", tmp_path / "run")  # fmt: skip
    assert code == 2 and "pickled" in err


# ---------------------------------------------------------------------- tensorboard
def test_tensorboard_log_holds_the_metrics_of_metrics_jsonl(tmp_path: Path) -> None:
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    data = _table(tmp_path / "t.npz", learnable=True)
    save = tmp_path / "run"
    code, _, err = _cli("train", "--data", data, *QUICK, "--pruning.burn_in", "5",
                        "--train.steps", "25", "--log", "tensorboard",
                        "--save_dir", save)  # fmt: skip
    assert code == 0, err
    entries = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    acc = event_accumulator.EventAccumulator(str(save / "tb"))
    acc.Reload()
    evals = {e["step"]: e["accuracy"] for e in entries if e["kind"] == "eval"}
    logged = {s.step: s.value for s in acc.Scalars("eval/accuracy")}
    assert logged.keys() == evals.keys()
    assert all(math.isclose(logged[k], evals[k], rel_tol=1e-6) for k in evals)
    prunes = [e for e in entries if e["kind"] == "prune"]
    assert len(acc.Scalars("prune/cost")) == len(prunes) > 0


def test_the_command_line_does_not_import_tensorboard_unless_asked() -> None:
    """``import fisherprune.cli.main`` (every command's start) leaves TensorBoard unimported:
    only a run with ``--log tensorboard`` imports it."""
    code = "import sys, fisherprune.cli.main; print([m for m in sys.modules if 'tensorboard' in m])"
    env = {**os.environ, "PYTHONPATH": str(Path(fisherprune.__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert done.stdout.strip() == "[]"


def test_unknown_log_is_a_clear_error(tmp_path: Path) -> None:
    data = _table(tmp_path / "t.npz", learnable=True)
    code, _, err = _cli("train", "--data", data, *QUICK, "--log", "wandb",
                        "--save_dir", tmp_path / "run")  # fmt: skip
    assert code == 2 and "unknown --log ['wandb']" in err


def test_masked_checkpoint_weights_load_into_a_fresh_masked_model(tmp_path: Path) -> None:
    """A checkpoint's weights are stored on the CPU and fit the model rebuilt from its meta."""
    data = _table(tmp_path / "t.npz", learnable=True)
    code, _, _ = _cli("train", "--data", data, *QUICK, "--pruning.burn_in", "5",
                      "--train.steps", "10", "--save_dir", tmp_path / "run")  # fmt: skip
    assert code == 0
    ckpt = _latest(tmp_path / "run")
    model = model_from_meta(ckpt["model_meta"])
    apply_masks(model, torch.zeros(1, 4))
    model.load_state_dict(ckpt["model"])
    assert all(v.device.type == "cpu" for v in ckpt["model"].values())


def test_pruning_uniform_reaches_the_optimizer_and_groups_the_mlp_layers() -> None:
    """``--pruning.uniform`` makes the run's optimizer prune the equal-width hidden layers of
    the built-in MLP (a Sequential: names differ in the index only) together."""
    from_cli = TrainConfig.from_dict({"pruning.uniform": True})
    assert from_cli.pruning_uniform
    model = build_model("mlp", (8,), 3, depth=3)
    x = torch.zeros(1, 8)
    apply_masks(model, x)
    popt = build_optimizer(from_cli, model, x, burn_in=0, weight_decay=5e-4)
    assert popt.uniform
    assert [len(c) for c in popt.uniform_classes] == [3]


def test_init_from_bare_weights_loads_inside_the_scaling_of_a_table(tmp_path: Path) -> None:
    """A CSV table's model is wrapped in the standardisation fitted on it; --init_from with
    the weights of the bare network loads them inside, and the run keeps its own scaling."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, 4)) * [1.0, 10.0, 100.0, 1000.0]
    y = x[:, :3].argmax(1)
    rows = ["a,b,c,d,label"] + [",".join(map(str, [*r, c])) for r, c in zip(x, y, strict=True)]
    data = tmp_path / "t.csv"
    data.write_text("\n".join(rows) + "\n")
    path, weights = _pretrained(tmp_path)
    burn_in = statistics_steps(TrainConfig().pruning_decay)
    code, _, err = _cli("train", "--data", data, *QUICK, "--init_from", path,
                        "--train.steps", burn_in, "--save_dir", tmp_path / "run")  # fmt: skip
    assert code == 0, err
    ckpt = _latest(tmp_path / "run")
    for k, v in weights.items():
        assert torch.equal(ckpt["model"][f"model.{k}"], v), k
    fitted = ckpt["model"]["scale_in.std"].double()  # this run's: the columns' own scales
    assert torch.allclose(fitted, torch.tensor([1.0, 10.0, 100.0, 1000.0]).double(), rtol=0.2)
