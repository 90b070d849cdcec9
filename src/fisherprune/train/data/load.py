"""``load_data``: a :class:`DataSpec` -> a :class:`Dataset` of tensors (or, for a table too
large to hold, a :class:`StreamingDataset`).

Without ``eval_source``, a random ``eval_fraction`` of the rows (chosen by ``seed``; not
stratified) is held out for evaluation; both parts keep the file's row order. Everything fitted
to the data (categories, standardisation, label checks) sees the training rows only.

Every error about the data names the file, and where it applies the column and the 1-based data
row (the header is not a row). All data and spec errors are ``ValueError``
(``FileNotFoundError`` for a missing file, ``ImportError`` for a missing optional package).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

from fisherprune.train.data.builtins import BUILTINS, builtin_arrays
from fisherprune.train.data.dataset import Dataset, Moments, Scaling, fit_scaling
from fisherprune.train.data.formats import READERS, format_of
from fisherprune.train.data.labels import check_classes, finish_labels
from fisherprune.train.data.parts import Part
from fisherprune.train.data.spec import DataSpec
from fisherprune.train.data.stream import StreamingDataset
from fisherprune.train.data.tables import TablePlan, row_at

__all__ = ["STREAM_BYTES", "load_data"]

#: ``stream="auto"`` streams a table file larger than this (bytes)
STREAM_BYTES = 512 * 2**20


def _reshape(x: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
    """``x`` reshaped to ``(N, *shape)``.

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


def _split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random train/eval row indices (each sorted, so file order is kept); ``fraction`` of
    ``n`` rounded to the nearest row (halves up) goes to eval (see ``_check_split``)."""
    n_eval = math.floor(n * fraction + 0.5)
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])


def _check_split(tr: np.ndarray, ev: np.ndarray, fraction: float, what: str) -> None:
    """Raise ValueError if either side of a split is empty."""
    if len(tr) < 1 or len(ev) < 1:
        raise ValueError(
            f"{what}: too few rows ({len(tr) + len(ev)}) to split with eval_fraction="
            f"{fraction}: that leaves {len(tr)} train and {len(ev)} eval rows"
        )


def _read(spec: DataSpec, path: str, train: Part | None) -> Part:
    """Read the data file (``train`` None) or the eval file (checked against ``train``).

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: Bad data, or eval examples shaped differently from the data file's.
    """
    path = os.path.expanduser(path)
    role = "eval file" if train is not None else "data file"
    fmt = format_of(path)
    if fmt is None or not (os.path.isfile(path) or READERS[fmt].directory):
        raise FileNotFoundError(f"{role} {path!r} does not exist")
    part = READERS[fmt].read(path, spec, role)
    if train is None:
        return part
    if part.table is not None and spec.features is None and spec.image_column is None:
        assert train.columns is not None and part.columns is not None
        if set(part.columns) != set(train.columns):
            missing = [c for c in train.columns if c not in part.columns]
            extra = [c for c in part.columns if c not in train.columns]
            raise ValueError(
                f"{path}: eval file has different columns from {train.file}: "
                f"missing {missing}, extra {extra}"
            )
        part.table = part.table.select(train.feature_names)
        part.feature_names = train.feature_names
    if part.x is not None and train.x is not None and part.x.shape[1:] != train.x.shape[1:]:
        raise ValueError(
            f"{path}: eval file rows have shape {part.x.shape[1:]}, but the rows of "
            f"{train.file} have shape {train.x.shape[1:]}"
        )
    return part


def _features(
    spec: DataSpec, parts: list[Part], train_rows: np.ndarray
) -> tuple[list[np.ndarray], TablePlan | None]:
    """The float32 features of every row of each part (checked in file order); a table's
    encoding is fitted on the training rows ``train_rows`` of ``parts[0]``."""
    if parts[0].table is None:
        return [p.x for p in parts], None
    plan = TablePlan.fit(parts[0], train_rows, spec)
    return [plan.encode(p.table, p.file, row_at()) for p in parts], plan


def _scaling(
    spec: DataSpec, x: np.ndarray, y: np.ndarray, plan: TablePlan | None, task: str
) -> Scaling | None:
    """Standardisation from the training rows: flat table/array features (not images), and
    regression targets; None when ``spec.standardize`` is off or nothing applies."""
    if not spec.standardize:
        return None
    flat = x.ndim == 2 and spec.image_shape is None and (plan is None or plan.image is None)
    target = None
    if task == "regression":
        target = Moments(1)
        target.update(y.reshape(-1, 1))
    if not flat:
        return fit_scaling(None, None, target) if target else None
    features = Moments(x.shape[1])
    features.update(x)
    scaled = plan.numeric if plan is not None else np.ones(x.shape[1], dtype=bool)
    return fit_scaling(features, scaled, target)


def _builtin(spec: DataSpec) -> Dataset:
    """A built-in data set, split by ``spec``; its images are not standardised."""
    x_all, y_all, default_shape, desc = builtin_arrays(spec.source)
    x_all = _reshape(x_all.astype(np.float32), spec.image_shape or default_shape, desc)
    tr, ev = _split(len(x_all), spec.eval_fraction, spec.seed)
    _check_split(tr, ev, spec.eval_fraction, desc)
    desc += f"; {len(ev)} of {len(x_all)} rows held out for eval (seed {spec.seed})"
    return _dataset(x_all[tr], y_all[tr], x_all[ev], y_all[ev], int(y_all.max()) + 1, desc, spec)


def _dataset(
    x_tr: np.ndarray,
    y_tr: np.ndarray,
    x_ev: np.ndarray,
    y_ev: np.ndarray,
    num_classes: int | None,
    desc: str,
    spec: DataSpec,
    **extra: Any,
) -> Dataset:
    y_dtype = torch.int64 if num_classes is not None else torch.float32
    return Dataset(
        x_train=torch.from_numpy(np.ascontiguousarray(x_tr, dtype=np.float32)),
        y_train=torch.from_numpy(np.ascontiguousarray(y_tr)).to(y_dtype),
        x_eval=torch.from_numpy(np.ascontiguousarray(x_ev, dtype=np.float32)),
        y_eval=torch.from_numpy(np.ascontiguousarray(y_ev)).to(y_dtype),
        num_classes=num_classes,
        input_shape=tuple(int(s) for s in x_tr.shape[1:]),
        source=desc,
        seed=spec.seed,
        **{"feature_names": None, **extra},
    )


def _streams(spec: DataSpec) -> bool:
    """Whether ``spec`` asks for (or its file's size calls for) a streamed table."""
    fmt = format_of(spec.source)
    if fmt is None or READERS[fmt].kind != "table" or spec.stream == "never":
        return False
    if spec.stream == "always":
        return True
    path = os.path.expanduser(spec.source)
    return os.path.isfile(path) and os.path.getsize(path) > STREAM_BYTES


def load_data(spec: DataSpec) -> Dataset | StreamingDataset:
    """Read the data a spec describes and split it into train and eval examples.

    Returns:
        A :class:`Dataset` (float32 features as the file holds them; int64 labels for
        classification, float32 for regression; the ``scaling`` the built model carries), or
        a :class:`StreamingDataset` for a table that is streamed (``spec.stream``).

    Raises:
        FileNotFoundError: A data, labels or eval file does not exist (named).
        ImportError: A built-in or a format needs a package that is not installed (the
            message says what to install).
        ValueError: Bad data: the message names the file and, where it applies, the column and
            the 1-based row (missing columns, non-numeric or non-finite values, bad labels, one
            class only, eval columns different from the data file's, no rows, too few rows to
            split, an image_shape that does not fit).
    """
    if not isinstance(spec, DataSpec):
        raise ValueError(f"load_data needs a DataSpec, got {type(spec).__name__}")
    if spec.source in BUILTINS:
        return _builtin(spec)
    if _streams(spec):
        return StreamingDataset(spec)
    train = _read(spec, spec.source, None)
    parts = [train]
    if spec.eval_source is not None:
        parts.append(_read(spec, spec.eval_source, train))
    ys, num_classes, class_names = finish_labels(spec.task, parts, spec.remap_labels)
    if spec.eval_source is None:
        tr, ev = _split(train.rows, spec.eval_fraction, spec.seed)
    else:
        tr, ev = np.arange(train.rows), np.arange(parts[1].rows)
    xs, plan = _features(spec, parts, tr)
    if spec.image_shape is not None:
        xs = [_reshape(x, spec.image_shape, p.file) for x, p in zip(xs, parts, strict=True)]
    if spec.eval_source is None:
        _check_split(tr, ev, spec.eval_fraction, train.file)
        x_tr, y_tr, x_ev, y_ev = xs[0][tr], ys[0][tr], xs[0][ev], ys[0][ev]
        desc = f"{train.file}; {len(ev)} of {train.rows} rows held out for eval (seed {spec.seed})"
    else:
        (x_tr, x_ev), (y_tr, y_ev) = xs, ys
        desc = f"{train.file}; eval: {parts[1].file}"
    if num_classes is not None:
        check_classes(y_tr, y_ev, class_names, train.file)
    encoding: dict[str, Any] = {"label": spec.label, "class_names": class_names}
    if plan is not None:
        encoding["columns"] = [
            {"name": c.name, "kind": c.kind, "categories": c.categories} for c in plan.columns
        ]
        if plan.image is not None:
            encoding["image"] = {"size": list(plan.image[0]), "mode": plan.image[1]}
    return _dataset(
        x_tr,
        y_tr,
        x_ev,
        y_ev,
        num_classes,
        desc,
        spec,
        feature_names=plan.feature_names if plan is not None and plan.image is None else None,
        class_names=class_names,
        scaling=_scaling(spec, x_tr, y_tr, plan, spec.task),
        encoding=encoding,
    )
