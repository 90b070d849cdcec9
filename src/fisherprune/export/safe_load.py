"""Reading torch files as tensors and plain data only: unpickling Python objects can run code.

Every checkpoint and export fisherprune reads goes through ``load_plain``, which is
``torch.load(..., weights_only=True)``: tensors, dicts, lists, tuples, strings and numbers load;
a file that needs any other class or function (a pickled object whose ``__reduce__`` would call
it) is refused with ``PickledObjectsError`` before anything from it runs. There is no fallback to
``weights_only=False``.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from fisherprune.export.manifest import check_exported_file

__all__ = ["PickledObjectsError", "load_plain", "looks_pickled"]

# opcodes that name an importable object: what an unpickler imports and may call
_GLOBAL_OPS = frozenset({"GLOBAL", "STACK_GLOBAL", "INST"})
# torch's weights-only unpickler names the first global it refused like this
_REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")


class PickledObjectsError(ValueError):
    """A file holds pickled Python objects (classes or functions an unpickler would import and
    call), which fisherprune will not load: loading them can run code. Nothing from the file
    ran. The message names the file and says what to do."""

    @classmethod
    def for_file(
        cls, what: str, path: str | os.PathLike, remedy: str, needs: str | None = None
    ) -> PickledObjectsError:
        """The error for ``path``, one line: ``"<what> <path> holds pickled Python objects
        (<needs>), which fisherprune will not load because loading them can run code;
        <remedy>"``."""
        named = f" ({needs})" if needs else ""
        return cls(
            f"{what} {path} holds pickled Python objects{named}, which fisherprune will not "
            f"load because loading them can run code; {remedy}"
        )


def load_plain(path: str | os.PathLike, what: str, remedy: str) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``: tensors and plain data only.

    Reads ``path`` and changes nothing; no code named in the file is imported or run.

    Args:
        path: a file written by ``torch.save``.
        what: what the file should be, to start the refusal ("checkpoint").
        remedy: what the user can do about a refused file, to end the message.

    Returns:
        The loaded object.

    Raises:
        PickledObjectsError: the file holds pickled Python objects (``torch.save`` of a class
            instance or a numpy array, or a ``pickle.dump`` file); the one-line message reads
            ``"<what> <path> holds pickled Python objects (<first refused global>), which
            fisherprune will not load because loading them can run code; <remedy>"``.
        pickle.UnpicklingError: the file is neither a pickle nor a ``torch.save`` file (one
            line, without torch's advice to retry with ``weights_only=False``).
        FileNotFoundError, RuntimeError, EOFError: as ``torch.load``, for a missing, empty or
            truncated file.
        ExportMismatchError: (a ValueError) the manifest of the file's folder (a
            ``fisherprune train`` export) records other bytes for it (``check_exported_file``).
    """
    check_exported_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        refused = _REFUSED_GLOBAL.search(str(e))
        if refused is None and not looks_pickled(Path(path)):
            raise pickle.UnpicklingError(
                "not a file written by torch.save, or a damaged one"
            ) from e
        needs = refused.group(1) if refused else None
        raise PickledObjectsError.for_file(what, path, remedy, needs) from e


def looks_pickled(path: Path) -> bool:
    """Whether ``path`` is a pickle (or a ``torch.save`` zip holding one) that names a class or
    function to import beyond what torch's weights-only loader allows (a tensor's own rebuild
    functions do not count). Nothing is imported or run, and nothing is changed: a zip is read
    by ``torch.serialization.get_unsafe_globals_in_checkpoint``, a plain pickle's opcodes are
    only parsed (``pickletools.genops``). A file that is not a whole pickle gives False.

    Raises:
        OSError: ``path`` cannot be read.
    """
    if zipfile.is_zipfile(path):
        try:
            return bool(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except Exception:  # a damaged archive: not readable as pickled objects either
            return False
    return _names_globals(path.read_bytes())


def _names_globals(data: bytes) -> bool:
    """Whether a whole pickle in ``data`` (pickles read one after another, up to the first
    bytes that are not one) names a global."""
    f = io.BytesIO(data)
    while f.tell() < len(data):
        try:
            ops = {op.name for op, _, _ in pickletools.genops(f)}
        except ValueError:  # not (or no longer) a whole pickle
            return False
        if ops & _GLOBAL_OPS:
            return True
    return False
