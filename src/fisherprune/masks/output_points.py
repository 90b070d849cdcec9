"""Masks on the model's output: a width the model returns and also reads inside.

A base model (``BertModel``, ``ViTModel``, a trunk returning features, the encoder half of
BART) returns its hidden width, which its own layers read too. Such a width is prunable; its
removed channels are zeroed in the output as well, by a forward hook on the model that
multiplies each such output tensor by the masks (``OutputMasks``), so that the masked model
returns exactly what the shrunk model returns: the kept channels, and 0 in the removed ones
(``fisherprune.export.output_fill`` puts them back as zeros). Outputs are named by their
pytree key path (``torch.utils._pytree.keystr``): ``""`` for a lone tensor, ``"[0]"``,
``"['last_hidden_state']"``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

__all__ = ["OutputMasks", "map_outputs"]


def map_outputs(output: Any, change: Mapping[str, Callable[[Tensor], Tensor]]) -> Any:
    """``output`` with each tensor whose key path is in ``change`` replaced by
    ``change[path](tensor)``; the rest, and the structure (tuples, dicts, ``ModelOutput``),
    as they were. An output with none of the paths comes back as it is."""
    leaves, spec = tree_flatten_with_path(output)
    hit = False
    new = []
    for path, leaf in leaves:
        fn = change.get(keystr(path)) if isinstance(leaf, Tensor) else None
        new.append(leaf if fn is None else fn(leaf))
        hit = hit or fn is not None
    return tree_unflatten(new, spec) if hit else output


class OutputMasks:
    """The forward hook on the model that multiplies its output tensors by their masks.

    ``points``: ``(key path, dim, size, multiply)``, ``multiply`` being the ``apply`` of the
    ``MaskPoint`` that holds the masks of that output dim (it also gathers the Fisher signal
    the output contributes while collecting).
    """

    def __init__(self, points: Sequence[tuple[str, int, int, Callable[[Tensor], Tensor]]]) -> None:
        self.points = list(points)
        self._by_path: dict[str, list[tuple[int, int, Callable[[Tensor], Tensor]]]] = {}
        for path, dim, size, fn in self.points:
            self._by_path.setdefault(path, []).append((dim, size, fn))

    def _masked(self, path: str) -> Callable[[Tensor], Tensor]:
        def go(t: Tensor) -> Tensor:
            for dim, size, fn in self._by_path[path]:
                if t.dim() <= dim or t.shape[dim] != size:
                    raise RuntimeError(
                        f"fisherprune mask on the model output{path}: a tensor of shape "
                        f"{tuple(t.shape)} has no dim {dim} of size {size}, as traced; call "
                        "apply_masks again"
                    )
                t = fn(t)
            return t

        return go

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return map_outputs(output, {p: self._masked(p) for p in self._by_path})
