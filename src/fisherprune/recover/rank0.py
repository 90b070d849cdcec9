"""Models read once, by rank 0: every other rank builds its copy on the meta device (no
memory for the weights: ``with torch.device("meta"): Model(config)``) and receives its
share of the weights from rank 0 once the model is sharded.

Without it every rank loads the whole model onto its CPU before sharding, so a node of eight
ranks needs eight copies of an 8B model's weights in host memory for a moment. With it, rank
0 holds one whole copy while the shards go out, and the others never more than their shard.

The blocks sharded one by one are found on rank 0 (a forward pass needs real weights) and
sent to the others by name, so that every rank shards the same modules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fisherprune.recover.sharding import find_blocks

__all__ = ["agreed_blocks", "fill_from_rank0", "held_on_meta"]


def _tensors(model: nn.Module) -> chain[Tensor]:
    return chain(model.parameters(), model.buffers())


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on at least one rank (a collective)."""
    t = torch.tensor([int(flag)], device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def held_on_meta(model: nn.Module, what: str) -> bool:
    """Whether any rank built ``model`` on the meta device, which then needs
    ``fill_from_rank0`` (a collective; call it before sharding).

    Raises:
        ValueError: on every rank, when rank 0's copy is on the meta device (rank 0 must
            hold the weights the others receive), a copy is partly on it, or a rank's copy
            differs from rank 0's in a state-dict name, shape or dtype.
    """
    tensors = list(_tensors(model))
    meta = [t.is_meta for t in tensors]
    partly = any(meta) and not all(meta)
    wrong = (dist.get_rank() == 0 and any(meta)) or partly
    if _any_rank(wrong):
        raise ValueError(
            f"the {what} is on the meta device on rank 0, or partly on it on some rank: rank "
            "0 must load the whole model, and the other ranks either load it too or build it "
            "wholly on the meta device (with torch.device('meta'): Model(config))"
        )
    if not _any_rank(any(meta)):
        return False
    _check_layout(model, what)
    return True


def _check_layout(model: nn.Module, what: str) -> None:
    """Every rank's ``model`` has rank 0's state-dict names, shapes and dtypes; else a
    ValueError on every rank naming the first entry that differs."""
    mine = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    sent = [mine if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(sent, src=0)
    theirs: dict[str, Any] = sent[0]  # type: ignore[assignment]
    differ = next(
        (k for k in sorted(theirs.keys() | mine.keys()) if theirs.get(k) != mine.get(k)), None
    )
    bad = [differ]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, bad)
    found = [(r, b[0]) for r, b in enumerate(gathered) if b[0] is not None]
    if found:
        rank, key = found[0]
        raise ValueError(
            f"the {what} built on rank {rank} differs from rank 0's at {key!r}: build it from "
            "the same configuration and dtype as the model rank 0 loads (transformers: "
            "from_config(AutoConfig.from_pretrained(folder)) under torch.device('meta'))"
        )


def agreed_blocks(
    model: nn.Module,
    example: Callable[[], Any],
    block_types: Sequence[type[nn.Module]] = (),
) -> list[nn.Module]:
    """The blocks of ``model`` to shard one by one, found on rank 0 by ``find_blocks`` (on
    ``example()``, called there only) and sent to the other ranks by qualified name, so that
    a copy on the meta device, which cannot run a forward pass, is sharded like rank 0's (a
    collective).

    Raises:
        ValueError: as ``find_blocks``, on rank 0 (the others then fail in the collective).
    """
    names: list[str] | None = None
    if dist.get_rank() == 0:
        where = {id(m): n for n, m in model.named_modules()}
        names = [where[id(b)] for b in find_blocks(model, example(), block_types)]
    sent = [names]
    dist.broadcast_object_list(sent, src=0)
    return [model.get_submodule(n) for n in sent[0] or []]


def fill_from_rank0(
    model: nn.Module,
    whole: dict[str, Tensor] | None,
    device: torch.device,
    *,
    sharded: bool,
) -> None:
    """Give every rank rank 0's weights, after ``held_on_meta`` said some rank needs them: a
    collective, called after sharding (``sharded``) or instead of it (a model replicated
    whole on every rank).

    Changes: ``model`` is on ``device`` on every rank: rank 0's moved there when not sharded,
    the other ranks' meta tensors allocated there (``to_empty``). A sharded model's
    parameters and persistent buffers are then set from ``whole`` (rank 0's
    ``model.state_dict()`` taken before sharding; ignored elsewhere), each rank keeping its
    shard; every other tensor (all of them when not sharded; non-persistent buffers such as
    rotary frequencies) is sent from rank 0 whole.
    """
    if dist.get_rank() != 0:
        model.to_empty(device=device)
    elif not sharded:
        model.to(device)
    if sharded:
        from torch.distributed.checkpoint.state_dict import (  # slow to import: only here
            StateDictOptions,
            set_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        state = whole if dist.get_rank() == 0 and whole is not None else {}
        set_model_state_dict(model, state, options=options)
        sent = model.buffers()
    else:
        sent = _tensors(model)
    with torch.no_grad():
        for t in sent:
            dist.broadcast(t, src=0)
