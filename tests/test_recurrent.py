"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``): their input width is prunable, their
cost is counted, their hidden units stay whole.

References outside the code under test: PyTorch's own modules (the step-by-step function's
outputs), a loop over PyTorch's own cells (``nn.LSTMCell`` / ``nn.GRUCell`` / ``nn.RNNCell``,
which ``FlopCounterMode`` counts: an ``nn.LSTM`` counts 0 there, its fused kernel having no
formula), the masked model's outputs (the shrunk one's), and per-example gradients by a plain
loop in float64 (the signal).
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

import fisherprune as fp
from fisherprune.recurrent import recurrent_forward
from tests.test_device_independence import structure

ATOL_F64 = 1e-12
CELLS = {nn.LSTM: nn.LSTMCell, nn.GRU: nn.GRUCell, nn.RNN: nn.RNNCell}
GATES = {nn.LSTM: 4, nn.GRU: 3, nn.RNN: 1}


def _flatten(out: tuple) -> list[Tensor]:
    """``(output, h_n)`` or ``(output, (h_n, c_n))`` as a list of tensors."""
    return [out[0], *(out[1] if isinstance(out[1], tuple) else (out[1],))]


def _cases() -> list[tuple]:
    out = []
    for cls, layers, bidir, batch_first, proj, given, batched in itertools.product(
        (nn.LSTM, nn.GRU, nn.RNN), (1, 2), (False, True), (False, True), (0, 3), (False, True),
        (False, True),
    ):  # fmt: skip
        if proj and cls is not nn.LSTM:
            continue
        out.append((cls, layers, bidir, batch_first, proj, given, batched))
    return out


def _cases_packed() -> list[tuple]:
    return [
        c
        for c in itertools.product(
            (nn.LSTM, nn.GRU, nn.RNN), (1, 2), (False, True), (0, 3), (False, True), (False, True)
        )
        if not (c[3] and c[0] is not nn.LSTM)
    ]


@pytest.mark.parametrize("cls,layers,bidir,batch_first,proj,given,batched", _cases())
def test_stepwise_function_equals_torch(
    cls: type, layers: int, bidir: bool, batch_first: bool, proj: int, given: bool, batched: bool
) -> None:
    """``recurrent_forward`` gives the module's output and final states (float64), for every
    mode, depth, direction, layout, projection, given or zero initial state, with and
    without a batch, with the input projected step by step (as traced) or at once."""
    torch.manual_seed(0)
    kw = {"proj_size": proj} if proj else {}
    m = cls(5, 4, num_layers=layers, bidirectional=bidir, batch_first=batch_first, **kw).double()
    n = 3
    shape = ((n, 6, 5) if batch_first else (6, n, 5)) if batched else (6, 5)
    x = torch.randn(shape, dtype=torch.float64)
    hx = None
    if given:
        states = layers * (2 if bidir else 1)
        lead = (states, n) if batched else (states,)
        h0 = torch.randn(*lead, proj or 4, dtype=torch.float64)
        hx = (h0, torch.randn(*lead, 4, dtype=torch.float64)) if cls is nn.LSTM else h0
    want = _flatten(m(x, hx))
    for at_once in (False, True):
        got = _flatten(recurrent_forward(m, x, hx, project_at_once=at_once))
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, atol=ATOL_F64, rtol=0)


def test_relu_rnn_equals_torch() -> None:
    m = nn.RNN(5, 4, nonlinearity="relu", num_layers=2).double()
    x = torch.randn(6, 3, 5, dtype=torch.float64)
    torch.testing.assert_close(recurrent_forward(m, x)[0], m(x)[0], atol=ATOL_F64, rtol=0)


# ----------------------------------------------------------------- a tagger around an RNN
class Tagger(nn.Module):
    """Embedding, a linear layer with ReLU, a recurrent layer, a classifier on the last step."""

    def __init__(
        self, cls: type, batch_first: bool, bidir: bool, layers: int = 2, width: int = 10
    ) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(50, 12)
        self.fc = nn.Linear(12, width)
        self.rnn = cls(width, 6, num_layers=layers, bidirectional=bidir, batch_first=batch_first)
        self.head = nn.Linear(12 if bidir else 6, 4)

    def forward(self, x: Tensor) -> Tensor:  # (N, L) token ids
        h = torch.relu(self.fc(self.emb(x)))
        if not self.batch_first:
            h = h.transpose(0, 1)
        o, _ = self.rnn(h)
        return self.head(o[:, -1] if self.batch_first else o[-1])


def _tagger(cls: type, batch_first: bool = True, bidir: bool = True) -> tuple[Tagger, Tensor]:
    torch.manual_seed(0)
    model = Tagger(cls, batch_first, bidir).double().eval()
    return model, torch.randint(0, 50, (3, 7))


def _cell_loop_flops(rnn: nn.RNNBase, x: Tensor) -> float:
    """FlopCounterMode's count of ``rnn`` on ``x`` (batch first) run as a loop over PyTorch's
    own cells with the layer's weights (its outputs checked equal to the module's)."""
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        out = _cells_masked(rnn, x, torch.ones(rnn.hidden_size, dtype=x.dtype))  # (x 1: free)
    torch.testing.assert_close(out, rnn(x)[0], atol=ATOL_F64, rtol=0)
    return counter.get_total_flops()


def _rnn_input(model: Tagger, x: Tensor) -> Tensor:
    """What ``model.rnn`` reads, batch first."""
    with torch.no_grad():
        return torch.relu(model.fc(model.emb(x)))


def _hidden(masks: fp.AppliedMasks) -> str:
    """The key of the recurrent layer's hidden-unit mask."""
    return next(k for k, g in masks.groups.items() if ("rnn.weight_hh_l0", 1) in g.params)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_input_width_and_hidden_units_are_groups(cls: type) -> None:
    """The linear layer feeding the recurrent one is a group (its consumer the recurrent
    layer), and so are the hidden units: unit j of both layers and both directions is one
    channel (6 of them), read by the recurrence, the layer above and the classifier."""
    model, x = _tagger(cls)
    masks = fp.apply_masks(model, x[:1])
    fc = next(g for g in masks.groups.values() if ("fc.weight", 0) in g.params)
    assert fc.num_channels == 10 and "rnn" in fc.consumers
    hidden = masks.groups[_hidden(masks)]
    assert hidden.num_channels == 6
    for name in ("weight_hh_l0", "weight_hh_l1_reverse", "weight_ih_l1"):
        assert (f"rnn.{name}", 0) in hidden.params and (f"rnn.{name}", 1) in hidden.params
    assert ("head.weight", 1) in hidden.params
    assert not [s for s in masks.skipped if "rnn" in str(s.params)]


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bidir", [True, False])
def test_shrunk_equals_masked_and_cost_equals_a_loop_of_torch_cells(
    cls: type, batch_first: bool, bidir: bool
) -> None:
    """A third of the recurrent layer's input channels and 2 of its 6 hidden units removed:
    the shrunk model gives the masked outputs (float64), its recurrent layer reads the kept
    width with the kept units, and the masked model's cost equals FlopCounterMode's count of
    the shrunk model (in float64 PyTorch's CPU kernels run the recurrence as products it
    counts), which counts the recurrent layer as a loop of PyTorch's cells."""
    model, x = _tagger(cls, batch_first, bidir)
    masks = fp.apply_masks(model, x[:1])
    fc = next(k for k, g in masks.groups.items() if ("fc.weight", 0) in g.params)
    masks[fc].mask[torch.tensor([1, 4, 8])] = 0.0
    masks[_hidden(masks)].mask[torch.tensor([0, 4])] = 0.0
    with torch.no_grad():
        want = model(x)
    small = fp.shrink(model, x[:1])
    with torch.no_grad():
        torch.testing.assert_close(small(x), want, atol=ATOL_F64, rtol=0)
    assert small.rnn.input_size == 7 and small.rnn.weight_ih_l0.shape[1] == 7
    assert small.rnn.hidden_size == 4 and small.rnn.weight_hh_l1.shape == (GATES[cls] * 4, 4)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        small(x)
    assert fp.computational_cost(model, x).total * x.shape[0] == counter.get_total_flops()
    rnn_in = _rnn_input(small, x)
    small.rnn.batch_first = True  # (the cell loop reads batch first; the same weights)
    with FlopCounterMode(display=False) as c, torch.no_grad():
        small.rnn(rnn_in)
    assert c.get_total_flops() == _cell_loop_flops(small.rnn, rnn_in)


def test_cost_does_not_depend_on_the_dtype() -> None:
    """In float32 the CPU runs an LSTM as one fused operator per layer, which FlopCounterMode
    counts as nothing; the cost is the same as in float64 (where it counts the products)."""
    model, x = _tagger(nn.LSTM)
    dense = fp.computational_cost(model, x).total
    model.float()
    h = _rnn_input(model, x)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model.rnn(h)
    assert counter.get_total_flops() == 0  # the premise: the fused kernel goes uncounted
    assert fp.computational_cost(model, x).total == dense


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_an_input_width_equal_to_the_hidden_size_shrinks_alone(cls: type) -> None:
    """The input width is 6, as the hidden size: pruning it leaves ``hidden_size`` as it is
    (no view inside the traced layer writes the width as a number that the attribute could be
    taken to hold) and the shrunk model gives the masked outputs."""
    torch.manual_seed(0)
    model = Tagger(cls, batch_first=True, bidir=True, width=6).double().eval()
    x = torch.randint(0, 50, (3, 7))
    masks = fp.apply_masks(model, x[:2])
    (fc,) = [k for k, g in masks.groups.items() if ("fc.weight", 0) in g.params]
    masks[fc].mask[torch.tensor([0, 4])] = 0.0
    with torch.no_grad():
        want = model(x)
        small = fp.shrink(model, x[:2])
        torch.testing.assert_close(small(x), want, atol=ATOL_F64, rtol=0)
    assert (small.rnn.input_size, small.rnn.hidden_size) == (4, 6)


def test_dense_cost_counts_the_recurrence() -> None:
    """An LSTM's dense cost is its products: per step and direction 2 * 4H * (input + H)
    multiply-adds per example, in each layer (the layer above reads both directions)."""
    model, x = _tagger(nn.LSTM)
    by_module = fp.computational_cost(model, x).by_module
    steps, h = 7, 6
    want = 2 * steps * 2 * 4 * h * (10 + h) + 2 * steps * 2 * 4 * h * (2 * h + h)
    assert by_module["rnn"] == want


def _cells_masked(rnn: nn.RNNBase, x: Tensor, m: Tensor) -> Tensor:
    """``rnn`` on ``x`` (batch first) as a loop over PyTorch's own cells with its weights,
    every step's hidden state multiplied by ``m`` (one multiplier per unit), in every layer
    and direction; returns the last layer's outputs."""
    dirs = 2 if rnn.bidirectional else 1
    inp = x
    for layer in range(rnn.num_layers):
        outs = []
        for d in range(dirs):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            cell = CELLS[type(rnn)](inp.shape[-1], rnn.hidden_size).double()
            with torch.no_grad():
                for role in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                    getattr(cell, role).copy_(getattr(rnn, role + sfx))
            state = None
            ys = [None] * inp.shape[1]
            for t in reversed(range(inp.shape[1])) if d else range(inp.shape[1]):
                state = cell(inp[:, t], state)
                if isinstance(state, tuple):  # an LSTM's (h, c): only h is masked
                    state = (state[0] * m, state[1])
                    ys[t] = state[0]
                else:
                    state = ys[t] = state * m
            outs.append(torch.stack(ys, dim=1))
        inp = torch.cat(outs, dim=-1)
    return inp


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_hidden_unit_signal_equals_a_per_example_loop(cls: type) -> None:
    """The hidden units' signal is 1/2 mean_n g_n^2, g_n the derivative of example n's loss
    w.r.t. one multiplier per unit acting on every step's state of both layers and both
    directions and on the classifier's input (where the masked model's mask acts too), in a
    loop over PyTorch's own cells, float64."""
    model, x = _tagger(cls)
    y = torch.tensor([0, 3, 1])
    masks = fp.apply_masks(model, x[:1])
    key = _hidden(masks)
    units = masks.groups[key].members[("rnn.weight_hh_l0", 1)]
    model.double().train()
    F.cross_entropy(model(x), y).backward()
    fp.update_pruning_signals(masks, decay=0)
    ref, _ = _tagger(cls)
    want = torch.zeros(6, dtype=torch.float64)
    for i in range(3):
        m = torch.ones(6, dtype=torch.float64, requires_grad=True)
        out = _cells_masked(ref.rnn, _rnn_input(ref, x[i : i + 1]), m)
        logits = ref.head(out[:, -1] * torch.cat([m, m]))
        (g,) = torch.autograd.grad(F.cross_entropy(logits, y[i : i + 1]), [m])
        want += 0.5 * g * g / 3
    assert float(want.abs().max()) > 0
    got = masks[key].signal[torch.as_tensor(units)]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_hidden_unit_signal_of_packed_sequences_equals_a_per_example_loop(cls: type) -> None:
    """With packed sequences of lengths 5, 7 and 3 (not sorted) the hidden units' signal is
    1/2 mean_n g_n^2, g_n from example n run alone over its own steps through PyTorch's
    cells, every state multiplied by the units' multipliers (and the classifier's input)."""
    model, (x, lengths) = _packed(cls)
    y = torch.tensor([0, 3, 1])
    masks = fp.apply_masks(model, (x, lengths))
    key = _hidden(masks)
    units = masks.groups[key].members[("rnn.weight_hh_l0", 1)]
    model.double().train()
    F.cross_entropy(model(x, lengths), y).backward()
    fp.update_pruning_signals(masks, decay=0)
    ref, _ = _packed(cls)
    want = torch.zeros(6, dtype=torch.float64)
    for i in range(3):
        m = torch.ones(6, dtype=torch.float64, requires_grad=True)
        steps = _rnn_input(ref, x[i : i + 1])[:, : int(lengths[i])]
        out = _cells_masked(ref.rnn, steps, m)
        logits = ref.head(out[:, 0] * torch.cat([m, m]))
        (g,) = torch.autograd.grad(F.cross_entropy(logits, y[i : i + 1]), [m])
        want += 0.5 * g * g / 3
    got = masks[key].signal[torch.as_tensor(units)]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("batch_first", [True, False])
def test_signal_at_the_recurrent_input_equals_a_per_example_loop(
    cls: type, batch_first: bool
) -> None:
    """The signal of the mask read by the recurrent layer is 1/2 mean_n g_n^2, g_n the
    derivative of example n's loss w.r.t. a multiplier on each of the recurrent layer's input
    channels of PyTorch's own module, float64."""
    model, x = _tagger(cls, batch_first)
    y = torch.tensor([0, 3, 1])
    masks = fp.apply_masks(model, x[:1])
    fc = next(k for k, g in masks.groups.items() if ("fc.weight", 0) in g.params)
    model.double().train()
    F.cross_entropy(model(x), y).backward()
    fp.update_pruning_signals(masks, decay=0)
    ref, _ = _tagger(cls, batch_first)
    want = torch.zeros(10, dtype=torch.float64)
    for i in range(3):
        m = torch.ones(10, dtype=torch.float64, requires_grad=True)
        h = _rnn_input(ref, x[i : i + 1]) * m
        o, _ = ref.rnn(h if batch_first else h.transpose(0, 1))
        logits = ref.head(o[:, -1] if batch_first else o[-1])
        (g,) = torch.autograd.grad(F.cross_entropy(logits, y[i : i + 1]), [m])
        want += 0.5 * g * g / 3
    assert float(want.abs().max()) > 0
    torch.testing.assert_close(masks[fc].signal, want, rtol=1e-9, atol=1e-15)


class PackedTagger(Tagger):
    """The same tagger fed its token ids with their lengths, packed (not sorted by length),
    classifying the first step's output."""

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:  # type: ignore[override]
        h = torch.relu(self.fc(self.emb(x)))
        o, _ = self.rnn(pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False))
        o, _ = pad_packed_sequence(o, batch_first=True)
        return self.head(o[:, 0])


def _packed(cls: type = nn.LSTM) -> tuple[PackedTagger, tuple[Tensor, Tensor]]:
    torch.manual_seed(0)
    model = PackedTagger(cls, batch_first=True, bidir=True).double().eval()
    return model, (torch.randint(0, 50, (3, 7)), torch.tensor([5, 7, 3]))


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_packed_sequence_input_width_is_masked_and_shrinks(
    cls: type, caplog: pytest.LogCaptureFixture
) -> None:
    """A recurrent layer given a PackedSequence: the width it reads is one group (its rows
    known to be the packed steps: no approximate-signal warning names it), and with some of
    that width and of its hidden units removed the shrunk model gives the masked outputs."""
    model, (x, lengths) = _packed(cls)
    masks = fp.apply_masks(model, (x, lengths))
    fc = next(k for k, g in masks.groups.items() if ("fc.weight", 0) in g.params)
    assert masks.groups[fc].consumers == ["rnn"]
    approximate = [r.getMessage() for r in caplog.records if "approximate" in r.getMessage()]
    named = {
        m for msg in approximate for m in msg.split(" masks at ")[1].split(" is ")[0].split(", ")
    }
    assert "rnn" not in named
    masks[fc].mask[torch.tensor([0, 3, 9])] = 0.0
    masks[_hidden(masks)].mask[torch.tensor([1, 5])] = 0.0
    with torch.no_grad():
        want = model(x, lengths)
        small = fp.shrink(model, (x, lengths))
        torch.testing.assert_close(small(x, lengths), want, atol=ATOL_F64, rtol=0)
    assert (small.rnn.input_size, small.rnn.hidden_size) == (7, 4)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_cost_of_a_packed_input_counts_the_steps_each_sequence_runs(cls: type) -> None:
    """With packed sequences of lengths 5, 7 and 3, the cost equals FlopCounterMode's count of
    the model in float64 (PyTorch's CPU kernels run the packed steps as products it counts)."""
    model, (x, lengths) = _packed(cls)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(x, lengths)
    assert fp.computational_cost(model, (x, lengths)).total * 3 == counter.get_total_flops()


def test_signal_of_a_packed_input_equals_a_per_example_loop() -> None:
    """With packed sequences of lengths 5, 7 and 3 the signal at the LSTM's input is
    1/2 mean_n g_n^2, g_n the derivative of example n's loss (run alone at its own length)
    w.r.t. a multiplier on each input channel of PyTorch's own LSTM, float64."""
    model, (x, lengths) = _packed()
    y = torch.tensor([0, 3, 1])
    masks = fp.apply_masks(model, (x, lengths))
    fc = next(k for k, g in masks.groups.items() if ("fc.weight", 0) in g.params)
    model.double().train()
    F.cross_entropy(model(x, lengths), y).backward()
    fp.update_pruning_signals(masks, decay=0)
    ref, _ = _packed()
    want = torch.zeros(10, dtype=torch.float64)
    for i in range(3):
        m = torch.ones(10, dtype=torch.float64, requires_grad=True)
        h = _rnn_input(ref, x[i : i + 1]) * m
        o, _ = ref.rnn(pack_padded_sequence(h, lengths[i : i + 1], batch_first=True))
        o, _ = pad_packed_sequence(o, batch_first=True)
        (g,) = torch.autograd.grad(F.cross_entropy(ref.head(o[:, 0]), y[i : i + 1]), [m])
        want += 0.5 * g * g / 3
    assert float(want.abs().max()) > 0
    torch.testing.assert_close(masks[fc].signal, want, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("cls,layers,bidir,proj,given,sort", _cases_packed())
def test_stepwise_function_equals_torch_on_packed_sequences(
    cls: type, layers: int, bidir: bool, proj: int, given: bool, sort: bool
) -> None:
    """``recurrent_forward`` of a PackedSequence (lengths 6, 5, 3, 1, sorted or not) gives
    the module's packed output and final states in the caller's order (float64), with the
    input projected step by step or at once."""
    torch.manual_seed(0)
    kw = {"proj_size": proj} if proj else {}
    m = cls(5, 4, num_layers=layers, bidirectional=bidir, batch_first=True, **kw).double()
    x = torch.randn(4, 6, 5, dtype=torch.float64)
    lengths = torch.tensor([6, 5, 3, 1] if sort else [3, 6, 1, 5])
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=sort)
    hx = None
    if given:
        states = layers * (2 if bidir else 1)
        h0 = torch.randn(states, 4, proj or 4, dtype=torch.float64)
        hx = (h0, torch.randn(states, 4, 4, dtype=torch.float64)) if cls is nn.LSTM else h0
    want = m(packed, hx)
    for at_once in (False, True):
        got = recurrent_forward(m, packed, hx, project_at_once=at_once)
        assert torch.equal(got[0].batch_sizes, want[0].batch_sizes)
        for a, b in zip(
            _flatten((got[0].data, got[1])), _flatten((want[0].data, want[1])), strict=True
        ):
            torch.testing.assert_close(a, b, atol=ATOL_F64, rtol=0)


class ProjectedLSTM(nn.LSTM):
    """A subclass whose forward is its own: a linear layer of its own before the recurrence."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.pre = nn.Linear(self.input_size, self.input_size)

    def forward(self, x: Tensor, hx: object = None) -> tuple:  # type: ignore[override]
        return super().forward(self.pre(x), hx)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_subclass_with_its_own_forward_is_traced_as_it_runs(dtype: torch.dtype) -> None:
    """A recurrent subclass that overrides ``forward`` is not replaced by the step-by-step
    function (which computes the base's): its own layer is traced, counted and masked, and
    the masked model gives its own outputs; in float32 too, where a CPU would run the LSTM as
    one fused operator (the trace turns that off around it)."""
    torch.manual_seed(0)
    model = Tagger(nn.LSTM, batch_first=True, bidir=False).to(dtype).eval()
    model.rnn = ProjectedLSTM(10, 6, batch_first=True).to(dtype)
    x = torch.randint(0, 50, (3, 7))
    with torch.no_grad():
        want = model(x)
    masks = fp.apply_masks(model, x[:1])
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, atol=0, rtol=0)
    cost = fp.computational_cost(model, x).by_module
    assert cost["rnn.pre"] == 2 * 7 * 10 * 10
    assert cost["rnn"] == 2 * 7 * 4 * 6 * (10 + 6)  # the recurrence, counted
    assert any("rnn.pre" in g.consumers for g in masks.groups.values())
    assert any(("fc.weight", 0) in g.params for g in masks.groups.values())
    assert torch.backends.mkldnn.enabled  # (restored after the trace)


@pytest.mark.parametrize("which", ["input", "hidden"])
def test_training_prunes_an_lstm_and_shrinks_to_the_masked_outputs(which: str) -> None:
    """``PruningOptimizer`` in float32 over the width the LSTM reads, or over its hidden units,
    gathers a finite signal there, prunes and the model shrinks to its masked outputs."""
    torch.manual_seed(0)
    model = Tagger(nn.LSTM, batch_first=True, bidir=True).train()
    x, y = torch.randint(0, 50, (8, 7)), torch.randint(0, 4, (8,))
    masks = fp.apply_masks(model, x[:1])
    fc = next(k for k, g in masks.groups.items() if ("fc.weight", 0) in g.params)
    key = fc if which == "input" else _hidden(masks)
    opt = fp.PruningOptimizer(
        model, x[:1], prune_every=2, burn_in=0, lr=0.05, masks={key: masks[key]}
    )
    for _ in range(6):
        opt.minimize(F.cross_entropy(model(x), y))
    assert torch.isfinite(masks[key].signal).all()
    pruned = int((masks[key].mask == 0).sum())
    assert pruned == 3
    model.eval()
    with torch.no_grad():
        want = model(x)
        small = fp.shrink(model, x[:1])
        torch.testing.assert_close(small(x), want, atol=1e-5, rtol=1e-5)
    kept = (small.rnn.input_size, small.rnn.hidden_size)
    assert kept == ((7, 6) if which == "input" else (10, 3))


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
    ],
)


@pytest.mark.parametrize("device", ["meta", CUDA])
def test_structure_equals_the_cpus(device: str) -> None:
    """Groups, mask points, skips and cost of an LSTM tagger living on ``device`` (cuDNN's
    fused LSTM on a GPU) equal those on the CPU."""
    model, x = _tagger(nn.LSTM)
    model.float()
    there = copy.deepcopy(model).to(device)
    assert structure(there, x.to(device)) == structure(model, x)
    cost = fp.computational_cost(model, x).total
    assert fp.computational_cost(there, x.to(device)).total == cost


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_float32_signal_and_shrink_on_device(device: str) -> None:
    """On ``device`` in float32 the signals at the LSTM's input and on its hidden units equal
    the float64 CPU ones (checked against per-example loops above), and the shrunk model
    gives the masked outputs."""
    model, x = _tagger(nn.LSTM)
    y = torch.tensor([0, 3, 1])
    masks = fp.apply_masks(model, x[:1])
    keys = [next(k for k, g in masks.groups.items() if ("fc.weight", 0) in g.params)]
    keys.append(_hidden(masks))
    model.double().train()  # (the masks' signals in float64 too)
    F.cross_entropy(model(x), y).backward()
    fp.update_pruning_signals(masks, decay=0)
    want = torch.cat([masks[k].signal for k in keys])
    there = copy.deepcopy(model).float().to(device)
    there.zero_grad(set_to_none=True)
    F.cross_entropy(there(x.to(device)), y.to(device)).backward()
    got = fp.find_masks(there)
    fp.update_pruning_signals(got, decay=0)
    mine = [next(m for name, m in got.items() if name.endswith(k)) for k in keys]
    signal = torch.cat([m.signal.double().cpu() for m in mine])
    torch.testing.assert_close(signal, want, rtol=1e-3, atol=1e-9)
    with torch.no_grad():
        for m in mine:
            m.mask[:2] = 0.0
    there.eval()
    with torch.no_grad():
        masked = there(x.to(device))
        small = fp.shrink(there, x[:1].to(device))
        torch.testing.assert_close(small(x.to(device)), masked, rtol=1e-4, atol=1e-5)


class _Projected(nn.Module):
    """A linear layer with ReLU, an LSTM with ``proj_size`` (2 layers, both directions), a
    classifier on its outputs' mean over the steps."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 10)
        self.rnn = nn.LSTM(10, 6, proj_size=4, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(torch.relu(self.fc(x)))[0].mean(1))


def _projected_loop(rnn: nn.LSTM, x: Tensor, m: Tensor, mc: Tensor | None = None) -> Tensor:
    """``rnn`` (an LSTM with ``proj_size``) on ``x`` (batch first) written out as a plain loop
    from its weights, every step's projected state multiplied by ``m`` (and its cells'
    outputs, before the projection, by ``mc``); the last layer's outputs."""
    mc = torch.ones(rnn.hidden_size, dtype=x.dtype) if mc is None else mc
    inp = x
    for layer in range(rnn.num_layers):
        outs = []
        for d in range(2 if rnn.bidirectional else 1):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            w_ih, w_hh, w_hr = (getattr(rnn, f"weight_{k}{sfx}") for k in ("ih", "hh", "hr"))
            b = getattr(rnn, f"bias_ih{sfx}") + getattr(rnn, f"bias_hh{sfx}")
            h = inp.new_zeros(inp.shape[0], rnn.proj_size)
            c = inp.new_zeros(inp.shape[0], rnn.hidden_size)
            ys = [h] * inp.shape[1]
            for t in reversed(range(inp.shape[1])) if d else range(inp.shape[1]):
                i, f, g, o = (inp[:, t] @ w_ih.T + h @ w_hh.T + b).chunk(4, dim=-1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = ys[t] = (torch.sigmoid(o) * torch.tanh(c) * mc) @ w_hr.T * m
            outs.append(torch.stack(ys, dim=1))
        inp = torch.cat(outs, dim=-1)
    return inp


def _cells(masks: fp.AppliedMasks) -> str:
    """The key of a projected LSTM's cells' mask."""
    return next(k for k, g in masks.groups.items() if ("rnn.weight_hr_l0", 1) in g.params)


def test_an_lstm_with_a_projection_prunes_its_projected_units_and_its_cells() -> None:
    """An LSTM with ``proj_size``: its projected units (the state its steps pass on and it
    returns: the recurrent weights' columns, the projection's rows, the next layer's and the
    classifier's columns) are one group, its cells (the gates' rows, the projection's
    columns) another, each tied over layers and directions. After a prune of each the shrunk
    LSTM (``proj_size`` 3, ``hidden_size`` 5) gives the masked outputs, and the cost equals
    ``FlopCounterMode`` on it (float64: PyTorch runs the products)."""
    torch.manual_seed(0)
    model, x = _Projected().double(), torch.randn(3, 6, 5, dtype=torch.float64)
    masks = fp.apply_masks(model, x[:1])
    key, cells = _hidden(masks), _cells(masks)
    assert masks[key].num_channels == 4 and masks[cells].num_channels == 6
    assert ("rnn.weight_hr_l1_reverse", 0) in masks.groups[key].params
    assert ("rnn.weight_ih_l1_reverse", 0) in masks.groups[cells].params
    assert not [s for s in masks.skipped if "output" not in s.reason]
    with torch.no_grad():
        masks[key].mask[1] = 0.0
        masks[cells].mask[4] = 0.0
        want = model(x)
        cost = fp.computational_cost(model, x[:1]).total
        small = fp.shrink(model, x[:1])
        torch.testing.assert_close(small(x), want, atol=ATOL_F64, rtol=0)
        with FlopCounterMode(display=False) as counter:
            small(x[:1])
    assert small.rnn.proj_size == 3 and small.rnn.hidden_size == 5
    assert cost == counter.get_total_flops()


class _Narrow(nn.Module):
    def __init__(self, cells: int) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 10)
        self.rnn = nn.LSTM(10, cells, proj_size=4, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(torch.relu(self.fc(x)))[0].mean(1))


def test_a_projected_lstm_keeps_more_cells_than_projected_units() -> None:
    """PyTorch runs an LSTM only with fewer projected units than cells: the cells keep
    ``proj_size + 1`` at least (their mask's floor, which ``prune`` honours, and within which
    ``apply_masks`` tries them), and an LSTM with no cell to spare keeps them whole, saying
    why. (A trial removing more cells than that had made the shrunk LSTM fail to run, and
    every group of the model was kept whole.)"""
    from fisherprune.pruner.prune import mask_floor

    x = torch.randn(1, 6, 5, dtype=torch.float64)
    masks = fp.apply_masks(_Narrow(7).double(), x)
    (cells,) = (m for k, m in masks.items() if ("rnn.weight_hr_l0", 1) in masks.groups[k].params)
    assert cells.num_channels == 7 and mask_floor(1, cells) == 5
    masks = fp.apply_masks(_Narrow(5).double(), x)
    assert not any(("rnn.weight_hr_l0", 1) in g.params for g in masks.groups.values())
    assert any("more cells than projected units" in s.reason for s in masks.skipped)


def test_removed_cells_and_projected_units_fold_once_nothing_is_collected() -> None:
    """Cells and projected units removed, nothing collected: the layer's own forward runs on
    weights whose columns reading them are zero (the projection's, the recurrent weights'),
    giving the outputs of the shrunk model, and those columns get no gradient."""
    torch.manual_seed(0)
    model, x = _Projected().double(), torch.randn(3, 6, 5, dtype=torch.float64)
    masks = fp.apply_masks(model, x[:1])
    key, cells = _hidden(masks), _cells(masks)
    with torch.no_grad():
        masks[key].mask[2] = 0.0
        masks[cells].mask[[0, 3]] = 0.0
    for m in masks.values():
        m.collecting = False
    want = fp.shrink(copy.deepcopy(model), x[:1])(x)
    out = model(x)
    out.pow(2).sum().backward()
    torch.testing.assert_close(out, want, atol=ATOL_F64, rtol=0)
    cols = [j for j, e in enumerate(masks.groups[cells].members[("rnn.weight_hr_l0", 1)])
            if e in (0, 3)]  # fmt: skip
    assert float(model.rnn.weight_hr_l0[:, cols].abs().max()) == 0.0
    assert float(model.rnn.weight_hr_l0.grad[:, cols].abs().max()) == 0.0


@pytest.mark.parametrize("which", ["projected_units", "cells"])
def test_signal_of_a_projected_lstm_equals_a_per_example_loop(which: str) -> None:
    """The projected units' (cells') signal of an LSTM with ``proj_size`` is 1/2 mean_n g_n^2,
    g_n the derivative of example n's loss w.r.t. one multiplier per unit (cell) acting on
    every step's projected state and the classifier's input (on every step's cells' outputs,
    before the projection), both layers and directions, in a plain float64 loop."""
    torch.manual_seed(0)
    model, x = _Projected().double(), torch.randn(3, 6, 5, dtype=torch.float64)
    y = torch.tensor([0, 2, 1])
    masks = fp.apply_masks(model, x[:1])
    cells = which == "cells"
    key, reader = (_cells(masks), "weight_hr_l0") if cells else (_hidden(masks), "weight_hh_l0")
    entries = masks.groups[key].members[(f"rnn.{reader}", 1)]
    model.double()
    F.cross_entropy(model(x), y).backward()
    fp.update_pruning_signals(masks, decay=0)
    n = 6 if cells else 4
    want = torch.zeros(n, dtype=torch.float64)
    for i in range(3):
        m = torch.ones(n, dtype=torch.float64, requires_grad=True)
        ones = torch.ones(4, dtype=torch.float64)
        with torch.no_grad():
            inp = torch.relu(model.fc(x[i : i + 1]))
        out = (
            _projected_loop(model.rnn, inp, ones, m)
            if cells
            else _projected_loop(model.rnn, inp, m)
        )
        read = out if cells else out * torch.cat([m, m])
        (g,) = torch.autograd.grad(F.cross_entropy(model.head(read.mean(1)), y[i : i + 1]), [m])
        want += 0.5 * g * g / 3
    assert float(want.abs().max()) > 0
    got = masks[key].signal[torch.as_tensor(entries)]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-15)


def test_l1_scores_hidden_units_by_their_gate_rows() -> None:
    """The L1 criterion scores hidden unit j by the absolute sum of its gate rows in every
    layer's and direction's input and recurrent weights (``weight_ih_l*``, ``weight_hh_l*``)."""
    model, x = _tagger(nn.LSTM)
    masks = fp.apply_masks(model, x[:1])
    key = _hidden(masks)
    units = masks.groups[key].members[("rnn.weight_hh_l0", 1)]
    got = fp.criteria.L1(normalize="none").importance(masks, model)[key]
    want = torch.zeros(6, dtype=torch.float64)
    for name, p in model.rnn.named_parameters():
        if name.startswith("weight_"):
            want += p.detach().abs().double().sum(1).view(4, 6).sum(0)
    torch.testing.assert_close(got[torch.as_tensor(units)], want, rtol=1e-12, atol=0)


def test_removed_units_fold_into_the_weights_once_nothing_is_collected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Units removed and no signal collected: the layer's own (fused) forward runs, not the
    step-by-step one; the removed units' columns of every weight that reads them are zero, so
    the masked model gives the shrunk model's outputs, and stay zero through an optimizer step
    (their gradients are zeroed too)."""
    import fisherprune.masks.recurrent_units as units_module

    model, x = _tagger(nn.LSTM)
    y = torch.tensor([0, 3, 1])
    masks = fp.apply_masks(model, x[:1])
    key = _hidden(masks)
    units = masks.groups[key].members[("rnn.weight_hh_l0", 1)]
    masks[key].mask[torch.tensor([1, 4])] = 0.0
    for m in masks.values():
        m.collecting = False
    removed = [j for j in range(6) if units[j] in (1, 4)]
    want = fp.shrink(copy.deepcopy(model), x[:1])
    calls: list[int] = []
    real = units_module.recurrent_forward
    monkeypatch.setattr(
        units_module, "recurrent_forward", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grad = model.rnn.weight_hh_l0.grad
        assert float(grad[:, removed].abs().max()) == 0.0
        opt.step()
    assert calls == []  # (the fused forward only)
    for name in ("weight_hh_l0", "weight_hh_l0_reverse", "weight_hh_l1", "weight_hh_l1_reverse"):
        assert float(getattr(model.rnn, name)[:, removed].abs().max()) == 0.0
    both = removed + [6 + j for j in removed]
    assert float(model.rnn.weight_ih_l1[:, both].abs().max()) == 0.0
    model.eval()
    small = fp.shrink(copy.deepcopy(model), x[:1])
    with torch.no_grad():
        torch.testing.assert_close(model(x), small(x), atol=ATOL_F64, rtol=0)
    assert want.rnn.hidden_size == small.rnn.hidden_size == 4


def test_no_fold_leaves_the_recurrent_weights_as_they_are() -> None:
    """Within ``no_fold`` (reading a masked model without touching it), removed units are
    masked step by step and no weight is written."""
    from fisherprune.masks.points import no_fold

    model, x = _tagger(nn.LSTM)
    masks = fp.apply_masks(model, x[:1])
    masks[_hidden(masks)].mask[torch.tensor([2])] = 0.0
    before = {n: p.detach().clone() for n, p in model.rnn.named_parameters()}
    with no_fold(model), torch.no_grad():
        inside = model(x)
    assert all(torch.equal(p, before[n]) for n, p in model.rnn.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(x), inside, atol=ATOL_F64, rtol=0)  # (folded now)


def test_no_fold_while_the_units_still_collect() -> None:
    """A forward without gradients while the masks still collect (pruning not over: a norm
    re-estimate between signal passes runs one) writes no weight: the removed units are
    masked step by step instead, and the output is the shrunk model's."""
    model, x = _tagger(nn.LSTM)
    masks = fp.apply_masks(model, x[:1])
    masks[_hidden(masks)].mask[torch.tensor([0, 3])] = 0.0
    assert all(m.collecting for m in masks.values())
    before = {n: p.detach().clone() for n, p in model.rnn.named_parameters()}
    with torch.no_grad():
        out = model(x)
    assert all(torch.equal(p, before[n]) for n, p in model.rnn.named_parameters())
    small = fp.shrink(copy.deepcopy(model), x[:1])
    with torch.no_grad():
        torch.testing.assert_close(out, small(x), atol=ATOL_F64, rtol=0)


def test_a_unit_restored_after_a_fold_gets_its_gradient_back() -> None:
    """Units folded (pruning over), then one restored (a checkpoint loaded, say) and collecting
    again: the gradient of the weight columns that read it is no longer filtered."""
    model, x = _tagger(nn.LSTM)
    y = torch.tensor([0, 3, 1])
    masks = fp.apply_masks(model, x[:1])
    key = _hidden(masks)
    unit = int(np.flatnonzero(masks.groups[key].members[("rnn.weight_hh_l0", 1)] == 2)[0])
    masks[key].mask[2] = 0.0
    for m in masks.values():
        m.collecting = False
    model.train()
    F.cross_entropy(model(x), y).backward()  # folds; the gradient filter is in place
    assert float(model.rnn.weight_hh_l0.grad[:, unit].abs().max()) == 0.0
    masks[key].mask[2] = 1.0
    for m in masks.values():
        m.collecting = True
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    assert float(model.rnn.weight_hh_l0.grad[:, unit].abs().max()) > 0.0


class StateFromInput(nn.Module):
    """An LSTM whose initial state ``(h0, c0)`` a linear layer makes from the first step (a
    tuple: no mask point can sit on it), then a classifier on the last step."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.init = nn.Linear(5, 8), nn.Linear(5, 6)
        self.rnn, self.head = nn.LSTM(8, 6, batch_first=True), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h0 = torch.tanh(self.init(x[:, 0])).unsqueeze(0)
        o, _ = self.rnn(torch.relu(self.fc(x)), (h0, torch.zeros_like(h0)))
        return self.head(o[:, -1])


@pytest.mark.parametrize("path", ["collecting", "folded"])
def test_a_given_initial_state_is_masked_with_the_units(path: str) -> None:
    """The units of an LSTM whose initial state a layer makes are one group with that layer's
    outputs; with two removed, the masked model (masking the state step by step, or with the
    units folded into the weights) gives the shrunk model's outputs."""
    torch.manual_seed(0)
    model = StateFromInput().double().eval()
    x = torch.randn(3, 7, 5, dtype=torch.float64)
    masks = fp.apply_masks(model, x[:1])
    key = _hidden(masks)
    assert ("init.weight", 0) in masks.groups[key].params
    masks[key].mask[torch.tensor([1, 4])] = 0.0
    for m in masks.values():
        m.collecting = path == "collecting"
    small = fp.shrink(copy.deepcopy(model), x[:1])
    with torch.no_grad():
        torch.testing.assert_close(model(x), small(x), atol=ATOL_F64, rtol=0)
    assert small.rnn.hidden_size == 4


def test_while_gathering_the_layers_own_forward_does_not_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step-by-step run that gathers the units' signal takes the place of the layer's own
    forward (its fused kernel), rather than following it: the own forward runs only where
    nothing is gathered."""
    model, x = _tagger(nn.LSTM)
    fp.apply_masks(model, x[:1])
    calls: list[int] = []
    own = nn.LSTM.forward

    def counted(self: nn.LSTM, *args: object, **kwargs: object) -> object:
        calls.append(1)
        return own(self, *args, **kwargs)

    monkeypatch.setattr(nn.LSTM, "forward", counted)
    model(x).sum().backward()  # gathering
    assert calls == []
    with torch.no_grad():
        model(x)  # nothing gathered
    assert calls == [1]


class _Reads(nn.Module):
    """A linear layer, a bidirectional LSTM (padded or packed input), a linear reader."""

    def __init__(self, packed: bool) -> None:
        super().__init__()
        self.packed = packed
        self.fc, self.rnn = nn.Linear(4, 5), nn.LSTM(5, 6, batch_first=True, bidirectional=True)
        self.head = nn.Linear(12, 2)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        h = self.fc(x)
        if not self.packed:
            return self.head(self.rnn(h)[0])
        o, _ = self.rnn(pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False))
        return self.head(pad_packed_sequence(o, batch_first=True)[0])


class _Written(TorchDispatchMode):
    """Counts the elements of every tensor the operators run under it return."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = tree_flatten(out)[0]
        self.count += sum(t.numel() for t in flat if isinstance(t, Tensor))
        return out


def _backward_written(packed: bool, steps: int) -> int:
    torch.manual_seed(0)
    model = _Reads(packed).double()
    x = torch.randn(3, steps, 4, dtype=torch.float64)
    lengths = torch.tensor([steps, steps - 1, steps // 2])
    fp.apply_masks(model, (x[:1], lengths[:1]))
    loss = model(x, lengths).pow(2).sum()
    with _Written() as written:
        loss.backward()
    return written.count


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_gathering_backward_grows_linearly_with_the_steps(packed: bool) -> None:
    """The backward of the step-by-step run writes about as much per step at 64 steps as at
    16: no step's backward writes a tensor the size of the whole sequence (a select or slice
    of it per step did: 6.2x the elements for 4x the steps)."""
    ratio = _backward_written(packed, 64) / _backward_written(packed, 16)
    assert ratio < 4.4


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_a_recurrent_layer_that_is_the_whole_model_has_its_units_masked(cls: type) -> None:
    """A bare recurrent layer given as the model: its hidden units (its outputs, its final
    states) are a masked group, and after a prune the shrunk model gives the masked model's
    outputs (float64). Its units' hook once ran after the model's own output hooks there, so
    the trial shrink failed and the units were kept whole."""
    torch.manual_seed(0)
    model = cls(4, 6, batch_first=True, bidirectional=True).double()
    x = torch.randn(3, 9, 4, dtype=torch.float64)
    masks = fp.apply_masks(model, x[:1])
    assert not masks.skipped and len(masks) == 1
    (mask,) = masks.values()
    with torch.no_grad():
        mask.mask[[1, 4]] = 0.0
        want = _flatten(model(x))
        got = _flatten(fp.shrink(model, x[:1])(x))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL_F64, rtol=0)


class TimeFirstPacked(Tagger):
    """Packed and padded back in PyTorch's default time-first layout (lengths sorted, as
    ``enforce_sorted=True`` needs, or not): the classifier reads every padded step (L, N, 12),
    averaged over the steps."""

    sort = False

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:  # type: ignore[override]
        h = torch.relu(self.fc(self.emb(x))).transpose(0, 1)
        o, _ = self.rnn(pack_padded_sequence(h, lengths, enforce_sorted=self.sort))
        return self.head(pad_packed_sequence(o)[0]).mean(0)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("sort", [False, True], ids=["unsorted", "enforce_sorted"])
def test_a_reader_of_time_first_padded_outputs_gets_the_exact_signal(
    cls: type, sort: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The classifier reads the outputs padded back time-first (the batch on dim 1, in the
    caller's order): its rows are followed (no "approximate" warning) and the hidden units'
    signal is 1/2 mean_n g_n^2, example n run alone over its own steps through PyTorch's
    cells, zero-padded to the longest, every state and the classifier's input multiplied by
    the units' multipliers, float64. Each step was taken for one example there before."""
    torch.manual_seed(0)
    model = TimeFirstPacked(cls, batch_first=False, bidir=True).double()
    model.sort = sort
    x, lengths = torch.randint(0, 50, (3, 7)), torch.tensor([7, 5, 3] if sort else [5, 7, 3])
    y = torch.tensor([0, 3, 1])
    with caplog.at_level("WARNING", logger="fisherprune"):
        masks = fp.apply_masks(model, (x, lengths))
    assert "approximate" not in caplog.text
    key = _hidden(masks)
    units = masks.groups[key].members[("rnn.weight_hh_l0", 1)]
    model.double()  # (the masks too)
    F.cross_entropy(model(x, lengths), y).backward()
    fp.update_pruning_signals(masks, decay=0)
    want = torch.zeros(6, dtype=torch.float64)
    for i in range(3):
        m = torch.ones(6, dtype=torch.float64, requires_grad=True)
        steps = _rnn_input(model, x[i : i + 1])[:, : int(lengths[i])]
        out = F.pad(_cells_masked(model.rnn, steps, m), (0, 0, 0, 7 - int(lengths[i])))
        logits = model.head(out * torch.cat([m, m])).mean(1)
        (g,) = torch.autograd.grad(F.cross_entropy(logits, y[i : i + 1]), [m])
        want += 0.5 * g * g / 3
    assert float(want.abs().max()) > 0
    got = masks[key].signal[torch.as_tensor(units)]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-15)


class _Normed(nn.Module):
    """A linear layer (bfloat16 under CPU autocast), its output cast to float32 or not, the
    recurrent layer, a classifier on its outputs' mean."""

    def __init__(self, cls: type, to_float32: bool) -> None:
        super().__init__()
        self.to_float32 = to_float32
        self.fc = nn.Linear(5, 8)
        self.rnn = cls(8, 6, batch_first=True, bidirectional=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return self.head(self.rnn(h.float() if self.to_float32 else h)[0].mean(1))


def _rnn_outputs(model: _Normed, x: Tensor) -> list[Tensor]:
    """The recurrent layer's outputs (and final states) in a bfloat16 autocast training step
    on ``x``'s device."""
    seen: list[Tensor] = []
    handle = model.rnn.register_forward_hook(lambda _m, _a, out: seen.extend(_flatten(out)))
    with torch.autocast(x.device.type, torch.bfloat16):
        loss = model(x).float().pow(2).sum()
    loss.backward()
    handle.remove()
    return seen


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("to_float32", [True, False], ids=["float32_input", "bfloat16_input"])
def test_gathering_under_autocast_keeps_the_layers_dtypes(
    cls: type, to_float32: bool, device: str
) -> None:
    """Under bfloat16 autocast, the step-by-step run that gathers the units' signal gives the
    outputs and final states in the dtypes the layer's own forward gives (on a CPU autocast
    casts an LSTM and an RNN to bfloat16, not a GRU: a float32 input keeps it float32; on a
    GPU cuDNN's every mode), within bfloat16 rounding of its values. It gave float32 where
    the layer gives bfloat16."""
    torch.manual_seed(0)
    model, x = _Normed(cls, to_float32).to(device), torch.randn(4, 7, 5, device=device)
    want = _rnn_outputs(model, x)
    fp.apply_masks(model, x[:1])
    got = _rnn_outputs(model, x)
    assert [t.dtype for t in got] == [t.dtype for t in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=0)


@pytest.mark.parametrize("name", ["lstm", "gru"])
@pytest.mark.parametrize(
    "shape", [(6, 4), (1, 4), (1, 5, 3), (7,)], ids=["steps", "one_step", "image", "vector"]
)
def test_built_in_recurrent_models_prune_both_widths_and_shrink_exactly(
    name: str, shape: tuple[int, ...]
) -> None:
    """``--model lstm`` / ``gru`` read sequences (T, F), images (C, H, W) row by row and flat
    vectors value by value: the width the recurrence reads and its hidden units are the two
    groups, and after a prune the shrunk model gives the masked one's outputs (float64)."""
    from fisherprune.train.models import build_model

    torch.manual_seed(0)
    model = build_model(name, shape, 3, 8, 1).double()
    x = torch.randn(4, *shape, dtype=torch.float64)
    masks = fp.apply_masks(model, x[:1])
    assert sorted(m.num_channels for m in masks.values()) == [8, 8]
    assert not [s for s in masks.skipped if "output" not in s.reason]
    with torch.no_grad():
        for m in masks.values():
            m.mask[[0, 5]] = 0.0
        want = model(x)
        torch.testing.assert_close(fp.shrink(model, x[:1])(x), want, atol=ATOL_F64, rtol=0)


class _PackedReads(nn.Module):
    """A linear layer, its output packed (lengths as given), an LSTM, padded back, read."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 8)
        self.rnn = nn.LSTM(8, 6, batch_first=True, num_layers=2)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        h = self.fc(x).float()
        o, _ = self.rnn(pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False))
        return self.head(pad_packed_sequence(o, batch_first=True)[0]).mean(1)


@pytest.mark.parametrize("lengths", [[7, 7, 7, 7], [7, 3, 5, 6]], ids=["even", "uneven"])
def test_gathering_a_packed_input_under_autocast_keeps_the_layers_dtypes(
    lengths: list[int],
) -> None:
    """Packed sequences under CPU bfloat16 autocast: the step-by-step run gives the packed
    output and final states in the dtypes the LSTM's own forward gives, which PyTorch makes
    bfloat16 for sequences of equal lengths and float32 for unequal ones (a kernel autocast
    does not cast); a probe on one plain row had given bfloat16 for both."""
    torch.manual_seed(0)
    model, x, n = _PackedReads(), torch.randn(4, 7, 5), torch.tensor(lengths)
    seen: list[Tensor] = []

    def outputs() -> list[torch.dtype]:
        seen.clear()
        handle = model.rnn.register_forward_hook(
            lambda _m, _a, out: seen.extend([out[0].data, *out[1]])
        )
        with torch.autocast("cpu", torch.bfloat16):
            model(x, n).float().sum().backward()
        handle.remove()
        return [t.dtype for t in seen]

    want = outputs()
    fp.apply_masks(model, (x[:1], n[:1]))
    assert outputs() == want


class _Attends(nn.Module):
    """A linear layer, a bidirectional 2-layer recurrent layer, attention over its outputs."""

    def __init__(self, cls: type) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 12)
        self.rnn = cls(12, 12, batch_first=True, num_layers=2, bidirectional=True)
        self.attn = nn.MultiheadAttention(24, 3, batch_first=True)
        self.head = nn.Linear(24, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.rnn(torch.relu(self.fc(x)))[0]
        return self.head(self.attn(h, h, h)[0].mean(1))


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("batch", [1, 3])
def test_attention_after_a_recurrent_layer_keeps_its_heads_at_any_example_batch(
    cls: type, batch: int
) -> None:
    """Traced with an example batch of 1 or 3, the attention reading the recurrent layer's
    outputs keeps its 3 heads prunable, and after a prune the shrunk model gives the masked
    outputs. At batch 3 the heads were kept whole ("merges channels of two dimensions"):
    the zero initial state, batch on dim 1, got fresh atoms rather than the batch's."""
    torch.manual_seed(0)
    model = _Attends(cls).double()
    x = torch.randn(batch, 5, 8, dtype=torch.float64)
    masks = fp.apply_masks(model, x)
    assert sorted(m.num_channels for m in masks.values()) == [3, 12, 12, 24]
    with torch.no_grad():
        for m in masks.values():
            m.mask[1] = 0.0
        want = model(x)
        torch.testing.assert_close(fp.shrink(model, x[:1])(x), want, atol=ATOL_F64, rtol=0)


class _OneStep(nn.Module):
    """A linear layer, a bidirectional LSTM (with ``proj_size`` or not), a classifier on the
    outputs' mean over the steps."""

    def __init__(self, proj: int, layers: int) -> None:
        super().__init__()
        kw = {"proj_size": proj} if proj else {}
        self.fc = nn.Linear(4, 5)
        self.rnn = nn.LSTM(5, 6, num_layers=layers, batch_first=True, bidirectional=True, **kw)
        self.head = nn.Linear(2 * (proj or 6), 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(self.fc(x))[0].mean(1))


@pytest.mark.parametrize("proj", [0, 3])
@pytest.mark.parametrize("layers", [1, 2])
def test_traced_on_one_step_the_units_are_whole_groups_and_shrink_for_longer_inputs(
    proj: int, layers: int
) -> None:
    """Traced on an example of one step (a table row read as a sequence), an LSTM's units
    (projected units where it has ``proj_size``) are still one group with the recurrent
    weights' columns, which only a second step reads: after a prune the shrunk model gives
    the masked outputs on 5 steps. A projected LSTM's shrunk ``weight_hh`` had kept its
    columns (it failed on 5 steps), and a plain one's units were kept whole."""
    torch.manual_seed(0)
    model = _OneStep(proj, layers).double()
    masks = fp.apply_masks(model, torch.randn(1, 1, 4, dtype=torch.float64))
    key = _hidden(masks)  # (a group holding the recurrent weights' columns)
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    with torch.no_grad():
        masks[key].mask[1] = 0.0
        want = model(x)
        small = fp.shrink(model, x[:1, :1])
        torch.testing.assert_close(small(x), want, atol=ATOL_F64, rtol=0)
