"""One run per save directory (issue 19, item 1): a directory holding another run's
checkpoints is refused unless --resume or --overwrite, and a lock keeps a second live run out;
the lock of a dead process is taken over."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fisherprune.train.checkpoint import CheckpointManager
from fisherprune.train.lock import LOCK_NAME, RunLock, SaveDirInUseError
from fisherprune.train.rundir import OtherRunError, claim_save_dir

TIMEOUT = 60


def _ckpts(save: Path, steps: tuple[int, ...] = (100, 200)) -> CheckpointManager:
    m = CheckpointManager(save / "checkpoints", keep=3)
    for s in steps:
        m.save(s, {"model": {"w": torch.zeros(2)}, "pruner": {}, "state": {"step": s}})
    return m


def _claim(save: Path, m: CheckpointManager, resume: bool, overwrite: bool) -> list[str]:
    lines: list[str] = []
    claim_save_dir(save, save / "export", m, resume, overwrite, lines.append).release()
    return lines


def test_fresh_run_in_a_directory_with_checkpoints_is_refused(tmp_path: Path) -> None:
    """The old trainer deleted each new checkpoint at once (the old run's steps are higher);
    now the run is refused, the message names --resume and --overwrite, nothing is deleted."""
    m = _ckpts(tmp_path)
    with pytest.raises(OtherRunError, match=r"ckpt-00000200.pt.*--resume.*--overwrite"):
        _claim(tmp_path, m, resume=False, overwrite=False)
    assert [p.name for p in m.paths()] == ["ckpt-00000100.pt", "ckpt-00000200.pt"]


def test_resume_keeps_and_overwrite_removes_the_checkpoints(tmp_path: Path) -> None:
    m = _ckpts(tmp_path)
    _claim(tmp_path, m, resume=True, overwrite=False)
    assert len(m.paths()) == 2
    lines = _claim(tmp_path, m, resume=False, overwrite=True)
    assert m.paths() == [] and any("removed 2 checkpoint" in line for line in lines)
    assert sorted(p.name for p in m.directory.iterdir()) == []


def test_an_empty_directory_is_taken_and_orphans_are_removed(tmp_path: Path) -> None:
    (tmp_path / "export").mkdir()
    orphan = tmp_path / "export" / ".model.pt.abcd1234.tmp"
    orphan.write_bytes(b"half")
    lines = _claim(tmp_path, CheckpointManager(tmp_path / "checkpoints", 3), False, False)
    assert not orphan.exists() and "1 temporary file" in lines[0]


_HOLDER = """
import sys, time
from pathlib import Path
from fisherprune.train.lock import RunLock
RunLock(Path(sys.argv[1])).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def test_a_live_run_keeps_a_second_out_and_its_lock_is_taken_over_once_dead(
    tmp_path: Path,
) -> None:
    """A process holding the lock: acquire raises SaveDirInUseError naming its pid. Once it is
    killed (the lock file still names it), the lock is taken over."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(SaveDirInUseError, match=rf"pid {holder.pid}"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait(TIMEOUT)
    assert f"pid {holder.pid}" in (tmp_path / LOCK_NAME).read_text()
    lock = RunLock(tmp_path)
    lock.acquire()
    assert (tmp_path / LOCK_NAME).read_text().startswith(f"pid {os.getpid()} ")
    lock.release()
