"""Make ``torch.compile`` tell a masked module from the same module unmasked.

Dynamo does not guard on a module's hook dicts (``torch._dynamo.config.skip_nnmodule_hook_guards``
is on by default, and an empty dict gets no guard at all), so a graph it traced through an
instance of a class with no hooks also passes its guards for another instance of that class
that ``apply_masks`` hooked, and runs without the masks: their products and their signal are
simply not in it. That happens whenever an unmasked instance of the model's class was compiled
first in the process (a dense baseline, an unmasked twin), or the model itself was compiled
before its masks were applied. Measured on torch 2.13: a conv net with two channels zeroed gave
the unmasked outputs under ``torch.compile``, and ``PruningOptimizer`` stopped at its first step
with "received no gradient".

Dynamo does guard, for every module a graph calls, that the module has no instance ``forward``
(``nn.Module.__call__`` looks ``forward`` up on the instance). ``ForwardMark`` sets one, the
class's own ``forward`` bound to the module, so it runs exactly what ran before; a graph traced
without masks then fails its guards on the masked model and is traced again, with them. A module
that already has an instance ``forward`` (a ``NormPoint``, another tool's) is left as it is.
"""

from __future__ import annotations

import types

from torch import nn

__all__ = ["ForwardMark", "mark_hooked"]


class ForwardMark:
    """The class's ``forward`` bound to ``module``, set as its instance ``forward`` when it has
    none. Changes: ``module.__dict__["forward"]``; ``remove`` deletes it again (the holder calls
    it with the hooks' handles)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.bound: types.MethodType | None = None
        if "forward" not in module.__dict__:
            self.bound = types.MethodType(type(module).forward, module)
            module.forward = self.bound  # type: ignore[method-assign]

    def remove(self) -> None:
        """Give the module back its class's ``forward`` (only if the mark is still there)."""
        if self.bound is not None and self.module.__dict__.get("forward") is self.bound:
            del self.module.forward
        self.bound = None


def mark_hooked(model: nn.Module) -> list[ForwardMark]:
    """A ``ForwardMark`` on ``model`` and every submodule with a forward hook or pre-hook and
    no instance ``forward``. The model's own hooks run outside a graph compiled from it, but
    inside one compiled from a wrapper (``DistributedDataParallel``, a pooling head around
    it). Called by ``apply_masks`` after every hook it adds (mask points, registered module
    forwards, block and expert gates); a module another tool hooked is marked too, which
    changes nothing it runs. Changes: those modules' ``__dict__``."""
    return [
        ForwardMark(mod)
        for mod in model.modules()
        if (mod._forward_pre_hooks or mod._forward_hooks) and "forward" not in mod.__dict__
    ]
