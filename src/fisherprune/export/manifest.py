"""A manifest that publishes files written at different times into a shared folder as one set.

``fisherprune train`` writes its export folder file by file over a run: ``dense.pt`` when the
dense phase ends, then ``plan.json``, one model file per export format and ``data.json``. That
folder may be the user's (``--export_dir``), hold other files or contain the save directory,
so it cannot be replaced whole as ``atomic_directory`` replaces ``fisherprune prune --out``.
Instead it holds ``fisherprune-export.json`` (``MANIFEST_FILE``), naming each file of one run
with its size and SHA-256, what it is, the run, and whether the set is complete.

``ExportSet`` keeps these promises, each write atomic, killed at any moment or not:

- the manifest never names a file whose bytes differ from what it records: a file is taken
  out of the manifest before it is written again, and put in after it was written whole;
- it says ``complete`` only once every file of the run is written (``ExportSet.complete``);
- the files of an earlier run are deleted only after the manifest stopped naming them, and
  only those it named whose bytes are still the ones it recorded: no other file in the
  folder is ever touched.

So the folder holds the complete set of one run, or a manifest marked incomplete naming the
files of the run under way that are whole (``dense.pt`` while the run trains on), or no
manifest at all (not a folder a run has written to). Readers check a file against it
(``check_exported_file``, called by ``load_plain``, ``PruningPlan.load`` and
``load_aoti_export``) or the whole set (``verify_export``). A file the manifest does not name
is outside the set and is read as it is: the manifest speaks only for the files it names.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fisherprune.export.storage import atomic_write_bytes, file_sha256

__all__ = [
    "MANIFEST_FILE",
    "ExportMismatchError",
    "ExportSet",
    "ExportedFile",
    "Manifest",
    "check_exported_file",
    "verify_export",
]

#: the manifest's file name in an export folder
MANIFEST_FILE = "fisherprune-export.json"
_FORMAT = "fisherprune-export"
_VERSION = 1
_UNCHECKED = f"or delete {MANIFEST_FILE} to read the folder's files unchecked"
#: what to do when a run finds a manifest it cannot read where it would write its set
_NOT_REPLACED = (
    "a run replaces only a manifest it can read: delete it, or give another --export_dir"
)


class ExportMismatchError(ValueError):
    """An export folder's files are not the set its manifest records: a file changed or is
    missing, the set is incomplete, there is no manifest, or the manifest cannot be read. The
    one-line message names the file and what to do."""


@dataclass(frozen=True)
class ExportedFile:
    """One file of a set, as the manifest records it."""

    sha256: str  # hex digest of its bytes
    size: int  # bytes
    what: str  # what the file is, for a person reading the manifest

    def problem(self, path: Path) -> str | None:
        """Why the file at ``path`` is not this one (missing, another size or SHA-256), or
        None when it is. Reads the file; changes nothing."""
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != self.size:
            return f"{path} has {size} bytes where the run wrote {self.size}"
        digest = file_sha256(path)
        if digest != self.sha256:
            return f"{path} has SHA-256 {digest[:12]}... where the run wrote {self.sha256[:12]}..."
        return None


@dataclass(frozen=True)
class Manifest:
    """The content of ``MANIFEST_FILE``: one run's files by name, in the order written."""

    run: str  # an id for the run: a resumed run keeps its own
    owner: str  # the run's save directory, resolved: which run the set belongs to
    started: str  # when the run began writing this set (UTC, ISO 8601)
    complete: bool = False
    finished: str | None = None  # when it was marked complete
    files: dict[str, ExportedFile] = field(default_factory=dict)

    @classmethod
    def read(cls, folder: Path, remedy: str = _UNCHECKED) -> Manifest | None:
        """The manifest in ``folder``, or None when it has none. Changes nothing.

        Raises:
            ExportMismatchError: the manifest is not one this module wrote (not JSON, another
                format, a file name that is not a plain name in the folder); the message
                ends with ``remedy``.
            OSError: it cannot be read (permission denied, a disk error).
        """
        path = Path(folder) / MANIFEST_FILE
        try:
            data = json.loads(path.read_bytes())
        except (FileNotFoundError, NotADirectoryError):  # no folder there: no manifest
            return None
        except ValueError as e:  # also UnicodeDecodeError
            raise ExportMismatchError(f"{path} is not JSON ({e}); {remedy}") from None
        try:
            if data["format"] != _FORMAT or data["version"] != _VERSION:
                raise ValueError(f"format {data['format']!r} version {data['version']!r}")
            files = {name: ExportedFile(**entry) for name, entry in data["files"].items()}
            for name in files:
                _check_name(name)
            return cls(
                run=str(data["run"]),
                owner=str(data["owner"]),
                started=str(data["started"]),
                complete=bool(data["complete"]),
                finished=data.get("finished"),
                files=files,
            )
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ExportMismatchError(
                f"{path} is not a fisherprune export manifest ({e}); {remedy}"
            ) from None

    def write(self, folder: Path) -> None:
        """Write this manifest into ``folder`` atomically (``atomic_write_bytes``)."""
        data = {"format": _FORMAT, "version": _VERSION, **asdict(self)}
        atomic_write_bytes(Path(folder) / MANIFEST_FILE, json.dumps(data, indent=2).encode())

    def describe(self) -> str:
        """``"the run of <owner> (started <time>)"``, for messages."""
        return f"the run of {self.owner} (started {self.started})"


class ExportSet:
    """The writer of one run's set of files in ``folder`` (see the module's promises).

    Make it with ``begin``; write each file with ``write``; call ``complete`` after the last.
    """

    def __init__(self, folder: Path, manifest: Manifest, written: bool) -> None:
        self.folder = Path(folder)
        self.manifest = manifest
        self._written = written  # whether ``manifest`` is on disk as it stands

    @property
    def path(self) -> Path:
        """The manifest's path."""
        return self.folder / MANIFEST_FILE

    @staticmethod
    def previous(folder: Path) -> Manifest | None:
        """The manifest that ``begin`` in ``folder`` would replace, or None. Changes nothing:
        call it to refuse a folder before other work (``begin`` reads it again).

        Raises:
            ExportMismatchError: the folder's manifest cannot be read (a run will not replace
                it: the message says to delete it or give another folder).
        """
        return Manifest.read(folder, _NOT_REPLACED)

    @classmethod
    def begin(
        cls,
        folder: Path,
        owner: str,
        carry: Collection[str] = (),
        say: Callable[[str], None] | None = None,
    ) -> ExportSet:
        """Start the set of the run ``owner`` (its save directory) in ``folder``.

        An earlier run's manifest there is first replaced by this run's, marked incomplete
        (so no instant shows an old manifest beside new files), then the files it named are
        deleted, except a file whose bytes changed since that run wrote it (it is left, and
        ``say`` gets a line naming it), and except the files of ``carry`` when the earlier
        manifest is ``owner``'s own and they are still whole: a resumed run keeps what its
        earlier session wrote and will not write again (``dense.pt``), and its run id. With
        no earlier manifest, nothing is written until the first ``write`` (a run that never
        exports leaves no folder).

        ``say`` gets one line for each thing removed.

        Raises:
            ExportMismatchError: ``folder`` holds a manifest that cannot be read (nothing is
                changed: what it names is unknown, so nothing is deleted or replaced).
            OSError: the manifest or a file could not be written or deleted (it names it).
        """
        folder, tell = Path(folder), say or (lambda _: None)
        old = cls.previous(folder)
        fresh = Manifest(run=uuid.uuid4().hex, owner=owner, started=_now())
        if old is None:
            return cls(folder, fresh, written=False)
        kept = {}
        if old.owner == owner:
            kept = {n: e for n, e in old.files.items() if n in carry and not e.problem(folder / n)}
        manifest = replace(fresh, run=old.run, files=kept) if kept else fresh
        manifest.write(folder)
        removed, changed = [], []
        for name, entry in old.files.items():
            if name in kept or not (folder / name).exists():
                continue
            if entry.problem(folder / name) is None:
                (folder / name).unlink()
                removed.append(name)
            else:
                changed.append(name)
        if removed:
            tell(f"removed {len(removed)} file(s) of {old.describe()} from {folder}: {removed}")
        if changed:
            tell(f"left {changed} in {folder}: changed since {old.describe()} wrote them")
        return cls(folder, manifest, written=True)

    def write(self, name: str, what: str, writer: Callable[[Path], Any]) -> Path:
        """Write the file ``name`` of the set: take it out of the manifest, call
        ``writer(path)`` (which must write ``folder/name`` atomically), then record it with
        its SHA-256, size and ``what``; the manifest, marked incomplete meanwhile, is then
        complete again if it was (a file of a finished run written again by ``fisherprune
        export``). Creates the folder. Returns the path.

        Raises:
            ValueError: ``name`` is not a plain file name, or is the manifest's.
            Exception: what ``writer`` raises; the file is then out of the manifest.
        """
        _check_name(name)
        before = self.manifest
        others = {n: e for n, e in before.files.items() if n != name}
        self._save(replace(before, complete=False, finished=None, files=others))
        path = self.folder / name
        writer(path)
        written = ExportedFile(file_sha256(path), path.stat().st_size, what)
        self._save(replace(before, files={**others, name: written}))
        return path

    def complete(self) -> None:
        """Mark the set complete: every file of the run is written."""
        self._save(replace(self.manifest, complete=True, finished=_now()))

    def _save(self, manifest: Manifest) -> None:
        if manifest == self.manifest and self._written:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        manifest.write(self.folder)
        self.manifest, self._written = manifest, True


def verify_export(folder: str | os.PathLike) -> list[Path]:
    """Check that ``folder`` holds one complete set: a manifest marked complete whose every
    file is there with the size and SHA-256 it records. Reads every file; changes nothing.

    Returns:
        The files of the set, in the order the run wrote them.

    Raises:
        ExportMismatchError: no manifest, an unreadable one, an incomplete set (its message
            names the run and the files whole so far), or the first file missing or changed.
    """
    folder = Path(folder)
    manifest = Manifest.read(folder)
    if manifest is None:
        raise ExportMismatchError(
            f"{folder} has no {MANIFEST_FILE}: no run of fisherprune train published a set "
            "of files there (a run that stopped before its export, or another folder)"
        )
    if not manifest.complete:
        raise ExportMismatchError(
            f"{folder} holds an incomplete export: {manifest.describe()} has not finished "
            f"writing it (still running, or stopped: resume it with --resume); whole so far: "
            f"{', '.join(manifest.files) or 'none'}"
        )
    for name, entry in manifest.files.items():
        problem = entry.problem(folder / name)
        if problem is not None:
            raise ExportMismatchError(f"{problem}: {_remedy(manifest)}")
    return [folder / name for name in manifest.files]


def check_exported_file(path: str | os.PathLike) -> None:
    """Refuse a file that the manifest of its folder names with other bytes. A file the
    manifest does not name, or in a folder with no manifest, passes unchecked; a file of an
    incomplete set passes when whole (``dense.pt`` while its run trains on). Reads the file
    only when the manifest names it; changes nothing.

    Raises:
        ExportMismatchError: the file differs from the manifest's record (one line naming the
            file and what to do), or the folder's manifest cannot be read.
    """
    path = Path(path)
    manifest = Manifest.read(path.parent)
    entry = None if manifest is None else manifest.files.get(path.name)
    if entry is None:
        return
    problem = entry.problem(path)
    if problem is not None:
        raise ExportMismatchError(f"{problem}: {_remedy(manifest)}")


def _remedy(manifest: Manifest) -> str:
    return (
        f"changed or damaged since {manifest.describe()} wrote it (its {MANIFEST_FILE} "
        f"records each file's SHA-256); write it again, {_UNCHECKED}"
    )


def _check_name(name: str) -> None:
    """Refuse a name that is not a plain file name in the folder (a manifest naming
    ``../x`` must not make ``begin`` delete a file outside it)."""
    if (
        not isinstance(name, str)
        or name in ("", ".", "..", MANIFEST_FILE)
        or Path(name).name != name
    ):
        raise ValueError(f"{name!r} is not the name of a file of an export set")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
