"""The shrunk model's zero-filled outputs: a returned width that lost channels is returned at
its full width again, with 0 in each removed channel.

Why zeros at the full width, rather than the narrower tensor: the masked model returns 0 in a
removed channel of such an output (``fisherprune.masks.output_points``), so the shrunk model
returning the same tensor is a drop-in replacement: code downstream of a base model (a head of
the user's own, a similarity on CLIP's ``last_hidden_state``, a loss on features) keeps its
shapes and gets the same values. ``shrink``, ``PruningPlan.apply`` and ``export_model``
(state_dict, TorchScript, ONNX, AOTInductor) put one ``OutputFill`` forward hook on the model;
it is a plain picklable object, so ``torch.save`` of the whole module keeps it, and applying
a plan again replaces it rather than adding a second. The kept channels alone are what a
standard architecture rebuilt from its new config (``save_pretrained`` / ``from_pretrained``)
returns: ``kept_outputs`` selects them from the full-width output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fisherprune.masks.output_points import map_outputs

__all__ = ["FilledOutput", "OutputFill", "install_output_fill", "output_fill"]


@dataclass(frozen=True)
class FilledOutput:
    """One zero-filled output dim: the tensor at key ``path`` (``keystr``), along ``dim``,
    comes out of the shrunk model ``len(kept)`` wide and is put back ``size`` wide, position
    ``kept[i]`` holding its channel ``i``."""

    path: str
    dim: int
    size: int
    kept: tuple[int, ...]


class OutputFill:
    """The forward hook that zero-fills the model's narrowed outputs back to full width."""

    def __init__(self, outputs: Sequence[FilledOutput]) -> None:
        self.outputs = list(outputs)
        self._index = {
            o.path + f"/{o.dim}": torch.tensor(o.kept, dtype=torch.long) for o in self.outputs
        }
        #: ``_index`` copied to each device it was used on, once: a copy from the host in every
        #: call would make each call wait for a GPU, and cannot be captured in a CUDA graph
        self._on_device: dict[tuple[str, torch.device], Tensor] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``torch.save`` of the whole module) without the device copies."""
        return {**self.__dict__, "_on_device": {}}

    def index(self, key: str, device: torch.device) -> Tensor:
        """The kept positions of output ``key`` (``path/dim``) as a long tensor on ``device``,
        copied there on the first call for that device and reused after."""
        got = self._on_device.get((key, device))
        if got is None:
            got = self._on_device[(key, device)] = self._index[key].to(device)
        return got

    def _fill(self, path: str):
        def go(t: Tensor) -> Tensor:
            for o in self.outputs:
                if o.path != path or t.dim() <= o.dim or t.shape[o.dim] == o.size:
                    continue  # (already full: the model computed the dense width)
                if t.shape[o.dim] != len(o.kept):
                    raise RuntimeError(
                        f"fisherprune zero-fill of the model output{path}: a tensor of shape "
                        f"{tuple(t.shape)} is neither {len(o.kept)} (shrunk) nor {o.size} "
                        f"(dense) wide along dim {o.dim}"
                    )
                shape = list(t.shape)
                shape[o.dim] = o.size
                idx = self.index(o.path + f"/{o.dim}", t.device)
                t = t.new_zeros(shape).index_copy(o.dim, idx, t)
            return t

        return go

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return map_outputs(output, {o.path: self._fill(o.path) for o in self.outputs})

    def kept_outputs(self, output: Any) -> Any:
        """``output`` (of the shrunk model) with each filled tensor cut back to its kept
        channels: what a model rebuilt from the shrunk config alone returns."""

        def cut(path: str):
            def go(t: Tensor) -> Tensor:
                for o in self.outputs:
                    if o.path == path and t.dim() > o.dim and t.shape[o.dim] == o.size:
                        idx = self.index(o.path + f"/{o.dim}", t.device)
                        t = t.index_select(o.dim, idx)
                return t

            return go

        return map_outputs(output, {o.path: cut(o.path) for o in self.outputs})


def output_fill(model: nn.Module) -> OutputFill | None:
    """The ``OutputFill`` hook on ``model``, if it has one."""
    return next((h for h in model._forward_hooks.values() if isinstance(h, OutputFill)), None)


def install_output_fill(model: nn.Module, outputs: Sequence[FilledOutput]) -> None:
    """Put one ``OutputFill`` hook for ``outputs`` on ``model`` (replacing one it has; with no
    ``outputs``, only removing it). Changes: the model's forward hooks."""
    for key in [k for k, h in model._forward_hooks.items() if isinstance(h, OutputFill)]:
        del model._forward_hooks[key]
    if outputs:
        model.register_forward_hook(OutputFill(outputs))
