"""The :class:`DataSpec`: where the training examples are and how to read them, validated on
construction (every bad field is named), from keyword arguments, a dict or a JSON/YAML file.

The seed's ``PruningDataRecordTrainer`` read twml DataRecords: feature columns plus a label.
Here the same information comes from ordinary files (one reader per format,
:mod:`fisherprune.train.data.formats`), a folder of images, or a built-in data set.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fisherprune.train.data.builtins import BUILTINS, builtin_names
from fisherprune.train.data.formats import READERS, format_of, supported
from fisherprune.train.data.images import IMAGE_MODES

try:
    import yaml  # type: ignore[import-untyped]
except ImportError:  # optional: YAML spec files
    yaml = None

__all__ = ["CATEGORICAL", "STREAM", "TASKS", "DataSpec"]

TASKS: tuple[str, ...] = ("classification", "regression")
#: what to do with a text feature column
CATEGORICAL: tuple[str, ...] = ("onehot", "refuse")
#: when to stream a table: auto (files over ``STREAM_BYTES``), always, never
STREAM: tuple[str, ...] = ("auto", "always", "never")


def _supported() -> str:
    """Describe the accepted sources, for error messages."""
    return f"{supported()}, or a built-in name {builtin_names()}"


# ====================================================================== the spec
@dataclass
class DataSpec:
    """Where the training data is, and how to read it.

    Attributes:
        source: A data file (``.csv``, ``.csv.gz``, ``.parquet``, ``.npy``, ``.npz``), a
            folder with one sub-folder of images per class, or a built-in name
            (:func:`builtin_names`).
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
        seed: Seed of the train/eval split (and of the batch order).
        image_size: ``(H, W)`` every image is resized to (image folders, ``image_column``).
            None: a folder's images must share one size; a column's are resized to its first.
        image_mode: ``"L"`` (grayscale, 1 channel), ``"RGB"`` (3) or ``"auto"`` (RGB if the
            images have colour).
        image_column: A table column holding encoded images (bytes) or image file paths
            (relative to the table's folder); it is then the only feature.
        categorical: What a text feature column becomes: ``"onehot"`` (one 0/1 feature per
            category of the training rows; an unseen one is all zeros, with a warning) or
            ``"refuse"`` (an error that says how to proceed).
        remap_labels: Map integer class labels' sorted distinct values to ``0..K-1`` (the
            originals are kept in ``Dataset.class_names``); without it, labels far above the
            class count are an error.
        standardize: Standardise table features (and regression targets) with the training
            rows' mean and standard deviation, inside the built model.
        stream: ``"auto"`` (stream a table file larger than ``STREAM_BYTES``), ``"always"`` or
            ``"never"``. A streamed table is read in record batches, never whole.
        shuffle_buffer: Rows shuffled together when streaming (bounds the memory).

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
    image_size: tuple[int, int] | None = None
    image_mode: str = "auto"
    image_column: str | None = None
    categorical: str = "onehot"
    remap_labels: bool = False
    standardize: bool = True
    stream: str = "auto"
    shuffle_buffer: int = 65536

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
        self._check_new_options()
        self._check_source_options()

    def _check_new_options(self) -> None:
        """Validate the image, encoding and streaming options."""
        if self.image_size is not None:
            size = self.image_size
            if isinstance(size, int) and not isinstance(size, bool):
                size = (size,)
            if isinstance(size, (list, tuple)) and len(size) == 1:  # one size: a square
                size = (size[0], size[0])
            if (
                isinstance(size, (str, bytes))
                or not isinstance(size, (list, tuple))
                or len(size) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in size)
            ):
                raise ValueError(
                    "data spec: image_size must be one positive integer (a square) or two, "
                    f"H,W, got {self.image_size!r}"
                )
            self.image_size = (int(size[0]), int(size[1]))
        for name, allowed in (
            ("image_mode", IMAGE_MODES),
            ("categorical", CATEGORICAL),
            ("stream", STREAM),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"data spec: {name} must be one of {list(allowed)}, got {getattr(self, name)!r}"
                )
        for name in ("remap_labels", "standardize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"data spec: {name} must be true or false")
        b = self.shuffle_buffer
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"data spec: shuffle_buffer must be an integer >= 1, got {b!r}")
        if self.image_column is not None and self.features is not None:
            raise ValueError("data spec: give image_column or features, not both")

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
        if self.source in BUILTINS:
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
        fmt = format_of(self.source)
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
        eval_fmt = format_of(self.eval_source)
        if eval_fmt is None:
            raise ValueError(
                f"data spec: cannot tell the format of eval_source "
                f"{self.eval_source!r}: expected {supported()}"
            )
        if READERS[eval_fmt].kind != READERS[fmt].kind:
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
            if format_of(labels) != "npy":
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
                if isinstance(value, str) and value not in BUILTINS:
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
            if yaml is None:
                raise ImportError(
                    f"reading the YAML data spec {str(p)!r} needs pyyaml "
                    f"(pip install pyyaml); or write the spec as JSON"
                )
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
        for name in ("image_shape", "image_size"):
            if out[name] is not None:
                out[name] = list(out[name])
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
