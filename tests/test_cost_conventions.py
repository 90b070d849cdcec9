"""register_cost_formula keeps its promise in every cost convention: a registered formula
changes that convention's total and marginal costs by exactly what it says (checked against
FlopCounterMode and hand counts on a tiny MLP), unregistering restores them, and a convention
that is not costed per operator refuses the formula with a message naming the derivations."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import fisherprune as fp
from fisherprune import MaskLayer
from fisherprune.cost import CONVENTIONS, formula_for
from fisherprune.cost.formulas import SAME_AS_TORCH, _grouped_heads, torch_flops

pytestmark = pytest.mark.filterwarnings("error")

aten = torch.ops.aten
IN, HIDDEN, OUT, BATCH = 6, 8, 4, 3
PRUNINGS = {"dense": [], "pruned": [1, 4, 6]}  # hidden units zeroed in the mask


# ------------------------------------------------------------------ helpers
def _two_per_element(*_args: Any, out_shape: Any = None, **_kw: Any) -> float:
    """A formula: 2 per output element (the same function serves FlopCounterMode)."""
    return 2.0 * math.prod(out_shape)


def _zero(*_args: Any, out_shape: Any = None, **_kw: Any) -> float:
    """A formula: the op is free."""
    return 0.0


class _Registrations:
    """Formulas registered by one test, all unregistered when it ends (whatever happens)."""

    def __init__(self) -> None:
        self._live: list[tuple[str, Any]] = []

    def add(self, convention: str, op: Any, formula: Any = _two_per_element) -> None:
        fp.register_cost_formula(convention, op)(formula)
        self._live.append((convention, op))

    def remove(self, convention: str, op: Any) -> None:
        fp.unregister_cost_formula(convention, op)
        self._live.remove((convention, op))

    def undo_all(self) -> None:
        while self._live:
            fp.unregister_cost_formula(*self._live.pop())


@pytest.fixture
def formulas() -> Iterator[_Registrations]:
    """Register formulas for one test only."""
    reg = _Registrations()
    try:
        yield reg
    finally:
        reg.undo_all()


def _net(pruning: str) -> nn.Sequential:
    """Linear(6, 8) -> ReLU -> MaskLayer(8) -> Linear(8, 4), with ``pruning``'s units zeroed."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.ReLU(), MaskLayer(HIDDEN), nn.Linear(HIDDEN, OUT)
    )  # fmt: skip
    with torch.no_grad():
        net[2].mask[PRUNINGS[pruning]] = 0.0
    return net


def _x() -> Tensor:
    return torch.randn(BATCH, IN)


def _twin(hidden: int) -> nn.Sequential:
    """The network built physically with ``hidden`` units and no mask."""
    return nn.Sequential(nn.Linear(IN, hidden), nn.ReLU(), nn.Linear(hidden, OUT))


def _flop_counter(net: nn.Module, mapping: dict[Any, Any] | None = None) -> float:
    """FLOPs per example by PyTorch's counter, with extra formulas in ``mapping``."""
    x = _x()
    with FlopCounterMode(display=False, custom_mapping=mapping or {}) as counter:
        net(x)
    return counter.get_total_flops() / x.shape[0]


def _reference(convention: str, hidden: int, relu_formula: bool) -> float:
    """Cost per example of the MLP with ``hidden`` units alive, counted independently: PyTorch's
    counter for flops (macs: half), the seed's formula and elements written by hand; plus the
    ReLU's cost per unit: its default (1 element written for memory, else free) or, with
    ``relu_formula``, the registered 2 per element."""
    if convention == "flops":
        mapping = {aten.relu: _two_per_element} if relu_formula else None
        return _flop_counter(_twin(hidden), mapping)  # the counter prices the ReLU itself
    base = {
        "macs": _flop_counter(_twin(hidden)) / 2,
        "twml": hidden * (2 * IN - 1) + hidden + OUT * (2 * hidden - 1) + OUT,  # + BiasAdds
        "memory": hidden + OUT,  # the two Linear outputs; the ReLU is added below
    }[convention]
    relu_per_unit = 2 if relu_formula else (1 if convention == "memory" else 0)
    return base + relu_per_unit * hidden


def _expected_marginal(convention: str, net: nn.Sequential, relu_formula: bool) -> Tensor:
    """Per unit: the reference cost with it alive minus with it gone; 0 for pruned units."""
    alive = int(net[2].kept)
    saved = _reference(convention, alive, relu_formula) - _reference(
        convention, alive - 1, relu_formula
    )
    return torch.where(net[2].mask > 0, saved, 0.0).double()


def _assert_cost(net: nn.Sequential, convention: str, relu_formula: bool) -> None:
    r = fp.computational_cost(net, _x(), convention)
    assert r.total == _reference(convention, int(net[2].kept), relu_formula)
    assert torch.equal(r.marginal[net[2]], _expected_marginal(convention, net, relu_formula))


PER_OP = [c for c in CONVENTIONS if c not in ("params", "latency")]


def test_every_convention_is_covered_here() -> None:
    """The conventions are exactly the four per-op ones tested below plus params and latency
    (both refuse formulas; latency's timing is tested in test_latency_cost.py): a new
    convention must say here what a registered formula does to it."""
    assert sorted(CONVENTIONS) == sorted(["flops", "macs", "twml", "memory", "params", "latency"])


# ------------------------------------------- registration changes the cost
@pytest.mark.parametrize("pruning", list(PRUNINGS))
@pytest.mark.parametrize("convention", PER_OP)
def test_reference_holds_without_registration(convention: str, pruning: str) -> None:
    """Without a registration, total and marginals equal the independent references
    (so the references below measure what a registration changes)."""
    _assert_cost(_net(pruning), convention, relu_formula=False)


@pytest.mark.parametrize("pruning", list(PRUNINGS))
@pytest.mark.parametrize("convention", PER_OP)
def test_registered_formula_sets_that_ops_cost(
    formulas: _Registrations, convention: str, pruning: str
) -> None:
    """A formula registered for ReLU (2 per element) replaces the convention's default for
    ReLU: the total moves by exactly 2 per alive unit less the default (0, or 1 element
    written for memory), and so does every alive unit's marginal cost."""
    net = _net(pruning)
    before = fp.computational_cost(net, _x(), convention)
    formulas.add(convention, aten.relu)
    after = fp.computational_cost(net, _x(), convention)
    _assert_cost(net, convention, relu_formula=True)
    per_unit = 1 if convention == "memory" else 2
    assert after.total - before.total == per_unit * net[2].kept  # not vacuous: it moved
    moved = after.marginal[net[2]] - before.marginal[net[2]]
    assert torch.equal(moved, torch.where(net[2].mask > 0, per_unit, 0.0).double())


@pytest.mark.parametrize("convention", PER_OP)
def test_unregistering_restores_the_cost(formulas: _Registrations, convention: str) -> None:
    """unregister_cost_formula is the exact inverse: total and marginals are the references
    without the formula again."""
    net = _net("pruned")
    formulas.add(convention, aten.relu)
    formulas.remove(convention, aten.relu)
    _assert_cost(net, convention, relu_formula=False)


def test_registering_an_overload_registers_its_packet(formulas: _Registrations) -> None:
    """A formula registered for ``aten.relu.default`` prices every ReLU call."""
    formulas.add("flops", aten.relu.default)
    assert formula_for("flops", aten.relu) is _two_per_element
    _assert_cost(_net("pruned"), "flops", relu_formula=True)


# --------------------------------------------------- macs derives from flops
@pytest.mark.parametrize("pruning", list(PRUNINGS))
def test_flops_formula_changes_macs_by_half(formulas: _Registrations, pruning: str) -> None:
    """macs derives from flops: a flops formula for ReLU (2 per element) adds 1 MAC per alive
    unit to the total and to each alive unit's marginal cost."""
    net = _net(pruning)
    before = fp.computational_cost(net, _x(), "macs")
    formulas.add("flops", aten.relu)
    after = fp.computational_cost(net, _x(), "macs")
    assert after.total == _reference("macs", net[2].kept, relu_formula=False) + net[2].kept
    moved = after.marginal[net[2]] - before.marginal[net[2]]
    assert torch.equal(moved, torch.where(net[2].mask > 0, 1.0, 0.0).double())


def test_macs_formula_overrides_the_derived_half(formulas: _Registrations) -> None:
    """A macs formula for addmm (free) replaces flops / 2 for the Linear layers: macs is 0,
    while flops still equals FlopCounterMode on the shrunk network."""
    net = _net("pruned")
    formulas.add("macs", aten.addmm, _zero)
    assert fp.computational_cost(net, _x(), "macs").total == 0.0
    assert fp.computational_cost(net, _x(), "flops").total == _flop_counter(_twin(net[2].kept))


def test_flops_formula_for_a_priced_op_replaces_pytorchs(formulas: _Registrations) -> None:
    """A flops formula for addmm replaces PyTorch's: the total equals FlopCounterMode with the
    same formula in its custom mapping, on the shrunk network."""
    net = _net("pruned")
    formulas.add("flops", aten.addmm)
    want = _flop_counter(_twin(net[2].kept), {aten.addmm: _two_per_element})
    assert want == 2 * (net[2].kept + OUT)  # the override, not PyTorch's 2 * MACs
    assert fp.computational_cost(net, _x(), "flops").total == want


def test_twml_formula_overrides_the_seeds(formulas: _Registrations) -> None:
    """A twml formula for addmm replaces the seed's MatMul + BiasAdd count; unregistering
    gives the seed's count back (the seed's formulas are the default, not registrations)."""
    net = _net("dense")
    formulas.add("twml", aten.addmm, _zero)
    assert fp.computational_cost(net, _x(), "twml").total == 0.0
    formulas.remove("twml", aten.addmm)
    assert fp.computational_cost(net, _x(), "twml").total == 160.0  # 8*11 + 8 + 4*15 + 4


def test_memory_formula_can_price_a_view(formulas: _Registrations) -> None:
    """memory skips views by default; a memory formula for ``t`` (2 per element) is read: it
    adds 2 per element of the two transposed weights (6*8 + 8*4), once per batch of 3."""
    net = _net("dense")
    before = fp.computational_cost(net, _x(), "memory").total
    formulas.add("memory", aten.t)
    after = fp.computational_cost(net, _x(), "memory").total
    assert after - before == pytest.approx(2 * (IN * HIDDEN + HIDDEN * OUT) / BATCH, rel=1e-12)


# --------------------------------------------------------------- params
def test_params_refuses_a_formula_and_names_the_derivations() -> None:
    """params counts parameter elements, not operators: registering a formula for it is a
    ValueError that says so and says macs derives from flops; nothing changes."""
    net = _net("pruned")
    before = fp.computational_cost(net, _x(), "params").total
    with pytest.raises(ValueError, match=r"'params' counts parameter elements") as err:
        fp.register_cost_formula("params", aten.addmm)
    assert "macs (derived: flops / 2" in str(err.value)
    assert fp.computational_cost(net, _x(), "params").total == before
    assert before == sum(p.numel() for p in _twin(net[2].kept).parameters())


def test_params_refuses_unregistering() -> None:
    """unregister_cost_formula refuses params the same way."""
    with pytest.raises(ValueError, match=r"'params' counts parameter elements"):
        fp.unregister_cost_formula("params", aten.addmm)


# --------------------------------------------------------------- refusals
def test_a_duplicate_is_refused_and_the_first_formula_kept(formulas: _Registrations) -> None:
    """A second formula for the same convention and op is a ValueError; the first stays."""
    formulas.add("flops", aten.relu)
    with pytest.raises(ValueError, match=r"already has a 'flops' formula"):
        fp.register_cost_formula("flops", aten.relu)(_zero)
    assert formula_for("flops", aten.relu) is _two_per_element


def test_the_same_op_in_two_conventions_is_not_a_duplicate(formulas: _Registrations) -> None:
    """Registrations are per convention: a flops and a memory formula for ReLU coexist."""
    formulas.add("flops", aten.relu)
    formulas.add("memory", aten.relu, _zero)
    assert formula_for("flops", aten.relu) is _two_per_element
    assert formula_for("memory", aten.relu) is _zero


def test_a_refused_registration_registers_nothing(formulas: _Registrations) -> None:
    """Registering (tanh, relu) when relu already has a formula registers neither."""
    formulas.add("flops", aten.relu)
    with pytest.raises(ValueError, match="already has"):
        fp.register_cost_formula("flops", aten.tanh, aten.relu)(_zero)
    assert formula_for("flops", aten.tanh) is None


def test_a_non_operator_is_refused() -> None:
    """A key that is not an operator is a TypeError (at the call), nothing registered."""
    with pytest.raises(TypeError, match="expects operators"):
        fp.register_cost_formula("flops", torch.relu)
    assert formula_for("flops", aten.relu) is None


def test_no_operator_is_refused() -> None:
    """A registration naming no operator would register nothing: ValueError."""
    with pytest.raises(ValueError, match="at least one operator"):
        fp.register_cost_formula("flops")


@pytest.mark.parametrize("convention", ["FLOPS", "bogus"])
def test_an_unknown_convention_is_refused(convention: str) -> None:
    """register and unregister name an unknown convention and list the known ones."""
    with pytest.raises(ValueError, match=rf"unknown cost convention {convention!r}; choose"):
        fp.register_cost_formula(convention, aten.relu)
    with pytest.raises(ValueError, match=rf"unknown cost convention {convention!r}; choose"):
        fp.unregister_cost_formula(convention, aten.relu)


def test_unregistering_what_was_never_registered_is_refused() -> None:
    """Unregistering an op with no registered formula is a ValueError, including a built-in
    default (the seed's twml formula for mm), which stays."""
    with pytest.raises(ValueError, match="has no registered 'flops' formula"):
        fp.unregister_cost_formula("flops", aten.relu)
    twml_mm = formula_for("twml", aten.mm)
    with pytest.raises(ValueError, match="has no registered 'twml' formula"):
        fp.unregister_cost_formula("twml", aten.mm)
    assert twml_mm is not None and formula_for("twml", aten.mm) is twml_mm


def test_a_cost_model_built_before_a_registration_keeps_its_formulas(
    formulas: _Registrations,
) -> None:
    """Formulas are looked up when a CostModel is built: a later registration changes the
    cost of models built afterwards only."""
    net = _net("dense")
    model = fp.CostModel(net, _x(), "flops")
    formulas.add("flops", aten.relu)
    assert model.total() == _reference("flops", HIDDEN, relu_formula=False)
    assert fp.CostModel(net, _x(), "flops").total() == _reference("flops", HIDDEN, True)


def test_no_formula_is_left_registered() -> None:
    """Outside the fixture the formulas these tests register are gone."""
    for convention in PER_OP:
        for op in (aten.relu, aten.tanh, aten.t):
            with pytest.raises(ValueError, match="has no registered"):
                fp.unregister_cost_formula(convention, op)


@pytest.mark.parametrize(
    ("op", "shapes"),
    [
        (torch.ops.aten.addmm, [(7,), (5, 3), (3, 7)]),
        (torch.ops.aten.baddbmm, [(2, 5, 7), (2, 5, 3), (2, 3, 7)]),
    ],
)
def test_unwrapped_product_formulas_count_as_torchs(op: Any, shapes: list[tuple]) -> None:
    """The formulas the cost model calls on shapes for ``addmm`` and ``baddbmm`` (PyTorch's
    count of the product alone, unwrapped) give what PyTorch's registered formula gives on
    the tensors themselves, as ``FlopCounterMode`` calls it."""
    from torch.utils.flop_counter import flop_registry

    from fisherprune.cost.formulas import torch_flops

    tensors = [torch.zeros(s) for s in shapes]
    out = op(*tensors)
    want = flop_registry[op](*tensors, out_val=out)
    assert torch_flops(op)(*(torch.Size(s) for s in shapes), out_shape=out.shape) == want


@pytest.mark.parametrize("kv_heads", [1, 2, 6])
def test_attention_with_fewer_key_value_heads_counts_its_heads_broadcast(kv_heads: int) -> None:
    """Grouped-query attention's FLOPs (torch 2.11's formula refuses its shapes): what
    FlopCounterMode counts for the same attention with key and value repeated to every query
    head, both by the wrapper that older torch gets and by the formula this torch uses."""
    q, k, v = (
        torch.randn(2, 6, 5, 4),
        torch.randn(2, kv_heads, 7, 4),
        torch.randn(2, kv_heads, 7, 3),
    )
    rep = 6 // kv_heads
    with FlopCounterMode(display=False, custom_mapping=SAME_AS_TORCH) as counter:
        F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    shapes = (q.shape, k.shape, v.shape)
    assert _grouped_heads(flop_registry[flash].__wrapped__)(*shapes) == counter.get_total_flops()
    assert torch_flops(flash)(*shapes, out_shape=None) == counter.get_total_flops()
