"""Images on disk: a folder with one sub-folder of PNG/JPEG files per class, or a table column
holding encoded images (bytes) or image file paths. Needs Pillow (``pip install
'fisherprune[images]'``).

Every image becomes float32 ``(C, H, W)`` in [0, 1]: resized (bilinear) to ``image_size`` when
given, else to the first image's size (a column), or all images must share one size (a
folder); ``image_mode`` ``"L"`` (1 channel) or ``"RGB"`` (3),
or ``"auto"``: RGB if some image has colour (a folder), or if the first image has (a column).
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

from fisherprune.train.data.formats import register_reader
from fisherprune.train.data.parts import Part

try:
    from PIL import Image, UnidentifiedImageError
except ImportError:  # optional: the 'images' extra
    Image = UnidentifiedImageError = None

__all__ = ["IMAGE_MODES", "IMAGE_SUFFIXES", "decode_images", "image_format"]

IMAGE_SUFFIXES: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif")
IMAGE_MODES: tuple[str, ...] = ("auto", "L", "RGB")
_GRAY = ("1", "L", "LA", "I", "I;16", "F")


def _need_pillow(what: str) -> None:
    if Image is None:
        raise ImportError(f"reading {what} needs Pillow: pip install 'fisherprune[images]'")


def _open(value: Any, base_dir: str, where: str) -> Any:
    """Open one image: bytes, or a path (relative paths from ``base_dir``).

    Raises:
        FileNotFoundError / ValueError: a missing file, or data that is not an image (named).
    """
    try:
        if isinstance(value, (bytes, bytearray, memoryview)):
            return Image.open(io.BytesIO(bytes(value)))
        path = os.path.join(base_dir, os.path.expanduser(str(value)))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{where}: image file {path!r} does not exist")
        return Image.open(path)
    except (UnidentifiedImageError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"{where}: not a readable image ({e})") from None


def image_format(
    first: Any, base_dir: str, size: tuple[int, int] | None, mode: str, where: str
) -> tuple[tuple[int, int], str]:
    """``(size, mode)`` to decode with: the given ones, or those of the ``first`` image."""
    _need_pillow(where)
    with _open(first, base_dir, where) as im:
        if size is None:
            size = (im.height, im.width)
        if mode == "auto":
            mode = "L" if im.mode in _GRAY else "RGB"
    return size, mode


def decode_images(
    values: np.ndarray,
    base_dir: str,
    size: tuple[int, int] | None,
    mode: str,
    path: str,
    where: Any = None,
) -> np.ndarray:
    """Decode images (bytes or paths) to float32 ``(N, C, H, W)`` in [0, 1].

    Args:
        values: One image per row: bytes, or a path (relative ones from ``base_dir``).
        base_dir: Where relative paths start.
        size: ``(H, W)`` to resize to; None: every image must have the first one's size.
        mode: ``"L"``, ``"RGB"`` or ``"auto"`` (the first image's).
        path: The table or folder, for messages.
        where: 0-based row -> description, for messages (default ``"row N"``).

    Raises:
        ImportError: Pillow is missing.
        ValueError: An unreadable image, or (no ``size``) images of different sizes.
    """
    at = where or (lambda i: f"row {i + 1}")
    given = size
    size, mode = image_format(values[0], base_dir, size, mode, f"{path}, {at(0)}")
    h, w = size
    out = np.empty((len(values), 1 if mode == "L" else 3, h, w), dtype=np.float32)
    for i, v in enumerate(values):
        with _open(v, base_dir, f"{path}, {at(i)}") as im:
            im = im.convert(mode)
            if (im.height, im.width) != (h, w):
                if given is None:
                    raise ValueError(
                        f"{path}, {at(i)}: image of {im.height}x{im.width}, but the first is "
                        f"{h}x{w}; pass --image_size H,W to resize them all"
                    )
                im = im.resize((w, h), Image.BILINEAR)
            a = np.asarray(im, dtype=np.float32) / 255.0
        out[i] = a[None] if a.ndim == 2 else a.transpose(2, 0, 1)
    return out


def _folder_files(path: str) -> tuple[list[str], list[str]]:
    """The image files of a folder per class, and each one's class (the sub-folder's name).

    Raises:
        ValueError: No sub-folder, or a sub-folder without images.
    """
    classes = sorted(d.name for d in os.scandir(path) if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise ValueError(
            f"{path}: a folder of images needs one sub-folder per class (e.g. {path}/cat/1.png)"
        )
    files: list[str] = []
    labels: list[str] = []
    for c in classes:
        found = sorted(
            f.path
            for f in os.scandir(os.path.join(path, c))
            if f.is_file() and f.name.lower().endswith(IMAGE_SUFFIXES)
        )
        if not found:
            raise ValueError(
                f"{path}: class folder {c!r} holds no image file ({', '.join(IMAGE_SUFFIXES)})"
            )
        files += found
        labels += [c] * len(found)
    return files, labels


@register_reader("image_folder", (), "images", directory=True)
def read_image_folder(path: str, spec: Any, role: str) -> Part:
    """Read a folder with one sub-folder of images per class (the class is the folder name).

    Raises:
        ImportError: Pillow is missing.
        ValueError: No class folder, an empty one, an unreadable image, or (no
            ``image_size``) images of different sizes (says to pass ``--image_size``).
    """
    _need_pillow(f"the image folder {path!r}")
    files, labels = _folder_files(path)
    mode = spec.image_mode
    if mode == "auto":
        mode = "L"
        for f in files:
            with _open(f, "", path) as im:
                if im.mode not in _GRAY:
                    mode = "RGB"
                    break
    size = spec.image_size
    if size is None:
        sizes = {}
        for f in files:
            with _open(f, "", path) as im:
                sizes.setdefault((im.height, im.width), f)
        if len(sizes) > 1:
            shown = ", ".join(f"{os.path.relpath(f, path)} {h}x{w}" for (h, w), f in sizes.items())
            raise ValueError(
                f"{path}: the images differ in size ({shown}); pass --image_size H,W to "
                "resize them all"
            )
        size = next(iter(sizes))
    x = decode_images(np.array(files, dtype=object), "", size, mode, path, lambda i: files[i])
    return Part(
        file=path,
        x=x,
        y=np.array(labels, dtype=str),
        y_file=path,
        y_at=lambda i: files[i],
        class_names=sorted(set(labels)),
    )
