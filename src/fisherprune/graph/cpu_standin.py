"""Run a model's forward on the CPU whatever device it lives on, without copying the module.

The tracer must see the operators a CPU dispatches: on a GPU the same network reaches the
dispatcher as other operators (``cudnn_batch_norm`` for ``native_batch_norm``, the flash,
memory-efficient or cuDNN attention kernels for SDPA's CPU kernel, ``_fused_rms_norm``), and
what the trace finds (groups, where masks act, costs) must be a property of the network, not
of its device. ``on_cpu`` swaps a CPU copy of every parameter and buffer that lives elsewhere
into the module's own slots for the duration of a block, and puts the originals back after
it, also when the block raises. The modules stay the same objects, so their names, hooks and
masks are the ones the caller knows.

A model on the ``meta`` device has no values to copy: its stand-in holds ones (zeros for
integer tensors), enough for a trace, which reads shapes, not values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from fisherprune.inputs import Inputs

__all__ = ["on_cpu"]

CPU = torch.device("cpu")


def _cpu_copy(t: Tensor) -> Tensor:
    """A CPU tensor with ``t``'s shape, dtype and values (ones or zeros for ``meta``)."""
    if t.device.type == "meta":
        fill = 1 if t.is_floating_point() or t.is_complex() else 0
        copy = torch.full(t.shape, fill, dtype=t.dtype, device=CPU)
    else:
        copy = t.detach().to(CPU, copy=True)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(copy, requires_grad=t.requires_grad)
    return copy


@contextlib.contextmanager
def on_cpu(model: nn.Module, inputs: Inputs) -> Iterator[Inputs]:
    """Inside the block, every parameter and buffer of ``model`` is on the CPU; yields the
    inputs moved there too. Tensors already on the CPU are used as they are (a CPU model is
    not copied at all); tensors shared by several modules (tied weights) share one copy.

    Changes: for the block's duration only, the entries of the modules' ``_parameters`` and
    ``_buffers`` that live off the CPU (restored afterwards, the same objects as before).
    """
    copies: dict[int, Tensor] = {}

    def cpu(t: Tensor) -> Tensor:
        if t.device.type == "cpu":
            return t
        got = copies.get(id(t))
        if got is None:
            got = copies[id(t)] = _cpu_copy(t)
        return got

    swapped: list[tuple[dict[str, Tensor | None], str, Tensor]] = []
    try:
        with torch.no_grad():
            for mod in model.modules():
                for slots in (mod._parameters, mod._buffers):
                    for name, t in slots.items():
                        if t is not None and t.device.type != "cpu":
                            swapped.append((slots, name, t))
                            slots[name] = cpu(t)
        moved = inputs.map_leaves(lambda x, _b: cpu(x) if isinstance(x, Tensor) else x)
        yield moved
    finally:
        for slots, name, t in reversed(swapped):
            slots[name] = t
