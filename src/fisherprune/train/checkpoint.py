"""Checkpoints: written atomically, the last N kept, the newest found for ``--resume``."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fisherprune.export.storage import atomic_save

__all__ = ["CheckpointManager", "rng_state", "set_rng_state"]

_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
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
        """Write ``state`` for ``step`` and delete all but the newest ``keep`` checkpoints."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"ckpt-{step:08d}.pt"
        atomic_save(path, lambda tmp: torch.save(state, tmp))
        for old in self.paths()[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    def latest(self) -> Path | None:
        paths = self.paths()
        return paths[-1] if paths else None

    @staticmethod
    def load(path: Path) -> dict[str, Any]:
        """Load a checkpoint written by ``save``.

        Raises:
            ValueError: the file is not a fisherprune checkpoint (or is damaged).
        """
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:
            raise ValueError(f"cannot read checkpoint {path}: {e}") from e
        if not isinstance(state, dict) or "model" not in state or "pruner" not in state:
            raise ValueError(f"{path} is not a fisherprune checkpoint")
        return state
