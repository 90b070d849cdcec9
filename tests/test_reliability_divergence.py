"""A diverging run stops (issue 19, item 4): a NaN or infinite loss ends ``fisherprune train``
with a clear error and a non-zero exit before the step that would use it, so nothing is
pruned on it and nothing is exported. (``prune`` refusing non-finite scores: test_prune.py.)"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import fisherprune.train.trainer as trainer_module
from fisherprune.cli.main import main
from fisherprune.export.manifest import MANIFEST_FILE, ExportMismatchError, verify_export
from fisherprune.train.checkpoint import CheckpointManager
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
    with pytest.raises(DivergedError, match=rf"loss is {value} at step 8:"):
        StopGuard(10.0).poll(torch.tensor(value), 7)


def test_poll_accepts_a_finite_loss_and_reads_its_value() -> None:
    guard = StopGuard(10.0)
    assert guard.poll(torch.tensor(1e30), 0) == 0
    assert guard.loss == pytest.approx(1e30)


def test_kept_losses_are_read_every_read_every_steps_and_name_the_bad_step() -> None:
    """With ``read_every=4`` (an accelerator) a NaN at step 2 (of 1, 2, 3, ...) is kept on the
    device until the fourth loss, which reads all four and names step 2 and the late read."""
    guard = StopGuard(10.0, read_every=4)
    for step, value in enumerate([1.0, math.nan, 2.0]):
        assert guard.poll(torch.tensor(value), step) == 0
    assert math.isnan(guard.loss)  # nothing read yet
    with pytest.raises(DivergedError, match=r"loss is nan at step 2 \(read at step 4"):
        guard.poll(torch.tensor(3.0), 3)


def test_a_read_asked_for_or_a_flush_reads_the_kept_losses_at_once() -> None:
    """``read=True`` (a prune is due) and ``flush()`` (a checkpoint, an eval) read what is kept
    before ``read_every`` steps have passed."""
    guard = StopGuard(10.0, read_every=100)
    guard.poll(torch.tensor(1.0), 0)
    guard.poll(torch.tensor(2.0), 1, read=True)
    assert guard.loss == 2.0
    guard.poll(torch.tensor(math.inf), 2)
    with pytest.raises(DivergedError, match="loss is inf at step 3:"):
        guard.flush()


@pytest.mark.parametrize("read_every", [1, 7])
def test_cli_stops_a_diverging_run_before_pruning_or_export(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    read_every: int,
) -> None:
    """Features of size 1e30 and a learning rate of 1e6 make the loss infinite: exit 1 with one
    line saying the loss diverged, no export, and no prune recorded after the last finite
    step (the old trainer pruned and exported such a model with exit 0); also with the losses
    read every 7 steps, as on a GPU: the error names the bad step and the later read, and
    every checkpoint written holds finite weights."""
    monkeypatch.setattr(trainer_module, "loss_read_every", lambda device: read_every)
    save = tmp_path / "run"
    code = main(
        [
            "train", "--data", str(_csv(tmp_path / "t.csv", 1e30)), "--model", "mlp",
            "--width", "8", "--depth", "1", "--learning_rate", "1e6", "--steps", "40",
            "--pruning.burn_in", "2", "--pruning.iter", str(1 if read_every == 1 else 100),
            "--save_dir", str(save), "--checkpoint_every", "4",
            "--dense_check", "warn",  # it diverges after the dense point: not a stop there
            "--progress", "none", "--export_formats", "state_dict",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1, err
    assert "training loss is" in err and "diverged" in err and "Traceback" not in err
    # one error line; a batch whose gradients overflowed before the loss did is skipped by the
    # signal, with its own one-line warning, and a prune due after it is skipped, saying so
    # (whether they come depends on the BLAS's rounding and the thread count)
    lines = err.strip().splitlines()
    errors = [ln for ln in lines if not ln.startswith("fisherprune train: warning:")]
    assert len(errors) == 1, err
    skipped = ("pruning-signal estimate is not finite", "no channel pruned", "were not finite")
    warned = [ln for ln in lines if ln not in errors]
    assert all(any(s in ln for s in skipped) for ln in warned), err
    exported = sorted(p.name for p in (save / "export").glob("*"))
    # the model as it was when its dense phase ended, in an export set marked incomplete
    assert exported in ([], ["dense.pt", MANIFEST_FILE])
    if exported:
        state = torch.load(save / "export" / "dense.pt", weights_only=True)["state_dict"]
        assert all(bool(torch.isfinite(t).all()) for t in state.values())
        with pytest.raises(ExportMismatchError, match="incomplete export"):
            verify_export(save / "export")
    assert not (save / "result.json").exists()
    entries = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert all(e["kind"] != "final" for e in entries)
    assert ("(read at step" in err) == (read_every > 1)
    bad = int(re.search(r"at step (\d+)", err).group(1))  # type: ignore[union-attr]
    assert all(e["step"] < bad for e in entries if e["kind"] == "prune")
    written = CheckpointManager(save / "checkpoints", keep=0).paths()
    assert written, "no checkpoint before the divergence: nothing to check"
    for path in written:
        weights = CheckpointManager.load(path)["model"].values()
        assert all(bool(torch.isfinite(w).all()) for w in weights), path
