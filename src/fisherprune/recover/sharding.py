"""FSDP2 over a model's repeated blocks: ``fully_shard`` on each block, then on the root.

Sharding per block lets FSDP2 gather one block's parameters at a time (forward and backward)
and free them after; the root call takes the parameters left outside the blocks (embeddings,
final norm, output head). The blocks are found as ``masks.blocks.find_block_list`` finds them
for block gates (the longest chain of same-class modules: Hugging Face ``model.model.layers``,
GPT-2 ``transformer.h``), or given by their classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from fisherprune.masks.blocks import find_block_list

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["data_parallel_mesh", "device_of", "find_blocks", "shard_model"]


def data_parallel_mesh() -> DeviceMesh:
    """A one-dimensional mesh over every rank of the default process group: on CUDA devices
    under NCCL (each rank on the GPU ``torch.cuda.current_device()``), on the CPU under gloo.

    Raises:
        RuntimeError: no process group (start the run with torchrun and call
            ``torch.distributed.init_process_group`` or ``train.interrupts.init_distributed``).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "sharded training needs a process group: start it with torchrun and call "
            "torch.distributed.init_process_group (gloo on CPUs, nccl on GPUs) first"
        )
    from torch.distributed.device_mesh import init_device_mesh  # slow to import: only here

    kind = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(kind, (dist.get_world_size(),))


def find_blocks(
    model: nn.Module,
    example_inputs: Any,
    block_types: Sequence[type[nn.Module]] = (),
) -> list[nn.Module]:
    """The modules to shard one by one: the outermost instances of ``block_types`` when given,
    else the model's chain of repeated blocks (one forward pass on ``example_inputs`` in eval
    mode without gradients; the model is left as it was).

    Raises:
        ValueError: ``block_types`` matches no module of ``model``, or (without it) the model
            has no chain of repeated blocks.
    """
    if not block_types:
        return list(find_block_list(model, example_inputs)[1])
    kinds = tuple(block_types)
    found: list[nn.Module] = []
    inside: set[int] = set()  # ids of modules within a block already found
    for m in model.modules():
        if id(m) in inside or not isinstance(m, kinds):
            continue
        found.append(m)
        inside.update(id(s) for s in m.modules())
    if not found:
        names = ", ".join(k.__name__ for k in kinds)
        raise ValueError(
            f"no module of {type(model).__name__} is a {names}: give block_types "
            "that the model holds (its decoder layer class), or none to find them"
        )
    return found


def shard_model(model: nn.Module, blocks: Sequence[nn.Module], mesh: DeviceMesh) -> nn.Module:
    """Shard ``model`` in place over ``mesh``: ``fully_shard`` on each of ``blocks``, then on
    ``model``. Returns ``model``.

    Changes: every parameter of ``model`` becomes a ``DTensor`` holding this rank's shard
    (dim 0), on the mesh's device; ``model``'s class becomes FSDP2's subclass of it.
    """
    from torch.distributed.fsdp import fully_shard  # slow to import: only when used

    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def device_of(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on: its GPU for a CUDA mesh, else the CPU."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
