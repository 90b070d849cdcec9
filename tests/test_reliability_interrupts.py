"""Interrupts (issue 19, item 7): Ctrl-C / SIGTERM stop a run at a step boundary with a
checkpoint, one line with the resume command and exit 130 / 143; under torchrun a rank that
does not answer ends the job with a clear error within ``dist_timeout``."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fisherprune.cli.main import main, resume_command
from fisherprune.train.checkpoint import CheckpointManager
from fisherprune.train.interrupts import StopGuard, leave_process_group

TIMEOUT = 120


def test_guard_turns_the_first_signal_into_a_request_and_the_second_into_an_interrupt() -> None:
    before = signal.getsignal(signal.SIGINT)
    with StopGuard(10.0) as guard:
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.poll(torch.tensor(1.0), 0) == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_a_signal_is_answered_at_once_when_losses_are_kept_on_the_device() -> None:
    """With losses read every 100 steps (an accelerator), a stop asked outside torchrun is
    still answered at the step it came in: the kept losses are read then."""
    guard = StopGuard(10.0, read_every=100)
    assert guard.poll(torch.tensor(1.0), 0) == 0
    guard.signum = signal.SIGTERM  # what the handler sets
    assert guard.poll(torch.tensor(2.0), 1) == signal.SIGTERM and guard.loss == 2.0


def test_a_stop_agreed_at_a_checkpoint_read_stops_there_under_torchrun_rules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As under torchrun on GPUs (losses read every 100 steps, a stop answered only where
    every rank reads): SIGTERM at step 13 stops the run at the checkpoint read of step 20,
    with that checkpoint, instead of being left unanswered until the run ended."""
    import fisherprune.train.interrupts as interrupts
    import fisherprune.train.phases as phases
    import fisherprune.train.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "loss_read_every", lambda device: 100)
    monkeypatch.setattr(interrupts, "in_group", lambda: True)
    monkeypatch.setattr(StopGuard, "_agree", lambda self, values: values)
    original = phases.train_step

    def signalled(loop: phases.Loop) -> None:
        if loop.state.step == 13:
            loop.guard.signum = signal.SIGTERM  # what the handler sets
        original(loop)

    monkeypatch.setattr(phases, "train_step", signalled)
    save = tmp_path / "run"
    code = main([
        "train", "--model", "mlp", "--width", "8", "--depth", "1", "--steps", "60",
        "--pruning.burn_in", "100000", "--eval_every", "100000", "--checkpoint_every", "20",
        "--progress", "none", "--export_formats", "state_dict", "--save_dir", str(save),
        "--weight_decay", "5e-4",
    ])  # fmt: skip
    assert code == 128 + signal.SIGTERM
    (ckpt,) = CheckpointManager(save / "checkpoints", 3).paths()
    assert CheckpointManager.load(ckpt)["state"]["step"] == 20
    assert not (save / "export").exists()


def test_resume_command_adds_resume_and_drops_overwrite() -> None:
    assert resume_command(["train", "--overwrite", "--save_dir", "a b"]) == (
        "fisherprune train --save_dir 'a b' --resume"
    )
    assert resume_command(["train", "--resume"]) == "fisherprune train --resume"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_training_saves_the_step_and_prints_the_resume_command(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """Sent once an eval line shows the loop runs: exit 128 + signal (130, 143), stderr is
    one line naming the checkpoint of the step reached and the resume command, which then
    continues from that step (the old trainer printed a 24-line traceback and lost up to
    checkpoint_every steps)."""
    save = tmp_path / "run"
    argv = [
        "train", "--model", "mlp", "--width", "8", "--depth", "1", "--steps", "100000",
        "--pruning.burn_in", "100000", "--eval_every", "5", "--checkpoint_every", "100000",
        "--progress", "plain", "--export_formats", "state_dict", "--save_dir", str(save),
        "--weight_decay", "5e-4",  # no weight-decay search before the loop starts
    ]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "fisherprune", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step 5:"):
                break
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"stopped by {sig.name} at step" in lines[0], err
    step = int(lines[0].split(" at step ")[1].split(":")[0])
    assert step >= 5
    (ckpt,) = CheckpointManager(save / "checkpoints", 3).paths()
    assert CheckpointManager.load(ckpt)["state"]["step"] == step
    command = shlex.split(lines[0].split("resume with: ")[1])
    assert command[0] == "fisherprune" and command[-1] == "--resume"
    assert main([*command[1:], "--steps", str(step + 2), "--progress", "none"]) == 0
    assert CheckpointManager(save / "checkpoints", 3).paths()[-1].name == (
        f"ckpt-{step + 2:08d}.pt"
    )


# rank 1 stops answering at step 10 (stuck in native code, say: SIGTERM still ends it)
_FROZEN_DRIVER = """
import signal, sys, time
from fisherprune.train.trainer import PruningTrainer
from fisherprune.cli.main import main
_batch = PruningTrainer._batch
def batch(self, i):
    if self.rank == 1 and i == 10:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(1000)
    return _batch(self, i)
PruningTrainer._batch = batch
sys.exit(main(sys.argv[1:]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_torchrun_with_a_frozen_rank_ends_with_a_clear_error_within_dist_timeout(
    tmp_path: Path,
) -> None:
    """Rank 1 freezes at step 10: rank 0 ends with exit 1 and one line saying another rank did
    not answer within --dist_timeout 5 s, and the job is over well before the old 300 s+."""
    driver = tmp_path / "driver.py"
    driver.write_text(_FROZEN_DRIVER)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(driver),
        "train", "--model", "mlp", "--width", "8", "--depth", "1", "--steps", "40",
        "--pruning.burn_in", "5", "--progress", "none", "--export_formats", "state_dict",
        "--threads", "1", "--dist_timeout", "5", "--save_dir", str(tmp_path / "out"),
    ]  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("fisherprune train:")]
    assert len(ours) == 1, done.stderr[-3000:]
    assert "another rank did not answer within 5 s" in ours[0]
    assert "[rank0]: Traceback" not in done.stderr
    assert time.monotonic() - start < TIMEOUT


@pytest.mark.parametrize("store_call", [True, False])
def test_leaving_the_process_group_ends_it(monkeypatch, store_call: bool) -> None:
    """``leave_process_group`` (the end of a run that went well) ends the group, whether the
    ranks order their teardown through the store or (a torch without the call for it) all
    leave at once; outside a group it does nothing."""
    if not store_call:
        monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
    leave_process_group(5.0)  # (no group: nothing to do)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        leave_process_group(5.0)
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
