"""``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` written step by step, from the module's parameters.

On a CPU, PyTorch runs an LSTM as one fused operator per layer (``aten.mkldnn_rnn_layer``) and
on a GPU as one cuDNN call: neither has a channel rule nor a FLOP formula, so a network's
recurrent layers would pin the width that feeds them and count for nothing in its cost (PyTorch's
own ``FlopCounterMode`` counts an ``nn.LSTM`` as 0 FLOPs). ``recurrent_forward`` computes the
same function from plain operators (per step, one matrix product for the input and one for the
recurrence, the gates elementwise), whatever device or backend: the
tracer runs it in place of the module's forward, so the input width is followed into the
layer's input projection (a prunable consumer, like a linear layer's input) and every matrix
product is counted. GRU and vanilla RNN layers are decomposed into the same products by
PyTorch's own CPU kernels, so their count equals ``FlopCounterMode``'s on the module.

Supported: every ``mode`` (``LSTM``, ``GRU``, ``RNN_TANH``, ``RNN_RELU``), ``num_layers``,
``bidirectional``, ``batch_first``, ``bias``, an LSTM's ``proj_size``, a given initial state,
batched (3-d) and unbatched (2-d) inputs, and ``PackedSequence`` inputs (each step runs the
sequences still going: the steps' batch sizes). Dropout between layers runs as the module runs
it (only in training mode).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from fisherprune.masks.row_tracker import add_rows, host_sizes

__all__ = ["recurrent_forward", "recurrent_params"]

#: gates per hidden unit, stacked along the rows of ``weight_ih`` / ``weight_hh``
GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def recurrent_params(module: nn.RNNBase, layer: int, direction: int) -> dict[str, Tensor | None]:
    """The parameters of one layer and direction (1: the reverse one), by their role:
    ``ih``, ``hh``, ``b_ih``, ``b_hh``, ``hr`` (an LSTM's projection; None where absent)."""
    sfx = f"_l{layer}" + ("_reverse" if direction else "")
    return {
        "ih": getattr(module, "weight_ih" + sfx),
        "hh": getattr(module, "weight_hh" + sfx),
        "b_ih": getattr(module, "bias_ih" + sfx, None) if module.bias else None,
        "b_hh": getattr(module, "bias_hh" + sfx, None) if module.bias else None,
        "hr": getattr(module, "weight_hr" + sfx, None) if module.proj_size else None,
    }


def _cell(
    mode: str, gi: Tensor, gh: Tensor, h: Tensor, c: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """One step: the new hidden state (and cell state) from the input's and the state's
    projections ``gi`` and ``gh`` (biases included), PyTorch's gate order."""
    if mode == "LSTM":
        i, f, g, o = (gi + gh).chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if mode == "GRU":
        ir, iz, inn = gi.chunk(3, dim=-1)
        hr, hz, hn = gh.chunk(3, dim=-1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(inn + r * hn)
        return n + z * (h - n), None
    pre = gi + gh
    return (torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)), None


#: called on each step's new hidden state (rows, hidden) with the reduction of its rows to
#: the call's examples (None: the rows are the examples), returning the state to go on with
#: (the layer's masked hidden units: ``fisherprune.masks.recurrent_units``)
StepHook = Callable[[Tensor, Callable[[Tensor], Tensor] | None], Tensor]
#: one layer's parameters by role (``recurrent_params``)
Params = dict[str, Tensor | None]
#: one direction of one layer run: its outputs, its final hidden and cell states
Run = tuple[Tensor, Tensor, Tensor | None]


def _step(
    mode: str,
    p: Params,
    x: Tensor,
    h: Tensor,
    c: Tensor | None,
    gi: Tensor | None = None,
    cells: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """One step on (rows, width) inputs: the input projection (unless given as ``gi``), step
    by step too when traced, so that no view writes a width as a number (the tracer would take
    a module attribute equal to it, such as ``hidden_size``, for one that holds it); then the
    cell, then an LSTM's projection (of its cells' outputs as ``cells`` leaves them)."""
    if gi is None:
        gi = F.linear(x, p["ih"], p["b_ih"])  # type: ignore[arg-type]
    h, c = _cell(mode, gi, F.linear(h, p["hh"], p["b_hh"]), h, c)  # type: ignore[arg-type]
    if p["hr"] is None:
        return h, c
    return F.linear(h if cells is None else cells(h), p["hr"]), c


def _layers(
    module: nn.RNNBase,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    direction: Callable[[Params, Tensor, Tensor, Tensor | None, bool], Run],
    dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Every layer and direction of ``module`` over ``x`` (``direction`` runs one), each
    layer reading the one below's outputs (both directions side by side, dropout between in
    training mode; ``dtype``: the weights cast to it). Returns the last layer's outputs and
    the stacked final states."""
    dirs = 2 if module.bidirectional else 1
    last_h: list[Tensor] = []
    last_c: list[Tensor] = []
    for layer in range(module.num_layers):
        outs = []
        for d in range(dirs):
            i = layer * dirs + d
            c_init = c0[i] if c0 is not None else None
            p = recurrent_params(module, layer, d)
            if dtype is not None:  # (differentiable casts: the gradients reach the weights)
                p = {k: v if v is None or v.dtype == dtype else v.to(dtype) for k, v in p.items()}
            y, h, c = direction(p, x, h0[i], c_init, bool(d))
            outs.append(y)
            last_h.append(h)
            if c is not None:
                last_c.append(c)
        x = torch.cat(outs, dim=-1) if dirs == 2 else outs[0]
        if module.dropout and module.training and layer < module.num_layers - 1:
            x = F.dropout(x, module.dropout, training=True)
    return x, torch.stack(last_h), torch.stack(last_c) if last_c else None


def recurrent_forward(
    module: nn.RNNBase,
    input: Tensor | PackedSequence,
    hx: Tensor | tuple[Tensor, Tensor] | None = None,
    step_hook: StepHook | None = None,
    hook_initial: bool = False,
    project_at_once: bool = False,
    dtype: torch.dtype | None = None,
    cell_hook: StepHook | None = None,
) -> tuple[Tensor | PackedSequence, Tensor | tuple[Tensor, Tensor]]:
    """``module(input, hx)`` as the module computes it (the same ``(output, h_n)``, or
    ``(output, (h_n, c_n))`` for an LSTM, within rounding; in training mode with dropout
    between layers, other random draws), one step at a time. ``step_hook``, if given, replaces
    each step's new hidden state (of every layer and direction) by what it returns; with
    ``hook_initial``, each layer's and direction's initial hidden state too. With
    ``project_at_once``, each layer's input projection is one matrix product over every step
    (faster: one kernel instead of one per step) rather than one per step (as traced).
    With ``dtype``, the input, the given state and the weights are cast to it and every step
    runs in it with autocast off: as the module's own forward runs under autocast, which
    casts them all to the dtype it gives the layer (per device and mode: on a CPU an LSTM's
    and an RNN's but not a GRU's), whereas autocast would cast each product of the steps
    alone, and the elementwise gate arithmetic would mix dtypes. ``cell_hook``, for an LSTM
    with ``proj_size``: as ``step_hook``, on each step's cells' outputs before the projection.

    Raises:
        ValueError: a mode this function does not know, or an input that is neither 2-d nor
            3-d (nor packed).
    """
    if module.mode not in GATES:
        raise ValueError(f"recurrent_forward: unknown recurrent mode {module.mode!r}")
    hooks = _Hooks(step_hook or _unchanged, cell_hook, hook_initial)
    if dtype is None:
        return _forward(module, input, hx, hooks, project_at_once, None)
    data = input.data if isinstance(input, PackedSequence) else input
    with torch.autocast(data.device.type, enabled=False):
        input, hx = _cast(input, dtype), _cast(hx, dtype)
        return _forward(module, input, hx, hooks, project_at_once, dtype)


class _Hooks(NamedTuple):
    """``recurrent_forward`` 's hooks: on each step's state, on an LSTM's cells' outputs
    before its projection (or None), and whether the initial state is hooked too."""

    state: StepHook
    cell: StepHook | None
    initial: bool

    def cells(self, examples: Callable[[Tensor], Tensor] | None) -> Any:
        """The cells' hook of one step, for ``_step`` (None: no hook)."""
        cell = self.cell
        return None if cell is None else lambda h: cell(h, examples)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` (a tensor, a ``PackedSequence``, a tuple of states or None) in ``dtype``."""
    if isinstance(value, PackedSequence):
        return value._replace(data=value.data.to(dtype))
    if isinstance(value, tuple):
        return tuple(_cast(v, dtype) for v in value)
    return value.to(dtype) if isinstance(value, Tensor) else value


def _forward(
    module: nn.RNNBase,
    input: Tensor | PackedSequence,
    hx: Tensor | tuple[Tensor, Tensor] | None,
    hooks: _Hooks,
    project_at_once: bool,
    dtype: torch.dtype | None,
) -> tuple[Tensor | PackedSequence, Tensor | tuple[Tensor, Tensor]]:
    mode, hook = module.mode, hooks.state
    if isinstance(input, PackedSequence):
        return _packed_forward(module, input, hx, hooks, project_at_once, dtype)
    if input.dim() not in (2, 3):
        raise ValueError(
            f"recurrent_forward: {type(module).__name__} takes a 2-d (unbatched) or 3-d input, "
            f"got {input.dim()}-d"
        )
    batched = input.dim() == 3
    x = input if batched else input.unsqueeze(0)
    if batched and not module.batch_first:
        x = x.transpose(0, 1)  # (batch, steps, features) from here on: rows stay examples
    dirs = 2 if module.bidirectional else 1
    h0, c0 = _initial_state(module, x, hx, batched, dirs)
    steps = x.shape[1]

    def direction(p: Params, x: Tensor, h: Tensor, c: Tensor | None, reverse: bool) -> Run:
        h = hook(h, None) if hooks.initial else h
        ys: list[Tensor] = [h] * steps
        xs = x.unbind(1)  # (not x[:, t]: each select's backward writes a whole zero tensor)
        gis = _projected(p, x).unbind(1) if project_at_once else None
        cells = hooks.cells(None)
        for t in reversed(range(steps)) if reverse else range(steps):
            h, c = _step(mode, p, xs[t], h, c, None if gis is None else gis[t], cells)
            h = ys[t] = hook(h, None)
        return torch.stack(ys, dim=1), h, c

    x, h_n, c_n = _layers(module, x, h0, c0, direction, dtype)
    if batched and not module.batch_first:
        x = x.transpose(0, 1)
    if not batched:
        x, h_n = x.squeeze(0), h_n.squeeze(1)
        c_n = c_n.squeeze(1) if c_n is not None else None
    return (x, (h_n, c_n)) if c_n is not None else (x, h_n)


def _initial_state(
    module: nn.RNNBase,
    x: Tensor,
    hx: Tensor | tuple[Tensor, Tensor] | None,
    batched: bool,
    dirs: int,
) -> tuple[Tensor, Tensor | None]:
    """``(h0, c0)`` as (layers * directions, batch, width) tensors; zeros where not given
    (``c0`` None for a GRU or RNN)."""
    lstm = module.mode == "LSTM"
    n, states = x.shape[0], module.num_layers * dirs
    if hx is None:  # (made batch first: the tracer reads a leading dim the batch's size as
        # the batch, so that a reader merging heads with the batch keeps its heads at batch 2)
        h_out = module.proj_size or module.hidden_size
        h0 = x.new_zeros(n, states, h_out).transpose(0, 1)
        c0 = x.new_zeros(n, states, module.hidden_size).transpose(0, 1) if lstm else None
        return h0, c0
    h0, c0 = hx if lstm else (hx, None)  # type: ignore[misc]
    if not batched:
        h0 = h0.unsqueeze(1)
        c0 = c0.unsqueeze(1) if c0 is not None else None
    return h0, c0


def _projected(p: Params, x: Tensor) -> Tensor:
    """The input projection of every step (and row) of ``x`` at once."""
    return F.linear(x, p["ih"], p["b_ih"])  # type: ignore[arg-type]


def _unchanged(h: Tensor, _examples: Callable[[Tensor], Tensor] | None) -> Tensor:
    return h


def _packed_forward(
    module: nn.RNNBase,
    packed: PackedSequence,
    hx: Tensor | tuple[Tensor, Tensor] | None,
    hooks: _Hooks,
    project_at_once: bool,
    dtype: torch.dtype | None,
) -> tuple[PackedSequence, Tensor | tuple[Tensor, Tensor]]:
    """``recurrent_forward`` of a ``PackedSequence``: its data holds step after step the rows
    of the sequences still going (sorted longest first, ``batch_sizes`` of them at each step);
    the initial and final states are in the caller's order (``sorted_indices``)."""
    sizes = host_sizes(packed.batch_sizes)
    hook, dirs = hooks.state, 2 if module.bidirectional else 1
    x = packed.data
    h0, c0 = _initial_state(module, x[: sizes[0]].unsqueeze(1), hx, True, dirs)  # (batch first)
    order = packed.sorted_indices
    rows = order if order is not None else torch.arange(sizes[0], device=x.device)
    examples = [functools.partial(add_rows, rows[:n], sizes[0]) for n in sizes]
    if hx is not None and order is not None:
        h0 = h0.index_select(1, order)
        c0 = c0.index_select(1, order) if c0 is not None else None

    def direction(p: Params, x: Tensor, h0: Tensor, c0: Tensor | None, reverse: bool) -> Run:
        h0 = hook(h0, examples[0]) if hooks.initial else h0  # (every sequence's, sorted)
        ys: list[Tensor] = []
        xs = x.split(sizes)  # (one split: a slice per step would write zeros in its backward)
        gis = _projected(p, x).split(sizes) if project_at_once else None

        def step(t: int, h: Tensor, c: Tensor | None) -> tuple[Tensor, Tensor | None]:
            gi = None if gis is None else gis[t]
            return _step(module.mode, p, xs[t], h, c, gi, hooks.cells(examples[t]))

        if not reverse:
            h, c = h0, c0
            ends_h: list[Tensor] = []  # the final states of sequences as they end
            ends_c: list[Tensor] = []
            for t, n in enumerate(sizes):
                c = c[:n] if c is not None else None
                h, c = step(t, h[:n], c)
                h = hook(h, examples[t])
                ys.append(h)
                ending = sizes[t + 1] if t + 1 < len(sizes) else 0
                ends_h.insert(0, h[ending:n])
                if c is not None:
                    ends_c.insert(0, c[ending:n])
            return torch.cat(ys), torch.cat(ends_h), torch.cat(ends_c) if c0 is not None else None
        h, c = h0[:0], c0[:0] if c0 is not None else None
        for t in reversed(range(len(sizes))):
            n = sizes[t]
            h = torch.cat([h, h0[h.shape[0] : n]])  # the sequences that start here join
            c = torch.cat([c, c0[c.shape[0] : n]]) if c is not None and c0 is not None else None
            h, c = step(t, h, c)
            h = hook(h, examples[t])
            ys.insert(0, h)
        return torch.cat(ys), h, c

    x, h_n, c_n = _layers(module, x, h0, c0, direction, dtype)
    back = packed.unsorted_indices
    if back is not None:
        h_n = h_n.index_select(1, back)
        c_n = c_n.index_select(1, back) if c_n is not None else None
    out = PackedSequence(x, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
    return (out, (h_n, c_n)) if c_n is not None else (out, h_n)
