"""Data for the trainer: a :class:`DataSpec` says where the examples are, :func:`load_data`
reads them into a :class:`Dataset` of tensors (or streams a large table).

Sources, one reader per format (:data:`READERS`, :func:`register_reader`):

* tables: ``.csv`` / ``.csv.gz`` (header row required) and ``.parquet``, read with pyarrow;
  ``label`` names the label column (default ``"label"``), ``features`` the feature columns
  (default every other). Text columns are one-hot encoded (or refused); numeric features and
  regression targets are standardised with the training rows' statistics, which the built
  model carries (it takes raw features and returns targets in their own units). A table
  larger than ``STREAM_BYTES`` (or any, with ``stream="always"``) is streamed in record
  batches with a bounded shuffle buffer.
* images: a folder with one sub-folder per class of PNG/JPEG files, or a table column of image
  bytes or paths (``image_column``), resized to ``image_size`` (needs Pillow).
* arrays: ``.npy`` features with a ``.npy`` label array (``labels``), or one ``.npz`` holding
  both (keys ``features[0]``, default ``"x"``, and ``label``, default ``"y"``).
* built-ins (:func:`builtin_names`): ``"digits"`` and ``"mnist5k"``.

Module map: ``spec`` (DataSpec), ``formats`` (reader registry), ``tables`` / ``arrays`` /
``images`` (readers), ``labels``, ``builtins``, ``dataset`` (Dataset, Scaling), ``stream``
(StreamingDataset), ``load`` (load_data).
"""

from __future__ import annotations

from fisherprune.train.data import arrays, images, tables  # noqa: F401  (registers readers)
from fisherprune.train.data.builtins import builtin_names
from fisherprune.train.data.dataset import Dataset, Scaling, data_card
from fisherprune.train.data.formats import READERS, register_reader
from fisherprune.train.data.load import STREAM_BYTES, load_data
from fisherprune.train.data.spec import TASKS, DataSpec
from fisherprune.train.data.stream import StreamingDataset

__all__ = [
    "READERS",
    "STREAM_BYTES",
    "TASKS",
    "DataSpec",
    "Dataset",
    "Scaling",
    "StreamingDataset",
    "builtin_names",
    "data_card",
    "load_data",
    "register_reader",
]
