"""Distillation: the loss against hand-written formulas, and a distilled fine-tune that keeps
the masks' meaning."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fisherprune as fp
from fisherprune.distill import distill_loss, finetune, frozen_teacher
from fisherprune.train.checkpoint import CheckpointManager
from fisherprune.train.config import TrainConfig
from tests.test_cli import FAST, MLP8, run_cli


def test_classifier_term_is_kl_at_temperature_times_t_squared() -> None:
    """alpha=1: T^2 * mean_n sum_k q_k (log q_k - log p_k) with p, q the softmaxes at T."""
    torch.manual_seed(0)
    s, t = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    temp = 3.0
    p, q = torch.softmax(s / temp, 1), torch.softmax(t / temp, 1)
    want = temp**2 * (q * (q.log() - p.log())).sum(1).mean()
    got = distill_loss(s, t, alpha=1.0, temperature=temp, task="classification")
    torch.testing.assert_close(got, want)


def test_mix_with_labels_and_regression_mse() -> None:
    """(1 - alpha) * label loss + alpha * soft; the regression soft term is the MSE."""
    torch.manual_seed(0)
    s, t, y = torch.randn(5, 3), torch.randn(5, 3), torch.randn(5, 3)
    got = distill_loss(s, t, y, loss_fn=F.l1_loss, alpha=0.25, task="regression")
    want = 0.75 * F.l1_loss(s, y) + 0.25 * ((s - t) ** 2).mean()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("kw", "match"), [({"alpha": 1.5}, "alpha"), ({"temperature": 0.0}, "temperature")]
)
def test_bad_settings_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        distill_loss(torch.zeros(2, 3), torch.zeros(2, 3), **kw)


def test_distilled_finetune_moves_towards_the_teacher_and_shrinks_exactly() -> None:
    """After pruning, a distilled fine-tune lowers the distance to the dense teacher's outputs;
    the masked model still shrinks to the same outputs, and the teacher is untouched."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(128, 6)
    teacher = frozen_teacher(net)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    batches = [(x[i : i + 32], None) for i in range(0, 128, 32)]
    fp.prune_to_target(net, x[:1], batches, "40%", reconstruct=False)
    with torch.no_grad():
        gap0 = F.mse_loss(net(x), teacher(x))
    finetune(net, teacher, batches, 60, alpha=1.0, task="regression", lr=3e-3)
    with torch.no_grad():
        masked = net(x)
        assert F.mse_loss(masked, teacher(x)) < 0.5 * gap0
        torch.testing.assert_close(fp.shrink(net)(x), masked, rtol=1e-4, atol=1e-5)
    for k, v in teacher.state_dict().items():
        assert torch.equal(before[k], v)


def test_finetune_needs_a_teacher_or_a_loss() -> None:
    with pytest.raises(ValueError, match="teacher, a loss_fn"):
        finetune(nn.Linear(2, 2), None, [(torch.zeros(1, 2), None)], 1)


def test_train_distills_from_the_dense_model_when_asked(tmp_path: Path) -> None:
    """``fisherprune train --distill.alpha 1 --distill.temperature 3`` runs through pruning and
    a distilled fine-tune; a bad alpha is refused by name (exit 2)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0).astype(np.int64)
    lines = ["a,b,c,d,label"] + [
        ",".join(f"{v:.6f}" for v in row) + f",{t}" for row, t in zip(x, y, strict=True)
    ]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    argv = ["train", "--data", tmp_path / "t.csv", *MLP8, *FAST, "--save_dir", tmp_path / "run"]
    cli = run_cli(
        *argv, "--distill.alpha", "1", "--distill.temperature", "3", "--train.steps", "40"
    )
    assert cli.code == 0, cli.err
    bad = run_cli(*argv, "--distill.alpha", "2")
    assert bad.code == 2 and "distill_alpha" in bad.err


def test_distill_settings_are_checked() -> None:
    """TrainConfig takes the distillation settings and refuses bad ones by name."""
    assert TrainConfig(distill_alpha=0.5).distill_temperature == 2.0
    with pytest.raises(ValueError, match="distill_temperature"):
        TrainConfig(distill_temperature=0)


def test_a_resumed_fine_tune_still_distils(tmp_path: Path) -> None:
    """A run cut at step 30, in the middle of a distilled fine-tune, and resumed to step 45 ends
    with the weights of the same run made in one go (the teacher is in the checkpoint); with
    the labels only after the resume, the weights would differ."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0).astype(np.int64)
    lines = ["a,b,c,d,label"] + [
        ",".join(f"{v:.6f}" for v in row) + f",{t}" for row, t in zip(x, y, strict=True)
    ]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")

    def train(save: str, *more: object) -> dict:
        cli = run_cli(
            "train", "--data", tmp_path / "t.csv", *MLP8, *FAST, "--fine_tune_steps", "40",
            "--distill.alpha", "0.7", "--dense_check", "off", "--weight_decay", "0",
            "--save_dir", tmp_path / save, *more,
        )  # fmt: skip
        assert cli.code == 0, cli.err
        path = CheckpointManager(tmp_path / save / "checkpoints", 3).latest()
        assert path is not None
        return CheckpointManager.load(path)

    whole = train("whole", "--train.steps", "45")
    train("cut", "--train.steps", "30")
    resumed = train("cut", "--train.steps", "45", "--resume")
    assert whole["state"]["step"] == resumed["state"]["step"] == 45
    assert whole["state"]["finished_at"] < 30
    for key, value in whole["model"].items():
        torch.testing.assert_close(resumed["model"][key], value, rtol=0, atol=0)
