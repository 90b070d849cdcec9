"""``fisherprune prune`` publishes its outputs as one set (issue 35, point 1): ``--out`` holds
the previous complete run or the new complete run at every moment, a killed run's temporary
folders are removed (or its old folder put back) by the next run, and a folder holding files
of something else is refused before any work."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fisherprune.cli.prune as prune_cli
from fisherprune.export.storage import atomic_directory, remove_stale_directories
from tests.test_cli import run_cli
from tests.test_cli_prune import _data_and_weights

TIMEOUT = 120

# Runs the command line with an audit hook that, before every event that writes under WATCH,
# copies WATCH as it is into SNAPS/<n>: what a SIGKILL at that moment would leave on disk.
_SNAPSHOTTING = """
import os, shutil, sys
from pathlib import Path
watch, snaps = os.path.abspath(sys.argv[1]), Path(sys.argv[2])
WRITES = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.truncate",
          "shutil.rmtree", "shutil.move", "tempfile.mkstemp", "tempfile.mkdtemp"}
busy, taken = False, []
def under(p):
    named = isinstance(p, (str, bytes, os.PathLike))
    return named and os.path.abspath(os.fsdecode(p)).startswith(watch)
def writes(event, args):
    if event == "open":
        mode, flags = args[1], args[2]
        return under(args[0]) and (any(c in (mode or "") for c in "wax+")
                                   or bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
    return event in WRITES and any(under(a) for a in args)
def hook(event, args):
    global busy
    if busy or not writes(event, args):
        return
    busy = True
    try:
        shutil.copytree(watch, snaps / f"{len(taken):04d}", symlinks=True)
        taken.append(event)
    finally:
        busy = False
sys.addaudithook(hook)
from fisherprune.cli.main import main
code = main(sys.argv[3:])
print(len(taken), "snapshots")
sys.exit(code)
"""


def _contents(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by relative path, with the SHA-256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _prune_args(tmp_path: Path, out: Path, target: str) -> list[str]:
    data, weights, _, _ = _data_and_weights(tmp_path)
    return ["prune", "mlp", "--width", "32", "--depth", "2", "--weights", str(weights),
            "--data", str(data), "--target", target, "--rounds", "1", "--calibration", "64",
            "--out", str(out)]  # fmt: skip


def test_a_kill_at_any_write_leaves_one_whole_run_that_the_next_run_tidies(
    tmp_path: Path,
) -> None:
    """Over ``--out`` holding a finished 75% run, a 50% run is watched at every write it makes
    there: at each, the disk as a SIGKILL would leave it has ``--out`` equal to the old run or
    the new one, file for file (``remove_stale_directories``, as the next run calls it, puts
    back an old folder set aside and leaves no temporary folder). The old command wrote
    model.pt, plan.json and report.json one by one into ``--out``: a kill between them left a
    mixture."""
    watch = tmp_path / "w"
    out = watch / "out"
    assert run_cli(*_prune_args(tmp_path, out, "75%")).code == 0
    old = _contents(out)
    snaps = tmp_path / "snaps"
    done = subprocess.run(
        [sys.executable, "-c", _SNAPSHOTTING, watch, snaps, *_prune_args(tmp_path, out, "50%")],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    new = _contents(out)
    assert new != old and set(new) == set(old)
    states = sorted(snaps.iterdir())
    assert len(states) >= 5, done.stdout  # the temporary folder, its files, the swap
    seen = set()
    for state in states:
        remove_stale_directories(state / "out")
        assert [p.name for p in state.iterdir()] == ["out"], state.name
        now = _contents(state / "out")
        assert now in (old, new), state.name
        seen.add(now == new)
    assert seen == {False, True}


def test_ctrl_c_while_writing_leaves_the_previous_run_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C after model.pt and plan.json of the new run were written (while its latency is
    timed): exit 130, and ``--out`` is the earlier run's, with no temporary folder beside it
    (the old command left the new model.pt beside the old report.json)."""
    out = tmp_path / "w" / "out"
    assert run_cli(*_prune_args(tmp_path, out, "75%")).code == 0
    old = _contents(out)

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(prune_cli, "compare_latency", interrupted)
    cli = run_cli(*_prune_args(tmp_path, out, "50%"))
    assert cli.code == 130 and "stopped by Ctrl-C" in cli.err
    assert _contents(out) == old
    assert [p.name for p in out.parent.iterdir()] == ["out"]


def test_an_out_holding_other_files_is_refused_before_any_work(tmp_path: Path) -> None:
    """A run replaces ``--out`` whole, so a folder with a file no run writes is refused (exit 2,
    naming it) and left as it was."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    cli = run_cli(*_prune_args(tmp_path, out, "50%"))
    assert cli.code == 2 and "notes.txt" in cli.err and len(cli.err.splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_a_live_writers_temporary_folder_is_kept_and_a_dead_ones_removed(tmp_path: Path) -> None:
    """``remove_stale_directories`` leaves the temporary folder of a writer that still holds
    its lock, and removes the one of a writer that ended without cleaning up (``os._exit``
    in a forked child: no ``finally`` runs, as after a SIGKILL)."""
    target = tmp_path / "out"
    with atomic_directory(target) as tmp:
        (tmp / "model.pt").write_bytes(b"new")
        assert remove_stale_directories(target) == [] and tmp.is_dir()
    assert (target / "model.pt").read_bytes() == b"new"
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        writing = atomic_directory(target)  # kept: a collected generator would clean up
        (writing.__enter__() / "model.pt").write_bytes(b"half")
        os._exit(0)
    os.waitpid(child, 0)
    (left,) = [p for p in tmp_path.iterdir() if p != target]
    assert remove_stale_directories(target) == [left] and not left.exists()
    assert (target / "model.pt").read_bytes() == b"new"


def test_an_old_folder_set_aside_by_a_killed_writer_is_put_back(tmp_path: Path) -> None:
    """Killed between setting ``out`` aside and moving the new folder in: no ``out``, the old
    one at ``.out.<key>.old`` and the new one at ``.out.<key>.tmp``. The next run puts the old
    one back and removes the new one."""
    (tmp_path / ".out.abcd1234.old").mkdir()
    (tmp_path / ".out.abcd1234.old" / "report.json").write_text("old")
    (tmp_path / ".out.abcd1234.tmp").mkdir()
    (tmp_path / ".out.abcd1234.tmp" / "report.json").write_text("new")
    (tmp_path / ".other.abcd1234.tmp").mkdir()  # another folder's: not ours to touch
    remove_stale_directories(tmp_path / "out")
    assert (tmp_path / "out" / "report.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.abcd1234.tmp", "out"]
