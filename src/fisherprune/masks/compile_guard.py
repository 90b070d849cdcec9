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
(``nn.Module.__call__`` looks ``forward`` up on the instance), and what one it has. A
``ForwardMark`` is such an instance ``forward``: at each call it runs what ran before (an
instance ``forward`` another tool set, else the class's ``forward``, looked up at the call, so
that a later patch of the class is seen), so a graph traced without masks fails its guards on
the masked model and is traced again, with them. A bound method would not do: dynamo checks the
function behind it, which an unmasked instance given the same method by another tool shares.
A ``NormPoint`` is a mark too, one that also normalises the kept channels.

A copy that shares the module's ``__dict__`` (``copy.copy``, ``nn.DataParallel``'s replicas)
shares its marks, hooks and masks with it, so it runs as the original: such copies are not
supported (``copy.deepcopy`` and ``DistributedDataParallel`` are).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["ForwardMark", "mark_hooked"]


class ForwardMark:
    """Stands in for ``module.forward`` (an instance attribute) and, at each call, runs the
    instance ``forward`` that was there before, else the class's ``forward``.

    Changes: sets ``module.forward`` to this mark; ``remove`` puts back what was there.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._before: Callable[..., Any] | None = module.__dict__.get("forward")
        module.forward = self  # type: ignore[method-assign]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._before is not None:
            return self._before(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def _target(self) -> Callable[..., Any]:
        """What a call runs now, as a callable of the call's arguments."""
        if self._before is not None:
            return self._before
        return types.MethodType(type(self.module).forward, self.module)

    @property
    def __signature__(self) -> inspect.Signature:
        """The signature of what a call runs (``inspect.signature(model.forward)`` is read
        by Hugging Face's ``Trainer`` and ``generate`` to pick the inputs a model takes)."""
        return inspect.signature(self._target())

    @property
    def __name__(self) -> str:
        return getattr(self._target(), "__name__", "forward")

    def remove(self) -> None:
        """Give the module back its forward (``nn.Module`` hooks' ``remove``, for the holder)."""
        if self.module.__dict__.get("forward") is self:
            del self.module.forward
            if self._before is not None:
                self.module.forward = self._before  # type: ignore[method-assign]


def mark_hooked(model: nn.Module) -> list[ForwardMark]:
    """A ``ForwardMark`` on ``model`` and every submodule with a forward hook or pre-hook,
    unless its ``forward`` is one already (a ``NormPoint``). The model's own hooks run outside
    a graph compiled from it, but inside one compiled from a wrapper
    (``DistributedDataParallel``, a pooling head around it). Called by ``apply_masks`` after
    every hook it adds (mask points, registered module forwards, block and expert gates); a
    module another tool hooked is marked too, which changes nothing it runs. Changes: those
    modules' ``__dict__``."""
    return [
        ForwardMark(mod)
        for mod in model.modules()
        if (mod._forward_pre_hooks or mod._forward_hooks)
        and not isinstance(mod.__dict__.get("forward"), ForwardMark)
    ]
