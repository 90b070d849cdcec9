"""One file's examples before labels and splits are settled, and the checks every reader shares
(finite features, label arrays of the right length)."""

from __future__ import annotations

import math
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["At", "Part", "array_features", "array_labels", "check_finite", "np_load"]

At = Callable[[int], str]  # 0-based row -> "column 'a', row 3" and the like


@dataclass
class Part:
    """One file's examples, as a reader returns them.

    Attributes:
        file: The file (or folder) read.
        y: Raw labels, 1-D: numbers or str.
        y_file: The file holding the labels (a ``.npy`` labels file, else ``file``).
        y_at: 0-based row -> where its label is, e.g. ``"column 'y', row 3"``.
        x: float32 features ``(N, ...)`` (arrays, images), or None for a table.
        table: A table's columns (a ``pyarrow.Table``) when ``x`` is None.
        feature_names: The feature columns of a table, else None.
        columns: Every column of a table, else None.
        class_names: Text labels that name classes by themselves (a folder per class), so
            that an eval folder maps its labels the same way.
    """

    file: str
    y: np.ndarray
    y_file: str
    y_at: At
    x: np.ndarray | None = None
    table: Any = None
    feature_names: list[str] | None = None
    columns: list[str] | None = None
    class_names: list[str] | None = None

    @property
    def rows(self) -> int:
        """Number of examples."""
        return len(self.y)


def check_finite(
    file: str, x32: np.ndarray, original: np.ndarray, at: Callable[[int, int], str]
) -> None:
    """Raise ValueError at the first (row-major) non-finite value of ``x32`` (N, F).

    Args:
        file: Named in the message.
        x32: The float32 features, 2-D.
        original: The same values before the float32 cast (same shape), for the message.
        at: ``(row, feature) -> "column 'a', row 3"``, 0-based arguments.

    Raises:
        ValueError: If some value is NaN or infinite (or too large for float32).
    """
    bad = ~np.isfinite(x32)
    if not bad.any():
        return
    flat = int(np.flatnonzero(bad.ravel())[0])
    r, c = divmod(flat, x32.shape[1])
    value = original[r, c].item()
    if isinstance(value, float) and math.isfinite(value):
        raise ValueError(f"{file}: value {value!r} in {at(r, c)} is too large for float32")
    raise ValueError(f"{file}: non-finite value {value!r} in {at(r, c)}; features must be finite")


def np_load(path: str, what: str) -> Any:
    """``np.load`` without pickles, naming the file in any error.

    Raises:
        ValueError: If numpy cannot read the file (including pickled object arrays).
    """
    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        # numpy takes any file without its magic bytes for a pickle and advises allow_pickle
        why = "not a numpy file, or a damaged one" if "allow_pickle" in str(e) else e
        raise ValueError(f"{path}: cannot read {what}: {why}") from e


def array_features(path: str, x: np.ndarray, what: str) -> np.ndarray:
    """Check a features array (numeric, non-empty, finite) and return it as float32 (N, ...).

    Args:
        path: File named in messages.
        x: The stored array; 1-D means one feature per row.
        what: E.g. ``"array 'x'"`` for .npz files, ``""`` for .npy.

    Raises:
        ValueError: Wrong dtype, no rows, or a non-finite value (file, row, feature index).
    """
    prefix = f"{what} " if what else ""
    if x.dtype.kind not in "biuf":
        raise ValueError(f"{path}: {prefix}has dtype {x.dtype}; features must be numbers")
    if x.ndim == 0:
        raise ValueError(f"{path}: {prefix}is a scalar; expected one row per example")
    if x.ndim == 1:
        x = x[:, None]
    if x.shape[0] == 0:
        raise ValueError(f"{path}: {prefix}has no rows")
    with np.errstate(over="ignore"):  # overflow is reported by check_finite
        x32 = x.astype(np.float32)
    sample = x.shape[1:]

    def at(r: int, c: int) -> str:
        idx = np.unravel_index(c, sample)
        pos = str(int(idx[0])) if len(idx) == 1 else str(tuple(int(i) for i in idx))
        return f"{prefix}row {r + 1}, feature index {pos}"

    n = x.shape[0]
    check_finite(path, x32.reshape(n, -1), x.reshape(n, -1), at)
    return x32


def array_labels(path: str, y: np.ndarray, what: str, n: int, x_file: str) -> np.ndarray:
    """Check a label array: 1-D (or (N, 1)), numbers or text, one per example.

    Args:
        path: File holding the labels.
        y: The stored array.
        what: E.g. ``"array 'y'"`` or ``""``.
        n: Number of feature rows.
        x_file: The features file, for the length-mismatch message.

    Raises:
        ValueError: Wrong dtype or shape, or a length different from ``n``.
    """
    prefix = f"{what} " if what else ""
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise ValueError(
            f"{path}: {prefix}labels have shape {y.shape}; expected one label per row, shape (N,)"
        )
    if y.dtype.kind not in "biufUS":
        raise ValueError(f"{path}: {prefix}labels have dtype {y.dtype}; expected numbers or text")
    if len(y) != n:
        src = f"{x_file} has" if x_file != path else "the features have"
        raise ValueError(f"{path}: {prefix}has {len(y)} labels but {src} {n} rows")
    return y.astype(str) if y.dtype.kind == "S" else y
