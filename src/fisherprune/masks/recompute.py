"""What masks must know of activation checkpointing (``fisherprune.calibrate.checkpoint``).

Two flags of this thread. ``checkpointing()``: a signal pass runs with its repeated blocks
checkpointed, so no mask may alias its input (an aliasing product holds its input for the
backward outside the saved tensors that checkpointing drops and recomputes).
``recomputing()``: a block's forward is being run again in backward to rebuild its saved
tensors; the masks inside it then change no state (no pass is closed, nothing is warned about),
so that nothing is counted twice. Any forward the autograd engine runs within a backward counts
too: the recomputation of a block the model's own code checkpoints (``torch.utils.checkpoint``;
a ``torch.compile`` of such a model runs those blocks eager, their masks' effects being more
than a checkpoint region may have).

The backward, and so the recomputation, may run on another thread than the forward: CUDA's
autograd engine runs it on a thread of the device. ``recomputing_on`` therefore raises both
flags on the thread it is entered on, so that the recomputed forward makes the same choices
(no aliasing) as the first one did.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["checkpointing", "checkpointing_on", "recomputing", "recomputing_on"]


class _Flags(threading.local):
    """This thread's nesting counts (class defaults: no ``getattr`` fallback on each read,
    which the masks make at every forward)."""

    checkpointing = 0
    recomputing = 0


_state = _Flags()
#: the id of the backward the autograd engine runs on this thread, -1 outside one (the call
#: ``torch.utils.checkpoint`` makes; where a torch lacks it, only ``recomputing_on`` counts)
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def checkpointing() -> bool:
    """Whether a checkpointed signal pass runs on this thread."""
    return _state.checkpointing > 0


def recomputing() -> bool:
    """Whether a checkpointed block's forward is being recomputed on this thread: inside
    ``recomputing_on``, or run by the autograd engine within a backward."""
    return _state.recomputing > 0 or _graph_task_id() != -1


@contextlib.contextmanager
def _raised(flag: str) -> Iterator[None]:
    setattr(_state, flag, getattr(_state, flag) + 1)
    try:
        yield
    finally:
        setattr(_state, flag, getattr(_state, flag) - 1)


def checkpointing_on() -> contextlib.AbstractContextManager[None]:
    """``checkpointing()`` is True inside the block (nests)."""
    return _raised("checkpointing")


@contextlib.contextmanager
def recomputing_on() -> Iterator[None]:
    """``recomputing()`` and ``checkpointing()`` are True inside the block, on the thread
    entering it (nests)."""
    with _raised("checkpointing"), _raised("recomputing"):
        yield
