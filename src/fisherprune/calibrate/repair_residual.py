"""The residual a repaired layer's output is added to (``ResidualWatch``).

In a residual network a layer's output ``o`` is often added straight to the stream it
branches off, ``z = r + o`` (a transformer's attention and FFN output projections; BERT's
post-LN ``LayerNorm(o + r)``, Llama's pre-LN ``r + o``). Pruning moves the stream too: the
pruned model's ``r_p`` differs from the dense ``r_d``. Fitting ``o`` to the dense ``o_d``
leaves that drift in place; fitting it to ``o_d + r_d - r_p`` makes the sum, which is what
the rest of the model reads, match the dense one (Kwon et al. 2022 fit their mask scales to
this target). A function mode sees every ``add`` of the forward and reports the other operand
of an add that takes a watched layer's output (by identity: the tensor the layer returned,
unchanged; an add with ``alpha``, a subtraction or a product is not a residual add).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["ResidualWatch"]

#: functions that add two tensors as ``a + b``
_ADDS = frozenset(
    {torch.add, Tensor.add, Tensor.add_, Tensor.__add__, Tensor.__radd__, Tensor.__iadd__}
)


class ResidualWatch(TorchFunctionMode):
    """While active, calls ``seen(key, other)`` before any add of a watched output ``out``
    (``watch(key, out)``) and a tensor ``other`` of the same shape; the output is then no longer
    watched (one residual per call of the layer). Changes nothing in the forward it watches."""

    def __init__(self, seen: Callable[[Any, Tensor], None]) -> None:
        super().__init__()
        self.seen = seen
        #: (key, weak reference to the output): an output no add takes (a query projection's,
        #: a language model's logits) is freed when the forward lets go of it, not held to the
        #: end of the pass (``stages`` watches every fitted layer of a whole forward)
        self.watched: list[tuple[Any, weakref.ref[Tensor]]] = []

    def watch(self, key: Any, out: Tensor) -> None:
        """Report the next add that takes ``out`` (held by weak reference: an add that takes it
        holds it alive itself)."""
        self.watched.append((key, weakref.ref(out)))

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.watched and func in _ADDS and len(args) == 2 and not kwargs:
            self._check(*args)
        return func(*args, **kwargs)

    def _check(self, a: Any, b: Any) -> None:
        self.watched = [(key, ref) for key, ref in self.watched if ref() is not None]
        for i, (key, ref) in enumerate(self.watched):
            out = ref()
            other = b if a is out else a if b is out else None
            if out is not None and isinstance(other, Tensor) and other.shape == out.shape:
                del self.watched[i]
                self.seen(key, other)
                return
