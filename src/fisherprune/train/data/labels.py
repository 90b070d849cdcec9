"""Labels: raw label columns -> class indices ``0..K-1`` (classification) or float32 targets
(regression), with the checks a task needs.

Integer labels keep their values (``K`` = the largest + 1), unless they are far sparser than
the classes they name (a label of 1,000,000 among 2 classes would make a million-way output
layer): that is an error, or with ``remap_labels`` the sorted distinct labels become
``0..K-1`` and ``Dataset.class_names`` records the original of each. Text labels map to
``0..K-1`` in sorted order. One class in the training rows is an error; an eval label that no
training row has is a warning (the model cannot learn to predict it).
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from fisherprune.train.data.parts import Part

__all__ = ["SPARSE_LABELS", "check_classes", "finish_labels"]

#: integer labels are "far above the class count" when the largest is at least this and more
#: than ten times the number of distinct labels
SPARSE_LABELS = 1000


def _label_kind(part: Part, task: str) -> tuple[str, np.ndarray, int | None]:
    """``("number", float64 labels, None)`` or ``("text", stripped str labels, first row whose
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
    if part.class_names is None:
        try:
            return "number", s.astype(np.float64), None
        except ValueError:
            pass
    bad = 0
    for i, v in enumerate(s.tolist()):
        try:
            float(v)
        except ValueError:
            bad = i
            break
    if task == "regression":
        raise ValueError(
            f"{part.y_file}: non-numeric label {str(s[bad])!r} in "
            f"{part.y_at(bad)}; regression labels must be numbers"
        )
    return "text", s, bad


def _class_indices(part: Part, y: np.ndarray) -> np.ndarray:
    """Check numeric classification labels (finite, integral, >= 0) and return int64.

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


def _regression(parts: list[Part], kinds: list[tuple[str, np.ndarray, int | None]]) -> list:
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
    return out


def _remap(
    parts: list[Part], ys: list[np.ndarray], remap: bool
) -> tuple[list[np.ndarray], int, list[str] | None]:
    """Integer labels as they are, or remapped to 0..K-1 (``remap``, or refused when sparse).

    Raises:
        ValueError: Labels far above the class count without ``remap`` (names the label).
    """
    distinct = np.unique(np.concatenate(ys))
    top = int(distinct[-1])
    if not remap and top >= SPARSE_LABELS and top + 1 > 10 * len(distinct):
        k = next(k for k, y in enumerate(ys) if (y == top).any())
        row = int(np.flatnonzero(ys[k] == top)[0])
        raise ValueError(
            f"{parts[k].y_file}: label {top} in {parts[k].y_at(row)} would make a "
            f"{top + 1:,}-way output layer for {len(distinct)} distinct labels; relabel the "
            "classes 0..K-1, or pass --remap_labels to map the sorted distinct labels to 0..K-1"
        )
    if not remap:
        return ys, top + 1, None
    out = [np.searchsorted(distinct, y).astype(np.int64) for y in ys]
    return out, len(distinct), [str(int(v)) for v in distinct.tolist()]


def finish_labels(
    task: str, parts: list[Part], remap: bool = False
) -> tuple[list[np.ndarray], int | None, list[str] | None]:
    """Turn the raw labels of the train (and eval) parts into final label arrays.

    Args:
        task: ``"classification"`` or ``"regression"``.
        parts: The train part, then the eval part if any.
        remap: Map integer labels' sorted distinct values to ``0..K-1``.

    Returns:
        The label arrays (int64 or float32) per part, ``num_classes`` and ``class_names``.

    Raises:
        ValueError: Bad labels (file, column, row), text labels in one file but numbers in the
            other, or integer labels far above the class count (without ``remap``).
    """
    kinds = [_label_kind(p, task) for p in parts]
    if task == "regression":
        return _regression(parts, kinds), None, None
    text = [k == "text" for k, _, _ in kinds]
    if any(text) and not all(text):
        ti, ni = text.index(True), text.index(False)
        row = kinds[ti][2]
        assert row is not None
        raise ValueError(
            f"{parts[ti].y_file}: text label {str(kinds[ti][1][row])!r} in "
            f"{parts[ti].y_at(row)}, but the labels in {parts[ni].y_file} are numbers"
        )
    if all(text):
        classes = np.unique(np.concatenate([y for _, y, _ in kinds]))
        out = [np.searchsorted(classes, y).astype(np.int64) for _, y, _ in kinds]
        return out, len(classes), [str(c) for c in classes.tolist()]
    ys = [_class_indices(p, y) for p, (_, y, _) in zip(parts, kinds, strict=True)]
    return _remap(parts, ys, remap)


def check_classes(
    y_train: np.ndarray, y_eval: np.ndarray, class_names: list[str] | None, what: str
) -> None:
    """Refuse a single class in the training rows; warn of eval classes no training row has.

    Raises:
        ValueError: Every training label is the same (names it).
    """
    seen = np.unique(y_train)

    def name(c: int) -> str:
        return repr(class_names[c]) if class_names else str(c)

    if len(seen) < 2:
        raise ValueError(
            f"{what}: every training row has the label {name(int(seen[0]))}; classification "
            "needs at least two classes (for a numeric target use --task regression)"
        )
    unseen = np.setdiff1d(np.unique(y_eval), seen)
    if len(unseen):
        shown = ", ".join(name(int(c)) for c in unseen[:10])
        warnings.warn(
            f"{what}: eval label(s) {shown} never appear in the training rows; the model "
            f"cannot learn them ({int(np.isin(y_eval, unseen).sum())} eval rows)",
            stacklevel=2,
        )
