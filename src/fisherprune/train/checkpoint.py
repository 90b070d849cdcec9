"""Checkpoints: written atomically with a content hash, the last N kept, the newest whole one
found for ``--resume``.

Each checkpoint proves its own integrity: besides the file's SHA-256 in a side file (for
``sha256sum -c``), it holds under ``"integrity"`` the SHA-256 of its content (every tensor's
dtype, shape and bytes and every plain value, in order: ``payload_sha256``), checked on every
load, so a file whose bytes changed is refused whether or not its side file survived.

A checkpoint holds tensors and plain data only (dicts, lists, tuples, strings, numbers), so it
is read back with ``torch.load(..., weights_only=True)``: nothing in it can run code on load.
"""

from __future__ import annotations

import errno
import hashlib
import io
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fisherprune._errors import first_line
from fisherprune.export.safe_load import PickledObjectsError, load_plain
from fisherprune.export.storage import atomic_write_bytes, file_sha256, remove_orphans

__all__ = [
    "CheckpointManager",
    "DamagedCheckpointError",
    "payload_sha256",
    "rng_state",
    "set_rng_state",
]

#: the key of a checkpoint's own content hash (``payload_sha256`` of the rest)
INTEGRITY = "integrity"

_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")

# what to do with a checkpoint refused for holding pickled objects
_REFUSED = (
    "it was written by an older fisherprune (which pickled numpy's random state) or by another "
    "program: if you trust it, export it with the fisherprune version that wrote it "
    "(fisherprune export --format state_dict), or train again with a new --save_dir"
)


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states, as tensors and plain data.

    ``torch.load(..., weights_only=True)`` reads them back exactly; ``set_rng_state`` restores
    them. Numpy's state (an ndarray in ``np.random.get_state()``) becomes a dict with its key
    as an int64 tensor. Reads the generators, changes nothing.
    """
    kind, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "python": random.getstate(),  # (version, tuple of 625 ints, gauss_next)
        "numpy": {
            "bit_generator": str(kind),
            "key": torch.from_numpy(key.astype(np.int64)),  # (624,) uint32 values
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned: sets the process-wide ``random``, ``np.random``
    and torch CPU generators, so each continues the stream it had when saved.

    Raises:
        ValueError: ``state`` is not in the form ``rng_state`` returns.
    """
    np_state = state.get("numpy")
    if not isinstance(np_state, dict) or not isinstance(np_state.get("key"), torch.Tensor):
        raise ValueError("the saved random state is not in the form rng_state() writes")
    random.setstate(state["python"])
    np.random.set_state(
        (
            np_state["bit_generator"],
            np_state["key"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])


class DamagedCheckpointError(ValueError):
    """A checkpoint whose bytes are not those written (its content hash differs from the one
    saved with it, or it cannot be read back): truncated, or changed on disk."""


class CheckpointManager:
    """Files ``ckpt-<step>.pt`` in ``directory``, each written whole or not at all, with its
    SHA-256 beside it in ``ckpt-<step>.pt.sha256`` (the format of ``sha256sum``, so
    ``sha256sum -c`` checks it too); ``load`` verifies it."""

    def __init__(self, directory: Path, keep: int) -> None:
        self.directory = Path(directory)
        self.keep = keep

    def paths(self) -> list[Path]:
        """Existing checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if _NAME.match(p.name)]
        return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))  # type: ignore[union-attr]

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` for ``step`` with its hash file, and delete all but the newest
        ``keep`` checkpoints (and their hash files).

        ``state`` must hold tensors and plain data only (what ``load`` reads back); the bytes
        are checked before anything is written. The hash file is written first: a process
        killed between the two leaves a checkpoint that ``load`` reports as damaged (and
        ``load_newest`` passes over), never one taken for whole without being checked.

        Raises:
            TypeError: ``state`` holds another object (a numpy array, a class instance): no
                file is written and no older checkpoint is deleted.
            OSError: a file could not be written (a full disk: ENOSPC); it names the file,
                and every older checkpoint is left as it was.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"ckpt-{step:08d}.pt"
        data = _plain_bytes({**state, INTEGRITY: {"sha256": payload_sha256(state)}})
        digest = hashlib.sha256(data).hexdigest()
        atomic_write_bytes(_hash_path(path), f"{digest}  {path.name}\n".encode())
        try:
            atomic_write_bytes(path, data)
        except BaseException:
            if not path.exists():  # no hash file without its checkpoint
                _hash_path(path).unlink(missing_ok=True)
            raise
        for old in self.paths()[: -self.keep]:
            old.unlink(missing_ok=True)
            _hash_path(old).unlink(missing_ok=True)
        return path

    def latest(self) -> Path | None:
        paths = self.paths()
        return paths[-1] if paths else None

    def remove_all(self) -> int:
        """Delete every checkpoint, its hash file and any set-aside damaged one; return how
        many checkpoints there were."""
        paths = self.paths()
        for p in paths:
            p.unlink(missing_ok=True)
            _hash_path(p).unlink(missing_ok=True)
        if self.directory.is_dir():
            for p in self.directory.glob("ckpt-*.pt.damaged"):
                p.unlink(missing_ok=True)
        return len(paths)

    def clean(self) -> list[Path]:
        """Delete what an interrupted ``save`` left: temporary files, and hash files whose
        checkpoint was never written; return them. Only while no other run writes here."""
        removed = remove_orphans(self.directory)
        if self.directory.is_dir():
            for h in self.directory.glob("ckpt-*.pt.sha256"):
                if not h.with_suffix("").exists():
                    h.unlink(missing_ok=True)
                    removed.append(h)
        return removed

    def load_newest(self, report: Callable[[str], None]) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that loads whole, and its path; None when there is none.

        Changes: a damaged checkpoint newer than it is renamed ``ckpt-<step>.pt.damaged`` (so
        that later saves, at lower steps, are not deleted in its favour), and ``report`` is
        called with one line naming it and why.

        Raises:
            DamagedCheckpointError: every checkpoint is damaged.
            PickledObjectsError: the newest readable checkpoint holds pickled objects.
        """
        damaged = []
        for path in reversed(self.paths()):
            try:
                return path, self.load(path)
            except DamagedCheckpointError as e:
                aside = path.with_name(path.name + ".damaged")
                path.replace(aside)
                _hash_path(path).unlink(missing_ok=True)
                report(f"{e}; set it aside as {aside.name} and trying the one before")
                damaged.append(path.name)
        if damaged:
            raise DamagedCheckpointError(
                f"every checkpoint in {self.directory} is damaged ({', '.join(damaged)}); "
                "start afresh with --overwrite or use another --save_dir"
            )
        return None

    @staticmethod
    def load(path: Path) -> dict[str, Any]:
        """Load a checkpoint written by ``save``: check the file's hash against its hash file
        (when there is one), read tensors and plain data only (``torch.load(...,
        weights_only=True)``), and check the content hash the file holds (a checkpoint of an
        older fisherprune has none and is read with the side file's check alone). Returns the
        state without that hash. Changes nothing.

        Raises:
            IsADirectoryError: ``path`` is a directory.
            DamagedCheckpointError: (a ValueError) a hash differs, or the file cannot be read
                (truncated): the message names the file.
            PickledObjectsError: (a ValueError) the file holds pickled Python objects: it was
                written by an older fisherprune or by another program. Nothing from it ran;
                the one-line message names the file and says what to do.
            ValueError: the file is not a fisherprune checkpoint.
        """
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(
                errno.EISDIR, "is a directory; give a ckpt-*.pt file in it", str(path)
            )
        saved = _saved_digest(path)
        if saved is not None and file_sha256(path) != saved:
            raise DamagedCheckpointError(
                f"checkpoint {path} is damaged: its content hash differs from the one "
                "written with it (truncated or changed on disk)"
            )
        try:
            state = load_plain(path, "checkpoint", _REFUSED)
        except PickledObjectsError:
            raise
        except Exception as e:
            raise DamagedCheckpointError(
                f"cannot read checkpoint {path}: it is damaged or not a checkpoint "
                f"({first_line(e)})"
            ) from e
        if not isinstance(state, dict) or "model" not in state or "pruner" not in state:
            raise ValueError(f"{path} is not a fisherprune checkpoint")
        integrity = state.pop(INTEGRITY, None)
        if integrity is not None and payload_sha256(state) != integrity.get("sha256"):
            raise DamagedCheckpointError(
                f"checkpoint {path} is damaged: its content differs from the hash written "
                "inside it (changed on disk)"
            )
        return state


def payload_sha256(state: Any) -> str:
    """The SHA-256 of ``state``'s content, hex: each tensor's dtype, shape and bytes, and each
    plain value (dict keys, strings, numbers, ``None``) by type and ``repr``, in the order the
    containers hold them, which ``torch.save`` and ``torch.load`` keep. Reads only."""
    h = hashlib.sha256()
    _digest_into(h, state)
    return h.hexdigest()


def _digest_into(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    elif isinstance(value, dict):
        h.update(f"D{len(value)}".encode())
        for k, v in value.items():
            _digest_into(h, k)
            _digest_into(h, v)
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__[0]}{len(value)}".encode())
        for v in value:
            _digest_into(h, v)
    else:
        h.update(f"{type(value).__name__}:{value!r};".encode())


def _hash_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _saved_digest(path: Path) -> str | None:
    """The hex digest in ``path``'s hash file; None when there is none."""
    try:
        text = _hash_path(path).read_text()
    except FileNotFoundError:
        return None
    return text.split()[0] if text.strip() else ""


def _plain_bytes(state: dict[str, Any]) -> memoryview:
    """``torch.save(state)`` as bytes, refused unless ``weights_only=True`` can read it."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(buf)
    if unsafe:
        raise TypeError(
            "a checkpoint holds tensors and plain data only, so that loading it cannot run "
            f"code; this state also holds {', '.join(sorted(unsafe))}"
        )
    return buf.getbuffer()  # no copy
