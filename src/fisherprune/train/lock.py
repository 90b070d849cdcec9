"""One live run per save directory: an advisory lock (``fcntl.flock``) on ``<save_dir>/run.lock``.

The operating system releases the lock when its process ends, however it ends, so a lock file
left by a crashed or killed run is simply taken over by the next one; the file only records
who holds it (pid, host, time) for the message another run prints. Where ``fcntl`` does not
exist (Windows) no lock is taken.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; runs are not kept apart
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "RunLock", "SaveDirInUseError"]

LOCK_NAME = "run.lock"


class SaveDirInUseError(ValueError):
    """Another live run holds the save directory."""


class RunLock:
    """The exclusive lock of a save directory, held from ``acquire`` to ``release`` (or the
    end of the process)."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock and write this process's pid, host and start time into the file.

        Raises:
            SaveDirInUseError: another live process holds it (the message says which).
            OSError: the lock file cannot be created (a read-only directory, ...).
        """
        if fcntl is None or self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown process"
            os.close(fd)
            raise SaveDirInUseError(
                f"{self.path.parent} is in use by another fisherprune run ({holder}); wait "
                "for it to end, or give this run another --save_dir"
            ) from None
        os.ftruncate(fd, 0)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {stamp}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Give the lock up (the file stays, naming the last holder)."""
        if self._fd is not None and fcntl is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
        self._fd = None
