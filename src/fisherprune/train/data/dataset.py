"""What the trainer gets: a :class:`Dataset` of tensors (or a stream with the same methods),
and the :class:`Scaling` fitted on its training rows."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "DataBase",
    "Dataset",
    "Moments",
    "Scaling",
    "data_card",
    "epoch_permutation",
    "fit_scaling",
    "shard",
]


@dataclass
class Scaling:
    """Standardisation fitted on the training rows only; the built model carries it.

    Attributes:
        feature_mean: Per feature (flat), the training mean; 0 for features not scaled
            (one-hot columns). None: features are not scaled.
        feature_std: Per feature, the training standard deviation (1 where it is 0, or for
            features not scaled). None with ``feature_mean``.
        target_mean: Regression only: the training targets' mean, else None.
        target_std: Regression only: their standard deviation (1 if they are all equal).
    """

    feature_mean: list[float] | None = None
    feature_std: list[float] | None = None
    target_mean: float | None = None
    target_std: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (checkpoints, ``data.json``)."""
        return {
            "feature_mean": self.feature_mean,
            "feature_std": self.feature_std,
            "target_mean": self.target_mean,
            "target_std": self.target_std,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Scaling:
        """The inverse of :meth:`to_dict`."""
        return cls(**d)


class Moments:
    """Count, mean and sum of squared deviations per column, merged batch by batch (Chan et
    al.'s pairwise update: exact in float64 where sums of squares would cancel)."""

    def __init__(self, width: int) -> None:
        self.n = 0
        self.mean = np.zeros(width)
        self.m2 = np.zeros(width)

    def update(self, x: np.ndarray) -> None:
        """Add the rows of ``x`` ``(n, width)`` (any real dtype) to the statistics."""
        n = len(x)
        if n == 0:
            return
        x = x.astype(np.float64)
        mean = x.mean(0)
        m2 = ((x - mean) ** 2).sum(0)
        total = self.n + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta**2 * (self.n * n / total)
        self.n = total

    @property
    def std(self) -> np.ndarray:
        """Population standard deviation per column; 1 where it is (relatively) zero."""
        std = np.sqrt(self.m2 / max(self.n, 1))
        return np.where(std > 1e-12 * np.maximum(np.abs(self.mean), 1.0), std, 1.0)


def fit_scaling(
    features: Moments | None, scaled: np.ndarray | None, target: Moments | None
) -> Scaling:
    """A :class:`Scaling` from the training rows' moments.

    Args:
        features: Per-feature moments, or None not to scale features.
        scaled: Bool per feature: True to standardise it (False: mean 0, std 1).
        target: Moments of the regression targets (width 1), or None.
    """
    s = Scaling()
    if features is not None and scaled is not None:
        s.feature_mean = np.where(scaled, features.mean, 0.0).tolist()
        s.feature_std = np.where(scaled, features.std, 1.0).tolist()
    if target is not None:
        s.target_mean, s.target_std = float(target.mean[0]), float(target.std[0])
    return s


def epoch_permutation(n: int, seed: int, epoch: int) -> Tensor:
    """The order of the ``n`` training rows in ``epoch``: a function of seed and epoch only, so
    a resumed run sees the batches it would have seen."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g)


def shard(x: Tensor, rank: int, world: int) -> slice:
    """This rank's slice of a global batch of ``len(x)`` rows."""
    per = math.ceil(x.shape[0] / world)
    return slice(rank * per, (rank + 1) * per)


class DataBase:
    """What an in-memory :class:`Dataset` and a stream share: the task and the loss scale,
    from ``num_classes`` and ``scaling``."""

    num_classes: int | None
    scaling: Scaling | None

    @property
    def task(self) -> str:
        """``"classification"`` if ``num_classes`` is set, else ``"regression"``."""
        return "regression" if self.num_classes is None else "classification"

    @property
    def num_outputs(self) -> int:
        """Outputs a model needs: ``num_classes``, or 1 for regression."""
        return 1 if self.num_classes is None else self.num_classes

    @property
    def loss_scale(self) -> float:
        """Factor of a regression MSE in original units that makes it the MSE of standardised
        targets (``1 / target_std**2``); 1.0 otherwise."""
        if self.scaling is None or self.scaling.target_std is None:
            return 1.0
        return 1.0 / self.scaling.target_std**2


@dataclass
class Dataset(DataBase):
    """Tensors ready for training.

    Attributes:
        x_train: float32 features, shape ``(N_train, *input_shape)``, in file order, as the file
            holds them (raw: the built model carries ``scaling``).
        y_train: int64 class indices (classification) or float32 targets (regression).
        x_eval: float32 features of the evaluation rows.
        y_eval: Labels of the evaluation rows.
        num_classes: K for classification (labels are ``0..K-1``), None for regression.
        input_shape: Shape of one example's features, e.g. ``(64,)`` or ``(1, 28, 28)``.
        feature_names: Names of the features (tables; ``"col=category"`` for one-hot
            features), else None.
        source: Human-readable description of where the data came from and how it was split.
        class_names: The original label of each class when labels were mapped to ``0..K-1``
            (text, a folder per class, remapped integers), else None.
        scaling: Standardisation of features / targets fitted on the training rows, or None.
        encoding: How the file's columns became features (JSON-able), for ``data.json``.
        seed: Seed of the batch order.
    """

    x_train: Tensor = field(repr=False)
    y_train: Tensor = field(repr=False)
    x_eval: Tensor = field(repr=False)
    y_eval: Tensor = field(repr=False)
    num_classes: int | None
    input_shape: tuple[int, ...]
    feature_names: list[str] | None = field(repr=False)
    source: str
    class_names: list[str] | None = field(default=None, repr=False)
    scaling: Scaling | None = field(default=None, repr=False)
    encoding: dict[str, Any] = field(default_factory=dict, repr=False)
    seed: int = 0

    @property
    def num_outputs(self) -> int:
        """Outputs a model needs: ``num_classes``, or the targets per example (regression)."""
        if self.num_classes is not None:
            return self.num_classes
        return 1 if self.y_train.dim() == 1 else int(self.y_train.shape[1])

    @property
    def num_train(self) -> int:
        """Training examples."""
        return int(self.x_train.shape[0])

    @property
    def num_eval(self) -> int:
        """Evaluation examples."""
        return int(self.x_eval.shape[0])

    def example(self) -> Tensor:
        """The first training example, ``(1, *input_shape)``."""
        return self.x_train[:1]

    def samples(self, n: int) -> Tensor:
        """Up to ``n`` training inputs (for timing the model)."""
        return self.x_train[:n]

    def train_batch(
        self, step: int, batch_size: int, rank: int = 0, world: int = 1
    ) -> tuple[Tensor, Tensor]:
        """This rank's share of the global batch of ``step``: a function of ``(seed, step)``
        only. Epochs are ``num_train // batch_size`` batches; each reshuffles."""
        per_epoch = max(1, self.num_train // batch_size)
        epoch, b = divmod(step, per_epoch)
        if getattr(self, "_perm_epoch", None) != epoch:
            self._perm = epoch_permutation(self.num_train, self.seed, epoch)
            self._perm_epoch = epoch
        idx = self._perm[b * batch_size : (b + 1) * batch_size]
        idx = idx[shard(idx, rank, world)]
        return self.x_train[idx], self.y_train[idx]

    def eval_batches(
        self, size: int = 512, limit: int | None = None
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """The evaluation rows in order, ``size`` at a time; the first ``limit`` of them only
        when given."""
        n = self.num_eval if limit is None else min(limit, self.num_eval)
        for lo in range(0, n, size):
            hi = min(lo + size, n)
            yield self.x_eval[lo:hi], self.y_eval[lo:hi]


def data_card(data: Any) -> dict[str, Any]:
    """What an exported model needs to know of its data (JSON-able): the input it takes
    (shape, feature names, how text columns were one-hot encoded, image size and mode), the
    classes its outputs stand for, and the scaling it carries. Reads ``data``, changes nothing.
    """
    return {
        "source": data.source,
        "task": data.task,
        "input_shape": list(data.input_shape),
        "num_classes": data.num_classes,
        "class_names": data.class_names,
        "feature_names": data.feature_names,
        "encoding": data.encoding,
        "scaling": None if data.scaling is None else data.scaling.to_dict(),
    }
