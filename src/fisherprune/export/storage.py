"""Atomic file writes: a file is either written whole or not at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["atomic_path", "atomic_save", "atomic_write_bytes"]


@contextlib.contextmanager
def atomic_path(path: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` atomically.

    On any exception the temporary file is removed and ``path`` is left as it was. ``suffix``
    ends the temporary name, for writers that insist on an extension (AOTInductor's ``.pt2``).

    Raises:
        FileNotFoundError: the parent directory does not exist.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_save(path: Path, writer: Callable[[Path], None], suffix: str = ".tmp") -> None:
    """Call ``writer(tmp_path)`` and move the result to ``path`` atomically (``suffix``: see
    ``atomic_path``)."""
    with atomic_path(path, suffix) as tmp:
        writer(tmp)
