"""The repair's copies of weights, kept on disk and read back one layer at a time
(``LayerStore``), so that the repair holds no second copy of the model in memory; also the
dense model's outputs on the held-out batches, read back one batch at a time (an LM's logits
on every held-out batch would grow with the calibration tokens).

The sequential repair runs the DENSE model (original weights, dense masks) once per pass, after
earlier passes have refitted layers in place; its guards put back a stage's original or
refitted weights. Holding every fitted layer's original weights in memory costs nearly the
model's size again when the hidden width is pruned (every projection reads it), so each
layer's parameters are written to a file of a temporary folder (``tempfile``: ``TMPDIR``
chooses where) and read back for one layer's call at a time (``LayerStore.swapped``), or to be
loaded for good (``LayerStore.load``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["LayerStore"]


class LayerStore:
    """Copies of some modules' own parameters under a key each, in files of a temporary
    folder that ``close`` (or the ``with`` block) deletes.

    Example:
        >>> with LayerStore() as store:
        ...     store.put("original", {"fc": model.fc})
        ...     store.load("original", {"fc": model.fc})
    """

    def __init__(self) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="fisherprune-repair-")
        self._files: dict[tuple[str, str], Path] = {}

    def __enter__(self) -> LayerStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete the files."""
        self._files.clear()
        self._folder.cleanup()

    def put(self, key: str, modules: dict[str, nn.Module]) -> None:
        """Write the current parameters of ``modules`` (by name) under ``key``, one file per
        module (replacing what ``key`` held for it). Memory: one module's tensors at a time."""
        for name, mod in modules.items():
            path = Path(self._folder.name) / f"{key}-{len(self._files)}.pt"
            state = {k: p.detach() for k, p in mod.named_parameters(recurse=False)}
            torch.save(state, path)
            self._files[key, name] = path

    def put_tensors(self, key: str, index: int, tensors: list[Tensor]) -> None:
        """Write ``tensors`` under ``key`` and ``index`` (replacing what was there)."""
        path = Path(self._folder.name) / f"{key}-{len(self._files)}.pt"
        torch.save([t.detach() for t in tensors], path)
        self._files[key, str(index)] = path

    def tensors(self, key: str, index: int) -> list[Tensor]:
        """The tensors ``put_tensors`` wrote under ``key`` and ``index``, read back (CPU)."""
        return torch.load(self._files[key, str(index)], weights_only=True, map_location="cpu")

    def _read(self, key: str, name: str) -> dict[str, Tensor]:
        return torch.load(self._files[key, name], weights_only=True, map_location="cpu")

    def load(self, key: str, modules: dict[str, nn.Module]) -> None:
        """Copy the parameters stored under ``key`` into ``modules`` (by name), in place."""
        for name, mod in modules.items():
            saved = self._read(key, name)
            with torch.no_grad():
                for k, p in mod.named_parameters(recurse=False):
                    p.copy_(saved[k])

    @contextmanager
    def swapped(self, key: str, modules: dict[str, nn.Module]) -> Iterator[None]:
        """For the block, each of ``modules`` computes with the parameters stored under
        ``key`` during its own calls: a forward pre-hook reads them (on the parameters'
        device) and swaps them in (``Parameter.data``), a forward hook swaps the module's own
        back. Only the module running holds two sets. A module left swapped by an exception
        from a later hook (a forward cut short) gets its own back when the block ends."""
        live: dict[str, list[tuple[nn.Parameter, Tensor]]] = {}

        def swap_in(name: str, mod: nn.Module, *_: Any) -> None:
            saved = self._read(key, name)
            pairs = []
            for k, p in mod.named_parameters(recurse=False):
                pairs.append((p, p.data))
                p.data = saved[k].to(p.device)
            live[name] = pairs

        def swap_out(name: str, *_: Any) -> None:
            for p, own in live.pop(name, []):
                p.data = own

        handles = []
        for name, mod in modules.items():
            handles.append(mod.register_forward_pre_hook(partial(swap_in, name)))
            handles.append(mod.register_forward_hook(partial(swap_out, name), always_call=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            for name in list(live):
                swap_out(name)
