"""Mask points: masks applied at a module's input by a forward pre-hook.

``apply_masks`` does not touch the model's class or code: it adds one
submodule, ``fisherprune_masks`` (a ``ModuleDict`` of MaskLayers, so masks and
signals are in ``state_dict``), one forward pre-hook per consuming module
that multiplies the module's input channels by the masks, on each norm of a
masked width an instance ``forward`` (``NormPoint``), and on each other hooked
submodule an instance ``forward`` that runs the class's (``ForwardMark``:
``torch.compile`` guards that, not hooks). ``remove_masks`` removes exactly those,
restoring the original model.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from fisherprune.masks import recompute, tracing
from fisherprune.masks.compile_guard import InstanceForward
from fisherprune.masks.compiled import (
    SignalOwner,
    compiled_product,
    compiling,
    covers_in_order,
)
from fisherprune.masks.folded_weight import FoldedWeight
from fisherprune.masks.layer import (
    CallFlags,
    MaskLayer,
    all_ones,
    buffers_key,
    gather_through,
    gathering_enabled,
    log_input_changed,
)
from fisherprune.masks.norm_points import NormPoint
from fisherprune.masks.output_points import OutputMasks
from fisherprune.masks.row_tracker import BatchProbe, RowScope, packed_rows, to_examples
from fisherprune.masks.rows import BATCH, PACKED, UNKNOWN, RowLayout

__all__ = [
    "MASKS_ATTR",
    "MaskHolder",
    "MaskPoint",
    "SharedProduct",
    "find_holder",
    "install_mask_points",
    "no_fold",
    "remembered_inputs",
    "remove_mask_points",
]

MASKS_ATTR = "fisherprune_masks"

log = logging.getLogger("fisherprune")


class SharedProduct:
    """The last input that one or more identical mask points multiplied, and the product.

    Points with the same masks, positions and dim (the q, k and v layers of one attention
    block all read the hidden width) share one: when a second of them is handed the very
    tensor the first multiplied, unchanged, it returns the same product, so the per-example
    reduction runs once per tensor rather than once per consumer (autograd sums the
    consumers' gradients before the product's backward). The input is held by weak reference;
    the product of the latest ``put`` on this thread (over every ``SharedProduct``) is held
    strongly until the next one, because a layer whose weight is frozen saves no input for
    its backward, and a product held only weakly would die before the next consumer asks for
    it: so at most one product beyond what the step holds is kept alive.
    """

    __slots__ = ("_key", "_out", "_version", "_x")
    _latest = threading.local()  # .out: the product of this thread's latest put

    def __init__(self) -> None:
        self._x: weakref.ref[Tensor] | None = None
        self._out: weakref.ref[Tensor] | None = None
        self._key: tuple[Any, ...] = ()
        self._version = -1  # of ``_x`` when its product was made

    def __reduce__(self) -> tuple[type[SharedProduct], tuple[()]]:
        """Pickled (``torch.save`` of the whole model) and copied empty: what it remembers
        is one step's, held by weak reference, which cannot be pickled."""
        return SharedProduct, ()

    def get(self, x: Tensor, key: tuple[Any, ...]) -> Tensor | None:
        """The product made from ``x`` under the same ``key``, if it is still alive (never for
        an inference-mode tensor, which has no version counter to tell a change)."""
        if x.is_inference() or self._x is None or self._x() is not x:
            return None
        if self._version != x._version or self._key != key:
            return None
        return self._out() if self._out is not None else None

    def put(self, x: Tensor, key: tuple[Any, ...], out: Tensor) -> Tensor:
        """Remember ``out`` as the product of ``x`` under ``key`` (not for an inference-mode
        ``x``); returns ``out``. Changes: this thread's strongly held product is now ``out``
        (the one it replaces is held weakly only)."""
        if not x.is_inference():
            self._x, self._out, self._key = weakref.ref(x), weakref.ref(out), key
            self._version = x._version
            SharedProduct._latest.out = out
        return out

    @staticmethod
    def release() -> None:
        """Drop this thread's strong hold on the latest product (the end of a pass)."""
        SharedProduct._latest.out = None


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """``t`` (on the host) copied to ``device``; to a GPU from pinned memory without waiting,
    so that even the first step after a move makes no synchronising copy."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class MaskPoint(SignalOwner):
    """Multiplies positional input ``arg`` of a module, along ``dim``, by one or more masks.

    ``parts``: for each mask, the positions of ``dim`` it covers and which of
    its channels each position uses; positions no mask covers are left as they are.
    ``shared``: the ``SharedProduct`` of the points with the same masks, positions and dim
    (default: one of its own).
    ``rows``: how the rows (dim 0, or the dim ``rows.dim``) of the input relate to examples
    (default: row n is example n); ``probe`` and ``scope`` give, at run time, the batch size
    and the rows a module selected by data, for the layouts that need them
    (``fisherprune.masks.row_tracker``). ``flags``: the model's ``CallFlags`` (default: ones
    of its own, never set).
    """

    def __init__(
        self,
        module_name: str,
        arg: int,
        dim: int,
        size: int,
        parts: Sequence[tuple[MaskLayer, np.ndarray, np.ndarray]],
        foldable: bool = False,
        shared: SharedProduct | None = None,
        rows: RowLayout | None = None,
        probe: BatchProbe | None = None,
        scope: RowScope | None = None,
        flags: CallFlags | None = None,
    ) -> None:
        self.module_name = module_name
        self.flags = CallFlags() if flags is None else flags
        self.rows = RowLayout() if rows is None else rows
        self.probe, self.scope = probe, scope
        self._rows_warned = False
        self.shared = SharedProduct() if shared is None else shared
        self.arg, self.dim, self.size = arg, dim, size
        self.parts = [
            (m, torch.as_tensor(p, dtype=torch.long), torch.as_tensor(i, dtype=torch.long))
            for m, p, i in parts
        ]
        self._np_parts = [(m, np.asarray(p), np.asarray(i)) for m, p, i in parts]
        self._parts_on: dict[torch.device, list[tuple[MaskLayer, Tensor, Tensor]]] = {}
        self._vector_cache: tuple[tuple[Any, ...], Tensor] | None = None
        self._direct = covers_in_order(self.parts, size)
        #: channels per mask entry when one mask covers the dim in order, each entry a run of
        #: as many consecutive channels (an attention head's): its gradient is then a view
        #: summed, not a gather and a scatter; else None
        self._block = _block_width(self.parts, size)
        self._masks = list(dict.fromkeys(m for m, _, _ in self.parts))
        self._ones_cache: dict[str, Any] = {}
        #: whether the channels may be removed in the layer's weight once pruning is over
        self.foldable = foldable
        self._fold_key: tuple[int, ...] | None = None  # ``buffers_key`` when ``_keep`` was made
        self._keep: Tensor  # (set by _fold) 1 for a kept input column of the weight, else 0
        self._weight = FoldedWeight(self._filter_grad)  # the layer's weight, once folded
        #: False once an in-place op downstream was seen changing the input (see _MaskMultiply)
        self._alias_ok = True
        #: the key the compiled backward hands the per-example signal by
        #: (``fisherprune.masks.compiled``)
        self.init_owner()

    def parts_on(self, device: torch.device) -> list[tuple[MaskLayer, Tensor, Tensor]]:
        """``parts`` with the position and index tensors on ``device``, copied there once: a
        copy from host memory in every step would make each step wait for a GPU."""
        got = self._parts_on.get(device)
        if got is None:
            got = [(m, to_device(p, device), to_device(i, device)) for m, p, i in self.parts]
            self._parts_on[device] = got
        return got

    def _buffers(self) -> list[Tensor]:
        """The masks' buffers as they are now: read once per call and handed on, from each
        mask's buffer dict (``m.mask`` goes through ``nn.Module.__getattr__``: 0.6 us a read)."""
        return [m._buffers["mask"] for m in self._masks]

    def _vector(self, dtype: torch.dtype, device: torch.device, bufs: list[Tensor]) -> Tensor:
        """The multiplier of each position of the masked dim, shape (size,), for the mask
        buffers ``bufs``; made again only when a mask changed (a step of a pruned model makes
        no small kernels for it)."""
        differentiated = any(b.requires_grad for b in bufs)  # (torch.func)
        key = (dtype, device, *buffers_key(bufs))
        cached = self._vector_cache
        if not differentiated and cached is not None and cached[0] == key:
            return cached[1]
        if self._direct:
            mult = self.parts[0][0].mask.to(dtype=dtype, device=device)
        else:
            mult = torch.ones(self.size, dtype=dtype, device=device)
            for m, pos, idx in self.parts_on(device):
                mult[pos] = m.mask[idx.to(m.mask.device)].to(dtype=dtype, device=device)
        if not differentiated:
            self._vector_cache = (key, mult)
        return mult

    def multiplier(self, x: Tensor, bufs: list[Tensor] | None = None) -> Tensor:
        """The (broadcastable) multiplier for input ``x``; ``bufs``: the masks' buffers, where
        the caller has them already."""
        shape = [1] * x.dim()
        shape[self.dim] = self.size
        bufs = self._buffers() if bufs is None else bufs
        return self._vector(x.dtype, x.device, bufs).view(shape)

    def __call__(self, module: nn.Module, args: tuple) -> tuple | None:
        compiled = compiling()
        if not compiled and self.flags.idle:
            return None  # every mask idle in this call of the model: a no-op, input unread
        packed = args[self.arg] if len(args) > self.arg else None
        if not isinstance(packed, PackedSequence):
            packed = None
        elif self.rows.kind == PACKED:
            args = (*args[: self.arg], packed.data, *args[self.arg + 1 :])  # its data, masked
        if len(args) <= self.arg or not isinstance(args[self.arg], Tensor):
            raise RuntimeError(
                f"fisherprune mask on {self.module_name!r} expects a tensor as positional input "
                f"{self.arg}, as when the masks were applied; got {len(args)} positional inputs"
            )
        x = args[self.arg]
        if x.dim() <= self.dim or x.shape[self.dim] != self.size:
            raise RuntimeError(
                f"fisherprune mask on {self.module_name!r}: input of shape {tuple(x.shape)} has "
                f"no dim {self.dim} of size {self.size}, as traced; call apply_masks again"
            )
        if compiled and packed is None:  # (x in the layer's autocast dtype first, as ``apply``)
            low = _cast_by_autocast(module, x)
            out = compiled_product(self, x if low is None else x.to(low))
            if out is not None:
                return (*args[: self.arg], out, *args[self.arg + 1 :])
        bufs = self._buffers()
        if (
            self.foldable
            and (self.dim == x.dim() - 1 or not isinstance(module, nn.Linear))
            and self._fold(module, bufs)
        ):
            return None  # the pruned channels are zeroed in the layer's weight instead
        if packed is not None:  # rows: steps of the sequences still going, longest first
            out = self.apply(x, bufs, _cast_by_autocast(module, x), packed_rows(packed))
            return (*args[: self.arg], packed._replace(data=out), *args[self.arg + 1 :])
        out = self.apply(x, bufs, _cast_by_autocast(module, x))
        return (*args[: self.arg], out, *args[self.arg + 1 :])

    def _fold(self, module: nn.Module, bufs: list[Tensor]) -> bool:
        """Once pruning is over, zero the weight columns that read pruned channels instead of
        multiplying the input (the same output and gradients): the columns are written again
        only when the weight was written since (its version moved), so a step costs no
        activation-sized product, no read-back and no host sync. ``bufs``: the masks' buffers.
        Returns whether it did so."""
        if (
            any(m.collecting for m in self._masks)
            or any(b.requires_grad for b in bufs)
            or tracing.active() is not None
        ):
            return False  # (masks that require grad, as under torch.func, stay in the graph)
        key = buffers_key(bufs)
        if all_ones(self._masks, self._ones_cache, key):
            return True
        w = module.weight
        if key != self._fold_key:
            shape = [1] * w.dim()
            shape[1] = self.size
            self._keep = (self._vector(w.dtype, w.device, bufs) > 0.5).to(w.dtype).view(shape)
            self._fold_key = key
            self._weight.stale()
        self._weight.zero(w, self._keep)
        return True

    def _filter_grad(self, g: Tensor) -> Tensor:
        """The weight's gradient with the pruned columns zeroed, as the activation mask gives.

        In place: the gradient of a plain conv or linear weight (never tied, see
        ``_shared_weights``) is a fresh kernel output that only the weight's accumulation reads,
        so no copy the size of the weight is made each step. A gradient that is itself
        differentiated (``create_graph=True``) is multiplied out of place."""
        keep = self._keep.to(g.dtype) if self._keep.dtype != g.dtype else self._keep
        return g * keep if g.requires_grad else g.mul_(keep)

    def release(self) -> None:
        """Remove the weight-gradient hook added by folding, if any."""
        self._weight.remove()

    def apply(
        self,
        x: Tensor,
        bufs: list[Tensor] | None = None,
        low: torch.dtype | None = None,
        to_examples: Any = None,
    ) -> Tensor:
        """Return ``x`` times the masks; gathers per-example gradients while collecting.
        ``bufs``: the masks' buffers, where the caller has them already; ``low``: the dtype
        autocast would cast ``x`` to first thing in the consuming layer, or None. ``x`` is
        cast to it before the product, then (the layer's own cast is a no-op on it): a float32
        ``x`` that the product or its backward kept would otherwise stay alive beside the
        half-precision copy the layer saves (on a GPU a LayerNorm's float32 output before
        each q, k, v and MLP input: +11% peak memory on BERT-base). ``to_examples``: the
        reduction of per-row gradients to per-example ones where the caller knows it (a
        ``PackedSequence`` 's rows), else read off the point's row layout."""
        if bufs is None:
            bufs = self._buffers()
        tracer = tracing.active()
        if tracer is not None:
            with tracer.suspended():
                out = x * self.multiplier(x, bufs)
            tracer.record_mask(x, out, self.dim, self._np_parts)
            return out
        grad = torch.is_grad_enabled()
        collect = grad and any(m.collecting for m in self._masks) and gathering_enabled()
        state = buffers_key(bufs)
        ones = all_ones(self._masks, self._ones_cache, state)
        if not collect and ones and not any(b.requires_grad for b in bufs):
            return x  # (masks that require grad, as under torch.func, stay in the graph)
        key = (grad, collect, low, *state)
        out = self.shared.get(x, key)
        if out is not None:
            return out
        given = x
        if low is not None:
            x = x.to(low)
        if not collect:
            return self.shared.put(given, key, x * self.multiplier(x, bufs))
        for m in self._masks:
            m.start_pass()
        ident = ones and self._alias_ok and not recompute.checkpointing()
        # an aliasing product needs no multiplier (unless it must carry the gradient)
        mult = None if ident and x.requires_grad else self.multiplier(x, bufs)
        reduce = self._to_examples(x) if to_examples is None else to_examples
        out = gather_through(x, mult, self, None, self.dim, ident, reduce, self.rows.dim)
        return self.shared.put(given, key, out)

    def _to_examples(self, x: Tensor) -> Any:
        """The reduction of this call's per-row gradients to per-example ones (None: rows are
        examples, or taken for them); says once when the layout cannot be honoured."""
        reduce = to_examples(self.rows.kind, x, self.probe, self.scope)
        if reduce is not False:
            return reduce
        if recompute.recomputing():  # outside the model call; its backward never runs
            return None
        if not self._rows_warned and self.rows.kind != UNKNOWN:
            self._rows_warned = True
            log.warning(
                "mask on %r: its input rows are %s, but this call gives no way to tell which "
                "example each of its %d rows belongs to (the model called other than as a "
                "whole, or a batch that does not divide the rows): each row counts as one "
                "example, so its Fisher signal is approximate",
                self.module_name,
                "tokens of the batch" if self.rows.kind == "tokens" else "selected by data",
                x.shape[0],
            )
        return None

    def input_changed_in_place(self) -> None:
        """Backward found the aliased input changed in place: drop the pass, stop aliasing."""
        self._alias_ok = False
        for m in self._masks:
            m.mark_received()  # the loss does reach these masks
        log_input_changed(f"mask on {self.module_name!r}")

    def accumulate(self, g: Tensor, index: Tensor | None) -> None:
        """Hand each mask the columns of ``g`` (N, size) that it covers (see ``MaskLayer``)."""
        if self._direct:  # one mask covering the dim in order: no copy, no scatter
            if self.parts[0][0].collecting:
                self.parts[0][0].accumulate(g, None)
            return
        if self._block is not None:  # one mask, each entry a run of channels (heads)
            m = self.parts[0][0]
            if m.collecting:
                m.accumulate(g.view(g.shape[0], m.num_channels, self._block).sum(-1), None)
            return
        for m, pos, idx in self.parts_on(g.device):
            if m.collecting:
                m.accumulate(g[:, pos], idx)


#: layers whose input autocast casts to its lower precision (``torch.autocast``'s list)
_LOW_PRECISION_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


#: whether autocast is on for any device: one call, against three for the device's own
#: check, at every masked layer's forward (where a torch lacks it, that check alone)
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def _cast_by_autocast(module: nn.Module, x: Tensor) -> torch.dtype | None:
    """The half-precision dtype autocast casts ``module``'s float32 input ``x`` to, or None
    (not such a layer, not float32, autocast off on ``x``'s device)."""
    if x.dtype != torch.float32 or type(module) not in _LOW_PRECISION_LAYERS:
        return None
    if _any_autocast is not None and not _any_autocast():
        return None
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return None
    low = torch.get_autocast_dtype(kind)
    return low if low in (torch.float16, torch.bfloat16) else None


def _block_width(parts: Sequence[tuple[MaskLayer, Tensor, Tensor]], size: int) -> int | None:
    """Channels per entry when ``parts`` is one mask whose entry ``k`` covers positions
    ``k * w .. (k + 1) * w - 1`` of a dim of ``size`` in order (``w`` > 1), else None."""
    if len(parts) != 1:
        return None
    m, pos, idx = parts[0]
    width = size // m.num_channels
    if width < 2 or width * m.num_channels != size or pos.numel() != size:
        return None
    in_order = torch.equal(pos, torch.arange(size))
    blocked = torch.equal(idx, torch.arange(m.num_channels).repeat_interleave(width))
    return width if in_order and blocked else None


class MaskHolder(nn.ModuleDict):
    """The ``fisherprune_masks`` submodule that ``apply_masks`` adds: the masks by key (so
    masks and signals are in ``state_dict``), plus what is needed to remove them again and to
    trace the model later.

    Attributes:
        points: the ``MaskPoint`` hooked on each consuming module, in install order.
        handles: the forward pre-hook handle of each point, each norm point (which stands in
            for its norm's ``forward``), the ``ForwardMark`` of each other hooked submodule
            (``fisherprune.masks.compile_guard``), the model's ``OutputMasks`` hook and its two
            ``ModelCall`` hooks; ``remove()`` undoes each.
        outputs: the ``MaskPoint`` of each masked output dim, by the output's key path (they
            act through the model's ``OutputMasks`` forward hook, on no module's input).
        example_inputs: a detached batch-of-one copy of the inputs the masks were found with
            (``shrink`` and ``export_model`` trace with it when given none), or None.
        groups: the channel group of each mask, by the mask's qualified name (what
            ``apply_masks`` returns as ``.groups``; criteria that read weights use it).
        recurrent: the hidden-unit hooks of recurrent layers
            (``fisherprune.masks.recurrent_units``).
    """

    def __init__(self, masks: dict[str, MaskLayer]) -> None:
        super().__init__(masks)
        self.points: list[MaskPoint] = []
        self.outputs: dict[str, list[MaskPoint]] = {}
        self.handles: list[torch.utils.hooks.RemovableHandle | InstanceForward] = []
        self.example_inputs: Any = None
        self.groups: dict[str, Any] = {}
        #: the hidden-unit hooks of recurrent layers (``fisherprune.masks.recurrent_units``)
        self.recurrent: list[Any] = []


_FOLD_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


def _foldable(mod: nn.Module, arg: int, dim: int, size: int) -> bool:
    """A plain conv (groups 1) or linear layer whose masked input dim is its weight's dim 1."""
    if type(mod) not in _FOLD_TYPES or arg != 0:
        return False
    w = getattr(mod, "weight", None)
    if not isinstance(w, Tensor) or w.dim() < 2 or w.shape[1] != size:
        return False
    if isinstance(mod, nn.Linear):
        return True  # the input's last dim; ``dim`` is checked against it per call
    return dim == 1 and mod.groups == 1


def _shared_weights(model: nn.Module) -> set[int]:
    """Ids of parameters used by more than one module (tied weights are never folded)."""
    seen: dict[int, int] = {}
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None:
                seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


@contextlib.contextmanager
def no_fold(model: nn.Module) -> Iterator[None]:
    """Within the block, finished masks multiply activations instead of folding into (and so
    changing) the layers' weights: for reading a masked model without touching it."""
    found = find_holder(model)
    points = [*found[1].points, *found[1].recurrent] if found else []
    flags = [mp.foldable for mp in points]
    for mp in points:
        mp.foldable = False
    try:
        yield
    finally:
        for mp, f in zip(points, flags, strict=True):
            mp.foldable = f


def find_holder(model: nn.Module) -> tuple[str, MaskHolder] | None:
    """Where ``apply_masks`` put its masks: ``(qualified name, MaskHolder)``, or None."""
    for name, mod in model.named_modules():
        holder = mod._modules.get(MASKS_ATTR)
        if isinstance(holder, MaskHolder):
            return (f"{name}.{MASKS_ATTR}" if name else MASKS_ATTR), holder
    return None


def remembered_inputs(model: nn.Module, example_inputs: Any = None) -> Any:
    """``example_inputs`` if given, else the batch-of-one copy ``apply_masks`` kept.

    Raises:
        ValueError: none given and the model has no masks from ``apply_masks`` (hand-placed
            MaskLayers keep no inputs).
    """
    if example_inputs is not None:
        return example_inputs
    found = find_holder(model)
    kept = found[1].example_inputs if found else None
    if kept is None:
        raise ValueError(
            "example_inputs are needed to trace this model (only masks added by apply_masks "
            "remember theirs)"
        )
    return kept


def _holder_parent(model: nn.Module, consumers: Sequence[str]) -> nn.Module:
    """The module to hold the masks: the model itself, unless its forward runs every child
    (a root ``nn.Sequential``); then the first consuming layer, whose forward does not."""
    if not isinstance(model, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        return model
    modules = dict(model.named_modules())
    for name in consumers:
        mod = modules[name]
        if not isinstance(mod, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            return mod
    raise ValueError("cannot find a module to hold the masks of this container model")


def install_mask_points(
    model: nn.Module,
    masks: dict[str, MaskLayer],
    points: Sequence[tuple[str, int, int, int, list[tuple[str, np.ndarray, np.ndarray]]]],
    norms: Sequence[tuple[str, int, int, list[tuple[str, np.ndarray, np.ndarray]]]] = (),
    outputs: Sequence[tuple[str, int, int, list[tuple[str, np.ndarray, np.ndarray]]]] = (),
    rows: Sequence[RowLayout] = (),
    output_rows: Sequence[RowLayout] = (),
) -> str:
    """Add ``masks`` as a ``fisherprune_masks`` ModuleDict and hook each point's module.

    The ModuleDict (a ``MaskHolder``) goes on the model itself (on the first consuming layer
    when the model is an ``nn.Sequential``, whose forward would call it). Changes: adds one
    submodule, a forward pre-hook and a forward hook on the model (``ModelCall``), one
    forward pre-hook per point, per norm point ``(module, dim, size, parts)`` a
    ``NormPoint`` as the norm's instance ``forward`` and, when ``outputs`` (``(key path, dim,
    size, parts)`` of model output tensors) is not empty, one forward hook on the model that
    multiplies those outputs (``OutputMasks``); on failure everything added is removed.
    (``apply_masks`` then marks every hooked submodule: ``ForwardMark``.)
    ``rows`` / ``output_rows`` (aligned with ``points`` / ``outputs``; default: dim 0 is the
    batch) say how each point's input rows relate to examples: where some are tokens or rows
    selected by data, also a ``BatchProbe`` (two hooks on the model) and, per module that
    selects rows, a ``RowScope`` (two hooks on it; ``fisherprune.masks.row_tracker``).

    Returns:
        The qualified name of the ModuleDict (``"fisherprune_masks"`` usually).

    Raises:
        ValueError: the model already has ``fisherprune_masks``.
    """
    if find_holder(model) is not None:
        raise ValueError(
            f"the model already has {MASKS_ATTR!r}: call fisherprune.remove_masks(model) first"
        )
    holder = MaskHolder(masks)
    _holder_parent(model, [p[0] for p in points]).add_module(MASKS_ATTR, holder)
    modules = dict(model.named_modules())
    call = ModelCall(list(masks.values()))
    try:
        # before any point's hook (one on the model itself too): registered first
        holder.handles.append(model.register_forward_pre_hook(call.enter))
        shared = _shared_weights(model)
        products: dict[tuple[Any, ...], SharedProduct] = {}
        layouts = list(rows) or [RowLayout()] * len(points)
        out_layouts = list(output_rows) or [RowLayout()] * len(outputs)
        probe = BatchProbe()
        if any(r.kind not in (BATCH, PACKED) for r in (*layouts, *out_layouts)):
            holder.handles.extend(probe.install(model))
        scopes = _row_scopes(holder, modules, layouts, probe)
        for (name, arg, dim, size, parts), layout in zip(points, layouts, strict=True):
            mod = modules[name]
            fold = _foldable(mod, arg, dim, size) and id(mod.weight) not in shared
            same = (
                dim,
                size,
                *((k, np.asarray(p).tobytes(), np.asarray(i).tobytes()) for k, p, i in parts),
            )
            product = products.setdefault(same, SharedProduct())
            masked = [(holder[k], p, i) for k, p, i in parts]
            scope = scopes.get(layout.scope) if layout.scope is not None else None
            mp = MaskPoint(
                name, arg, dim, size, masked, fold, product, layout, probe, scope, call.flags
            )
            holder.points.append(mp)
            holder.handles.append(mod.register_forward_pre_hook(mp))
        for name, scope in scopes.items():  # after the points: they see the masked inputs
            holder.handles.extend(scope.install(modules[name]))
        for name, dim, size, parts in norms:
            masked = [(holder[k], p, i) for k, p, i in parts]
            holder.handles.append(NormPoint(name, modules[name], dim, size, masked, call.flags))
        for (path, dim, size, parts), layout in zip(outputs, out_layouts, strict=True):
            masked = [(holder[k], p, i) for k, p, i in parts]
            mp = MaskPoint(f"<output>{path}", -1, dim, size, masked, rows=layout, probe=probe)
            holder.outputs.setdefault(path, []).append(mp)
        if outputs:
            hook = OutputMasks(
                [(p, mp.dim, mp.size, mp.apply) for p, mps in holder.outputs.items() for mp in mps]
            )
            holder.handles.append(model.register_forward_hook(hook))
        # last: after the output masks' products too
        holder.handles.append(model.register_forward_hook(call.leave, always_call=True))
    except Exception:
        remove_mask_points(model)
        raise
    found = find_holder(model)
    assert found is not None
    return found[0]


class ModelCall:
    """The model's first forward pre-hook and last forward hook, around each call of the
    whole model (a submodule called on its own, or recomputed in backward, is outside one)."""

    def __init__(self, masks: list[MaskLayer]) -> None:
        self.masks = masks
        self.flags = CallFlags()
        self._ones_cache: dict[str, Any] = {}

    def enter(self, _module: nn.Module, _args: tuple) -> None:
        """A call begins: what its points need to know of every mask (``CallFlags``), asked
        once here rather than by each point. Changes: ``flags`` on this thread."""
        if compiling() or tracing.active() is not None:
            # the points of a compiled graph or of a trace take their own path (and a read of
            # the masks here would be recorded in the trace)
            return
        masks = self.masks
        ones = all_ones(masks, self._ones_cache)
        self.flags.ones = ones
        self.flags.idle = (
            ones
            and not any(m.collecting for m in masks)
            and not any(m._buffers["mask"].requires_grad for m in masks)
        )

    def leave(self, _module: nn.Module, _args: tuple, _out: Any) -> None:
        """A call ended (or raised): ``flags`` cleared, and the strong hold on its latest
        product dropped (``SharedProduct``), so that a forward without a backward leaves nothing
        of its graph alive."""
        self.flags.ones = self.flags.idle = False
        SharedProduct.release()


def _row_scopes(
    holder: MaskHolder, modules: dict[str, nn.Module], layouts: list[RowLayout], probe: BatchProbe
) -> dict[str, RowScope]:
    """One ``RowScope`` per module that the layouts name as selecting rows by data."""
    collecting = functools.partial(_any_collecting, holder)  # (pickles with the model)
    scopes: dict[str, RowScope] = {}
    for r in layouts:
        if r.scope is not None and r.scope in modules and r.scope not in scopes:
            scopes[r.scope] = RowScope(r.scope, r.scope_args, probe, collecting)
    return scopes


def _any_collecting(holder: MaskHolder) -> bool:
    return any(m.collecting for m in holder.values() if isinstance(m, MaskLayer))


def remove_mask_points(model: nn.Module) -> bool:
    """Remove the hooks and the ``fisherprune_masks`` submodule; return whether there were any."""
    found = find_holder(model)
    if found is None:
        return False
    name, holder = found
    for h in holder.handles:
        h.remove()
    for mp in [*holder.points, *holder.recurrent]:
        mp.release()
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    delattr(parent, MASKS_ATTR)
    return True
