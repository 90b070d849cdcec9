"""Taking a save directory for a run: its lock, the leftovers of an interrupted write, and the
refusal to mix two runs' checkpoints in it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fisherprune.export.storage import remove_orphans
from fisherprune.train.checkpoint import CheckpointManager
from fisherprune.train.lock import RunLock

__all__ = ["OtherRunError", "claim_save_dir"]


class OtherRunError(ValueError):
    """A new run was pointed at a save directory holding another run's checkpoints."""


def claim_save_dir(
    save_dir: Path,
    export_dir: Path,
    ckpts: CheckpointManager,
    resume: bool,
    overwrite: bool,
    say: Callable[[str], None],
) -> RunLock:
    """Make ``save_dir`` this run's: create it, lock it, delete temporary files an interrupted
    write left there (checkpoints, exports, reports), and with ``overwrite`` (and no
    ``resume``) delete the checkpoints of an earlier run. ``say`` gets one line for each thing
    removed.

    Returns:
        The lock, held; release it when the run ends (the OS does when the process dies).

    Raises:
        SaveDirInUseError: another live run holds the directory.
        OtherRunError: it holds checkpoints, and neither ``resume`` nor ``overwrite`` was given.
        OSError: the directory cannot be created or written (it names the path and why).
    """
    save_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(save_dir)
    lock.acquire()
    try:
        left = ckpts.clean() + remove_orphans(export_dir) + remove_orphans(save_dir)
        if left:
            say(f"removed {len(left)} temporary file(s) an interrupted run left in {save_dir}")
        existing = ckpts.paths()
        if existing and not resume:
            if not overwrite:
                raise OtherRunError(
                    f"{save_dir} holds the checkpoints of another run (newest: "
                    f"{existing[-1].name}); continue it with --resume, replace it with "
                    "--overwrite, or give this run another --save_dir"
                )
            say(f"--overwrite: removed {ckpts.remove_all()} checkpoint(s) of an earlier run")
    except BaseException:
        lock.release()
        raise
    return lock
