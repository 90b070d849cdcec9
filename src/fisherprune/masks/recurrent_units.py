"""The hidden units of a recurrent layer (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``), masked inside its
recurrence.

Hidden unit j of every layer and direction is one channel (``nn.LSTM`` has one hidden size for
all of them; ``fisherprune.graph.module_forwards`` ties them). A removed unit must be absent
from every step: its state is multiplied by the mask after each step, so that no later step, no
layer above and no reader of the outputs sees it, as in the shrunk layer, which has no such
unit. ``RecurrentUnits``, which ``apply_masks`` sets as the layer's instance ``forward``, does
that. While the unit mask is all ones and no signal is collected, the layer's own forward (its
fused kernel) runs untouched. While a signal is collected (or the mask requires grad, as under
``torch.func``), the output is computed again step by step
(``fisherprune.recurrent.recurrent_forward``), in place of the layer's own forward, with the
mask acting on each step's state (and, in an LSTM with ``proj_size``, the cells' mask on each
step's cells' outputs before the projection), which also gathers the Fisher signal there (each
step's per-example gradient, summed over the steps before squaring, as for any mask applied at
several places). Once units are removed and no signal is collected, their columns in the
weights that read them (the recurrent weights of every layer and direction, the input weights
of the layers above) are zeroed instead, with their gradients, as ``MaskPoint`` folds a linear
layer's input: no other unit, step or layer then sees a removed unit, and the fused kernel
keeps running (its outputs at a removed unit are read by no one: the layers reading them
outside mask them).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from fisherprune.masks import tracing
from fisherprune.masks.compile_guard import InstanceForward
from fisherprune.masks.folded_weight import FoldedWeight
from fisherprune.masks.layer import MaskLayer, all_ones, buffers_key
from fisherprune.masks.points import MaskPoint, to_device
from fisherprune.masks.row_tracker import host_sizes
from fisherprune.modes import eval_mode
from fisherprune.recurrent import recurrent_forward

__all__ = ["RecurrentUnits"]

_SIGNATURE = inspect.signature(lambda input, hx=None: None)

#: a masked set of a recurrent layer's units: the mask, the mask entry of each unit, and for
#: each of the layer's weights whose columns read the units (by local name) the mask entry of
#: each column
Units = tuple[MaskLayer, np.ndarray, dict[str, np.ndarray]]


class RecurrentUnits(InstanceForward):
    """Stands in for the ``forward`` of ``module``, masking its hidden units (``units``: the state
    each step makes, an LSTM's projected units where it has ``proj_size``) and, for such an
    LSTM, its cells (``cells``: their outputs, before the projection), either may be None:
    it folds removed ones into the weights once pruning is over and runs the layer's own
    forward, or runs the layer step by step while a signal is gathered. The fold's gradient
    hooks go with ``release`` (``remove_masks`` calls it). ``foldable``: False within
    ``no_fold`` (the weights are left as they are; the step-by-step path is used instead).
    ``mask_initial``: whether a given initial hidden state is masked here too (False where a
    mask point on the layer's second input already masks it).

    Changes: sets ``module.forward`` (an instance attribute) to this object; ``remove`` puts
    back what was there before."""

    def __init__(
        self,
        name: str,
        module: nn.RNNBase,
        units: Units | None,
        cells: Units | None = None,
    ) -> None:
        #: (mask, its point, the columns reading it by weight) of the state each step makes
        #: (an LSTM's projected units where it has ``proj_size``), then of such an LSTM's cells
        self.parts: list[tuple[MaskLayer, MaskPoint, dict[str, Tensor]]] = []
        self.points: list[MaskPoint | None] = []
        for part, size in (
            (units, module.proj_size or module.hidden_size),
            (cells, module.hidden_size),
        ):
            if part is None:
                self.points.append(None)
                continue
            mask, channels, columns = part
            point = MaskPoint(name, 0, 1, size, [(mask, np.arange(size), channels)])
            cols = {p: torch.as_tensor(c, dtype=torch.long) for p, c in columns.items()}
            self.parts.append((mask, point, cols))
            self.points.append(point)
        self.masks = [m for m, _, _ in self.parts]
        self.foldable = True
        #: whether the hook masks a given initial state too (no mask point on the layer's
        #: second positional input does: a state passed as a tuple, or by keyword)
        self.mask_initial = True
        self.cache: dict[str, Any] = {}
        self._keep: dict[str, Tensor] = {}  # 1 for a kept column, by weight
        self._fold_key: tuple[int, ...] | None = None
        self._weights = {
            p: FoldedWeight(functools.partial(self._filter, p))
            for _, _, cols in self.parts
            for p in cols
        }
        #: the dtype the layer's own forward runs in, by autocast setting (``_autocast_dtype``)
        self._dtypes: dict[tuple[Any, ...], torch.dtype] = {}
        #: set by ``remove``: the masks are gone, whoever still calls this forward
        self.removed = False
        super().__init__(module, self)

    def _idle(self) -> bool:
        return all_ones(self.masks, self.cache) and not any(
            m.mask.requires_grad for m in self.masks
        )

    def _gathering(self) -> bool:
        """Whether this call gathers a signal of the layer (or a mask is differentiated, as
        under ``torch.func``): the masks must then act on every step."""
        grad = torch.is_grad_enabled()
        return any((grad and m.collecting) or m.mask.requires_grad for m in self.masks)

    def _may_fold(self) -> bool:
        """Whether removed units may be zeroed in the weights: not while a mask still collects
        (pruning is not over: a forward without gradients between signal passes, as a norm
        re-estimate runs, must not change the weights), nor within ``no_fold``."""
        return self.foldable and not any(m.collecting or m.mask.requires_grad for m in self.masks)

    @property
    def __signature__(self) -> inspect.Signature:
        """The layer's own (``inspect.signature(lstm.forward)`` reads what it read unmasked)."""
        return inspect.signature(self.forward_before())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The layer's forward: its own (the fused kernel), after zeroing removed units'
        columns once pruning is over; or, while the units' signal is gathered (or units are
        removed and may not be folded), the layer step by step with the mask on each step's
        state, in place of its own forward rather than after it."""
        if self.removed or tracing.active() is not None:
            return self.call_before(*args, **kwargs)  # (the tracer follows its own forward)
        if not self._gathering():
            if self._idle():
                return self.call_before(*args, **kwargs)
            if self._may_fold():
                self._fold(self.module)
                return self.call_before(*args, **kwargs)
        bound = _SIGNATURE.bind(*args, **kwargs)
        x, hx = bound.arguments["input"], bound.arguments.get("hx")
        return recurrent_forward(
            self.module,  # type: ignore[arg-type]
            x,
            hx,
            step_hook=self._hook(0),
            hook_initial=self.mask_initial and hx is not None and self.points[0] is not None,
            project_at_once=True,
            dtype=self._autocast_dtype(x, hx),
            cell_hook=self._hook(1) if self.points[1] is not None else None,
        )

    def _autocast_dtype(self, x: Tensor | PackedSequence, hx: Any) -> torch.dtype | None:
        """The dtype the layer's own forward gives under autocast (None where autocast is off
        on the input's device): read off the layer's own forward (in eval mode: no dropout
        draw) on one step of one sequence given as the call gives its input and state, once
        per autocast setting, kind of input and dtypes. Autocast casts an LSTM's padded input
        on a CPU, not its packed one, nor a GRU's; a GPU's cuDNN every mode's."""
        data = x.data if isinstance(x, PackedSequence) else x
        kind = data.device.type
        if not data.is_floating_point() or not torch.is_autocast_enabled(kind):
            return None
        states = hx if isinstance(hx, tuple) else (hx,) if hx is not None else ()
        packed = isinstance(x, PackedSequence)
        # (PyTorch runs sequences of unequal lengths in a kernel autocast does not cast)
        sizes = host_sizes(x.batch_sizes) if packed else []
        uneven = packed and sizes[0] != sizes[-1]
        key = (
            kind, torch.get_autocast_dtype(kind), packed, uneven, data.dtype,
            self.module.weight_ih_l0.dtype, *(h.dtype for h in states),
        )  # fmt: skip
        got = self._dtypes.get(key)
        if got is None:
            n = 2 if uneven else 1  # sequences in the probe: lengths 2 and 1, or one of 1
            one: Any = data.detach()[:1, :1] if data.dim() == 3 else data.detach()[: 2 * n - 1]
            if packed:
                one = PackedSequence(one, torch.tensor([2, 1] if uneven else [1]))
            if data.dim() == 3 or packed:
                states = tuple(h.detach()[:, :n] for h in states)  # (its batch)
            state = None if not states else states if isinstance(hx, tuple) else states[0]
            with torch.no_grad(), eval_mode(self.module):
                out = self.call_before(one, state)[0]
            got = (out.data if isinstance(out, PackedSequence) else out).dtype
            self._dtypes[key] = got
        return got

    def remove(self) -> None:
        """As ``InstanceForward.remove``; a caller still holding this forward (a tool that
        wrapped the layer's forward after the masks came) gets the layer's own from now on."""
        self.removed = True
        super().remove()

    def traced_cell_hook(self) -> Any:
        """For the tracer (a masked model traced again): the cells' mask, recorded at every
        step, so that the trace sees what removes them (their only read is the projection
        inside the layer); None where the layer has no such mask."""
        return self._hook(1)

    def _hook(self, i: int) -> Any:
        """The step hook of part ``i`` (0: the state, 1: an LSTM's cells): its point's product
        (which gathers the signal), or nothing where the part has no mask."""
        point = self.points[i]
        if point is None:
            return None
        return lambda h, to_examples: point.apply(h, to_examples=to_examples)

    def _refresh(self) -> None:
        """``_keep`` for the mask as it is now (made again only when the mask changed)."""
        key = buffers_key([m._buffers["mask"] for m in self.masks])
        if key == self._fold_key:
            return
        self._keep = {}
        for mask, _, cols in self.parts:
            m = mask.mask.detach()
            kept = torch.cat([m > 0.5, torch.ones(1, dtype=torch.bool, device=m.device)])
            self._keep |= {p: kept[to_device(c, kept.device)].view(1, -1) for p, c in cols.items()}
        self._fold_key = key
        for folded in self._weights.values():
            folded.stale()

    def _fold(self, module: nn.Module) -> None:
        self._refresh()
        for pname, keep in self._keep.items():
            self._weights[pname].zero(getattr(module, pname), keep)

    def _filter(self, pname: str, g: Tensor) -> Tensor:
        """The gradient of weight ``pname`` with the removed units' columns zeroed (for the mask
        as it is now: a unit restored since the fold gets its gradient back)."""
        self._refresh()
        keep = self._keep[pname].to(device=g.device, dtype=g.dtype)
        return g * keep if g.requires_grad else g.mul_(keep)

    def release(self) -> None:
        """Remove the gradient hooks the fold added, if any (``remove_masks``)."""
        for folded in self._weights.values():
            folded.remove()
