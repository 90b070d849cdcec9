"""``fisherprune train`` publishes its export folder as one set (issue 35, point 1): a manifest
(``fisherprune-export.json``) names each file of one run with its SHA-256, is marked complete
only after the last write, never names a file whose bytes differ, and readers refuse a file
whose bytes differ from its record. The folder may be the user's: no file the manifest did
not name is ever deleted."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torch import nn

import fisherprune.train.trainer as trainer_module
from fisherprune.export import PruningPlan, load_state_dict_export
from fisherprune.export.manifest import (
    MANIFEST_FILE,
    ExportMismatchError,
    ExportSet,
    verify_export,
)
from fisherprune.export.safe_load import load_plain
from fisherprune.export.storage import atomic_write_bytes, remove_orphans
from fisherprune.train.checkpoint import CheckpointManager
from fisherprune.train.scaling import model_from_meta
from tests.test_cli import FAST, MLP8, _table, _write_csv, run_cli
from tests.test_reliability_prune_out import _SNAPSHOTTING

TIMEOUT = 120


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / MANIFEST_FILE).read_text())


def _train_args(tmp_path: Path, save: Path, export: Path, seed: int, *extra: str) -> list[str]:
    data = tmp_path / "train.csv"
    if not data.exists():
        _write_csv(data, *_table(200, seed=1))
    return ["train", "--data", str(data), *MLP8, "--train.steps", "40", *FAST,
            "--seed", str(seed), "--save_dir", str(save), "--export_dir", str(export),
            *extra]  # fmt: skip


def _train(tmp_path: Path, save: Path, export: Path, seed: int = 0, *extra: str) -> None:
    cli = run_cli(*_train_args(tmp_path, save, export, seed, *extra))
    assert cli.code == 0, cli.err


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The export folder of one finished tiny run (read only by the tests that use it)."""
    tmp = tmp_path_factory.mktemp("finished")
    _train(tmp, tmp / "run", tmp / "run" / "export")
    return tmp / "run" / "export"


def test_a_finished_run_names_every_file_it_wrote_with_its_sha256(finished: Path) -> None:
    """The manifest of a finished run is complete and names dense.pt, plan.json, model.pt and
    data.json, each with the size and SHA-256 of the bytes on disk (hashlib, read here), and
    names the run's save directory; ``verify_export`` returns those files."""
    manifest = _manifest(finished)
    assert manifest["complete"] is True
    assert manifest["owner"] == str(finished.parent.resolve())
    assert set(manifest["files"]) == {"dense.pt", "plan.json", "model.pt", "data.json"}
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == _sha256(finished / name), name
        assert entry["size"] == (finished / name).stat().st_size, name
    assert verify_export(finished) == [finished / n for n in manifest["files"]]


def test_a_kill_at_any_write_of_a_run_never_leaves_a_manifest_naming_other_bytes(
    tmp_path: Path,
) -> None:
    """Over an export folder holding a finished run, an --overwrite run with another seed is
    watched at every write it makes there: at each, the folder as a SIGKILL would leave it
    (temporary files removed, as the next run does), and as the run left it, has a manifest
    whose every named file has the recorded SHA-256; a manifest marked complete names
    exactly the old run's files or the new run's; an incomplete one is refused by
    ``verify_export`` and names each file as soon as it is written (every stage from none to
    all four is seen). Both complete sets are seen too (the watch is not vacuous). The old trainer
    wrote the new dense.pt beside the old plan.json and model.pt, with nothing to tell them
    apart."""
    save, export = tmp_path / "run", tmp_path / "w" / "export"
    _train(tmp_path, save, export, seed=0)
    old = {n: e["sha256"] for n, e in _manifest(export)["files"].items()}
    snaps = tmp_path / "snaps"
    args = _train_args(tmp_path, save, export, 1, "--overwrite")
    done = subprocess.run(
        [sys.executable, "-c", _SNAPSHOTTING, export.parent, snaps, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    new = {n: e["sha256"] for n, e in _manifest(export)["files"].items()}
    assert new != old and set(new) == set(old)
    seen, partial = set(), set()
    for folder in [*(state / "export" for state in sorted(snaps.iterdir())), export]:
        remove_orphans(folder)
        manifest = _manifest(folder)
        named = {n: e["sha256"] for n, e in manifest["files"].items()}
        for name, digest in named.items():
            assert _sha256(folder / name) == digest, (folder, name)
        if manifest["complete"]:
            assert named in (old, new), folder
            seen.add("new" if named == new else "old")
        else:
            with pytest.raises(ExportMismatchError, match="incomplete export"):
                verify_export(folder)
            seen.add("incomplete")
            partial.add(tuple(named))
    assert seen == {"old", "incomplete", "new"}
    order = ("dense.pt", "plan.json", "model.pt", "data.json")  # as the run writes them
    assert {order[:k] for k in range(len(order) + 1)} <= partial, partial


def _copy(export: Path, to: Path) -> Path:
    """A copy of the run folder holding ``export`` under ``to``; returns its export folder."""
    shutil.copytree(export.parent, to / export.parent.name)
    return to / export.parent.name / export.name


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


READERS: dict[str, Callable[[Path], object]] = {
    "dense.pt": lambda p: load_plain(p, "weights file", "-"),  # what --weights reads with
    "plan.json": PruningPlan.load,
    "model.pt": lambda p: load_state_dict_export(p, _fresh_model(p.parent.parent)),
}


def _fresh_model(save_dir: Path) -> nn.Module:
    """The unpruned model of the run in ``save_dir`` (its table scaling included)."""
    checkpoint = CheckpointManager(save_dir / "checkpoints", 1).latest()
    assert checkpoint is not None
    return model_from_meta(CheckpointManager.load(checkpoint)["model_meta"])


@pytest.mark.parametrize("name", sorted(READERS))
def test_a_changed_file_of_a_set_is_refused_by_its_reader_naming_it(
    finished: Path, tmp_path: Path, name: str
) -> None:
    """One byte of a file of the set flipped (its size kept): ``load_plain`` (dense.pt, as
    ``--weights`` reads it), ``PruningPlan.load`` (plan.json) and ``load_state_dict_export``
    (model.pt) refuse it naming the file, and so does ``verify_export``; the file as the run
    wrote it is read."""
    folder = _copy(finished, tmp_path)
    READERS[name](folder / name)
    _flip_a_byte(folder / name)
    with pytest.raises(ExportMismatchError, match=re.escape(str(folder / name))):
        READERS[name](folder / name)
    with pytest.raises(ExportMismatchError, match=re.escape(str(folder / name))):
        verify_export(folder)


def test_prune_refuses_a_changed_dense_pt_in_one_line(finished: Path, tmp_path: Path) -> None:
    """``fisherprune prune --weights export/dense.pt`` with a byte of dense.pt changed since
    the run wrote it: exit 2, one line naming the file, nothing written under --out."""
    folder = _copy(finished, tmp_path)
    _flip_a_byte(folder / "dense.pt")
    data = _write_csv(tmp_path / "train.csv", *_table(200, seed=1))
    cli = run_cli("prune", "mlp", "--width", "8", "--depth", "1", "--weights",
                  folder / "dense.pt", "--data", data, "--target", "50%",
                  "--out", tmp_path / "pruned")  # fmt: skip
    assert cli.code == 2, cli.err
    assert str(folder / "dense.pt") in cli.err and "changed or damaged" in cli.err
    assert len(cli.err.strip().splitlines()) == 1, cli.err
    assert not (tmp_path / "pruned").exists()


def test_a_users_files_in_export_dir_are_never_deleted(tmp_path: Path) -> None:
    """A user's file in --export_dir, and dense.pt changed by the user after the run wrote
    it, are kept by a later --overwrite run that does not write dense.pt again (it is no
    longer named in the manifest); the files of the earlier set are written anew."""
    save, export = tmp_path / "run", tmp_path / "mine"
    export.mkdir()
    (export / "notes.txt").write_text("keep me")
    _train(tmp_path, save, export)
    _flip_a_byte(export / "dense.pt")
    changed = (export / "dense.pt").read_bytes()
    _train(tmp_path, save, export, 0, "--overwrite", "--no-export_dense")
    assert (export / "notes.txt").read_text() == "keep me"
    assert (export / "dense.pt").read_bytes() == changed
    assert set(_manifest(export)["files"]) == {"plan.json", "model.pt", "data.json"}
    assert len(verify_export(export)) == 3


def _set(folder: Path, owner: str, files: dict[str, bytes]) -> ExportSet:
    """A finished set of ``owner`` in ``folder`` holding ``files``."""
    exports = ExportSet.begin(folder, owner)
    for name, data in files.items():
        exports.write(name, "test", lambda p, d=data: atomic_write_bytes(p, d))
    exports.complete()
    return exports


def test_a_new_run_deletes_only_the_unchanged_files_the_old_manifest_named(
    tmp_path: Path,
) -> None:
    """``ExportSet.begin`` over another run's set: its manifest is replaced first by the new
    run's, incomplete and empty; the files it named and that are as it recorded are deleted;
    one changed since, and files it never named, stay."""
    _set(tmp_path, "/runs/a", {"dense.pt": b"d", "plan.json": b"p", "model.pt": b"m"})
    (tmp_path / "plan.json").write_bytes(b"edited")
    (tmp_path / "notes.txt").write_bytes(b"n")
    lines: list[str] = []
    ExportSet.begin(tmp_path, "/runs/b", say=lines.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST_FILE, "notes.txt", "plan.json"]
    manifest = _manifest(tmp_path)
    assert manifest["owner"] == "/runs/b" and manifest["files"] == {}
    assert manifest["complete"] is False
    assert any("plan.json" in line and "changed" in line for line in lines), lines


def test_a_resumed_run_keeps_its_own_carried_file_and_run_id(tmp_path: Path) -> None:
    """``begin`` with ``carry=("dense.pt",)`` over the same owner's manifest keeps dense.pt
    named (with its hash) and the run id, and deletes the rest; over another owner's, carry
    keeps nothing."""
    first = _set(tmp_path, "/runs/a", {"dense.pt": b"d", "model.pt": b"m"})
    resumed = ExportSet.begin(tmp_path, "/runs/a", carry=("dense.pt",))
    assert resumed.manifest.run == first.manifest.run
    assert set(_manifest(tmp_path)["files"]) == {"dense.pt"}
    assert not (tmp_path / "model.pt").exists()
    ExportSet.begin(tmp_path, "/runs/b", carry=("dense.pt",))
    assert _manifest(tmp_path)["files"] == {} and not (tmp_path / "dense.pt").exists()


def test_a_manifest_naming_a_path_outside_its_folder_deletes_nothing(tmp_path: Path) -> None:
    """A manifest naming ``../victim.txt`` (with that file's true hash) is not read: readers
    and ``begin`` refuse it, naming it and what to do, and nothing is deleted, inside the
    folder or out."""
    folder = tmp_path / "export"
    _set(folder, "/runs/a", {"model.pt": b"m"})
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"v")
    manifest = _manifest(folder)
    entry = {"sha256": _sha256(victim), "size": 1, "what": "x"}
    manifest["files"] = {"../victim.txt": entry}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(ExportMismatchError, match="not a fisherprune export manifest"):
        verify_export(folder)
    with pytest.raises(ExportMismatchError, match="delete it, or give another --export_dir"):
        ExportSet.begin(folder, "/runs/b")
    assert victim.read_bytes() == b"v" and (folder / "model.pt").read_bytes() == b"m"
    assert _manifest(folder)["files"] == {"../victim.txt": entry}


def test_train_refuses_an_unreadable_manifest_before_deleting_checkpoints(
    tmp_path: Path,
) -> None:
    """An --overwrite run over an export folder whose manifest is not JSON: exit 2, one line
    naming the manifest, and the earlier run's checkpoints and files are all kept."""
    save, export = tmp_path / "run", tmp_path / "run" / "export"
    _train(tmp_path, save, export)
    (export / MANIFEST_FILE).write_text("not json")
    before = sorted(p.relative_to(save) for p in save.rglob("*") if p.is_file())
    cli = run_cli(*_train_args(tmp_path, save, export, 0, "--overwrite"))
    assert cli.code == 2 and str(export / MANIFEST_FILE) in cli.err, cli.err
    assert len(cli.err.strip().splitlines()) == 1, cli.err
    after = sorted(p.relative_to(save) for p in save.rglob("*") if p.is_file())
    assert after == before


def test_fisherprune_export_into_its_runs_set_records_the_new_bytes(tmp_path: Path) -> None:
    """``fisherprune export --checkpoint`` of the run over the run's own ``model.pt`` keeps
    the set complete with the new file's hash (torchscript bytes here, so they differ); over
    another run's set's file it is refused (exit 2, naming it) and the file is unchanged."""
    save, export = tmp_path / "run", tmp_path / "run" / "export"
    _train(tmp_path, save, export)
    (ckpt,) = sorted((save / "checkpoints").glob("ckpt-*.pt"))[-1:]
    cli = run_cli("export", "--checkpoint", ckpt, "--format", "torchscript",
                  "--out", export / "model.pt")  # fmt: skip
    assert cli.code == 0, cli.err
    assert _manifest(export)["files"]["model.pt"]["sha256"] == _sha256(export / "model.pt")
    assert len(verify_export(export)) == 4
    other = tmp_path / "other"
    _train(tmp_path, other, other / "export")
    before = (other / "export" / "model.pt").read_bytes()
    cli = run_cli("export", "--checkpoint", ckpt, "--out", other / "export" / "model.pt")
    assert cli.code == 2 and str(other / "export" / "model.pt") in cli.err, cli.err
    assert (other / "export" / "model.pt").read_bytes() == before


def test_a_resumed_run_publishes_the_dense_pt_its_first_session_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that fails during fine-tuning leaves an incomplete set naming dense.pt only;
    ``--resume`` (past the dense point, so it does not write dense.pt again) ends with a
    complete set naming that same dense.pt, by its hash, beside the files it wrote."""
    save, export = tmp_path / "run", tmp_path / "run" / "export"

    def failed(loop: object) -> None:
        raise RuntimeError("stopped here")

    monkeypatch.setattr(trainer_module, "fine_tune_phase", failed)
    every = ("--checkpoint_every", "2")
    assert run_cli(*_train_args(tmp_path, save, export, 0, *every)).code == 1
    monkeypatch.undo()
    dense = _sha256(export / "dense.pt")
    first = _manifest(export)
    assert first["complete"] is False and set(first["files"]) == {"dense.pt"}
    cli = run_cli(*_train_args(tmp_path, save, export, 0, *every, "--resume"))
    assert cli.code == 0, cli.err
    assert "dense model written" not in cli.out + cli.err
    manifest = _manifest(export)
    assert manifest["complete"] is True and manifest["run"] == first["run"]
    assert set(manifest["files"]) == {"dense.pt", "plan.json", "model.pt", "data.json"}
    assert manifest["files"]["dense.pt"]["sha256"] == dense == _sha256(export / "dense.pt")
