"""Keep the masks' buffers out of ``DistributedDataParallel``'s buffer broadcast.

With ``broadcast_buffers=True`` (its default) DDP copies rank 0's buffers into every rank's
at the start of each forward. Masks need no such copy: every rank starts from the same masks
and prunes the same channels, from all-reduced signals. And the copy defeats the caches that
let a training step read nothing back from the device (``MaskLayer.is_all_ones``, the mask
points' multipliers and folded weights): they are keyed on the buffers' versions, and
torch 2.11's broadcast bumps the version of every buffer it writes, so each forward read
each mask back to the host (a CUDA synchronisation per mask per step under DDP; torch 2.13's
broadcast does not bump them, and also writes unseen by those caches).

DDP reads the names it leaves alone from the wrapped module's
``_ddp_params_and_buffers_to_ignore`` when it is built (the attribute its
``_set_params_and_buffers_to_ignore_for_model`` sets; both torch 2.11 and 2.13 read it).
``apply_masks`` adds the buffers of every ``MaskLayer`` in the model it was given (its own
and any placed by hand) to it, so a DDP built around that model afterwards leaves them alone;
``remove_masks`` takes them out again. ``PruningTrainer`` adds them again before it builds
its DDP (a model whose masks were placed by hand, with no ``apply_masks``). A DDP built
around a parent of that model broadcasts them as before, and so does one built before
``apply_masks`` (it sees no mask buffer at all: DDP lists buffers when it is built). The list
also keeps the masks out of the copy from rank 0 that DDP makes once when it is built: ranks
must apply (or load) the same masks, as ``PruningTrainer``'s do (each rank reads the same
checkpoint on ``--resume``).
"""

from __future__ import annotations

from torch import nn

from fisherprune.masks.layer import MaskLayer

__all__ = ["IGNORE_ATTR", "BroadcastExclusion", "mask_buffer_names"]

#: the attribute of a module that DDP reads the names of parameters and buffers to leave
#: alone from
IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"


def mask_buffer_names(model: nn.Module) -> list[str]:
    """The qualified names of the buffers of every ``MaskLayer`` in ``model`` (its mask and
    signal, and a gate's)."""
    return [
        f"{name}.{b}" if name else b
        for name, mod in model.named_modules()
        if isinstance(mod, MaskLayer)
        for b, _ in mod.named_buffers(recurse=False)
    ]


class BroadcastExclusion:
    """Adds the buffers of every ``MaskLayer`` in ``model`` to ``model``'s DDP ignore list.
    Changes: ``model._ddp_params_and_buffers_to_ignore`` (made if absent; names already there
    kept). ``remove`` takes back the names it added."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        had = list(getattr(model, IGNORE_ATTR, None) or [])
        self.added = [n for n in mask_buffer_names(model) if n not in had]
        if self.added:  # (a model with no new mask gets no attribute)
            setattr(model, IGNORE_ATTR, had + self.added)

    def remove(self) -> None:
        """Take the names this added out of the ignore list (the attribute goes when empty)."""
        if not self.added:
            return
        left = [n for n in getattr(self.model, IGNORE_ATTR, None) or [] if n not in self.added]
        if left:
            setattr(self.model, IGNORE_ATTR, left)
        elif hasattr(self.model, IGNORE_ATTR):
            delattr(self.model, IGNORE_ATTR)
