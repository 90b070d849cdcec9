"""A spy on every way a tensor's values reach the host (``.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``bool()``, ``float()``, ``int()``), recording the calls that fisherprune's own
code makes. On a GPU each of them waits for the device, so none may happen inside a training
step; on this CPU the spy sees the same calls that would wait there.

A call counts when the function that makes it is in the fisherprune package (calls that torch
makes itself, e.g. an optimizer reading its step count, are torch's). Two kinds are told apart
rather than counted:

* ``prune_time``: calls made while ``PruningOptimizer`` chooses what to prune (a prune step
  reads the signals, as it must);
* the read of the finiteness flags that ``PendingFlags.read`` makes once ``ready()`` says their
  copy landed in host memory: a read of host memory, which waits for nothing. It is not recorded;
* the read of a ``PackedSequence`` 's step sizes in ``row_tracker.host_sizes``, which PyTorch
  keeps in host memory whatever the data's device (the function checks it): not recorded.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import fisherprune
from fisherprune.signals import gather

PACKAGE = Path(fisherprune.__file__).resolve().parent
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
#: the function whose calls are the prune decision (and its frames below)
PRUNE_DECISION = "_maybe_prune"
#: the function that reads a PackedSequence's step sizes, which live in host memory
HOST_SIZES = "host_sizes"


class HostReads:
    """Records, while ``active``, each host read made by fisherprune's code, as
    ``"<attr> at <path in the package>:<line> (<function>)"``: in ``step`` outside the prune
    decision, in ``prune_time`` inside it."""

    def __init__(self) -> None:
        self.active = False
        self.step: list[str] = []
        self.prune_time: list[str] = []

    def spy(self, attr: str, original: Callable[..., Any]) -> Callable[..., Any]:
        """``original`` (a ``torch.Tensor`` method), recording the call first."""

        def spied(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.active:
                self.record(attr, t, inspect.currentframe())
            return original(t, *args, **kwargs)

        return spied

    def record(self, attr: str, t: torch.Tensor, here: FrameType | None) -> None:
        caller = here.f_back if here is not None else None
        if caller is None:
            return
        path = Path(caller.f_code.co_filename).resolve()
        if not path.is_relative_to(PACKAGE) or _landed_flags(t, caller):
            return
        if caller.f_code.co_name == HOST_SIZES and t.device.type == "cpu":
            return
        where = f"{attr} at {path.relative_to(PACKAGE)}:{caller.f_lineno} ({caller.f_code.co_name})"
        frames = [caller]
        while frames[-1].f_back is not None:
            frames.append(frames[-1].f_back)  # type: ignore[arg-type]
        pruning = any(f.f_code.co_name == PRUNE_DECISION for f in frames)
        (self.prune_time if pruning else self.step).append(where)

    @contextmanager
    def watching(self) -> Iterator[HostReads]:
        """Record inside the block, starting from empty lists."""
        self.step, self.prune_time, self.active = [], [], True
        try:
            yield self
        finally:
            self.active = False


def _landed_flags(t: torch.Tensor, caller: FrameType) -> bool:
    """Whether ``t`` is the host copy of finiteness flags read by ``PendingFlags.read`` after
    its copy landed."""
    owner = caller.f_locals.get("self")
    return isinstance(owner, gather.PendingFlags) and t is owner.flags and owner.ready()


@contextmanager
def spied_tensor_reads() -> Iterator[HostReads]:
    """Patch the read-back methods of ``torch.Tensor`` for the block (restored after it);
    the spy records only inside ``HostReads.watching()``."""
    reads = HostReads()
    originals = {attr: getattr(torch.Tensor, attr) for attr in READS}
    for attr, original in originals.items():
        setattr(torch.Tensor, attr, reads.spy(attr, original))
    try:
        yield reads
    finally:
        for attr, original in originals.items():
            setattr(torch.Tensor, attr, original)
