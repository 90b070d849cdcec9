"""Readers of tables, ``.csv`` / ``.csv.gz`` and ``.parquet``, through pyarrow; and the
:class:`TablePlan` that turns a table's columns into float32 features.

A CSV file needs a header row. ``label`` names the label column (default ``"label"``);
``features`` lists the feature columns (default every other column). A numeric column is used
as it is; a text column whose every cell is a word (no cell is a number) is *categorical* and
becomes one 0/1 column per category seen in the training rows (``categorical="onehot"``), or is
refused (``categorical="refuse"``); a column with ``image_column`` holds encoded images or their
file paths. The same plan encodes in-memory tables and the batches a stream reads.
"""

from __future__ import annotations

import codecs
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fisherprune.train.data.formats import register_reader
from fisherprune.train.data.images import decode_images, image_format
from fisherprune.train.data.parts import At, Part, check_finite

try:
    import pyarrow as pa
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq
except ImportError:  # optional: the 'data' extra
    pa = pa_csv = pq = None

__all__ = [
    "DEFAULT_TABLE_LABEL",
    "TableColumn",
    "TablePlan",
    "binary_column_error",
    "column_values",
    "csv_error",
    "is_binary",
    "need_pyarrow",
]

DEFAULT_TABLE_LABEL = "label"
_SNIFF_BYTES = 1 << 16  # how much of a CSV file that failed to parse is checked for text


def need_pyarrow(path: str) -> None:
    """Raise ImportError, naming ``path`` and what to install, if pyarrow is missing."""
    if pa is None:
        raise ImportError(
            f"reading the table {path!r} needs pyarrow: pip install pyarrow "
            "(or pip install 'fisherprune[data]')"
        )


def row_at(offset: int = 0) -> At:
    """0-based row (plus ``offset``) -> ``"row 3"`` (data rows, the header is not a row)."""
    return lambda i: f"row {i + offset + 1}"


def check_names(path: str, names: list[str]) -> None:
    """Refuse a table without columns, with a blank or repeated name, or (CSV) without a
    header row (its first line is all numbers).

    Raises:
        ValueError: Naming the file and the column(s).
    """
    if not names:
        raise ValueError(f"{path}: no columns")
    for j, n in enumerate(names):
        if not str(n).strip():
            raise ValueError(f"{path}: header column {j + 1} has no name")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{path}: column(s) {dupes} appear more than once")
    try:
        [float(n) for n in names]
    except ValueError:
        return
    raise ValueError(
        f"{path}: the first line {','.join(names)[:60]!r} looks like data; a "
        f"header row of column names is required"
    )


@register_reader("csv", (".csv", ".csv.gz"), "table")
def read_csv(path: str, spec: Any, role: str) -> Part:
    """Read a whole CSV file (gzip detected from the name) with ``pyarrow.csv``.

    Raises:
        ImportError: pyarrow is missing.
        OSError: The file cannot be opened (missing, no permission).
        ValueError: An empty file, a bad header, a row with the wrong number of fields, a
            file that is not UTF-8 text, compressed data that is corrupt (see ``csv_error``).
    """
    need_pyarrow(path)
    try:
        table = pa_csv.read_csv(path)
        names = table.column_names  # decodes the header: a binary file can fail here
    except (pa.ArrowInvalid, UnicodeDecodeError, OSError) as e:
        raise csv_error(path, e) from None
    return _table_part(path, table, names, spec, role)


def csv_error(path: str, e: Exception, where: str = "") -> Exception:
    """The one-line error to raise for pyarrow's failure ``e`` to read the CSV file ``path``
    (``where``: e.g. ``" after row 8192"``): the OS's own error (a missing file, no
    permission) as it is; else a ValueError naming the file and the problem (compressed data
    that is corrupt or cut short, a file that is not UTF-8 text, an empty file, pyarrow's
    parse error), with no raw bytes of the file in it."""
    if isinstance(e, OSError) and e.errno is not None:
        return e
    if isinstance(e, OSError):  # pyarrow's decompression failed
        return ValueError(
            f"{path}: cannot decompress{where}: {_printable(str(e))} (the compressed data is "
            "corrupt or cut short; download or write the file again)"
        )
    not_text = _not_text(path)
    if not_text is not None:
        return ValueError(
            f"{path}: not a CSV text file: {not_text} (a binary file, or text in another "
            "encoding: convert it to UTF-8)"
        )
    msg = _printable(str(e))
    if "Empty CSV file" in msg:
        return ValueError(f"{path}: the file is empty (a header row of column names is required)")
    return ValueError(f"{path}: cannot read as CSV{where}: {msg}")


def _not_text(path: str) -> str | None:
    """Where the start of ``path`` (decompressed as its name says) stops being UTF-8 text, e.g.
    ``"byte 0x9f at offset 3 is not UTF-8 text"``; None when it is text (or unreadable)."""
    try:
        with pa.input_stream(path, compression="detect") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError:
        return None
    nul = head.find(b"\0")
    try:  # final=False: a character cut by the end of the sample is not an error
        codecs.getincrementaldecoder("utf-8")().decode(head[: nul if nul >= 0 else None])
    except UnicodeDecodeError as bad:
        return f"byte 0x{head[bad.start]:02x} at offset {bad.start} is not UTF-8 text"
    return None if nul < 0 else f"it holds a NUL byte at offset {nul}"


def _printable(text: str) -> str:
    """``text`` with every character that is not printable, and the replacement character
    pyarrow puts for bytes that are not UTF-8, written as an escape (``\\x8f``, ``\\ufffd``)."""
    return "".join(
        c if c.isprintable() and c != "\ufffd" else c.encode("unicode_escape").decode()
        for c in text
    )


@register_reader("parquet", (".parquet", ".pq"), "table")
def read_parquet(path: str, spec: Any, role: str) -> Part:
    """Read a whole Parquet file with pyarrow.

    Raises:
        ImportError: pyarrow is missing.
        ValueError: The file is not Parquet, or has no rows.
    """
    need_pyarrow(path)
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"{path}: cannot read as Parquet: {e}") from e
    return _table_part(path, table, table.column_names, spec, role)


def _table_part(path: str, table: Any, column_names: list[str], spec: Any, role: str) -> Part:
    """Check a read table's columns (named ``column_names``) against the spec and wrap it as
    a Part."""
    names = [str(n) for n in column_names]
    check_names(path, names)
    if table.num_rows == 0:
        raise ValueError(f"{path}: no data rows (only a header)")
    label, features = table_columns(path, names, spec, role)
    at = row_at()
    return Part(
        file=path,
        y=column_values(table, label, path, at),
        y_file=path,
        y_at=lambda i: f"column {label!r}, {at(i)}",
        table=table.select(features),
        feature_names=features,
        columns=names,
    )


def table_columns(path: str, names: list[str], spec: Any, role: str) -> tuple[str, list[str]]:
    """The label column and the feature columns of a table with columns ``names``.

    Raises:
        ValueError: A missing label or feature column (the columns are listed), or no feature.
    """
    label = spec.label or DEFAULT_TABLE_LABEL
    if label not in names:
        note = "" if spec.label else f" (label defaults to {DEFAULT_TABLE_LABEL!r})"
        raise ValueError(f"{path}: {role} has no label column {label!r}{note}; columns: {names}")
    if spec.image_column is not None:
        wanted = [spec.image_column]
    elif spec.features is not None:
        wanted = list(spec.features)
    else:
        wanted = [c for c in names if c != label]
        if not wanted:
            raise ValueError(f"{path}: no feature columns besides the label {label!r}")
    missing = [f for f in wanted if f not in names]
    if missing:
        raise ValueError(f"{path}: {role} has no feature column(s) {missing}; columns: {names}")
    return label, wanted


def column_values(table: Any, name: str, path: str, at: At) -> np.ndarray:
    """One column as a 1-D numpy array: float64/int/bool numbers, str text, or object bytes.

    Raises:
        ValueError: A missing value (file, column, row) or a type that is neither.
    """
    col = table.column(name)
    if col.null_count:
        first = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(
            f"{path}: missing value (an empty cell, NaN or null) in column {name!r}, {at(first)}"
        )
    t = col.type
    if pa.types.is_dictionary(t):
        col, t = col.cast(t.value_type), t.value_type
    if pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t):
        return np.asarray(col.to_numpy(zero_copy_only=False))
    if pa.types.is_decimal(t):
        return np.asarray(col.cast(pa.float64()).to_numpy(zero_copy_only=False))
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return np.asarray(col.to_numpy(zero_copy_only=False), dtype=str)
    if is_binary(t):
        return np.asarray(col.to_numpy(zero_copy_only=False), dtype=object)
    raise ValueError(f"{path}: column {name!r} has type {t}, which is neither numeric nor text")


def is_binary(t: Any) -> bool:
    """Whether the pyarrow type ``t`` is binary (bytes): an image column's encoded images."""
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def binary_column_error(path: str, name: str) -> ValueError:
    """The refusal of a binary (bytes) feature column that is not the image column: its bytes
    are neither numbers nor text categories."""
    return ValueError(
        f"{path}: feature column {name!r} holds binary values (bytes), which are neither "
        "numbers nor text; decode it to text or numbers, leave it out with --features, or name "
        "it with --image_column if it holds encoded images"
    )


def _numbers(raw: np.ndarray) -> np.ndarray | None:
    """A text column's cells as float64 if every one is a number, else None."""
    s = np.char.strip(raw.astype(str))
    try:
        return s.astype(np.float64)
    except ValueError:
        return None


@dataclass
class TableColumn:
    """How one feature column becomes features.

    Attributes:
        name: The column.
        kind: ``"number"`` (one feature), ``"category"`` (one 0/1 feature per category) or
            ``"image"`` (the decoded image is the whole example).
        categories: The categories seen in the training rows, sorted (``"category"`` only).
    """

    name: str
    kind: str
    categories: list[str] = field(default_factory=list)


@dataclass
class TablePlan:
    """The encoding of a table's feature columns, fitted on training rows only.

    Attributes:
        file: The table the plan was fitted on.
        columns: One entry per feature column, in order.
        image: ``((H, W), mode)`` of an image column (``mode`` ``"L"`` or ``"RGB"``): the
            spec's, else the first training image's.
    """

    file: str
    columns: list[TableColumn]
    image: tuple[tuple[int, int], str] | None = None

    @classmethod
    def fit(cls, part: Part, rows: np.ndarray, spec: Any) -> TablePlan:
        """Decide each feature column's kind, and the categories from the training ``rows``.

        Raises:
            ValueError: A text column that mixes numbers and words (the first word is named),
                a categorical column with ``categorical="refuse"`` (says how to proceed), or a
                binary (bytes) column that is not the image column.
        """
        out: list[TableColumn] = []
        errors: list[tuple[int, int, str]] = []  # (row, column position, message)
        image = None
        for k, name in enumerate(part.feature_names or []):
            raw = column_values(part.table, name, part.file, row_at())
            if name == spec.image_column:
                out.append(TableColumn(name, "image"))
                first = f"{part.file}, column {name!r}, {row_at()(int(rows[0]))}"
                base = os.path.dirname(part.file)
                image = image_format(raw[rows[0]], base, spec.image_size, spec.image_mode, first)
            elif raw.dtype == object:  # bytes (column_values)
                raise binary_column_error(part.file, name)
            elif raw.dtype.kind in "biuf" or _numbers(raw) is not None:
                out.append(TableColumn(name, "number"))
            else:
                try:
                    out.append(_category(part.file, name, raw, rows, spec))
                except _MixedColumn as e:
                    errors.append((e.row, k, str(e)))
        if errors:
            raise ValueError(min(errors)[2])
        return cls(part.file, out, image)

    @property
    def feature_names(self) -> list[str]:
        """The encoded features' names: a number column's name, ``"col=category"`` per one-hot
        feature."""
        names: list[str] = []
        for c in self.columns:
            names += [f"{c.name}={v}" for v in c.categories] if c.kind == "category" else [c.name]
        return names

    @property
    def numeric(self) -> np.ndarray:
        """Bool per encoded feature: True for a number column (these are standardised)."""
        flags: list[bool] = []
        for c in self.columns:
            flags += [False] * len(c.categories) if c.kind == "category" else [c.kind == "number"]
        return np.array(flags, dtype=bool)

    def encode(self, table: Any, path: str, at: At) -> np.ndarray:
        """The float32 features of ``table``'s rows: ``(N, F)``, or ``(N, C, H, W)`` images.

        An unseen category becomes all zeros, with a warning naming it.

        Raises:
            ValueError: A missing, non-numeric or non-finite value (file, column, row).
        """
        if self.image is not None:
            values = column_values(table, self.columns[0].name, path, at)
            return decode_images(values, os.path.dirname(path), *self.image, path)
        blocks: list[np.ndarray] = []
        for c in self.columns:
            raw = column_values(table, c.name, path, at)
            if c.kind == "number":
                blocks.append(_as_numbers(raw, path, c.name, at)[:, None])
            else:
                blocks.append(_one_hot(raw, c, path))
        x64 = np.concatenate(blocks, axis=1)
        with np.errstate(over="ignore"):  # overflow is reported by check_finite
            x32 = x64.astype(np.float32)
        names = self.feature_names
        check_finite(path, x32, x64, lambda r, j: f"column {names[j].split('=')[0]!r}, {at(r)}")
        return x32


def _as_numbers(raw: np.ndarray, path: str, name: str, at: At) -> np.ndarray:
    """A number column as float64; a text cell that is not a number is an error (named)."""
    if raw.dtype.kind in "biuf":
        return raw.astype(np.float64)
    nums = _numbers(raw)
    if nums is not None:
        return nums
    s = np.char.strip(raw.astype(str))
    for i, v in enumerate(s.tolist()):
        try:
            float(v)
        except ValueError:
            what = "empty cell" if v == "" else f"non-numeric value {v!r}"
            raise ValueError(
                f"{path}: {what} in feature column {name!r}, {at(i)}; features must be numbers"
            ) from None
    raise AssertionError("unreachable: some cell failed to parse")


class _MixedColumn(ValueError):
    """A text column with numbers and words: the first word's row is ``row`` (0-based)."""

    def __init__(self, message: str, row: int) -> None:
        super().__init__(message)
        self.row = row


def _category(path: str, name: str, raw: np.ndarray, rows: np.ndarray, spec: Any) -> TableColumn:
    """A text column: categorical (its training rows' categories) unless some cells are
    numbers (then the first word is an error) or ``spec.categorical == "refuse"``."""
    s = np.char.strip(raw.astype(str))
    is_num = np.zeros(len(s), dtype=bool)
    for i, v in enumerate(s.tolist()):
        try:
            float(v)
            is_num[i] = True
        except ValueError:
            pass
    if is_num.any():
        i = int(np.flatnonzero(~is_num)[0])
        what = "empty cell" if s[i] == "" else f"non-numeric value {str(s[i])!r}"
        raise _MixedColumn(
            f"{path}: {what} in feature column {name!r}, row {i + 1}; features must be numbers",
            i,
        )
    if spec.categorical == "refuse":
        raise ValueError(
            f"{path}: feature column {name!r} holds text (e.g. {str(s[0])!r}); encode it as "
            "numbers, leave it out with --features, or pass --categorical onehot to one-hot "
            "encode it"
        )
    return TableColumn(name, "category", sorted(set(s[rows].tolist())))


def _one_hot(raw: np.ndarray, col: TableColumn, path: str) -> np.ndarray:
    """One 0/1 column per category; an unseen category is all zeros (with a warning)."""
    s = np.char.strip(raw.astype(str))
    cats = np.array(col.categories, dtype=str)
    idx = np.searchsorted(cats, s)
    idx = np.minimum(idx, len(cats) - 1)
    known = cats[idx] == s
    if not known.all():
        unseen = sorted(set(s[~known].tolist()))
        warnings.warn(
            f"{path}: column {col.name!r} has categories {unseen[:5]} not seen in the training "
            f"rows ({int((~known).sum())} rows); they are encoded as all zeros",
            stacklevel=2,
        )
    out = np.zeros((len(s), len(cats)), dtype=np.float64)
    out[np.flatnonzero(known), idx[known]] = 1.0
    return out
