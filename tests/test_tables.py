"""Tables that train: standardisation fitted on the training rows only and carried by the
model, regression targets in their own units, one-hot text columns, and the label checks."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import torch

from fisherprune.train.config import TrainConfig
from fisherprune.train.data import DataSpec, load_data
from fisherprune.train.models import build_model
from fisherprune.train.scaling import with_scaling
from fisherprune.train.trainer import PruningTrainer


def _table(tmp: Path, name: str, columns: dict[str, object]) -> str:
    t = pa.table(columns)
    path = tmp / name
    if name.endswith(".csv"):
        pa_csv.write_csv(t, path)
    else:
        pq.write_table(t, path)
    return str(path)


def _wide(n: int = 120, seed: int = 0) -> dict[str, object]:
    """Features on very different scales (one in the thousands), 2 classes."""
    rng = np.random.default_rng(seed)
    a, b = rng.normal(3.0, 0.1, n), rng.normal(5000.0, 800.0, n)
    return {"a": a, "b": b, "label": (b > 5000).astype(np.int64)}


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_scaling_is_fitted_on_the_training_rows_only(tmp_path: Path, suffix: str) -> None:
    """mean/std equal numpy's float64 statistics of the training rows, not of all rows."""
    ds = load_data(DataSpec(_table(tmp_path, "t" + suffix, _wide())))
    x = ds.x_train.double().numpy()
    assert ds.scaling is not None
    np.testing.assert_allclose(ds.scaling.feature_mean, x.mean(0), rtol=1e-12)
    np.testing.assert_allclose(ds.scaling.feature_std, x.std(0), rtol=1e-9)
    all_rows = torch.cat([ds.x_train, ds.x_eval]).double().numpy()
    assert abs(ds.scaling.feature_mean[1] - all_rows[:, 1].mean()) > 1e-6  # not vacuous


def test_model_with_scaling_takes_raw_features_and_returns_raw_targets(tmp_path: Path) -> None:
    """The wrapped model on raw features equals the inner model on standardised features,
    mapped back to target units (float64 reference)."""
    rng = np.random.default_rng(1)
    cols = {"a": rng.normal(10, 3, 50), "b": rng.normal(-2000, 500, 50)}
    cols["y"] = 1e4 + 300 * cols["a"]
    ds = load_data(DataSpec(_table(tmp_path, "r.parquet", cols), label="y", task="regression"))
    inner = build_model("mlp", ds.input_shape, 1, 8, 1).double()
    model = with_scaling(inner, ds.scaling).double()
    x = ds.x_eval.double()
    s = ds.scaling
    assert s is not None and s.target_std is not None and s.target_mean is not None
    z = (x - torch.tensor(s.feature_mean, dtype=torch.float64)) / torch.tensor(
        s.feature_std, dtype=torch.float64
    )
    ref = inner(z) * s.target_std + s.target_mean
    torch.testing.assert_close(model(x), ref)
    y = ds.y_train.double().numpy()
    assert s.target_mean == pytest.approx(y.mean()) and s.target_std == pytest.approx(y.std())


def test_regression_metrics_are_in_the_targets_units(tmp_path: Path) -> None:
    """A run on targets around 1e4 reports the MSE of the model's outputs against the raw eval
    targets (recomputed here), and learns (MSE far below the targets' variance)."""
    rng = np.random.default_rng(2)
    x = rng.normal(0, 1, (300, 3)) * np.array([1.0, 100.0, 0.01])
    y = 1e4 + 2000 * x[:, 0] + 20 * x[:, 1] + 1e5 * x[:, 2]
    path = _table(tmp_path, "r.csv", {"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "y": y})
    cfg = TrainConfig(
        data=path, label="y", task="regression", model="mlp", width=16, depth=1,
        optimizer="adam", learning_rate=0.01, steps=300, pruning_burn_in=250,
        fine_tune_steps=0, save_dir=str(tmp_path / "run"), export_formats=["state_dict"],
        progress="none",
    )  # fmt: skip
    trainer = PruningTrainer(cfg)
    result = trainer.run()
    with torch.no_grad():
        out = trainer.model.eval()(trainer.data.x_eval).reshape(-1).double()
    mse = float(((out - trainer.data.y_eval.double()) ** 2).mean())
    assert result.final_metric == pytest.approx(mse, rel=1e-4)
    assert result.dense_metric < 0.05 * float(trainer.data.y_eval.double().var())


def test_text_column_is_one_hot_with_training_categories(tmp_path: Path) -> None:
    """A text column becomes one 0/1 feature per training category (sorted); an eval category
    never seen in training becomes all zeros, with a warning naming it."""
    train = _table(
        tmp_path, "tr.csv", {"x": [1.0, 2, 3, 4], "c": ["red", "blue", "red", "blue"],
                             "label": [0, 1, 0, 1]},
    )  # fmt: skip
    ev = _table(tmp_path, "ev.csv", {"x": [5.0, 6], "c": ["blue", "green"], "label": [1, 0]})
    with pytest.warns(UserWarning, match=r"'c' has categories \['green'\] not seen"):
        ds = load_data(DataSpec(train, eval_source=ev))
    assert ds.feature_names == ["x", "c=blue", "c=red"]
    assert ds.x_train[:, 1:].tolist() == [[0, 1], [1, 0], [0, 1], [1, 0]]
    assert ds.x_eval[:, 1:].tolist() == [[1, 0], [0, 0]]
    assert ds.scaling is not None
    assert ds.scaling.feature_mean[1:] == [0.0, 0.0] and ds.scaling.feature_std[1:] == [1.0, 1.0]


def test_text_column_refused_says_which_and_how(tmp_path: Path) -> None:
    """categorical='refuse' names the column and the ways forward."""
    path = _table(tmp_path, "t.csv", {"x": [1.0, 2, 3, 4, 5], "city": list("abcab"),
                                      "label": [0, 1, 0, 1, 0]})  # fmt: skip
    with pytest.raises(ValueError, match=r"t\.csv: feature column 'city' holds text.*--features"):
        load_data(DataSpec(path, categorical="refuse"))


@pytest.mark.parametrize("stream", ["never", "always"])
def test_binary_column_is_refused_naming_it_and_what_to_do(tmp_path: Path, stream: str) -> None:
    """A Parquet column of bytes is refused, read whole or streamed, naming the file and the
    column and saying to decode or drop it (it was one-hot encoded as text categories)."""
    path = _table(tmp_path, "t.parquet", {"x": [1.0, 2, 3, 4, 5], "raw": [b"a", b"b"] * 2 + [b"a"],
                                          "label": [0, 1, 0, 1, 0]})  # fmt: skip
    with pytest.raises(ValueError, match=r"t\.parquet: feature column 'raw' holds binary") as info:
        load_data(DataSpec(path, stream=stream))
    assert "decode it to text or numbers" in str(info.value) and "--features" in str(info.value)


def test_label_far_above_the_class_count_is_named(tmp_path: Path) -> None:
    """A label of 1,000,000 among 2 classes is an error naming it and --remap_labels."""
    cols = {"x": np.arange(10.0), "label": [0, 1_000_000] * 5}
    path = _table(tmp_path, "t.parquet", cols)
    with pytest.raises(ValueError, match=r"label 1000000 in column 'label', row 2.*--remap_labels"):
        load_data(DataSpec(path))


def test_remap_labels_maps_sorted_distinct_labels(tmp_path: Path) -> None:
    """remap_labels: labels {7, 1000000} become {0, 1}; class_names keeps the originals."""
    y = np.array([7, 1_000_000] * 5)
    path = _table(tmp_path, "t.parquet", {"x": np.arange(10.0), "label": y})
    ds = load_data(DataSpec(path, remap_labels=True))
    assert ds.num_classes == 2 and ds.class_names == ["7", "1000000"]
    got = torch.cat([ds.y_train, ds.y_eval]).sort().values.tolist()
    assert got == sorted((y == 1_000_000).astype(int).tolist())


def test_single_class_is_an_error(tmp_path: Path) -> None:
    """Every training row with the same label: a clear error, not a trained constant."""
    path = _table(tmp_path, "t.csv", {"x": np.arange(10.0), "label": [3] * 10})
    with pytest.raises(ValueError, match=r"every training row has the label 3.*two classes"):
        load_data(DataSpec(path))


def test_eval_label_unseen_in_training_warns(tmp_path: Path) -> None:
    """An eval label no training row has is a warning naming it."""
    train = _table(tmp_path, "tr.csv", {"x": np.arange(6.0), "label": [0, 1] * 3})
    ev = _table(tmp_path, "ev.csv", {"x": np.arange(3.0), "label": [0, 1, 2]})
    with pytest.warns(UserWarning, match=r"eval label\(s\) 2 never appear"):
        load_data(DataSpec(train, eval_source=ev))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_data(DataSpec(train, eval_source=train))  # nothing unseen: no warning


def test_csv_and_parquet_give_the_same_dataset(tmp_path: Path) -> None:
    """The same table as CSV and Parquet loads to equal tensors and scaling."""
    cols = _wide(40)
    a = load_data(DataSpec(_table(tmp_path, "t.csv", cols)))
    b = load_data(DataSpec(_table(tmp_path, "t.parquet", cols)))
    torch.testing.assert_close(a.x_train, b.x_train)
    torch.testing.assert_close(a.y_eval, b.y_eval)
    assert a.scaling == b.scaling


def test_scaling_keeps_its_precision_far_from_zero(tmp_path: Path) -> None:
    """Features around 1e6 with a spread of 1 (where mean-of-squares minus squared mean loses
    digits): the fitted std matches numpy's two-pass std of the training rows to 1e-9."""
    rng = np.random.default_rng(3)
    cols = {"a": 1e6 + rng.normal(0, 1, 2000), "label": np.arange(2000) % 2}
    ds = load_data(DataSpec(_table(tmp_path, "t.parquet", cols)))
    assert ds.scaling is not None
    x = ds.x_train[:, 0].double().numpy()
    assert ds.scaling.feature_std[0] == pytest.approx(x.std(), rel=1e-9)
    naive = np.sqrt(np.mean(x * x) - np.mean(x) ** 2)
    assert abs(naive - x.std()) > 1e-9 * x.std()  # the case is one where it matters
