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
(``nn.Module.__call__`` looks ``forward`` up on the instance), and which function one it has
runs. ``ForwardMark`` gives each hooked submodule one: a method bound to the module, of a
function made for that module, which at each call runs what ran before (an instance
``forward`` another tool set, else the class's ``forward``, looked up at the call so that a
later patch of the class is seen). A graph traced without masks then fails its guards on the
masked model and is traced again, with them. Its function is not the class's (an unmasked
twin given the class's ``forward`` bound to it by another tool would pass the guard), and it
carries the class's signature, name and docstring. Being a bound method, it is what tools that
read ``forward.__func__`` / ``__self__`` / ``__code__`` or rebind a copy's methods expect.

The model itself is not marked: its own hooks run outside a graph compiled from it, and
``torch.export`` and Accelerate read and replace a model's ``forward`` as a function.

A copy that shares the module's ``__dict__`` without rebinding its methods (``copy.copy``,
``nn.DataParallel``'s replicas) shares its hooks and masks with it, so it runs as the
original: such copies are not supported (``copy.deepcopy`` and ``DistributedDataParallel``
are).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["ForwardMark", "InstanceForward", "mark_hooked"]


class InstanceForward:
    """Sets ``forward`` (a callable) as ``module``'s instance ``forward``, keeping the one that
    was there before, if any (``before``). Changes: ``module.__dict__["forward"]``; ``remove``
    puts back what was there (if ``forward`` is still the module's)."""

    def __init__(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        self.module = module
        self.before: Callable[..., Any] | None = module.__dict__.get("forward")
        self.installed = forward
        module.forward = forward  # type: ignore[method-assign]

    def forward_before(self) -> Callable[..., Any]:
        """What ran before, as a callable of a call's arguments: the instance ``forward``
        that was there, else the class's bound to the module."""
        if self.before is not None:
            return self.before
        return types.MethodType(type(self.module).forward, self.module)

    def call_before(self, *args: Any, **kwargs: Any) -> Any:
        """Run what ran before (``forward_before``, without building a method per call)."""
        if self.before is not None:
            return self.before(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def remove(self) -> None:
        """Give the module back its forward (``nn.Module`` hooks' ``remove``, for the holder)."""
        if self.module.__dict__.get("forward") is self.installed:
            del self.module.forward
            if self.before is not None:
                self.module.forward = self.before  # type: ignore[method-assign]


def _runs(before: Callable[..., Any] | None, cls: type) -> Callable[..., Any]:
    """A new function of ``(module, *args, **kwargs)`` running ``before`` (a callable of the
    arguments) or, when there is none, ``type(module).forward``, with ``cls.forward``'s
    signature, name and docstring."""
    if before is None:

        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return type(module).forward(module, *args, **kwargs)

    else:

        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return before(*args, **kwargs)

    target = cls.forward if before is None else before
    forward.__signature__ = inspect.signature(target)  # type: ignore[attr-defined]
    forward.__name__ = getattr(target, "__name__", "forward")
    forward.__doc__ = getattr(target, "__doc__", None)
    return forward


class ForwardMark(InstanceForward):
    """A submodule's instance ``forward`` that runs what ran before: a method bound to it, of
    a function made for it (``_runs``). Changes: ``module.__dict__["forward"]``."""

    def __init__(self, module: nn.Module) -> None:
        before = module.__dict__.get("forward")
        super().__init__(module, types.MethodType(_runs(before, type(module)), module))


def mark_hooked(model: nn.Module) -> list[ForwardMark]:
    """A ``ForwardMark`` on every submodule of ``model`` (not the model) with a forward hook or
    pre-hook, unless an ``InstanceForward`` stands in for its ``forward`` already (a
    ``NormPoint``). Called by ``apply_masks`` after every hook it adds (mask points,
    registered module forwards, block and expert gates); a module another tool hooked is
    marked too, which changes nothing it runs. Changes: those modules' ``__dict__``."""
    return [
        ForwardMark(mod)
        for mod in model.modules()
        if mod is not model
        and (mod._forward_pre_hooks or mod._forward_hooks)
        and not isinstance(mod.__dict__.get("forward"), InstanceForward)
    ]
