"""Cost conventions: one registered object per way of counting cost.

A ``Convention`` answers the three questions ``CostModel`` asks of it:

- ``formula(op)``: the formula of an operator: one registered for it with
  ``register_cost_formula``, else the convention's default (None: the op is free);
- ``parameter_formula``: the cost of one parameter tensor of a given (pruned) shape,
  or None when parameters cost nothing;
- ``divisor(batch_size)``: what a traced cost is divided by to be per example.

The conventions, and what a formula registered for an operator changes:

    flops   default: PyTorch's ``torch.utils.flop_counter`` formulas (2 FLOPs per
            multiply-accumulate of conv / linear / matmul / attention, bias and
            element-wise ops ignored), so the count equals ``FlopCounterMode`` on the
            physically shrunk network. A flops formula replaces PyTorch's for its op
            (or prices an op PyTorch has none for), and so changes ``macs`` too.
    macs    derived from flops: half the op's flops formula, registered or PyTorch's.
            A macs formula replaces the derived half for its op; flops is unchanged.
    twml    default: the seed's formulas (``formulas.TWML``; every other op is free).
            A twml formula replaces the seed's for its op or prices another op.
    memory  default: elements written by every operator that is not a view (the
            activation memory traffic Group Fisher Pruning normalises by). A memory
            formula replaces that count for its op, views included.
    params  parameter elements, with pruned shapes, per network (not divided by the
            batch). Not counted per operator: registering a formula for it is refused.
    latency microseconds per forward pass of a batch, every operator that is not a view timed
            on the device a ``LatencySpec`` names (``fisherprune.cost.latency``). Measured,
            not computed: registering a formula for it is refused.

Registering a second formula for the same convention and operator is refused;
``unregister_cost_formula`` is the exact inverse of ``register_cost_formula`` (the
built-in defaults are not registrations and cannot be removed). Formulas are looked
up when a ``CostModel`` is built: a registration changes the cost of every model
costed afterwards, not that of a ``CostModel`` that already exists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from fisherprune.cost.formulas import (
    TWML,
    VIEWS,
    Formula,
    elements_written,
    parameter_elements,
    torch_flops,
)

__all__ = [
    "CONVENTIONS",
    "Convention",
    "check_conventions",
    "cost_unit",
    "formula_for",
    "get_convention",
    "register_cost_formula",
    "unregister_cost_formula",
]

OpKey = torch._ops.OpOverloadPacket
Default = Callable[[OpKey], Formula | None]


@dataclass(frozen=True)
class Convention:
    """One way of counting cost, with the formulas registered for it.

    Attributes:
        name: the convention's name (``"flops"`` ...).
        summary: what it counts and what it derives from, one phrase (used in messages).
        default: the formula of an operator packet when none is registered, or None when
            the convention does not count operators at all (then formulas are refused).
        parameter_formula: cost of one parameter tensor from its (pruned) ``torch.Size``,
            or None when parameters cost nothing.
        per_example: divide the traced cost by the batch size (False: per network).
        measured: the operators' costs are timed (``fisherprune.cost.latency``), not
            computed by formulas (which are then refused).
    """

    name: str
    summary: str
    default: Default | None
    parameter_formula: Callable[[torch.Size], float] | None = None
    per_example: bool = True
    measured: bool = False
    _formulas: dict[OpKey, Formula] = field(default_factory=dict, init=False, repr=False)

    @property
    def per_op(self) -> bool:
        """Whether operators are costed (and formulas can be registered)."""
        return self.default is not None

    def formula(self, op: Any) -> Formula | None:
        """The formula of ``op`` (an operator or its packet): registered, else the default."""
        key = _packet(op)
        if key is None or self.default is None:
            return None
        if self.measured:  # every non-view op is timed; the default only says which
            return self.default(key)
        return self._formulas.get(key) or self.default(key)

    def divisor(self, batch_size: int) -> int:
        """What a cost traced on ``batch_size`` examples is divided by."""
        return batch_size if self.per_example else 1


def _packet(op: Any) -> OpKey | None:
    key = getattr(op, "overloadpacket", op)
    return key if isinstance(key, OpKey) else None


def _half_of_flops(key: OpKey) -> Formula | None:
    flops = _CONVENTIONS["flops"].formula(key)
    if flops is None:
        return None

    def macs(*args: Any, **kwargs: Any) -> float:
        return flops(*args, **kwargs) / 2

    return macs


def _written_unless_view(key: OpKey) -> Formula | None:
    return None if key in VIEWS else elements_written


_CONVENTIONS: dict[str, Convention] = {
    c.name: c
    for c in (
        Convention("flops", "PyTorch's flop_counter formulas", torch_flops),
        Convention(
            "macs",
            "derived: flops / 2 per op, so a flops formula changes macs too, "
            "unless a macs formula is registered for that op",
            _half_of_flops,
        ),
        Convention("twml", "the seed's formulas", TWML.get),
        Convention("memory", "elements written by every non-view op", _written_unless_view),
        Convention(
            "params",
            "parameter elements (with pruned shapes)",
            None,
            parameter_formula=parameter_elements,
            per_example=False,
        ),
        Convention(
            "latency",
            "microseconds per forward pass, timed per operator (a LatencySpec)",
            _written_unless_view,
            per_example=False,
            measured=True,
        ),
    )
}
CONVENTIONS: tuple[str, ...] = tuple(_CONVENTIONS)


def get_convention(name: str) -> Convention:
    """The convention called ``name``.

    Raises:
        ValueError: no such convention (the message lists them).
    """
    try:
        return _CONVENTIONS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown cost convention {name!r}; choose one of {', '.join(CONVENTIONS)}"
        ) from None


def check_conventions(convention: str, score_convention: str | None, latency: Any) -> None:
    """Refuse a ``score_convention`` that is no convention, and a ``latency`` spec given to a
    prune whose conventions are both computed (it would be ignored, and the prune would price
    FLOPs while the caller asked for a measured latency).

    Raises:
        ValueError: naming the setting and what to pass instead.
    """
    if score_convention is not None and score_convention not in CONVENTIONS:
        raise ValueError(
            f"score_convention must be one of {', '.join(CONVENTIONS)} or None, "
            f"got {score_convention!r}"
        )
    if latency is not None and "latency" not in (convention, score_convention):
        raise ValueError(
            f"latency= describes how convention='latency' times the model, but this prune's "
            f"convention is {convention!r} (score_convention {score_convention!r}): pass "
            "convention='latency' (or score_convention='latency'), or drop latency="
        )


def cost_unit(convention: str) -> str:
    """How a cost in ``convention`` reads after its number: ``flops/example``,
    ``us/forward pass`` (``latency``), ``params`` (per network)."""
    conv = get_convention(convention)
    if conv.measured:
        return "us/forward pass"
    return f"{conv.name}/example" if conv.per_example else conv.name


def formula_for(convention: str, op: Any) -> Formula | None:
    """The formula of ``op`` under ``convention``, or None if it costs nothing there.

    Raises:
        ValueError: unknown convention.
    """
    return get_convention(convention).formula(op)


def register_cost_formula(convention: str, *ops: Any) -> Callable[[Formula], Formula]:
    """Register the decorated function as the ``convention`` formula of every op in ``ops``.

    A formula receives the operator's arguments with every tensor replaced by its
    (pruned) ``torch.Size``, and the output shape(s) as ``out_shape``; it returns the
    cost of the whole traced batch (a negative result counts as 0). It replaces the
    convention's default for those ops in every model costed afterwards; a ``flops``
    formula also changes ``macs``, which derives from it (see the module docstring).

    Args:
        convention: a per-operator convention: ``flops``, ``macs``, ``twml`` or ``memory``.
        ops: operators (``torch.ops.aten.mm``, a ``torch.library`` op, or an overload of
            either; the whole packet is registered).

    Returns:
        A decorator that registers the function and returns it unchanged.

    Raises:
        ValueError: unknown convention; ``params`` (not per operator; the message says
            which conventions derive from which); no ops; an op that already has a
            registered formula for this convention.
        TypeError: a key that is not an operator.
        On any error nothing is registered.

    Example:
        >>> @register_cost_formula("flops", torch.ops.mylib.scale)
        ... def _scale(x, w, *, out_shape):
        ...     return math.prod(out_shape)  # one multiply per output element
    """
    conv = _per_op_convention(convention, "register_cost_formula")
    keys = _keys(ops, "register_cost_formula")

    def deco(fn: Formula) -> Formula:
        taken = [k for k in keys if k in conv._formulas]
        if taken:
            raise ValueError(
                f"{taken[0]} already has a {convention!r} formula; "
                "unregister_cost_formula it first to replace it"
            )
        for k in keys:
            conv._formulas[k] = fn
        return fn

    return deco


def unregister_cost_formula(convention: str, *ops: Any) -> None:
    """Remove the ``convention`` formulas registered for ``ops``.

    The exact inverse of ``register_cost_formula``: those ops cost the convention's
    default again in every model costed afterwards (for ``flops``, ``macs`` follows).
    Built-in defaults (PyTorch's formulas, the seed's) are not registrations and stay.

    Raises:
        ValueError: unknown or non-per-operator convention, no ops, or an op with no
            registered formula for this convention (then nothing is removed).
        TypeError: a key that is not an operator.
    """
    conv = _per_op_convention(convention, "unregister_cost_formula")
    keys = _keys(ops, "unregister_cost_formula")
    missing = [k for k in keys if k not in conv._formulas]
    if missing:
        raise ValueError(f"{missing[0]} has no registered {convention!r} formula")
    for k in keys:
        del conv._formulas[k]


def _per_op_convention(name: str, caller: str) -> Convention:
    conv = get_convention(name)
    if conv.measured:
        raise ValueError(
            f"{caller}: {name!r} is timed on the device, not computed by formulas; an "
            "operator that cannot be timed alone is priced by the elements it moves"
        )
    if not conv.per_op:
        per_op = "; ".join(f"{c.name} ({c.summary})" for c in _CONVENTIONS.values() if c.per_op)
        raise ValueError(
            f"{caller}: {name!r} counts {conv.summary}, not operators, so it takes no operator "
            f"formula (one would never be read). Conventions costed per operator: {per_op}"
        )
    return conv


def _keys(ops: Iterable[Any], caller: str) -> list[OpKey]:
    keys = []
    for op in ops:
        key = _packet(op)
        if key is None:
            raise TypeError(f"{caller} expects operators, got {op!r}")
        keys.append(key)
    if not keys:
        raise ValueError(f"{caller} needs at least one operator")
    return keys
