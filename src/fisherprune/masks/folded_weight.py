"""One weight whose pruned columns are zeroed in place, with its gradient filtered to match.

A mask folded into a layer (``MaskPoint._fold``, ``RecurrentUnits``) zeroes the weight's
columns that read pruned channels and adds a gradient hook that zeroes their gradient too.
Both belong to one tensor: a deep copy of the model (an EMA, a teacher), a model saved whole
and loaded, or ``load_state_dict(assign=True)`` holds new weight tensors, which carry neither
(PyTorch copies no tensor hooks), and ``torch.func.functional_call`` puts other tensors in the
weight's place for one call. ``FoldedWeight`` therefore looks, at each fold, whether the
weight it is handed carries its hook (hooking it when it does not and requires grad, leaving
the hooks of other tensors in place: the model's own weight keeps its filter while a
``functional_call`` runs on other tensors) and whether it is the tensor it zeroed last, at the
version it left it (zeroing it again when not). It holds that tensor strongly, never by weak
reference, which would stop ``torch.utils.swap_tensors`` (``model.to`` with
``torch.__future__.set_swap_module_params_on_conversion``, FSDP2) from swapping it; after
such a swap the tensor's hooks stay with its former contents, and it is hooked again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["FoldedWeight"]


class FoldedWeight:
    """Keeps one weight's pruned columns zero and its gradient filtered.

    ``grad_filter``: the gradient hook (the gradient with the pruned columns zeroed); it must
    pickle (a bound method or a ``functools.partial`` of one), since a model is saved whole
    with its masks. Copied and pickled without the tensors it acted on: the copy acts again on
    its own model's weight at its next ``zero``.
    """

    def __init__(self, grad_filter: Callable[[Tensor], Tensor]) -> None:
        self.grad_filter = grad_filter
        #: the hooks it added, on whichever tensors, each with the tensor's impl (``_cdata``)
        self._handles: list[tuple[Any, int]] = []
        self._zeroed: Tensor | None = None  # the tensor it zeroed last
        self._version = -1  # of that tensor when it zeroed it

    def __getstate__(self) -> dict[str, Any]:
        return {"grad_filter": self.grad_filter}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["grad_filter"])  # type: ignore[misc]

    def zero(self, w: Tensor, keep: Tensor) -> None:
        """Make ``w``'s pruned columns zero (``keep``: 1 for a kept column, 0 for a pruned one,
        broadcastable to ``w``) and, if ``w`` requires grad, see that its gradient is filtered.
        Changes ``w`` in place only when it was written since it was last zeroed (an optimizer
        step, a load) or is another tensor; no host read."""
        if w.requires_grad:
            self._hook(w)
        if w is not self._zeroed or w._version != self._version:
            with torch.no_grad():
                # an in-place product by the 0/1 columns: no read-back, no host sync, and
                # about 10x faster on CPU than index_fill_ along dim 1 (strided writes)
                w.mul_(keep.to(device=w.device, dtype=w.dtype))
            self._zeroed, self._version = w, w._version

    def _hook(self, w: Tensor) -> None:
        """See that ``w`` carries this filter among its gradient hooks, on the impl it has now
        (its ``_cdata``): ``torch.utils.swap_tensors`` leaves the tensor's hook dict with it
        but its hooks act on its former impl; setting the dict again hooks it to the new one."""
        hooks = getattr(w, "_backward_hooks", None)
        ours = hooks is not None and any(h is self.grad_filter for h in hooks.values())
        if ours and any(c == w._cdata for _, c in self._handles):
            return
        self._handles = [(h, c) for h, c in self._handles if h.hooks_dict_ref() is not None]
        if not ours:
            self._handles.append((w.register_hook(self.grad_filter), w._cdata))
            return
        w._backward_hooks = hooks  # (swapped: the setter hooks the dict to this impl)
        handle = next((h for h, _ in self._handles if h.hooks_dict_ref() is hooks), None)
        if handle is not None:
            self._handles.append((handle, w._cdata))

    def stale(self) -> None:
        """The pruned columns changed: zero them again at the next ``zero``."""
        self._zeroed, self._version = None, -1

    def remove(self) -> None:
        """Remove every gradient hook it added; the weights are left as they are."""
        for h, _ in self._handles:
            h.remove()
        self._handles = []
        self.stale()
