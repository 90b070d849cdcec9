"""Modules that the tracer and the masks run through a fisherprune forward of the same function.

Some modules compute in a way channels cannot be followed through: ``nn.MultiheadAttention``
merges its heads with the batch and calls its output projection through ``F.linear``, so no
head is a channel and a mask on ``out_proj`` never runs. A module type registered here gets:

- ``traced(module, args, kwargs, suspended)``: while tracing, its forward runs unrecorded and
  this computes the output again under the tracer (``suspended()`` hides ops from it, for
  values that carry no channel);
- ``masked(module, args, kwargs, points, cache)``: once masks are applied and some of them act
  on the submodules named in ``inner`` (their ``MaskPoint`` s, ``points``), a forward hook
  calls this after each forward; it returns the output with those masks acting, or None when
  they would change nothing (all ones, not collecting signals), keeping the module's own
  output (its fast path included); ``cache`` is a dict kept with the hook.

Both must give the module's own output when no mask acts. ``apply_masks`` installs the hook;
``remove_masks`` removes it.

A tensor passed in several positional inputs (``attn(x, x, x)``) stays one tensor after the
masks acting at the module's input (``share_inputs_hooks``): masks are placed on its first
position only, and a self-attention keeps reading one (masked) tensor, as its fast path needs.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from fisherprune.attention import multihead_attention
from fisherprune.masks import tracing
from fisherprune.masks.layer import all_ones
from fisherprune.masks.points import MaskPoint
from fisherprune.recurrent import recurrent_forward

__all__ = [
    "MULTIHEAD_ATTENTION",
    "ModuleForward",
    "module_forward",
    "register_module_forward",
    "share_inputs_hooks",
]

Traced = Callable[[nn.Module, tuple, dict, Callable[[], contextlib.AbstractContextManager]], Any]
Masked = Callable[[nn.Module, tuple, dict, list[MaskPoint], dict[str, Any]], Any]


@dataclass(frozen=True)
class ModuleForward:
    """How the tracer and the masks run one module type (see the module's docstring)."""

    traced: Traced
    masked: Masked
    inner: tuple[str, ...]


_FORWARDS: dict[type, ModuleForward] = {}


def register_module_forward(cls: type, forward: ModuleForward) -> None:
    """Run modules of ``cls`` (and its subclasses that keep its ``forward``) through
    ``forward`` when tracing and when masked; a subclass overriding ``forward`` runs its own.
    Changes: the registry, for every model traced or masked afterwards.

    Raises:
        ValueError: ``cls`` is already registered.
    """
    if cls in _FORWARDS:
        raise ValueError(f"{cls.__name__} already has a module forward")
    _FORWARDS[cls] = forward


def module_forward(module: nn.Module) -> ModuleForward | None:
    """The entry of ``module``'s class or its nearest registered base, or None; None also for
    a subclass that overrides ``forward`` (the registered function computes the base's)."""
    cls = type(module)
    base = next((t for t in cls.__mro__ if t in _FORWARDS), None)
    if base is None or getattr(cls, "forward", None) is not getattr(base, "forward", None):
        return None
    return _FORWARDS[base]


class _SharedInputs:
    """Which positional inputs of a call are the same tensor as an earlier one: ``before``
    notes them, ``after`` passes the earlier one (as masked by the pre-hooks between them) in
    their place. A class, not closures, so that a model saved whole pickles its hooks."""

    def __init__(self) -> None:
        self.same: list[int | None] = []

    def before(self, _m: nn.Module, args: tuple) -> None:
        self.same = [
            next((j for j in range(i) if args[j] is a), None) if isinstance(a, Tensor) else None
            for i, a in enumerate(args)
        ]

    def after(self, _m: nn.Module, args: tuple) -> tuple | None:
        same = self.same
        if len(same) != len(args) or all(j is None for j in same):
            return None
        return tuple(a if j is None else args[j] for a, j in zip(args, same, strict=True))


def share_inputs_hooks(module: nn.Module) -> list[RemovableHandle]:
    """Add two forward pre-hooks to ``module``: the first to run notes which positional inputs
    are the same tensor as an earlier one, the last to run passes the earlier one (as masked by
    the pre-hooks between them) in their place. Returns their handles."""
    shared = _SharedInputs()
    return [
        module.register_forward_pre_hook(shared.before, prepend=True),
        module.register_forward_pre_hook(shared.after),
    ]


# ------------------------------------------------------------- nn.MultiheadAttention
_MHA_SIGNATURE = inspect.signature(multihead_attention)


def _mha_call(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name, defaults filled in."""
    bound = _MHA_SIGNATURE.bind(module, *args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _traced_mha(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    suspended: Callable[[], contextlib.AbstractContextManager],
) -> Any:
    """The heads apart; the average of the attention weights over heads is taken unrecorded
    (it carries no channel: a masked head is left out of it as a removed head is)."""
    call = _mha_call(module, args, kwargs)
    average = call.pop("average_attn_weights")
    out, weights = multihead_attention(**call, average_attn_weights=False)
    if weights is not None and average:
        with suspended():
            weights = weights.mean(dim=1)
    return out, weights


def _masked_mha(
    module: nn.Module, args: tuple, kwargs: dict, points: list[MaskPoint], cache: dict[str, Any]
) -> Any:
    """Run again with ``out_proj`` 's head mask acting, when it changes anything or signals
    are being collected; the averaged attention weights leave out masked heads."""
    if tracing.active() is not None:
        return None  # the tracer runs its own forward
    masks = list(dict.fromkeys(m for mp in points for m, _, _ in mp.parts))
    idle = all_ones(masks, cache) and not any(m.mask.requires_grad for m in masks)
    if idle and not (torch.is_grad_enabled() and any(m.collecting for m in masks)):
        return None
    call = _mha_call(module, args, kwargs)
    (point,) = points
    mult = point.multiplier(torch.empty([1] * point.dim + [point.size])).flatten()
    call["head_weights"] = mult.view(-1, module.head_dim)[:, 0]
    return multihead_attention(**call)


#: how ``nn.MultiheadAttention`` (and ``fisherprune.export.mha.PrunedMultiheadAttention``) run
MULTIHEAD_ATTENTION = ModuleForward(_traced_mha, _masked_mha, inner=("out_proj",))
register_module_forward(nn.MultiheadAttention, MULTIHEAD_ATTENTION)


# ------------------------------------------------------------- nn.LSTM / nn.GRU / nn.RNN
def _traced_recurrent(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    suspended: Callable[[], contextlib.AbstractContextManager],
) -> Any:
    """The layer step by step (``fisherprune.recurrent``), a ``PackedSequence`` input too:
    its input width is read by the input projection of the first layer (a prunable consumer)
    and every product is counted. Hidden unit j of every layer and direction is one channel
    (``nn.LSTM`` has one hidden size for all): its reads inside the layer pass it on (the
    layer's forward masks it there, ``fisherprune.masks.recurrent_units``), its readers
    outside are masked as any layer's input. An LSTM with ``proj_size``: its projected units
    (the state the steps pass on and the layer returns) are those channels, and its cells
    (the gates' rows, the projection's columns; one count for every layer and direction) a
    second group, read inside only by the projection (a ``hooked`` use: the layer's forward
    masks them there too, and, in a masked model traced again, records that mask)."""
    tracer = tracing.active()
    bound = _RNN_SIGNATURE.bind(*args, **kwargs)
    first = len(tracer.trace.consumers) if tracer is not None else 0
    hooked = getattr(module.__dict__.get("forward"), "traced_cell_hook", None)  # (masked)
    out = recurrent_forward(
        module,  # type: ignore[arg-type]
        bound.arguments["input"],
        bound.arguments.get("hx"),
        cell_hook=hooked() if hooked is not None else None,
    )
    if tracer is None:
        return out
    atoms = tracer.trace.atoms
    params = dict(module.named_parameters(recurse=False))

    def tie(role: str, dim: int) -> set[int]:
        """Index j of ``role`` 's weights along ``dim`` in every layer and direction: one
        channel (``nn.LSTM`` has one hidden size, one projection size); its atoms' roots."""
        labels = [tracer.info(p).labels[dim] for n, p in params.items() if n.startswith(role)]
        for lab in labels[1:]:
            atoms.union(labels[0], lab)
        return set(atoms.find(labels[0]).tolist())

    for name, p in params.items():  # the state each step makes, which the next step reads
        if name.startswith("weight_hh"):  # (traced at one step, nothing would say so)
            made = params.get(name.replace("weight_hh", "weight_hr"))
            rows = tracer.info(made if made is not None else p).labels[0]
            atoms.union(tracer.info(p).labels[1], rows[: p.shape[1]])
            if made is not None:  # an LSTM's cells: the gates' rows, the projection's columns
                atoms.union(tracer.info(made).labels[1], tracer.info(p).labels[0][: made.shape[1]])
    units = tie("weight_hh", 1)
    cells = tie("weight_hr", 1) if module.proj_size else set()  # type: ignore[union-attr]
    if module.proj_size and module.hidden_size <= module.proj_size + 1:  # type: ignore[union-attr]
        why = "PyTorch runs an LSTM only with more cells than projected units: none can go"
        atoms.block(np.asarray(sorted(cells), dtype=np.int64), why)
    for cp in tracer.trace.consumers[first:]:  # the reads inside: masked by the layer's hook
        read = set(atoms.find(cp.labels).tolist()) if cp.output is None else {-1}
        if read <= units:
            cp.passed_on = True  # (their readers outside decide)
        elif read <= cells:
            cp.hooked = True  # (the projection alone reads them)
    return out


def _masked_recurrent(
    module: nn.Module, args: tuple, kwargs: dict, points: list[MaskPoint], cache: dict[str, Any]
) -> Any:
    """Never called (no mask acts on a submodule of a recurrent layer): its own output."""
    return None


_RNN_SIGNATURE = inspect.signature(lambda input, hx=None: None)

#: how ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` are traced
RECURRENT = ModuleForward(_traced_recurrent, _masked_recurrent, inner=())
for _cls in (nn.RNNBase, nn.RNN, nn.LSTM, nn.GRU):
    register_module_forward(_cls, RECURRENT)
