"""Tables larger than memory: a CSV or Parquet file read in record batches, never whole.

One pass at the start (the *scan*) counts the rows of each split, checks and collects the
labels and the categories, and sums the training rows' features for the standardisation. Each
epoch then reads the file again: Parquet row groups in an order drawn from ``(seed, epoch)``,
rows shuffled within a buffer of ``shuffle_buffer`` rows, so memory is bounded by the buffer
and one record batch, whatever the file's size. A row belongs to the eval split when a hash of
``(seed, row number)`` falls below ``eval_fraction``, so the split needs no index in memory.
Batch ``step`` is a function of ``(seed, step)``: a resumed run re-reads its epoch up to it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fisherprune.train.data.dataset import DataBase, Moments, Scaling, fit_scaling, shard
from fisherprune.train.data.images import image_format
from fisherprune.train.data.labels import check_classes, finish_labels
from fisherprune.train.data.parts import Part
from fisherprune.train.data.tables import (
    TableColumn,
    TablePlan,
    binary_column_error,
    check_names,
    column_values,
    csv_error,
    is_binary,
    need_pyarrow,
    table_columns,
)

try:
    import pyarrow as pa
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq
except ImportError:  # optional: the 'data' extra
    pa = pa_csv = pq = None

__all__ = ["CHUNK_ROWS", "StreamingDataset", "eval_rows"]


def _local_size(batch_size: int, rank: int, world: int) -> int:
    """Rows of a global batch of ``batch_size`` that rank ``rank`` takes (as ``shard``)."""
    per = -(-batch_size // world)
    return max(0, min(per, batch_size - rank * per))


#: rows per record batch read (Parquet); CSV blocks are sized to about as many bytes x 64
CHUNK_ROWS = 8192
_HEAD = 256  # training rows kept for the example input and timing


def eval_rows(rows: np.ndarray, seed: int, fraction: float) -> np.ndarray:
    """Bool per row number: True for the eval split (a splitmix64 hash of seed and row below
    ``fraction``), a function of the row number only."""
    with np.errstate(over="ignore"):
        z = rows.astype(np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15) % 2**64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / 2.0**53 < fraction


def _chunks(
    path: str,
    columns: list[str],
    order_seed: list[int] | None,
    part: tuple[int, int] | None = None,
) -> Iterator[Any]:
    """``(record batch, row numbers)`` of ``path``; Parquet row groups shuffled by
    ``order_seed`` when given, else in file order. With ``part = (rank, world)``, only that
    rank's share: every ``world``-th Parquet row group from the ``rank``-th (the others are
    not read) when there are at least ``world`` of them, else every ``world``-th record batch
    (a CSV file is parsed whole, its other blocks dropped)."""
    rank, world = part or (0, 1)
    if path.lower().endswith((".parquet", ".pq")):
        pf = pq.ParquetFile(path)
        starts = np.cumsum(
            [0] + [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
        )
        groups = np.arange(pf.num_row_groups)
        if order_seed is not None:
            groups = np.random.default_rng(order_seed).permutation(groups)
        by_group = world > 1 and len(groups) >= world
        if by_group:
            groups = groups[rank::world]
        i = 0
        for g in groups.tolist():
            lo = int(starts[g])
            for b in pf.iter_batches(batch_size=CHUNK_ROWS, row_groups=[g], columns=columns):
                if by_group or i % world == rank:
                    yield b, np.arange(lo, lo + b.num_rows)
                lo += b.num_rows
                i += 1
        return
    read = pa_csv.ReadOptions(block_size=CHUNK_ROWS * 64)
    conv = pa_csv.ConvertOptions(include_columns=columns)
    lo = 0
    try:
        with pa_csv.open_csv(path, read_options=read, convert_options=conv) as reader:
            for i, b in enumerate(reader):
                if i % world == rank:
                    yield b, np.arange(lo, lo + b.num_rows)
                lo += b.num_rows
    except (pa.ArrowInvalid, OSError) as e:
        raise csv_error(path, e, f" after row {lo}") from None


class StreamingDataset(DataBase):
    """A table read in batches: the methods of :class:`Dataset` the trainer uses
    (``train_batch``, ``eval_batches``, ``example``, ``samples``, ``num_train``...), without
    holding the rows.

    Args:
        spec: The :class:`DataSpec` (a ``.csv``/``.parquet`` source).

    Raises:
        ImportError: pyarrow is missing.
        ValueError: As :func:`load_data` for the same file (the scan reads every row once).
    """

    def __init__(self, spec: Any) -> None:
        need_pyarrow(spec.source)
        self.spec, self.seed = spec, spec.seed
        self.files = [spec.source] + ([spec.eval_source] if spec.eval_source else [])
        self._plan(spec)
        self._scan()
        self._iter: tuple[tuple[int, int, int], Iterator[tuple[Tensor, Tensor]]] | None = None

    # ------------------------------------------------------------ the scan
    def _plan(self, spec: Any) -> None:
        """The columns and the kind of each feature, from the data file's schema."""
        path = spec.source
        if path.lower().endswith((".parquet", ".pq")):
            schema = pq.read_schema(path)
            names = [str(n) for n in schema.names]
        else:
            try:
                with pa_csv.open_csv(path) as r:
                    schema = r.schema
                names = [str(n) for n in schema.names]  # a binary file can fail to decode
            except (pa.ArrowInvalid, UnicodeDecodeError, OSError) as e:
                raise csv_error(path, e) from None
        check_names(path, names)
        self.label, features = table_columns(path, names, spec, "data file")
        cols: list[TableColumn] = []
        for f in features:
            t = schema.field(f).type
            if f == spec.image_column:
                cols.append(TableColumn(f, "image"))
            elif is_binary(t):
                raise binary_column_error(path, f)
            elif pa.types.is_string(t) or pa.types.is_large_string(t):
                if spec.categorical == "refuse":
                    raise ValueError(
                        f"{path}: feature column {f!r} holds text; encode it as numbers, leave "
                        "it out with --features, or pass --categorical onehot"
                    )
                cols.append(TableColumn(f, "category"))
            else:
                cols.append(TableColumn(f, "number"))
        self.plan = TablePlan(path, cols)
        self.read_columns = [*features, self.label]
        if spec.image_column is not None:
            first, _ = next(_chunks(path, self.read_columns, None))
            value = column_values(first, spec.image_column, path, lambda i: f"row {i + 1}")[0]
            self.plan.image = image_format(
                value, os.path.dirname(path), spec.image_size, spec.image_mode, f"{path}, row 1"
            )

    def _split(self, k: int, rows: np.ndarray) -> np.ndarray:
        """Bool per row of file ``k``: True for training rows."""
        if len(self.files) > 1:
            return np.full(len(rows), k == 0)
        return ~eval_rows(rows, self.seed, self.spec.eval_fraction)

    def _scan(self) -> None:
        """Read every row once: counts, labels, categories, sums for the scaling."""
        spec = self.spec
        counts, labels = [0, 0], [set(), set()]
        cats: dict[str, set[str]] = {
            c.name: set() for c in self.plan.columns if c.kind == "category"
        }
        numeric = [c.name for c in self.plan.columns if c.kind == "number"]
        moments, target = Moments(len(numeric)), Moments(1)
        self.train_chunks = 0  # record batches of the data file: the shares ranks can read
        for k, path in enumerate(self.files):
            for batch, rows in _chunks(path, self.read_columns, None):
                self.train_chunks += k == 0
                at = lambda i, rows=rows: f"row {int(rows[i]) + 1}"  # noqa: E731
                train = self._split(k, rows)
                y = column_values(batch, self.label, path, at)
                for side, m in ((0, train), (1, ~train)):
                    counts[side] += int(m.sum())
                    if spec.task == "classification":
                        labels[side].update(np.unique(y[m]).tolist())
                if spec.task == "regression":
                    target.update(y[train].reshape(-1, 1))
                for name in cats:
                    v = np.char.strip(column_values(batch, name, path, at)[train].astype(str))
                    cats[name].update(v.tolist())
                if numeric and k == 0:
                    cols = [column_values(batch, n, path, at)[train] for n in numeric]
                    moments.update(np.stack(cols, axis=1))
        for c in self.plan.columns:
            if c.kind == "category":
                c.categories = sorted(cats[c.name])
        if min(counts) == 0:
            raise ValueError(
                f"{spec.source}: the split leaves {counts[0]} train and {counts[1]} eval rows"
            )
        self.num_train, self.num_eval = counts
        self._labels(labels)
        self._head = self._first_train_rows()
        self.input_shape = tuple(int(s) for s in self._head.shape[1:])
        self.feature_names = self.plan.feature_names if self.plan.image is None else None
        self.scaling = self._fit_scaling(moments, target)
        self.source = (
            f"{spec.source} (streamed); {self.num_eval} of {self.num_train + self.num_eval} rows "
            f"held out for eval (seed {self.seed})"
        )
        self.encoding = {
            "label": self.label,
            "class_names": self.class_names,
            "columns": [
                {"name": c.name, "kind": c.kind, "categories": c.categories}
                for c in self.plan.columns
            ],
            "streamed": True,
        }

    def _labels(self, labels: list[set[Any]]) -> None:
        """Classes and their indices from the distinct labels of each split."""
        self.num_classes, self.class_names, self._classes = None, None, None
        if self.spec.task == "regression":
            return
        values = sorted(labels[0] | labels[1], key=lambda v: (isinstance(v, str), v))
        raw = np.array(values)
        part = Part(self.spec.source, raw, self.spec.source, lambda i: f"column {self.label!r}")
        (ys,), self.num_classes, self.class_names = finish_labels(
            "classification", [part], self.spec.remap_labels
        )
        self._classes = raw if self.class_names is not None else None
        index = dict(zip(values, ys.tolist(), strict=True))
        check_classes(
            np.array([index[v] for v in labels[0]]),
            np.array([index[v] for v in labels[1]]),
            self.class_names,
            self.spec.source,
        )

    def _fit_scaling(self, moments: Moments, target: Moments) -> Scaling | None:
        """Standardisation from the scan's moments (features only for flat table features)."""
        if not self.spec.standardize:
            return None
        tgt = target if self.spec.task == "regression" else None
        if self.plan.image is not None:
            return fit_scaling(None, None, tgt) if tgt else None
        flags = self.plan.numeric
        full = Moments(len(flags))  # one-hot features: mean 0, std 1 (not scaled)
        full.n, full.mean[flags], full.m2[flags] = moments.n, moments.mean, moments.m2
        return fit_scaling(full, flags, tgt)

    # ------------------------------------------------------------ reading
    def _encode(self, k: int, batch: Any, rows: np.ndarray, train: bool) -> tuple[Tensor, Tensor]:
        """The features and labels of the rows of ``batch`` in the wanted split."""
        m = self._split(k, rows)
        if not train:
            m = ~m
        path = self.files[k]
        kept = rows[m]
        batch = batch.filter(pa.array(m))
        at = lambda i: f"row {int(kept[i]) + 1}"  # noqa: E731
        x = self.plan.encode(batch, path, at)
        y = column_values(batch, self.label, path, at)
        if self.num_classes is None:
            yt = torch.from_numpy(y.astype(np.float32))
        elif self._classes is not None:
            yt = torch.from_numpy(np.searchsorted(self._classes, y).astype(np.int64))
        else:
            yt = torch.from_numpy(y.astype(np.int64))
        return torch.from_numpy(x), yt

    def _first_train_rows(self) -> Tensor:
        """Up to 256 training inputs from the start of the data file."""
        out: list[Tensor] = []
        n = 0
        for batch, rows in _chunks(self.files[0], self.read_columns, None):
            x, _ = self._encode(0, batch, rows, True)
            out.append(x[: _HEAD - n])
            n += len(out[-1])
            if n >= _HEAD:
                break
        return torch.cat(out)

    def _epoch(
        self, epoch: int, batch_size: int, part: tuple[int, int] | None = None, again: int = 0
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Batches of ``epoch`` (of one rank's share with ``part``, see ``_chunks``): row
        groups in a seeded order, rows shuffled within the buffer; the last partial batch is
        dropped. ``again`` > 0: a further pass over the share in another order."""
        key = [self.seed, epoch] if again == 0 else [self.seed, epoch, again]
        rng = np.random.default_rng(key)
        xs: list[Tensor] = []
        ys: list[Tensor] = []
        held = 0
        for batch, rows in _chunks(self.files[0], self.read_columns, key, part):
            x, y = self._encode(0, batch, rows, True)
            xs.append(x)
            ys.append(y)
            held += len(y)
            if held >= self.spec.shuffle_buffer:
                yield from self._flush(xs, ys, rng, batch_size)
                held = len(ys[0]) if ys else 0
        yield from self._flush(xs, ys, rng, batch_size)

    @staticmethod
    def _flush(
        xs: list[Tensor], ys: list[Tensor], rng: np.random.Generator, batch_size: int
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Shuffle what the buffer holds, yield its full batches, keep the remainder in it."""
        x, y = torch.cat(xs), torch.cat(ys)
        perm = torch.from_numpy(rng.permutation(len(y)))
        x, y = x[perm], y[perm]
        full = len(y) // batch_size * batch_size
        xs.clear()
        ys.clear()
        if full < len(y):
            xs.append(x[full:])
            ys.append(y[full:])
        for lo in range(0, full, batch_size):
            yield x[lo : lo + batch_size], y[lo : lo + batch_size]

    # ------------------------------------------------------------ what the trainer calls
    def example(self) -> Tensor:
        """The first training example, ``(1, *input_shape)``."""
        return self._head[:1]

    def samples(self, n: int) -> Tensor:
        """Up to ``min(n, 256)`` training inputs (for timing the model)."""
        return self._head[:n]

    def train_batch(
        self, step: int, batch_size: int, rank: int = 0, world: int = 1
    ) -> tuple[Tensor, Tensor]:
        """This rank's share of the global batch of ``step``: a function of ``(seed, step)``;
        consecutive steps continue one read of the file, any other step re-reads its epoch.

        Under ``torchrun`` (``world`` > 1) each rank reads only its own share of the file
        (``_chunks``) and makes its part of the batch from it; a rank whose share runs out
        before the epoch's last step reads it again in another order. With fewer record
        batches than ranks, every rank reads the file and takes its slice of the batch."""
        per_epoch = max(1, self.num_train // batch_size)
        epoch, b = divmod(step, per_epoch)
        shared = world > 1 and self.train_chunks >= world
        shared = shared and _local_size(batch_size, world - 1, world) > 0
        size = _local_size(batch_size, rank, world) if shared else batch_size
        if self._iter is None or self._iter[0] != (epoch, b, size):
            it = (
                self._rank_batches(epoch, size, (rank, world))
                if shared
                else self._epoch(epoch, size)
            )
            for _ in range(b):
                next(it)
            self._iter = ((epoch, b, size), it)
        x, y = next(self._iter[1])
        self._iter = ((epoch, b + 1, size), self._iter[1])
        if shared:
            return x, y
        return x[shard(x, rank, world)], y[shard(y, rank, world)]

    def _rank_batches(
        self, epoch: int, size: int, part: tuple[int, int]
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """One rank's batches of ``epoch`` from its share, read again as often as needed.

        Raises:
            ValueError: the share holds fewer than ``size`` rows.
        """
        for again in itertools.count():
            empty = True
            for batch in self._epoch(epoch, size, part, again):
                empty = False
                yield batch
            if empty:
                raise ValueError(
                    f"{self.spec.source}: rank {part[0]}'s share of the file holds fewer than "
                    f"{size} training rows; use a smaller --batch_size or fewer processes"
                )

    def eval_batches(
        self, size: int = 512, limit: int | None = None
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """The eval rows in file order, at most ``size`` at a time, read from the file; with
        ``limit``, the first ``limit`` eval rows only, and the file is read no further than
        they lie (the same rows at every call)."""
        k = len(self.files) - 1
        left = self.num_eval if limit is None else limit
        if left <= 0:
            return
        for batch, rows in _chunks(self.files[k], self.read_columns, None):
            x, y = self._encode(k, batch, rows, False)
            x, y = x[:left], y[:left]
            left -= len(y)
            for lo in range(0, len(y), size):
                yield x[lo : lo + size], y[lo : lo + size]
            if left <= 0:
                return
