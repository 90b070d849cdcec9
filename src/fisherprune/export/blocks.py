"""Removing gated-off blocks: the depth half of a ``PruningPlan``.

A block whose ``BlockGate`` entry is 0 is the identity in the masked model; the shrunk model
drops it from its ``nn.ModuleList``, the kept blocks are renumbered with no gaps (``layers.0``,
``layers.1``, ...; an integer ``layer_idx`` attribute inside a block, as Hugging Face
attention layers keep for their cache, follows), and a Hugging Face ``config`` follows too:
``num_hidden_layers``, and every list in the config with one entry per block (``layer_types``)
keeps the kept blocks' entries, so ``save_pretrained`` / ``from_pretrained`` round-trip.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from fisherprune.masks import MaskLayer
from fisherprune.masks.blocks import BlockGate

__all__ = ["check_blocks", "remove_blocks", "removed_blocks"]

#: the config field that counts the blocks (GPT-2's ``n_layer`` answers to it too)
LAYERS_FIELD = "num_hidden_layers"


def removed_blocks(masks: Mapping[str, MaskLayer]) -> dict[str, dict[str, Any]]:
    """Per gated ModuleList (qualified name): ``{"count": its length, "removed": [indices of
    blocks whose gate entry is 0]}``, for the gates among ``masks`` that removed any."""
    out: dict[str, dict[str, Any]] = {}
    for m in masks.values():
        if isinstance(m, BlockGate):
            gone = (m.mask.detach().cpu() < 0.5).nonzero().flatten().tolist()
            if gone:
                out[m.list_path] = {"count": m.num_channels, "removed": gone}
    return out


def check_blocks(blocks: Any) -> dict[str, dict[str, Any]]:
    """``blocks`` as read from a plan's JSON, validated.

    Raises:
        ValueError: not ``{list name: {"count": n, "removed": sorted unique indices in [0, n),
            fewer than n}}``.
    """

    def ok(v: Any) -> bool:
        if not isinstance(v, dict) or type(v.get("count")) is not int:
            return False
        n, gone = v["count"], v.get("removed")
        return (
            isinstance(gone, list)
            and all(type(i) is int and 0 <= i < n for i in gone)
            and gone == sorted(set(gone))
            and len(gone) < n
        )

    if not isinstance(blocks, dict) or not all(
        isinstance(k, str) and ok(v) for k, v in blocks.items()
    ):
        raise ValueError(
            "pruning plan: 'blocks' must map ModuleList names to {count, removed} with removed "
            "sorted, unique, in [0, count) and keeping at least one block"
        )
    return blocks


def _per_layer_fields(config: object, n: int) -> list[str]:
    """Fields of ``config`` holding one entry per block: lists of length ``n``."""
    return [k for k, v in vars(config).items() if isinstance(v, list) and len(v) == n]


def _update_config(model: nn.Module, n: int, kept: list[int]) -> None:
    config = getattr(model, "config", None)
    if config is None or getattr(config, LAYERS_FIELD, None) != n:
        return
    for field in _per_layer_fields(config, n):
        setattr(config, field, [getattr(config, field)[i] for i in kept])
    setattr(config, LAYERS_FIELD, len(kept))


def remove_blocks(model: nn.Module, path: str, count: int, removed: list[int]) -> None:
    """Drop blocks ``removed`` of the ModuleList ``path`` of ``model``, in place.

    Changes: the ModuleList (the same object) keeps the other blocks, renumbered from 0; an integer
    ``layer_idx`` of any module inside a kept block becomes its new index when it was the old
    one; a Hugging Face ``config`` whose ``num_hidden_layers`` was ``count`` gets the kept
    count, and its lists of ``count`` entries keep the kept blocks' entries. A list already
    ``count - len(removed)`` long is taken as done (nothing changes).

    Raises:
        ValueError: no ModuleList at ``path``, or one of another length.
    """
    blocks = model.get_submodule(path) if path else model
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"the plan removes blocks of {path!r}, which is not an nn.ModuleList")
    if len(blocks) == count - len(removed):
        return
    if len(blocks) != count:
        raise ValueError(
            f"the plan removes blocks of {path!r} made for {count} blocks; it has {len(blocks)}"
        )
    gone = set(removed)
    kept = [i for i in range(count) if i not in gone]
    for new, old in enumerate(kept):
        for mod in blocks[old].modules():
            if type(getattr(mod, "layer_idx", None)) is int and mod.layer_idx == old:
                mod.layer_idx = new
    for i in sorted(gone, reverse=True):
        del blocks[i]  # (ModuleList renumbers its keys from 0)
    _update_config(model, count, kept)
