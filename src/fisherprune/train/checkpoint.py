"""Checkpoints: written atomically, the last N kept, the newest found for ``--resume``.

A checkpoint holds tensors and plain data only (dicts, lists, tuples, strings, numbers), so it
is read back with ``torch.load(..., weights_only=True)``: nothing in it can run code on load.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fisherprune.export.safe_load import PickledObjectsError, load_plain
from fisherprune.export.storage import atomic_save

__all__ = ["CheckpointManager", "rng_state", "set_rng_state"]

_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")

# what to do with a checkpoint refused for holding pickled objects
_REFUSED = (
    "it was written by an older fisherprune (which pickled numpy's random state) or by another "
    "program: if you trust it, export it with the fisherprune version that wrote it "
    "(fisherprune export --format state_dict), or train again with a new --save_dir"
)


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states, as tensors and plain data.

    ``torch.load(..., weights_only=True)`` reads them back exactly; ``set_rng_state`` restores
    them. Numpy's state (an ndarray in ``np.random.get_state()``) becomes a dict with its key
    as an int64 tensor. Reads the generators, changes nothing.
    """
    kind, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "python": random.getstate(),  # (version, tuple of 625 ints, gauss_next)
        "numpy": {
            "bit_generator": str(kind),
            "key": torch.from_numpy(key.astype(np.int64)),  # (624,) uint32 values
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned: sets the process-wide ``random``, ``np.random``
    and torch CPU generators, so each continues the stream it had when saved.

    Raises:
        ValueError: ``state`` is not in the form ``rng_state`` returns.
    """
    np_state = state.get("numpy")
    if not isinstance(np_state, dict) or not isinstance(np_state.get("key"), torch.Tensor):
        raise ValueError("the saved random state is not in the form rng_state() writes")
    random.setstate(state["python"])
    np.random.set_state(
        (
            np_state["bit_generator"],
            np_state["key"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])


class CheckpointManager:
    """Files ``ckpt-<step>.pt`` in ``directory``; each written whole or not at all."""

    def __init__(self, directory: Path, keep: int) -> None:
        self.directory = Path(directory)
        self.keep = keep

    def paths(self) -> list[Path]:
        """Existing checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if _NAME.match(p.name)]
        return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))  # type: ignore[union-attr]

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` for ``step`` and delete all but the newest ``keep`` checkpoints.

        ``state`` must hold tensors and plain data only (what ``load`` reads back); the file is
        checked before it replaces anything.

        Raises:
            TypeError: ``state`` holds another object (a numpy array, a class instance): no
                file is written and no older checkpoint is deleted.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"ckpt-{step:08d}.pt"
        atomic_save(path, lambda tmp: _save_plain(state, tmp))
        for old in self.paths()[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    def latest(self) -> Path | None:
        paths = self.paths()
        return paths[-1] if paths else None

    @staticmethod
    def load(path: Path) -> dict[str, Any]:
        """Load a checkpoint written by ``save`` as tensors and plain data only
        (``torch.load(..., weights_only=True)``); reads the file, changes nothing.

        Raises:
            PickledObjectsError: (a ValueError) the file holds pickled Python objects: it was
                written by an older fisherprune or by another program. Nothing from it ran;
                the one-line message names the file and says what to do.
            ValueError: the file is not a fisherprune checkpoint (or is damaged).
        """
        try:
            state = load_plain(path, "checkpoint", _REFUSED)
        except PickledObjectsError:
            raise
        except Exception as e:
            raise ValueError(f"cannot read checkpoint {path}: {e}") from e
        if not isinstance(state, dict) or "model" not in state or "pruner" not in state:
            raise ValueError(f"{path} is not a fisherprune checkpoint")
        return state


def _save_plain(state: dict[str, Any], tmp: Path) -> None:
    """``torch.save(state, tmp)``, then refuse it unless ``weights_only=True`` can read it."""
    torch.save(state, tmp)
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(tmp)
    if unsafe:
        raise TypeError(
            "a checkpoint holds tensors and plain data only, so that loading it cannot run "
            f"code; this state also holds {', '.join(sorted(unsafe))}"
        )
