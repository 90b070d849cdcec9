"""Images on disk: a folder per class, a table column of image bytes or paths; tiny PNGs made
here with Pillow."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import torch

from fisherprune.cli.main import main
from fisherprune.train.data import DataSpec, load_data
from fisherprune.train.data import images as images_mod

Image = pytest.importorskip("PIL.Image")


def _pixels(n: int, seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, *shape), dtype=np.uint8)


def _folder(root: Path, shape: tuple[int, ...] = (6, 5), n: int = 5) -> dict[str, np.ndarray]:
    """root/cat/*.png and root/dog/*.png; returns the pixels written per class."""
    out = {}
    for k, cls in enumerate(["cat", "dog"]):
        (root / cls).mkdir(parents=True)
        px = _pixels(n, k, shape)
        for i, a in enumerate(px):
            Image.fromarray(a).save(root / cls / f"{i}.png")
        out[cls] = px
    return out


def test_folder_per_class_reads_pixels_and_labels(tmp_path: Path) -> None:
    """Each PNG becomes (1, H, W) = pixels / 255; its label is its folder's index (sorted)."""
    px = _folder(tmp_path / "imgs")
    ds = load_data(DataSpec(str(tmp_path / "imgs"), eval_fraction=0.3))
    assert ds.input_shape == (1, 6, 5) and ds.num_classes == 2
    assert ds.class_names == ["cat", "dog"] and ds.scaling is None
    x = torch.cat([ds.x_train, ds.x_eval]).numpy()
    y = torch.cat([ds.y_train, ds.y_eval]).numpy()
    want = np.concatenate([px["cat"], px["dog"]]).astype(np.float32)[:, None] / 255
    order = np.lexsort(x.reshape(len(x), -1).T)
    ref = np.lexsort(want.reshape(len(want), -1).T)
    np.testing.assert_array_equal(x[order], want[ref])
    np.testing.assert_array_equal(y[order], np.repeat([0, 1], 5)[ref])


def test_rgb_is_detected_and_image_size_resizes(tmp_path: Path) -> None:
    """Colour images give 3 channels; image_size resizes to (H, W) as Pillow's bilinear does."""
    px = _folder(tmp_path / "imgs", (6, 5, 3), n=3)
    ds = load_data(DataSpec(str(tmp_path / "imgs"), image_size=(4, 7), eval_fraction=0.34))
    assert ds.input_shape == (3, 4, 7)
    first = Image.open(tmp_path / "imgs" / "cat" / "0.png").convert("RGB")
    first = first.resize((7, 4), Image.BILINEAR)
    ref = np.asarray(first, dtype=np.float32).transpose(2, 0, 1) / 255
    x = torch.cat([ds.x_train, ds.x_eval]).numpy()
    assert any(np.array_equal(row, ref) for row in x)
    assert px["cat"].shape == (3, 6, 5, 3)


@pytest.mark.parametrize("one", [5, (5,), [5]])
def test_one_image_size_means_a_square(tmp_path: Path, one: object) -> None:
    """image_size=5 (the CLI's "--image_size 5") reads exactly what (5, 5) reads."""
    _folder(tmp_path / "imgs", (6, 5, 3), n=3)
    square = load_data(DataSpec(str(tmp_path / "imgs"), image_size=(5, 5), eval_fraction=0.34))
    got = load_data(DataSpec(str(tmp_path / "imgs"), image_size=one, eval_fraction=0.34))
    assert got.input_shape == (3, 5, 5)
    assert torch.equal(got.x_train, square.x_train) and torch.equal(got.x_eval, square.x_eval)


@pytest.mark.parametrize("bad", [0, (4, 0), (1, 2, 3), "32", True])
def test_bad_image_size_is_named(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ValueError, match="image_size must be one positive integer"):
        DataSpec(str(tmp_path), image_size=bad)


def test_grayscale_flag_turns_colour_images_gray(tmp_path: Path) -> None:
    """image_mode='L' reads colour images as one channel."""
    _folder(tmp_path / "imgs", (6, 5, 3), n=3)
    ds = load_data(DataSpec(str(tmp_path / "imgs"), image_mode="L", eval_fraction=0.34))
    assert ds.input_shape == (1, 6, 5)


def test_images_of_different_sizes_ask_for_image_size(tmp_path: Path) -> None:
    """Without image_size, images of two sizes are an error that says --image_size."""
    _folder(tmp_path / "imgs")
    Image.fromarray(_pixels(1, 9, (8, 8))[0]).save(tmp_path / "imgs" / "dog" / "big.png")
    with pytest.raises(ValueError, match=r"differ in size .*--image_size H,W"):
        load_data(DataSpec(str(tmp_path / "imgs")))


def test_empty_class_folder_is_named(tmp_path: Path) -> None:
    """A class folder without images is named."""
    _folder(tmp_path / "imgs")
    (tmp_path / "imgs" / "emu").mkdir()
    with pytest.raises(ValueError, match=r"class folder 'emu' holds no image"):
        load_data(DataSpec(str(tmp_path / "imgs")))


def test_parquet_bytes_and_csv_paths_equal_the_folder(tmp_path: Path) -> None:
    """A Parquet column of PNG bytes and a CSV column of relative paths load the same pixels
    as the folder they came from."""
    _folder(tmp_path / "imgs")
    files = sorted((tmp_path / "imgs").glob("*/*.png"))
    labels = [f.parent.name for f in files]
    blobs = [f.read_bytes() for f in files]
    rel = [str(f.relative_to(tmp_path)) for f in files]
    pq.write_table(pa.table({"img": blobs, "label": labels}), tmp_path / "b.parquet")
    pa_csv.write_csv(pa.table({"img": rel, "label": labels}), tmp_path / "p.csv")
    ref = load_data(DataSpec(str(tmp_path / "imgs"), eval_fraction=0.3))
    for name in ("b.parquet", "p.csv"):
        ds = load_data(DataSpec(str(tmp_path / name), image_column="img", eval_fraction=0.3))
        assert ds.scaling is None and ds.class_names == ["cat", "dog"]
        torch.testing.assert_close(ds.x_train, ref.x_train)
        torch.testing.assert_close(ds.y_eval, ref.y_eval)


def test_bytes_that_are_not_an_image_are_named(tmp_path: Path) -> None:
    """A cell that does not decode names the table and the row."""
    buf = io.BytesIO()
    Image.fromarray(_pixels(1, 0, (4, 4))[0]).save(buf, format="PNG")
    cells = [buf.getvalue(), b"not an image", buf.getvalue()]
    pq.write_table(pa.table({"img": cells, "label": [0, 1, 0]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b\.parquet, row 2: not a readable image"):
        load_data(DataSpec(str(tmp_path / "b.parquet"), image_column="img", eval_fraction=0.34))


def test_without_pillow_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image folder without Pillow: ImportError naming the images extra."""
    _folder(tmp_path / "imgs")
    monkeypatch.setattr(images_mod, "Image", None)
    with pytest.raises(ImportError, match=r"fisherprune\[images\]"):
        load_data(DataSpec(str(tmp_path / "imgs")))


def test_train_on_an_image_folder_from_the_command_line(tmp_path: Path) -> None:
    """fisherprune train --data FOLDER --data.image_size H,W trains a CNN on the folder and
    records the classes and image size in export/data.json."""
    _folder(tmp_path / "imgs", n=8)
    save = tmp_path / "run"
    code = main(
        [
            "train", "--data", str(tmp_path / "imgs"), "--data.image_size", "8,8",
            "--model", "cnn", "--width", "4", "--train.steps", "12", "--batch_size", "8",
            "--pruning.burn_in", "4", "--pruning.iter", "1", "--fine_tune_steps", "2",
            "--export_formats", "state_dict", "--progress", "none", "--save_dir", str(save),
            "--dense_check", "warn",  # random pixels: nothing to learn in 4 dense steps
        ]
    )  # fmt: skip
    assert code == 0
    card = json.loads((save / "export" / "data.json").read_text())
    assert card["class_names"] == ["cat", "dog"] and card["input_shape"] == [1, 8, 8]
    assert card["encoding"]["class_names"] == ["cat", "dog"]
