"""A diverging run stops (issue 19, item 4): a NaN or infinite loss ends ``fisherprune train``
with a clear error and a non-zero exit before the step that would use it, so nothing is
pruned on it and nothing is exported. (``prune`` refusing non-finite scores: test_prune.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fisherprune.cli.main import main
from fisherprune.train.interrupts import DivergedError, StopGuard


def _csv(path: Path, scale: float) -> Path:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 4)) * scale
    y = (x[:, 0] > 0).astype(int)
    rows = ["a,b,c,d,label"] + [",".join(map(str, r)) + f",{t}" for r, t in zip(x, y, strict=True)]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_poll_refuses_a_non_finite_loss(value: float) -> None:
    """NaN and +-inf raise DivergedError naming the value and the step."""
    with pytest.raises(DivergedError, match=rf"loss is {value}.*step 8"):
        StopGuard(10.0).poll(torch.tensor(value), 7)


def test_poll_accepts_a_finite_loss_and_returns_its_value() -> None:
    signum, value = StopGuard(10.0).poll(torch.tensor(1e30), 0)
    assert signum == 0 and value == pytest.approx(1e30)


def test_cli_stops_a_diverging_run_before_pruning_or_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Features of size 1e30 and a learning rate of 1e6 make the loss infinite: exit 1 with one
    line saying the loss diverged, no export, and no prune recorded after the last finite
    step (the old trainer pruned and exported such a model with exit 0)."""
    save = tmp_path / "run"
    code = main(
        [
            "train", "--data", str(_csv(tmp_path / "t.csv", 1e30)), "--model", "mlp",
            "--width", "8", "--depth", "1", "--learning_rate", "1e6", "--steps", "40",
            "--pruning.burn_in", "2", "--pruning.iter", "1", "--save_dir", str(save),
            "--dense_check", "warn",  # it diverges after the dense point: not a stop there
            "--progress", "none", "--export_formats", "state_dict",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1, err
    assert "training loss is" in err and "diverged" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (save / "export").exists()
    assert not (save / "result.json").exists()
    entries = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert all(e["kind"] != "final" for e in entries)
