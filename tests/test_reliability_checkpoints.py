"""Checkpoints that prove they are whole (issue 19, item 3), and files that are written whole
or not at all, with the user's umask (item 5)."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fisherprune.export import storage
from fisherprune.export.storage import atomic_write_bytes, os_error_text
from fisherprune.train.checkpoint import CheckpointManager, DamagedCheckpointError


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((64,), float(step))}, "pruner": {}, "state": {"step": step}}


@pytest.fixture
def three(tmp_path: Path) -> CheckpointManager:
    """A manager keeping 3, with checkpoints at steps 10, 20 and 30."""
    m = CheckpointManager(tmp_path / "checkpoints", keep=3)
    for step in (10, 20, 30):
        m.save(step, _state(step))
    return m


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_hash_file_holds_the_sha256_of_the_checkpoint_in_sha256sum_format(
    three: CheckpointManager,
) -> None:
    for p in three.paths():
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        assert p.with_name(p.name + ".sha256").read_text() == f"{digest}  {p.name}\n"


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_checkpoint_is_refused_on_load(three: CheckpointManager, damage: str) -> None:
    """16 bytes changed in the middle of the file, or the file cut short: DamagedCheckpointError
    naming the file (the old code loaded flipped weights silently)."""
    path = three.paths()[-1]
    data = bytearray(path.read_bytes())
    if damage == "flip":
        mid = len(data) // 2
        data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpointError, match=str(path)):
        CheckpointManager.load(path)


def test_load_newest_passes_over_a_damaged_newest_and_sets_it_aside(
    three: CheckpointManager,
) -> None:
    """The newest good checkpoint (step 20) is used, one line names the damaged one, which is
    renamed out of the way so that later saves at steps below 30 are kept."""
    newest = three.paths()[-1]
    newest.write_bytes(newest.read_bytes()[:100])
    lines: list[str] = []
    path, state = three.load_newest(lines.append)
    assert path.name == "ckpt-00000020.pt" and state["state"]["step"] == 20
    assert len(lines) == 1 and "ckpt-00000030.pt is damaged" in lines[0]
    assert [p.name for p in three.paths()] == ["ckpt-00000010.pt", "ckpt-00000020.pt"]
    assert (newest.parent / "ckpt-00000030.pt.damaged").exists()
    three.save(25, _state(25))
    assert [p.name for p in three.paths()][-1] == "ckpt-00000025.pt"


def test_load_newest_with_every_checkpoint_damaged_raises(three: CheckpointManager) -> None:
    for p in three.paths():
        p.write_bytes(b"junk")
    with pytest.raises(DamagedCheckpointError, match="every checkpoint"):
        three.load_newest(lambda line: None)


def test_load_of_a_directory_says_it_is_a_directory(three: CheckpointManager) -> None:
    with pytest.raises(IsADirectoryError) as info:
        CheckpointManager.load(three.directory)
    assert "is a directory" in os_error_text(info.value)


def test_clean_removes_orphan_temporary_and_hash_files_only(three: CheckpointManager) -> None:
    """What a write killed midway leaves (a .tmp file, a hash file with no checkpoint) goes;
    the checkpoints and their hash files stay."""
    before = sorted(p.name for p in three.directory.iterdir())
    orphans = [".ckpt-00000040.pt.k2j_8x0a.tmp", ".ckpt-00000040.pt.sha256.ab12cd34.tmp"]
    for name in [*orphans, "ckpt-00000040.pt.sha256"]:
        (three.directory / name).write_bytes(b"x")
    removed = three.clean()
    assert len(removed) == 3
    assert sorted(p.name for p in three.directory.iterdir()) == before


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_files_follow_the_umask(tmp_path: Path, umask: None, mask: int, mode: int) -> None:
    """A checkpoint and an atomically written file get the mode open() would give them (the
    old code left every file 0600, mkstemp's mode)."""
    os.umask(mask)
    atomic_write_bytes(tmp_path / "f.bin", b"abc")
    path = CheckpointManager(tmp_path / "c", 3).save(1, _state(1))
    for p in (tmp_path / "f.bin", path, path.with_name(path.name + ".sha256")):
        assert stat.S_IMODE(p.stat().st_mode) == mode, p


def test_a_full_disk_leaves_earlier_checkpoints_and_no_partial_file(
    three: CheckpointManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that hits ENOSPC raises an OSError naming the checkpoint (not a temporary
    file) whose text says "disk full"; the three earlier checkpoints load as before and no
    temporary file is left."""

    real = storage.write_file

    def full(path: Path, data: bytes) -> None:
        if ".sha256" in path.name:  # the small hash file fits, the checkpoint does not
            return real(path, data)
        path.write_bytes(data[:10])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(storage, "write_file", full)
    with pytest.raises(OSError) as info:
        three.save(40, _state(40))
    assert info.value.errno == errno.ENOSPC
    text = os_error_text(info.value)
    assert "disk full" in text and "ckpt-00000040.pt" in text and ".tmp" not in text
    monkeypatch.undo()
    assert sorted(p.name for p in three.directory.iterdir()) == sorted(
        n for step in (10, 20, 30) for n in (f"ckpt-{step:08d}.pt", f"ckpt-{step:08d}.pt.sha256")
    )
    for p in three.paths():
        assert CheckpointManager.load(p)["state"]["step"] == int(p.name[5:13])


def test_changed_tensor_bytes_are_refused_without_the_side_file(
    three: CheckpointManager,
) -> None:
    """Issue 35, point 4: the bytes of a weight changed and the ``.sha256`` side file gone: the
    hash the checkpoint holds refuses it (the old code loaded, exported and resumed from it)."""
    path = three.paths()[-1]
    data = path.read_bytes()
    weights = torch.full((64,), 30.0).numpy().tobytes()
    at = data.index(weights)
    path.write_bytes(data[:at] + b"\x00\x00\x80\x7f" + data[at + 4 :])  # 30.0 -> inf
    path.with_name(path.name + ".sha256").unlink()
    with pytest.raises(DamagedCheckpointError, match=rf"{path} is damaged.*hash written inside"):
        CheckpointManager.load(path)


def test_a_checkpoint_loads_without_its_hash_and_an_old_one_without_one_loads(
    tmp_path: Path, three: CheckpointManager
) -> None:
    """A whole checkpoint loads to the state saved (its own hash taken out); one written by an
    older fisherprune (no hash inside, only its side file) still loads, checked by that."""
    assert CheckpointManager.load(three.paths()[-1]).keys() == _state(30).keys()
    old = tmp_path / "ckpt-00000001.pt"
    torch.save(_state(1), old)
    digest = hashlib.sha256(old.read_bytes()).hexdigest()
    old.with_name(old.name + ".sha256").write_text(f"{digest}  {old.name}\n")
    assert CheckpointManager.load(old)["state"] == {"step": 1}
