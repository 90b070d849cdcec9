"""Atomic file writes: a file is either written whole or not at all.

Every write goes to a temporary file beside its target (``.<name>.<random>.tmp``), which is
synced, given the mode the user's umask allows (as ``open`` would, not ``mkstemp``'s 0600) and
renamed over the target. An ``OSError`` on the way is raised again naming the target file, and
the temporary file is removed; one left by a killed process is removed by ``remove_orphans``.
A folder of several files is written the same way, whole (``atomic_directory``); one left by a
killed process is removed by ``remove_stale_directories``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "atomic_directory",
    "atomic_path",
    "atomic_save",
    "atomic_write_bytes",
    "file_sha256",
    "os_error_text",
    "remove_orphans",
    "remove_stale_directories",
    "write_file",
]

#: a temporary file of ``atomic_path``: ``.<target name>.<8 random characters><suffix>``
_TEMPORARY = re.compile(r"^\..+\.[a-z0-9_]{8}(\.tmp|\.pt2)$")

#: the words a message uses for an OSError's errno
_CAUSES: dict[int, str] = {
    errno.ENOSPC: "disk full (no space left on device)",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EISDIR: "is a directory",
    errno.ENOTDIR: "a part of the path is not a directory",
    errno.ENOENT: "no such file or directory",
    errno.EIO: "input/output error (a failing disk?)",
}


def os_error_text(e: OSError) -> str:
    """One line for ``e``: ``"<path>: disk full (no space left on device)"``; the path is left
    out when ``e`` names none, the cause is the OS's text for an errno not in the table; the
    notes added to ``e`` (``__notes__``: what to do next) follow, each after ``"; "``."""
    cause = _CAUSES.get(e.errno or -1) or e.strerror or str(e) or type(e).__name__
    text = f"{e.filename}: {cause}" if e.filename else cause
    return "; ".join([text, *getattr(e, "__notes__", ())])


def _located(e: OSError, path: Path) -> OSError:
    """``e`` again, of the same class, naming ``path`` (the file the user asked for rather than
    a temporary one); ``e`` itself when it has no errno."""
    if e.errno is None:
        return e
    return type(e)(e.errno, e.strerror or os.strerror(e.errno), str(path))


def _umasked(mode: int) -> int:
    """``mode`` as the process's umask leaves it: what ``open`` (0o666) or ``mkdir`` (0o777)
    gives a new file or folder (0o644 / 0o755 for umask 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of the file at ``path``, hex, read in blocks of 1 MiB."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_file(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` and sync it to disk: the one place the bytes of a file from
    ``atomic_write_bytes`` reach the disk. Raises OSError (ENOSPC for a full disk)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` atomically,
    with the mode the umask allows.

    On any exception the temporary file is removed and ``path`` is left as it was. ``suffix``
    ends the temporary name, for writers that insist on an extension (AOTInductor's ``.pt2``).

    Raises:
        FileNotFoundError: the parent directory does not exist.
        IsADirectoryError: ``path`` is a directory.
        OSError: the write failed (full disk, read-only directory, ...); it names ``path``.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: directory {path.parent} does not exist")
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory; give a file name", str(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    except OSError as e:
        raise _located(e, path) from e
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp_path, _umasked(0o666))
        os.replace(tmp_path, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp_path.unlink()
        if isinstance(e, OSError):
            raise _located(e, path) from e
        raise


@contextlib.contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``path`` (``.<name>.<random>.tmp``); on success
    it takes ``path``'s place (a folder already there is replaced whole, never merged), so that
    a reader sees the old folder or the complete new one.

    The temporary folder is locked (``fcntl.flock``) while this runs, so that
    ``remove_stale_directories``, called here first, removes only what a killed writer left.
    The old folder is renamed ``.<name>.<random>.old`` for the instant before the new one
    moves in; a writer killed in that instant leaves no ``path``, and the next call (or
    ``remove_stale_directories``) puts the old folder back.

    On any exception the temporary folder is removed and ``path`` is left as it was.

    Raises:
        FileNotFoundError: the parent directory does not exist.
        FileExistsError: ``path`` is a file.
        OSError: the write failed; it names ``path``.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: directory {path.parent} does not exist")
    remove_stale_directories(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(errno.EEXIST, "is a file; give a folder name", str(path))
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    except OSError as e:
        raise _located(e, path) from e
    lock = _lock(tmp)
    aside = tmp.with_suffix(".old")
    try:
        os.chmod(tmp, _umasked(0o777))  # as mkdir makes it, not mkdtemp's 0700
        yield tmp
        if path.exists():
            os.replace(path, aside)
        os.replace(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside.exists() and not path.exists():  # put the old folder back
            try:
                os.replace(aside, path)
            except OSError:  # it stays aside, named in the error, rather than deleted
                raise OSError(
                    errno.EIO, f"the folder it replaced is left at {aside}", str(path)
                ) from e
        if isinstance(e, OSError):
            raise _located(e, path) from e
        raise
    else:
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        if lock is not None:
            os.close(lock)


#: a folder of ``atomic_directory``: ``.<target name>.<8 random characters>.tmp`` (the new
#: folder being written) or ``.old`` (the folder it replaces, set aside for an instant)
_TEMPORARY_DIR = re.compile(r"^\.(?P<name>.+)\.(?P<key>[a-z0-9_]{8})\.(?P<kind>tmp|old)$")


def _lock(folder: Path) -> int | None:
    """An open descriptor of ``folder`` holding its exclusive advisory lock, or None where
    ``fcntl`` does not exist (Windows) or the folder cannot be opened."""
    if fcntl is None:
        return None
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _in_use(folder: Path) -> bool:
    """Whether a live ``atomic_directory`` holds ``folder``'s lock."""
    fd = _lock(folder)
    if fd is None:
        return fcntl is not None and folder.exists()
    os.close(fd)
    return False


def remove_stale_directories(path: Path) -> list[Path]:
    """Remove the temporary folders beside ``path`` that a killed ``atomic_directory(path)``
    left (those whose writer is alive stay); where it was killed between setting the old
    folder aside and moving the new one in (no ``path``), the old folder is put back at
    ``path``. Returns the folders removed. Where locks do not exist (Windows), every
    temporary folder counts as left by a killed writer.

    Changes: the parent of ``path`` (nothing when it does not exist).
    """
    path = Path(path)
    if not path.parent.is_dir():
        return []
    removed = []
    for p in sorted(path.parent.iterdir()):
        found = _TEMPORARY_DIR.match(p.name)
        if found is None or found["name"] != path.name or not p.is_dir():
            continue
        writing = p.with_name(f".{path.name}.{found['key']}.tmp")
        if writing.exists() and _in_use(writing):
            continue
        if found["kind"] == "old" and not path.exists():
            os.replace(p, path)
        else:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` atomically (``write_file`` on a temporary file)."""
    with atomic_path(path) as tmp:
        write_file(tmp, data)


def atomic_save(path: Path, writer: Callable[[Path], None], suffix: str = ".tmp") -> None:
    """Call ``writer(tmp_path)`` and move the result to ``path`` atomically (``suffix``: see
    ``atomic_path``)."""
    with atomic_path(path, suffix) as tmp:
        writer(tmp)


def remove_orphans(directory: Path) -> list[Path]:
    """Delete the temporary files an interrupted ``atomic_path`` left in ``directory`` (a
    process killed mid-write); return them. Call it only while no other process writes there
    (``fisherprune train`` holds the directory's lock)."""
    if not Path(directory).is_dir():
        return []
    removed = [p for p in Path(directory).iterdir() if _TEMPORARY.match(p.name) and p.is_file()]
    for p in removed:
        p.unlink(missing_ok=True)
    return removed
