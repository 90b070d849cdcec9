"""A half-precision model's outputs computed in float32 without widening the model whole.

``shrink`` checks a bf16 / fp16 model against its shrunk copy in float32 (their different sums
round apart by more than any fixed tolerance in half precision, issue 36). Converting every
weight to float32 for that forward held the weights three times over at its peak (the float32
values are twice the half-precision bytes), which made ``apply_masks`` on a bf16 decoder peak
far above 1.3 times its weights (issue 33). Here the model is left as it is: while the forward
runs, every torch call that is handed one of the model's half-precision parameters or buffers
gets a float32 copy of it instead, made for that call and freed after it, and reading such a
tensor's ``dtype`` gives float32 (code that casts to its weight's dtype then stays in float32).
The float32 values are those of the widened model exactly (float32 holds every half-precision
value), so the outputs are the same, while at most one call's weights are held in float32.

A model whose forward does not run so (a tensor the code reaches by a path no torch call sees)
is run again on the model widened in place, as before, so the outcome never depends on which
of the two ran.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from fisherprune._errors import first_line
from fisherprune.inputs import eval_outputs

__all__ = ["HALF", "float32_outputs", "is_half_precision"]

log = logging.getLogger(__name__)

#: the dtypes a model is widened from
HALF = (torch.float16, torch.bfloat16)
_DTYPE = torch.Tensor.dtype.__get__


def _half_tensors(model: nn.Module) -> dict[int, Tensor]:
    """The model's fp16 / bf16 parameters and buffers by ``id`` (a tied tensor once)."""
    return {id(t): t for t in [*model.parameters(), *model.buffers()] if t.dtype in HALF}


def is_half_precision(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is fp16 or bf16."""
    return bool(_half_tensors(model))


class _ReadWidened(TorchFunctionMode):
    """Inside it, the tensors of ``held`` reach every torch call as float32 copies."""

    def __init__(self, held: dict[int, Tensor]) -> None:
        super().__init__()
        self.held = held

    def _widen(self, x: Any) -> Any:
        return x.float() if isinstance(x, Tensor) and self.held.get(id(x)) is x else x

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func == _DTYPE and args and self.held.get(id(args[0])) is args[0]:
            return torch.float32
        args, kwargs = tree_map(self._widen, (args, kwargs or {}))
        return func(*args, **kwargs)


@contextmanager
def _widened_whole(model: nn.Module) -> Iterator[None]:
    """``model``'s fp16 / bf16 parameters and buffers hold float32 values for the block, in
    place (the same ``Parameter`` objects), and their own dtype again after it."""
    held = list(_half_tensors(model).values())
    dtypes = [t.dtype for t in held]
    try:
        with torch.no_grad():
            for t in held:
                t.data = t.data.float()
        yield
    finally:
        with torch.no_grad():
            for t, dtype in zip(held, dtypes, strict=True):
                t.data = t.data.to(dtype)


def float32_outputs(model: nn.Module, inputs: Any) -> list[Tensor]:
    """``eval_outputs(model, inputs)`` with every fp16 / bf16 parameter and buffer of
    ``model`` read as float32 (``inputs`` as given: widen them first). Changes nothing: the
    model's tensors keep their dtype and values, and only one call's weights are held in
    float32 at a time; where the forward cannot run so, it runs on the model widened in place
    and put back (the same outputs, at the cost of a float32 copy of every weight)."""
    held = _half_tensors(model)
    try:
        with _ReadWidened(held):
            return eval_outputs(model, inputs)
    except Exception as e:  # a tensor reached around the torch calls: widen it all
        log.debug("float32 outputs read call by call failed (%s); widening whole", first_line(e))
    with _widened_whole(model):
        return eval_outputs(model, inputs)
