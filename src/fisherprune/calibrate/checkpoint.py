"""Activation checkpointing of a model's repeated blocks for a signal pass (issue 33).

A signal pass holds, until its backward, every tensor the forward saved, and each mask's
per-example dot needs its input too: about twice a plain forward and backward, for every block
at once. ``checkpointed_blocks`` wraps each block of a repeated ``nn.ModuleList`` (decoder
layers) in ``torch.utils.checkpoint`` (non-reentrant) for the pass, so that a block's saved
tensors are dropped after its forward and rebuilt by running it again when the backward reaches
it: one block's worth lives at a time, plus each block's input.

Hugging Face models checkpoint only in train mode, and a signal pass runs in eval mode, so the
wrapping is done here, for any model with such a list. The recomputed forward changes no mask
state (``fisherprune.masks.recompute``): the backward that runs is the first forward's, so each
mask gathers its gradient once, and the signals equal those of a pass without checkpointing.
A recomputation that saves other tensors than the first forward (a block that keeps state
between calls) is an error of ``torch.utils.checkpoint``, never a silent difference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from fisherprune.masks import MaskLayer, recompute
from fisherprune.masks.blocks import BlockGate, find_block_list
from fisherprune.masks.experts import ExpertGate
from fisherprune.masks.points import SharedProduct

__all__ = ["AUTO_MIN_BYTES", "check_checkpoint", "checkpointed_blocks", "resolve_block_list"]

#: ``checkpoint="auto"`` leaves models whose parameters take fewer bytes than this alone (8M
#: float32 parameters): the activations a pass of such a model holds are small in bytes, and
#: recomputing each block would cost one more forward per batch for nothing
AUTO_MIN_BYTES = 32 * 2**20


def _contexts() -> tuple[contextlib.AbstractContextManager[None], Any]:
    """``context_fn`` of ``checkpoint``: nothing around the first forward, the recomputing flag
    around the second."""
    return contextlib.nullcontext(), _recomputing()


@contextlib.contextmanager
def _recomputing() -> Iterator[None]:
    """The recomputing flag for a block's second forward; on exit, the strong hold on its
    latest mask product is dropped (``SharedProduct``: the recomputed graph is not kept)."""
    try:
        with recompute.recomputing_on():
            yield
    finally:
        SharedProduct.release()


class _Checkpointed(nn.Module):
    """Calls ``block`` under ``torch.utils.checkpoint``; any other attribute is the block's
    (a model's loop may read one, as Qwen2's ``attention_type``)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=_contexts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            block = self.__dict__.get("_modules", {}).get("block")
            if block is None:
                raise
            return getattr(block, name)


@contextlib.contextmanager
def checkpointed_blocks(model: nn.Module, blocks: nn.ModuleList) -> Iterator[None]:
    """Checkpoint each entry of ``blocks`` (a ``nn.ModuleList`` inside ``model``) for the block
    of code, with masks that do not alias their inputs (``masks.recompute``).

    Changes, for the block only (put back also when it raises): each entry of ``blocks`` is a
    wrapper holding the block (module names gain ``.block``); ``model.config.use_cache`` is
    False where the model has one (a key/value cache filled by the first forward would be
    filled again by the recomputation).

    Raises:
        ValueError: ``blocks`` is not an ``nn.ModuleList`` of ``model``, or is empty.
    """
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ValueError(f"checkpointing needs a non-empty nn.ModuleList of blocks, got {blocks!r}")
    if not any(m is blocks for m in model.modules()):
        raise ValueError("checkpointing: the block list is not a module of the model")
    originals = list(blocks)
    config = getattr(model, "config", None)
    cache = getattr(config, "use_cache", None)
    try:
        for i, b in enumerate(originals):
            blocks[i] = _Checkpointed(b)
        if cache is not None:
            config.use_cache = False
        with recompute.checkpointing_on():
            yield
    finally:
        for i, b in enumerate(originals):
            blocks[i] = b
        if cache is not None:
            config.use_cache = cache


def check_checkpoint(checkpoint: Any) -> None:
    """Raises ValueError unless ``checkpoint`` is True, False or ``"auto"``."""
    if checkpoint not in (True, False, "auto"):
        raise ValueError(f'checkpoint must be True, False or "auto", got {checkpoint!r}')


def resolve_block_list(
    model: nn.Module, example_inputs: Any, masks: dict[str, MaskLayer], checkpoint: bool | str
) -> nn.ModuleList | None:
    """The blocks a signal pass checkpoints under ``checkpoint``: False, None; True, the
    model's repeated blocks (a ``BlockGate``'s list, else ``find_block_list``: one forward
    pass without gradient); ``"auto"``: the same, but None for a model without such a list,
    with an ``ExpertGate`` (its routing is not checked under recomputation), or whose
    parameters take fewer than ``AUTO_MIN_BYTES`` (then no forward pass is run).

    Raises:
        ValueError: ``checkpoint`` is not True, False or ``"auto"``; True and no block list.
    """
    check_checkpoint(checkpoint)
    if checkpoint is False:
        return None
    if checkpoint == "auto" and (
        any(isinstance(m, ExpertGate) for m in masks.values())
        or sum(p.numel() * p.element_size() for p in model.parameters()) < AUTO_MIN_BYTES
    ):
        return None
    gate = next((m for m in masks.values() if isinstance(m, BlockGate)), None)
    if gate is not None:
        found = model.get_submodule(gate.list_path)
        assert isinstance(found, nn.ModuleList)
        return found
    try:
        return find_block_list(model, example_inputs)[1]
    except ValueError:
        if checkpoint == "auto":
            return None
        raise ValueError(
            "checkpoint=True: the model has no nn.ModuleList of same-class blocks that run one "
            "after another (each output the next block's input) to recompute in backward; "
            "use checkpoint=False"
        ) from None
