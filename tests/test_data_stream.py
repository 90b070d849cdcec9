"""Tables streamed in record batches: the split, the statistics of the scan, every training
row once per epoch in a shuffled order, and batches that depend on (seed, step) only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import torch

from fisherprune.train.config import TrainConfig
from fisherprune.train.data import Dataset, DataSpec, StreamingDataset, load_data
from fisherprune.train.data import load as load_mod
from fisherprune.train.data.stream import eval_rows
from fisherprune.train.trainer import PruningTrainer

N = 400


def _columns() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = np.arange(N, dtype=np.float64)  # identifies the row in every batch
    big = rng.normal(1000.0, 50.0, N)
    return {"id": ids, "big": big, "label": (big > 1000).astype(np.int64)}


@pytest.fixture
def parquet(tmp_path: Path) -> str:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table(_columns()), path, row_group_size=50)
    return str(path)


def _stream(path: str, **kw: object) -> StreamingDataset:
    ds = load_data(DataSpec(path, stream="always", shuffle_buffer=64, **kw))  # type: ignore[arg-type]
    assert isinstance(ds, StreamingDataset)
    return ds


def _ids(ds: StreamingDataset, x: torch.Tensor) -> list[int]:
    """Row ids from raw features (the streamed features are raw: the model scales them)."""
    return x[:, 0].round().long().tolist()


def test_scan_counts_split_and_scaling(parquet: str) -> None:
    """The eval split is the rows eval_rows picks; scaling equals numpy's float64 statistics
    of the training rows."""
    ds = _stream(parquet)
    is_eval = eval_rows(np.arange(N), 0, 0.2)
    assert (ds.num_train, ds.num_eval) == (int((~is_eval).sum()), int(is_eval.sum()))
    x = np.stack([_columns()["id"], _columns()["big"]], 1)[~is_eval]
    assert ds.scaling is not None
    np.testing.assert_allclose(ds.scaling.feature_mean, x.mean(0), rtol=1e-12)
    np.testing.assert_allclose(ds.scaling.feature_std, x.std(0), rtol=1e-9)
    assert 0.1 < is_eval.mean() < 0.3 and ds.num_classes == 2


def test_eval_batches_are_the_eval_rows_in_file_order(parquet: str) -> None:
    """eval_batches yields exactly the eval rows, in file order, with their labels."""
    ds = _stream(parquet)
    xs, ys = zip(*ds.eval_batches(7), strict=True)
    ids = _ids(ds, torch.cat(xs))
    assert ids == np.flatnonzero(eval_rows(np.arange(N), 0, 0.2)).tolist()
    assert torch.cat(ys).tolist() == _columns()["label"][ids].tolist()


def test_an_epoch_shows_each_training_row_at_most_once_shuffled(parquet: str) -> None:
    """num_train // batch batches per epoch; no row twice; all but < one batch of the
    training rows seen; labels travel with their rows; the next epoch has another order."""
    ds = _stream(parquet)
    bs = 16
    per_epoch = ds.num_train // bs
    epochs = []
    for e in range(2):
        ids = []
        for b in range(per_epoch):
            x, y = ds.train_batch(e * per_epoch + b, bs)
            ids += _ids(ds, x)
            assert y.tolist() == _columns()["label"][_ids(ds, x)].tolist()
        epochs.append(ids)
    train_ids = set(np.flatnonzero(~eval_rows(np.arange(N), 0, 0.2)).tolist())
    for ids in epochs:
        assert len(ids) == len(set(ids)) == per_epoch * bs and set(ids) <= train_ids
    assert epochs[0] != epochs[1] and epochs[0] != sorted(epochs[0])


def test_batch_of_a_step_does_not_depend_on_what_came_before(parquet: str) -> None:
    """A fresh stream asked for step k directly (a resumed run) gets the batch a stream that
    went through steps 0..k got; so does one that goes back."""
    a = _stream(parquet)
    seq = [a.train_batch(s, 16)[0] for s in range(25)]
    b = _stream(parquet)
    for s in (17, 3, 24):
        torch.testing.assert_close(b.train_batch(s, 16)[0], seq[s])
    c = _stream(parquet, seed=1)
    assert not torch.equal(c.train_batch(3, 16)[0], seq[3])


def test_each_rank_reads_only_its_own_row_groups(
    parquet: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under two processes each rank reads only its share of the row groups (every other one
    of the epoch's order), and over an epoch the two ranks' rows are disjoint training rows
    with their labels, half a global batch per step."""
    read: dict[int, set[int]] = {0: set(), 1: set()}
    who = {"rank": 0}
    iter_batches = pq.ParquetFile.iter_batches

    def spy(self: pq.ParquetFile, *args: object, **kw: object) -> object:
        read[who["rank"]].update(kw.get("row_groups") or [])
        return iter_batches(self, *args, **kw)

    ranks = {r: _stream(parquet) for r in (0, 1)}
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    seen: dict[int, list[int]] = {0: [], 1: []}
    per_epoch = ranks[0].num_train // 16
    for step in range(per_epoch):
        for r, ds in ranks.items():
            who["rank"] = r
            x, y = ds.train_batch(step, 16, rank=r, world=2)
            assert len(y) == 8
            assert y.tolist() == _columns()["label"][_ids(ds, x)].tolist()
            seen[r] += _ids(ds, x)
    assert read[0] and read[1] and not read[0] & read[1]
    assert len(read[0] | read[1]) == 8  # the file's 8 row groups, each read by one rank
    groups = {r: {i // 50 for i in ids} for r, ids in seen.items()}
    assert groups[0] <= read[0] and groups[1] <= read[1]
    train_ids = set(np.flatnonzero(~eval_rows(np.arange(N), 0, 0.2)).tolist())
    assert not set(seen[0]) & set(seen[1]) and set(seen[0]) | set(seen[1]) <= train_ids


def test_bounded_eval_reads_the_first_eval_rows_and_stops(
    parquet: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """eval_batches(limit=k) yields the first k eval rows of a full read, and reads no record
    batch past the one holding the k-th (the stream's 8 row groups: a full read takes 8)."""
    ds = _stream(parquet)
    full = torch.cat([x for x, _ in ds.eval_batches(7)])
    batches = {"n": 0}
    iter_batches = pq.ParquetFile.iter_batches

    def count(self: pq.ParquetFile, *args: object, **kw: object) -> object:
        for b in iter_batches(self, *args, **kw):
            batches["n"] += 1
            yield b

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", count)
    part = torch.cat([x for x, _ in ds.eval_batches(7, limit=12)])
    torch.testing.assert_close(part, full[:12])
    assert batches["n"] <= 2


def test_csv_streams_like_parquet(parquet: str, tmp_path: Path) -> None:
    """The same table as CSV streams to the same split, counts and scaling."""
    csv = tmp_path / "t.csv"
    pa_csv.write_csv(pq.read_table(parquet), csv)
    a, b = _stream(parquet), _stream(str(csv))
    assert (a.num_train, a.num_eval) == (b.num_train, b.num_eval)
    assert a.scaling is not None and b.scaling is not None
    np.testing.assert_allclose(a.scaling.feature_std, b.scaling.feature_std, rtol=1e-9)


def test_auto_streams_only_files_over_the_threshold(
    parquet: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stream='auto' loads a small file whole, and streams it when it exceeds STREAM_BYTES."""
    assert isinstance(load_data(DataSpec(parquet)), Dataset)
    monkeypatch.setattr(load_mod, "STREAM_BYTES", 1000)
    assert isinstance(load_data(DataSpec(parquet)), StreamingDataset)


def test_trainer_runs_on_a_stream(parquet: str, tmp_path: Path) -> None:
    """PruningTrainer trains, prunes and exports from a streamed table."""
    cfg = TrainConfig(
        data=parquet, stream="always", shuffle_buffer=64, model="mlp", width=8, depth=1,
        batch_size=16, steps=30, pruning_burn_in=10, pruning_iter=2, fine_tune_steps=4,
        eval_every=10, save_dir=str(tmp_path / "run"), export_formats=["state_dict"],
        progress="none",
    )  # fmt: skip
    result = PruningTrainer(cfg).run()
    assert result.prunes > 0 and 0.0 <= result.final_metric <= 1.0
    assert (tmp_path / "run" / "export" / "data.json").is_file()
