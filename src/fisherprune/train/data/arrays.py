"""Readers of numpy arrays: ``.npy`` features with a ``.npy`` label file, or one ``.npz`` with
both (keys ``features[0]``, default ``"x"``, and ``label``, default ``"y"``)."""

from __future__ import annotations

import os
from typing import Any

from fisherprune.train.data.formats import register_reader
from fisherprune.train.data.parts import Part, array_features, array_labels, np_load

__all__ = ["DEFAULT_NPZ_FEATURES", "DEFAULT_NPZ_LABEL"]

DEFAULT_NPZ_FEATURES = "x"
DEFAULT_NPZ_LABEL = "y"


@register_reader("npy", (".npy",), "npy")
def read_npy(path: str, spec: Any, role: str) -> Part:
    """Load ``.npy`` features and their ``.npy`` labels file (``spec.labels`` for the data file,
    ``spec.eval_labels`` for the eval file).

    Raises:
        FileNotFoundError: If the labels file is missing.
        ValueError: Bad arrays, or different lengths (both files named).
    """
    labels = spec.eval_labels if role == "eval file" else spec.labels
    labels = os.path.expanduser(labels)
    if not os.path.isfile(labels):
        raise FileNotFoundError(f"labels file {labels!r} (for {path}) does not exist")
    x = array_features(path, np_load(path, "a .npy features array"), "")
    y = array_labels(labels, np_load(labels, "a .npy label array"), "", len(x), path)
    return Part(file=path, x=x, y=y, y_file=labels, y_at=lambda i: f"row {i + 1}")


@register_reader("npz", (".npz",), "npz")
def read_npz(path: str, spec: Any, role: str) -> Part:
    """Load features and labels from one ``.npz`` archive.

    Raises:
        ValueError: A missing key (the archive's keys are listed), or bad arrays.
    """
    xkey = spec.features[0] if spec.features else DEFAULT_NPZ_FEATURES
    ykey = spec.label or DEFAULT_NPZ_LABEL
    with np_load(path, "an .npz archive") as z:
        keys = list(z.files)
        for key, what in ((xkey, "features"), (ykey, "labels")):
            if key not in keys:
                raise ValueError(f"{path}: no array {key!r} for the {what}; keys: {keys}")
        try:
            x_raw, y_raw = z[xkey], z[ykey]
        except ValueError as e:  # e.g. a pickled object array
            raise ValueError(f"{path}: cannot read arrays {xkey!r}/{ykey!r}: {e}") from e
    x = array_features(path, x_raw, f"array {xkey!r}")
    y = array_labels(path, y_raw, f"array {ykey!r}", len(x), path)
    return Part(file=path, x=x, y=y, y_file=path, y_at=lambda i: f"array {ykey!r}, row {i + 1}")
