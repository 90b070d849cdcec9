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
batched (3-d) and unbatched (2-d) inputs. Dropout between layers runs as the module runs it
(only in training mode). A ``PackedSequence`` input is not supported here (its caller keeps the
module's own forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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


def recurrent_forward(
    module: nn.RNNBase, input: Tensor, hx: Tensor | tuple[Tensor, Tensor] | None = None
) -> tuple[Tensor, Tensor | tuple[Tensor, Tensor]]:
    """``module(input, hx)`` as the module computes it (the same ``(output, h_n)``, or
    ``(output, (h_n, c_n))`` for an LSTM, within rounding), one step at a time.

    Raises:
        ValueError: a mode this function does not know, or an input that is neither 2-d nor
            3-d.
    """
    mode = module.mode
    if mode not in GATES:
        raise ValueError(f"recurrent_forward: unknown recurrent mode {mode!r}")
    if input.dim() not in (2, 3):
        raise ValueError(
            f"recurrent_forward: {type(module).__name__} takes a 2-d (unbatched) or 3-d input, "
            f"got {input.dim()}-d"
        )
    batched = input.dim() == 3
    x = input if batched else input.unsqueeze(0)
    if batched and not module.batch_first:
        x = x.transpose(0, 1)  # (batch, steps, features) from here on: rows stay examples
    lstm = mode == "LSTM"
    dirs = 2 if module.bidirectional else 1
    h0, c0 = _initial_state(module, x, hx, batched, dirs)
    steps = x.shape[1]
    last_h: list[Tensor] = []
    last_c: list[Tensor] = []
    for layer in range(module.num_layers):
        outs = []
        for d in range(dirs):
            p = recurrent_params(module, layer, d)
            h = h0[layer * dirs + d]
            c = c0[layer * dirs + d] if c0 is not None else None
            ys: list[Tensor] = [h] * steps
            for t in reversed(range(steps)) if d else range(steps):
                # the input projection step by step too: on (batch, width) rows, so no view
                # writes a width as a number (the tracer would take a module attribute equal
                # to it, such as ``hidden_size``, for one that holds it)
                gi = F.linear(x[:, t], p["ih"], p["b_ih"])
                h, c = _cell(mode, gi, F.linear(h, p["hh"], p["b_hh"]), h, c)
                if p["hr"] is not None:
                    h = F.linear(h, p["hr"])
                ys[t] = h
            outs.append(torch.stack(ys, dim=1))
            last_h.append(h)
            if c is not None:
                last_c.append(c)
        x = torch.cat(outs, dim=-1) if dirs == 2 else outs[0]
        if module.dropout and module.training and layer < module.num_layers - 1:
            x = F.dropout(x, module.dropout, training=True)
    h_n = torch.stack(last_h)
    c_n = torch.stack(last_c) if lstm else None
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
    n = x.shape[0]
    if hx is None:
        h_out = module.proj_size or module.hidden_size
        h0 = x.new_zeros(module.num_layers * dirs, n, h_out)
        c0 = x.new_zeros(module.num_layers * dirs, n, module.hidden_size) if lstm else None
        return h0, c0
    h0, c0 = hx if lstm else (hx, None)  # type: ignore[misc]
    if not batched:
        h0 = h0.unsqueeze(1)
        c0 = c0.unsqueeze(1) if c0 is not None else None
    return h0, c0
