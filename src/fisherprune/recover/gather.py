"""The end of a sharded run: the model's state gathered whole on rank 0, and written as a
plain Hugging Face folder that ``from_pretrained`` loads without fisherprune or FSDP."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fisherprune.export.storage import atomic_directory

__all__ = ["full_state_dict", "save_pretrained_gathered"]


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and persistent buffer of the sharded ``model``, whole and on the CPU,
    on rank 0 (an empty dict on the other ranks). A collective; changes nothing."""
    from torch.distributed.checkpoint.state_dict import (  # slow to import: only when used
        StateDictOptions,
        get_model_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def save_pretrained_gathered(model: nn.Module, folder: Path | str) -> Path | None:
    """Write the sharded Hugging Face ``model`` to ``folder`` with ``save_pretrained``, as a
    plain model of its own class (not FSDP's subclass) that ``from_pretrained`` loads. A
    collective: every rank calls it; rank 0 builds the plain model on the CPU from
    ``model.config`` (memory for one whole copy) and writes the folder, whole or not at all
    (``atomic_directory``). Returns the folder on rank 0, None on the others.

    Raises:
        TypeError: ``model`` is not a Hugging Face model (no ``config`` and
            ``save_pretrained``); save ``full_state_dict(model)`` yourself instead.
    """
    from torch.distributed.fsdp import FSDPModule  # slow to import: only when used

    plain_class = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    if not (hasattr(model, "config") and hasattr(plain_class, "save_pretrained")):
        raise TypeError(
            f"{plain_class.__name__} is not a Hugging Face model (no config / save_pretrained): "
            "gather its weights with full_state_dict(model) and save them yourself on rank 0"
        )
    state = full_state_dict(model)
    if dist.get_rank() != 0:
        return None
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    plain = plain_class(model.config).to(dtype)
    plain.load_state_dict(state)
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(folder) as tmp:
        plain.save_pretrained(tmp)
    return folder
