"""Mode switches that give the model back as it was."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["eval_mode"]


@contextlib.contextmanager
def eval_mode(*models: object) -> Iterator[None]:
    """Put every given ``nn.Module`` in eval mode for the block, then give each of its
    submodules back its own ``training`` flag, also when the block raises.

    ``eval()`` is called on each model (a module may override ``train``); objects that are not
    an ``nn.Module`` with a ``training`` flag (a plain callable, a frozen TorchScript module)
    are left alone.

    Example:
        >>> with eval_mode(net), torch.no_grad():
        ...     out = net(x)
    """
    modules = [m for model in models if isinstance(model, nn.Module) for m in model.modules()]
    flags = {m: m.training for m in modules if isinstance(getattr(m, "training", None), bool)}
    try:
        for model in models:
            if isinstance(model, nn.Module) and model in flags:
                model.eval()
        yield
    finally:
        for m, flag in flags.items():
            m.training = flag
