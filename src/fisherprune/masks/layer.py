"""MaskLayer: a 0/1 channel mask that also collects the Fisher pruning signal.

The mask multiplies one dimension (the channel dimension) of its input. While
``collecting`` is on, the backward pass that training already runs also hands
the layer the per-example derivative of the loss with respect to the mask,

    g[n, k] = sum over positions of  x[n, k, pos] * dL/d(m_k x)[n, k, pos],

without a second backward and without a per-example copy of the mask. The
layer sums ``g`` over every place it is applied in one forward pass (a mask
shared by coupled channels) before squaring it: the chain rule for one shared
mask (Liu et al., Group Fisher Pruning, ICML 2021, Eq. 4). ``update_pruning_signals``
turns what was gathered into ``Delta_k = 1/2 * mean_n g[n, k]^2`` (Theis et al. 2018).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fisherprune.masks import recompute, tracing
from fisherprune.masks.compiled import SignalOwner, compiling, masked_product

__all__ = [
    "CallFlags",
    "MaskLayer",
    "all_ones",
    "buffers_key",
    "gather_through",
    "log_input_changed",
]

log = logging.getLogger("fisherprune")


#: below this many elements the plain product-and-sum is as fast as the fused reduction
FUSED_DOT_MIN_NUMEL = 1 << 16
#: activation dtypes whose per-example dot is accumulated in float32
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=64)
def _zeros_and_ones(n: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    return torch.zeros(n, dtype=dtype, device=device), torch.ones(n, dtype=dtype, device=device)


#: (device type, dtype) pairs whose batch-norm backward refused the fused dot: the generic
#: product-and-sum serves them from then on
_NO_FUSED: set[tuple[str, torch.dtype]] = set()


def _fused_channel_dot(grad: Tensor, x: Tensor) -> Tensor | None:
    """The per-(example, channel) dot of contiguous (N, C, ...) tensors through ATen's
    batch-norm backward, or None where this backend refuses it (remembered, then never tried
    again for that device type and dtype).

    Every (example, channel) pair is viewed as one "channel" of a batch of one with mean 0 and
    inverse std 1: the weight gradient is then exactly the per-row dot product, computed in one
    fused pass that reads each input once, materialises no product, and keeps half-precision
    inputs as they are while accumulating in float32 (the weight, mean and inverse std are
    float32: the kernels' mixed-precision form). Measured 1.3-1.7x faster than product-and-sum
    on cache-cold activations on CPU. All five optional tensors are given: CUDA's kernel
    refuses undefined ones ("tensor does not have a device")."""
    key = (x.device.type, x.dtype)
    if key in _NO_FUSED:
        return None
    rows = x.shape[0] * x.shape[1]
    stats = torch.float32 if x.dtype in _LOW_PRECISION else x.dtype
    zeros, ones = _zeros_and_ones(rows, stats, x.device)
    try:
        _, dot, _ = torch.ops.aten.native_batch_norm_backward(
            grad.view(1, rows, -1), x.view(1, rows, -1), ones, zeros, ones, zeros, ones,
            True, 0.0, [False, True, False],
        )  # fmt: skip
    except torch.OutOfMemoryError:
        raise  # the device is full, not the path refused: the generic one would need more
    except (RuntimeError, NotImplementedError) as e:
        _NO_FUSED.add(key)
        log.info("per-example channel dot: the fused path is refused on %s %s (%s)", *key, e)
        return None
    return dot.view(x.shape[0], x.shape[1])


def _per_example_channel_dot(grad: Tensor, x: Tensor, dim: int, batch_dim: int = 0) -> Tensor:
    """Return ``sum over positions of grad * x`` for each (example, channel): shape (N, C),
    the examples being the indices of ``batch_dim`` (1 for a sequence-first (L, N, C) input).

    Large contiguous (N, C, ...) tensors go through ``_fused_channel_dot`` where the backend
    takes it; anything else (channels-last, (N, L, C) tokens, small tensors, a backend that
    refuses the fused path) is a plain product and sum (about 3x faster on CPU than einsum,
    which lowers to many tiny matmuls). The result is float32 for fp16 / bf16 inputs: the
    product stays in the inputs' dtype (no activation is upcast) and the sum over thousands of
    positions accumulates in float32, not rounded to 8 or 11 bits.
    """
    if batch_dim:  # the batch moved to dim 0 (views): the product-and-sum below serves them
        d = dim % x.dim()
        grad, x = grad.movedim(batch_dim, 0), x.movedim(batch_dim, 0)
        dim = d + 1 if d < batch_dim else d
    gtype, xtype = grad.dtype, x.dtype
    low = gtype in _LOW_PRECISION or xtype in _LOW_PRECISION
    if gtype != xtype:  # (autocast can hand a float32 gradient for a bf16 input)
        grad = grad.to(xtype)
    if (
        dim == 1
        and x.dim() >= 3
        and x.numel() >= FUSED_DOT_MIN_NUMEL
        and x.is_floating_point()
        and x.is_contiguous()
        and grad.is_contiguous()
    ):
        dot = _fused_channel_dot(grad, x)
        if dot is not None:
            return dot
    others = _other_dims(x.dim(), dim)
    if len(others) == 1 and not low:  # the same product and sum, in one call
        return torch.linalg.vecdot(grad, x, dim=others[0])
    prod = grad * x
    if not others:
        return prod.float() if low else prod  # (N, C): batch then channel
    return prod.sum(dim=others, dtype=torch.float32 if low else None)


@functools.lru_cache(maxsize=64)
def _other_dims(ndim: int, dim: int) -> tuple[int, ...]:
    """The dims of an ``ndim``-d tensor other than the batch (0) and ``dim``."""
    return tuple(d for d in range(ndim) if d not in (0, dim))


class _MaskMultiply(torch.autograd.Function):
    """``x * mult`` whose backward also reports the per-example mask gradient to ``owner``.

    With ``identity`` (nothing pruned yet) the products by ones are skipped: the forward
    returns a tensor sharing ``x``'s storage and the backward passes the gradient through.
    That tensor is deliberately not an autograd view of ``x``, so that in-place operations
    downstream (``nn.ReLU(inplace=True)`` after the mask) stay as legal as without the mask.
    If one does change ``x`` before the backward, ``x`` no longer holds the values the
    gradient needs: that pass is dropped and ``owner`` is told to stop aliasing
    (``input_changed_in_place``), so that later passes multiply into a new tensor. ``x`` is
    released once its backward ran (so that activations are freed as the backward goes, as
    without the mask); a second backward through the same graph (``retain_graph=True``)
    finds it gone and is handled the same way. ``batch_dim`` is the dim of ``x`` that holds
    the examples; ``to_examples`` (or None where the rows of that dim are the examples) maps
    the per-row gradients to per-example ones before they are handed over (rows that are
    tokens, or rows selected by data: ``fisherprune.masks.row_tracker``).

    The arguments other than ``x`` and ``mult`` come as one tuple, ``spec``: ``(owner, index,
    dim, identity, to_examples, batch_dim)`` (``Function.apply`` pays per argument).
    """

    @staticmethod
    def forward(ctx, x, mult, spec):  # type: ignore[override]
        ctx.spec = spec
        if spec[3]:  # identity
            # kept off save_for_backward: its version check would turn a legal in-place
            # op downstream into an error; the version is compared in backward instead
            ctx.x, ctx.version = x, x._version
            return x.detach()
        ctx.save_for_backward(x, mult)
        return x * mult

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        owner, index, dim, identity, to_examples, batch_dim = ctx.spec
        if identity:
            # freed here, not kept with the graph: an attribute of ctx (unlike a saved tensor)
            # would hold every masked activation until the whole backward ends
            x, mult, ctx.x = ctx.x, None, None
            changed = x is None or x._version != ctx.version  # None: a second backward
        else:
            (x, mult), changed = ctx.saved_tensors, False
        if changed:
            owner.input_changed_in_place()
        else:
            g = grad.detach() if grad.requires_grad else grad  # create_graph: keep no graph
            dot = _per_example_channel_dot(g, x, dim, batch_dim)  # (rows, C)
            if to_examples is not None:
                dot = to_examples(dot)  # (N, C), before anything is squared
            owner.accumulate(dot, index)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad if mult is None else grad * mult
        return grad_x, None, None


#: whether a ``torch.func`` transform (``vmap``, ``grad``) is running (False on a torch
#: without the query)
_functorch_active: Callable[[], bool] = getattr(
    torch._C, "_are_functorch_transforms_active", lambda: False
)


def gathering_enabled() -> bool:
    """Whether the backward of a forward run now can gather per-example mask gradients: grad
    mode is on and no ``torch.func`` transform runs (``vmap(grad(...))`` computes per-example
    gradients itself, and refuses a tensor made to require grad inside it: masks then act as
    plain products, differentiable through the transform)."""
    return torch.is_grad_enabled() and not _functorch_active()


def gather_through(
    x: Tensor,
    mult: Tensor | None,
    owner: Any,
    index: Tensor | None,
    dim: int,
    identity: bool,
    to_examples: Callable[[Tensor], Tensor] | None = None,
    batch_dim: int = 0,
) -> Tensor:
    """``x * mult`` (or ``x`` itself when ``identity``), handing ``owner.accumulate`` the
    per-example mask gradient during backward (see ``_MaskMultiply``). ``mult`` may be None
    only with ``identity`` and an ``x`` that requires grad; ``to_examples`` maps per-row
    gradients (rows, C) to per-example ones (N, C) where dim 0 of ``x`` is not the batch;
    ``batch_dim``: the dim of ``x`` that holds the examples (1 for sequence-first tensors)."""
    if not x.requires_grad:
        assert mult is not None, "a multiplier is needed to carry the gradient"
        # then the multiplier requires grad, so that backward still reaches the mask
        # (a mask on the model input, or after frozen layers)
        mult = mult.detach().requires_grad_()
    return _MaskMultiply.apply(x, mult, (owner, index, dim, identity, to_examples, batch_dim))


def _state(buffer: Tensor) -> tuple[int, int]:
    """A mask buffer's version and storage: what a cache of what the buffer holds is keyed on
    (beside the buffer itself). The storage too, since a deep copy's buffer starts its version
    count again: a copy written as often as the original since would match on the version."""
    try:
        storage = buffer.data_ptr()
    except RuntimeError:  # a torch.func wrapper has no storage: keyed on itself and its version
        storage = -1
    return buffer._version, storage


def buffers_key(buffers: Sequence[Tensor]) -> tuple[int, ...]:
    """The id, then the version, of each mask buffer: the same on two calls exactly when none
    was replaced or written in place in between (what the caches of a mask's users key on)."""
    if len(buffers) == 1:  # (most points: a quarter of the time of the general form)
        b = buffers[0]
        return (id(b), b._version)
    return (*map(id, buffers), *[b._version for b in buffers])


def all_ones(
    masks: list[MaskLayer], cache: dict[str, Any], key: tuple[int, ...] | None = None
) -> bool:
    """Whether every mask is all ones, recomputed only when a mask buffer changed. ``key``:
    ``buffers_key`` of the masks' buffers, where the caller has it already."""
    if key is None:
        key = buffers_key([m._buffers["mask"] for m in masks])  # (not ``nn.Module.__getattr__``)
    if cache.get("key") != key:
        cache["key"] = key
        cache["tensors"] = [m.mask for m in masks]  # alive, so that their ids stay theirs
        cache["ones"] = all(m.is_all_ones() for m in masks)
    return bool(cache["ones"])


class CallFlags(threading.local):
    """What this thread's current call of the whole model began with (``ModelCall`` sets
    them): ``ones``, every mask all ones (the norm points run their norms as they are);
    ``idle``, besides, none collecting or requiring grad and no tracer (the mask points leave
    their inputs as they are). Each point then skips asking its masks, which at every forward
    of every masked layer costs about 5% of a step of a small model. Pickled and copied off:
    they are a thread's state, not the model's."""

    ones = False
    idle = False

    def __reduce__(self) -> tuple[type[CallFlags], tuple[()]]:
        return CallFlags, ()


def log_input_changed(where: str) -> None:
    log.info(
        "%s: an in-place operation after the mask changed its input before the backward (or "
        "a second backward through a retained graph found it released); this pass's signal "
        "is dropped and the mask now multiplies into a new tensor",
        where,
    )


class _Gathered:
    """The per-example mask gradients handed over by backward since the last update.

    A plain object rather than attributes of the module: ``nn.Module.__setattr__`` is slow
    enough to matter on this path, which runs at every forward and backward.
    """

    __slots__ = ("backward_seen", "current", "opened", "passes", "received")

    def __init__(self) -> None:
        self.current: Tensor | None = None  # (N, C) sum of g over the places of this pass
        self.backward_seen = False
        self.passes: list[Tensor] = []  # (N, C) summed g of each closed pass
        self.received = False  # a gradient arrived since the last update
        self.opened = False  # a compiled forward used the mask since the last add (open_pass)

    def add(self, g: Tensor) -> None:
        """Add one place's (N, C) gradient to the current pass (after closing it, if it has a
        different shape or a compiled forward came since its last gradient)."""
        if self.opened or (self.current is not None and self.current.shape != g.shape):
            self.opened = False
            self.commit()
        self.current = g if self.current is None else self.current + g
        self.backward_seen = self.received = True

    def commit(self) -> None:
        """Close the current pass; nothing is computed here (the training step stays cheap)."""
        if self.current is not None:
            self.passes.append(self.current)
        self.current, self.backward_seen = None, False

    def divide(self, scale: float | Tensor) -> None:
        """Divide every gradient gathered so far by ``scale``."""
        if self.current is not None:
            self.current = self.current / scale
        self.passes = [g / scale for g in self.passes]

    def take(self) -> list[Tensor]:
        """Close the current pass, return every pass and start afresh."""
        self.commit()
        passes, self.passes, self.received = self.passes, [], False
        return passes


class MaskLayer(SignalOwner, nn.Module):
    """A binary mask over ``num_channels`` channels of dimension ``dim`` of its input.

    Buffers (saved in ``state_dict``):
        mask:   shape (num_channels,), ones; a 0 removes that channel. Updated in
                place only, so its identity never changes.
        signal: shape (num_channels,), zeros; the exponential moving average of
                the Fisher pruning signal, updated by ``update_pruning_signals``.

    Args:
        num_channels: size of the masked dimension.
        dim: the channel dimension of the input; ``1`` for (N, C, ...) and
            ``-1`` for channels-last / (N, L, C). Dimension 0 is the batch.

    Placement: the signal costs work in proportion to the size of the tensor the mask
    multiplies, and a channel mask commutes with ReLU, pooling and flatten; put it after
    the pooling that follows an activation (``conv-BN-ReLU-pool-MaskLayer``), as
    ``apply_masks`` does: the signal and every channel's cost are the same as before the
    pool, and the collecting work is 4x smaller after a 2x2 pool.

    Raises:
        ValueError: ``num_channels`` < 1, or ``dim`` is 0 (the batch dimension).

    Example:
        >>> net = nn.Sequential(nn.Linear(20, 50), nn.ReLU(), MaskLayer(50), nn.Linear(50, 2))
    """

    mask: Tensor
    signal: Tensor

    def __init__(self, num_channels: int, dim: int = 1) -> None:
        super().__init__()
        if not isinstance(num_channels, int) or num_channels < 1:
            raise ValueError(f"MaskLayer needs num_channels >= 1, got {num_channels!r}")
        if not isinstance(dim, int) or dim == 0:
            raise ValueError(
                f"MaskLayer dim={dim!r} is invalid: dimension 0 is the batch; "
                "use dim=1 for (N, C, ...) inputs or dim=-1 for channels-last inputs"
            )
        self.num_channels = num_channels
        self.dim = dim
        #: weight rows (or columns) one channel spans: ``apply_masks`` sets ``head_dim`` for an
        #: attention head; ``round_to`` counts these (``fisherprune.pruner.prune.rounding``)
        self.channel_width = 1
        #: the channels kept must stay a multiple of this (``apply_masks`` sets it for a width
        #: a grouped matrix product reads, whose kernel needs 16-byte rows); ``prune`` keeps it
        self.keep_multiple = 1
        self.register_buffer("mask", torch.ones(num_channels))
        self.register_buffer("signal", torch.zeros(num_channels))
        #: whether backward passes gather Fisher statistics (off once pruning is over)
        self.collecting = True
        self._gathered = _Gathered()
        self._ones_cache: dict[str, Any] = {}
        #: (mask buffer, its version, its storage, whether all ones then): known without a
        #: read-back (the storage too: a deep copy's mask starts its version again)
        self._ones_known: tuple[Tensor, tuple[int, int], bool] = (
            self.mask,
            _state(self.mask),
            True,
        )
        #: (mask buffer, its version, its storage, its host copy then): see ``host_mask``
        self._host_known: tuple[Tensor, tuple[int, int], Tensor] | None = None
        self._mult_cache: tuple[Tensor, tuple[Any, ...], Tensor] | None = None
        #: False once an in-place op downstream was seen changing the input (see _MaskMultiply)
        self._alias_ok = True
        #: the key the compiled path hands this layer's signal by, when called as a module
        #: (masks.compiled)
        self.init_owner()

    def extra_repr(self) -> str:
        kept = int(self.mask.sum().item())
        return f"num_channels={self.num_channels}, dim={self.dim}, kept={kept}"

    # ----------------------------------------------------------------- forward
    def _channel_dim(self, x: Tensor) -> int:
        if not -x.dim() <= self.dim < x.dim():
            raise ValueError(
                f"MaskLayer(dim={self.dim}) got a {x.dim()}-d input of shape "
                f"{tuple(x.shape)}: dim is out of range"
            )
        d = self.dim % x.dim()
        if d == 0:
            raise ValueError(
                f"MaskLayer(dim={self.dim}) resolves to the batch dimension for a "
                f"{x.dim()}-d input of shape {tuple(x.shape)}"
            )
        return d

    def forward(self, x: Tensor) -> Tensor:
        """Return ``x`` with masked channels zeroed; gathers signals in backward if collecting."""
        d = self._channel_dim(x)
        if x.shape[d] != self.num_channels:
            raise ValueError(
                f"MaskLayer(num_channels={self.num_channels}, dim={self.dim}) got input of "
                f"shape {tuple(x.shape)} whose dim {d} has {x.shape[d]} channels"
            )
        return self.apply_to(x, d, None)

    def apply_to(self, x: Tensor, dim: int, index: Tensor | None) -> Tensor:
        """Multiply channel dimension ``dim`` of ``x`` by this mask.

        ``index`` (optional, long, length ``x.shape[dim]``) says which mask entry
        each channel of ``x`` uses; it lets one mask act at several places with
        different channel layouts (concatenation, grouped channels).
        """
        if compiling() and index is None and not self.mask.requires_grad:
            return masked_product(self, x, self.mask, [self], dim, 0)
        tracer = tracing.active()
        if tracer is not None:
            with tracer.suspended():
                out = x * self._multiplier(x, dim, index)
            idx = None if index is None else index.cpu().numpy()
            tracer.record_mask(x, out, dim, [(self, None, idx)])
            return out
        collect = self.collecting and x.dim() >= 2 and gathering_enabled()
        ones = all_ones([self], self._ones_cache)
        if ones and not collect and not self._buffers["mask"].requires_grad:
            return x  # (a mask that requires grad, as under torch.func, must stay in the graph)
        mult = self._multiplier(x, dim, index)
        if collect:
            self.start_pass()
            alias = ones and self._alias_ok and not recompute.checkpointing()
            return gather_through(x, mult, self, index, dim, alias)
        return x * mult

    def _multiplier(self, x: Tensor, dim: int, index: Tensor | None) -> Tensor:
        """The mask as a broadcastable multiplier for ``x`` (cached until the mask changes)."""
        mask = self._buffers["mask"]  # (read once: ``nn.Module.__getattr__`` is slow)
        key = (_state(mask), x.dtype, x.device, x.dim(), dim)
        cached = self._mult_cache
        if index is None and cached is not None and cached[0] is mask and cached[1] == key:
            return cached[2]
        mult = mask if index is None else mask[index]
        shape = [1] * x.dim()
        shape[dim] = mult.numel()
        out = mult.to(dtype=x.dtype).view(shape)
        if index is None and not mask.requires_grad:
            self._mult_cache = (mask, key, out)
        return out

    def input_changed_in_place(self) -> None:
        """Backward found the aliased input changed in place: drop the pass, stop aliasing."""
        self._alias_ok = False
        self.mark_received()  # the loss does reach this mask
        log_input_changed(f"MaskLayer({self.num_channels})")

    def is_all_ones(self) -> bool:
        """Whether every entry of the mask is 1. Read back from the mask's device only when
        the buffer changed in a way this layer was not told of (``record_values``): the forward
        of a training step asks, and on a GPU a read-back would wait for the device."""
        known = self._ones_known
        if known[0] is not self.mask or known[1] != _state(self.mask):
            known = (self.mask, _state(self.mask), bool((self.mask > 0.5).all()))
            self._ones_known = known
        return known[2]

    def host_mask(self) -> Tensor:
        """The mask on the host (detached, on the CPU; to read, not to write), copied from the
        mask's device only when the buffer was replaced or written since the last call: a
        prune decision reads every mask several times (scores, cost, selection), and on a GPU
        each read waits for the device, while a prune changes only the masks it prunes.
        Changes nothing but that remembered copy."""
        mask, known = self.mask, self._host_known
        if known is None or known[0] is not mask or known[1] != _state(mask):
            known = (mask, _state(mask), mask.detach().cpu())
            self._host_known = known
        return known[2]

    def record_values(self, all_ones: bool) -> None:
        """Record whether the mask is all ones, for a caller that has just written it in place
        and knows (a prune zeroed entries; a dry run restored the values it saved), so that the
        next forward need not read it back. Changes nothing else."""
        self._ones_known = (self.mask, _state(self.mask), all_ones)

    # ---------------------------------------------------------------- signals
    @property
    def received(self) -> bool:
        """Whether a gradient arrived since the statistics were last taken."""
        return self._gathered.received

    def mark_received(self) -> None:
        """Record that the loss reaches this mask although no statistics were gathered (a
        pass dropped because its input was changed in place)."""
        self._gathered.received = True

    def start_pass(self) -> None:
        """Called at each forward use: a forward after a backward closes the last pass (not a
        forward recomputed within the backward, ``masks.recompute``)."""
        if self._gathered.backward_seen and not recompute.recomputing():
            self._gathered.commit()

    def open_pass(self) -> None:
        """Called at each forward use inside a compiled graph: the next gradient added closes
        the last pass first, as ``start_pass`` would have at this forward. It only writes: a
        compiled forward that read the state (as ``start_pass`` does) would be guarded on it
        and traced again at every pass of a step. Changes: that flag alone."""
        self._gathered.opened = True

    def closed_passes(self) -> list[Tensor]:
        """Close the current pass (as the next forward would) and return the per-example
        gradients (N, C) of every pass closed since the statistics were last taken, oldest
        first: the layer's own list, to read and not to change (``take_statistics`` empties
        it). For a criterion that pairs each pass's gradients with statistics of its own."""
        self._gathered.commit()
        return self._gathered.passes

    def accumulate(self, g: Tensor, index: Tensor | None) -> None:
        """Add one place's per-example gradient (N, C_place) to the current pass."""
        if index is not None:
            full = g.new_zeros(g.shape[0], self.num_channels)
            full.index_add_(1, index if index.device == g.device else index.to(g.device), g)
            g = full
        self._gathered.add(g)

    def take_statistics(
        self,
        loss_reduction: str,
        statistic: Callable[[Tensor], Tensor],
        degree: int,
    ) -> tuple[Tensor, float, int] | None:
        """Return ``(total, scale, count)`` of what backward gathered, and start afresh; None
        if no gradient arrived since the last call.

        ``total * scale`` is the per-channel sum over the ``count`` examples of the criterion's
        per-example statistic: ``statistic(g)`` maps one pass's per-example mask gradients
        ``g`` (N, C) to their (C,) sum over examples (``sum_n g^2`` for Fisher). With
        ``loss_reduction="mean"`` each pass's ``g`` carries a factor 1/N, undone by
        ``N ** degree`` (the statistic is homogeneous of that degree in ``g``). The scale is
        returned apart so that the caller folds it into one later product.
        """
        passes = self._gathered.take()
        if not passes:
            return None
        dtype = self._buffers["signal"].dtype  # (not ``nn.Module.__getattr__``: once per step)

        def factor(n: int) -> float:
            return float(n**degree) if loss_reduction == "mean" else 1.0

        def reduce(g: Tensor) -> Tensor:
            return statistic(g if g.dtype == dtype else g.to(dtype))

        count = sum(g.shape[0] for g in passes)
        if len(passes) == 1:
            return reduce(passes[0]), factor(count), count
        total = sum(reduce(g) * factor(g.shape[0]) for g in passes)
        assert isinstance(total, Tensor)
        return total, 1.0, count

    def unscale_gradients(self, scale: float | Tensor) -> None:
        """Divide the per-example gradients gathered since the last update by ``scale``: the
        factor a ``GradScaler`` multiplied the loss by, so that the signal is that of the
        unscaled loss (call after ``backward``, before the optimizer step)."""
        self._gathered.divide(scale)

    def reset_statistics(self) -> None:
        """Drop gradients gathered since the last update (the signal EMA is kept)."""
        self._gathered = _Gathered()

    # ------------------------------------------------------------------ state
    @property
    def kept(self) -> int:
        """Number of channels whose mask entry is 1."""
        return int((self.mask > 0.5).sum().item())
