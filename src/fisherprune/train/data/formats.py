"""The reader registry: one reader per data format, found by a file's suffix (or, for a folder
of images, by being a directory).

A reader turns one file into a :class:`~fisherprune.train.data.parts.Part` (features or table
columns, plus raw labels). Files of the same ``kind`` may be mixed between ``source`` and
``eval_source`` (a CSV data file with a Parquet eval file, say).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["READERS", "Reader", "format_of", "register_reader", "supported"]

#: a reader's signature: ``(path, spec, role) -> Part``; ``role`` is "data file" or "eval file"
ReadFn = Callable[[str, Any, str], Any]


@dataclass(frozen=True)
class Reader:
    """One data format.

    Attributes:
        name: The format's name (``"csv"``, ``"parquet"``, ``"npz"``, ...).
        suffixes: File name endings that select it, lower case (none for a directory reader).
        kind: Formats of the same kind can be mixed between the data and the eval file.
        read: ``(path, spec, role) -> Part``.
        directory: True if the source is a directory (a folder of images), not a file.
    """

    name: str
    suffixes: tuple[str, ...]
    kind: str
    read: ReadFn
    directory: bool = False


READERS: dict[str, Reader] = {}


def register_reader(
    name: str, suffixes: tuple[str, ...], kind: str, *, directory: bool = False
) -> Callable[[ReadFn], ReadFn]:
    """Register ``read`` as the reader of format ``name`` (adds one entry to ``READERS``).

    Raises:
        ValueError: ``name`` or one of ``suffixes`` is already registered, or a directory
            reader is registered twice.
    """

    def deco(read: ReadFn) -> ReadFn:
        if name in READERS:
            raise ValueError(f"data format {name!r} is already registered")
        taken = {s: r.name for r in READERS.values() for s in r.suffixes}
        for s in suffixes:
            if s in taken:
                raise ValueError(f"suffix {s!r} already belongs to data format {taken[s]!r}")
        if directory and any(r.directory for r in READERS.values()):
            raise ValueError("a directory reader is already registered")
        READERS[name] = Reader(name, tuple(s.lower() for s in suffixes), kind, read, directory)
        return read

    return deco


def format_of(path: str) -> str | None:
    """The format named by ``path``'s suffix (case-insensitive; the longest suffix wins), the
    directory reader's format if ``path`` is an existing directory, else None."""
    if os.path.isdir(os.path.expanduser(path)):
        return next((r.name for r in READERS.values() if r.directory), None)
    low = path.lower()
    best: tuple[int, str] | None = None
    for r in READERS.values():
        for s in r.suffixes:
            if low.endswith(s) and (best is None or len(s) > best[0]):
                best = (len(s), r.name)
    return None if best is None else best[1]


def supported() -> str:
    """The accepted file endings, for error messages."""
    suffixes = [s for r in READERS.values() for s in r.suffixes]
    folders = (
        " or a folder with one sub-folder of images per class"
        if any(r.directory for r in READERS.values())
        else ""
    )
    return f"a file ending in {', '.join(suffixes)}{folders}"
