"""Which adds the repair takes for a layer's residual: ``a + o``, ``o + a``, ``torch.add`` and
``+=`` with the layer's own output report the other operand; a scaled add, a subtraction, a
product or a copy of the output does not."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from fisherprune.calibrate.repair_residual import ResidualWatch


def _reported(op: Callable[[Tensor, Tensor], Tensor]) -> list[Tensor]:
    out, other = torch.randn(3, 4), torch.randn(3, 4)
    seen: list[Tensor] = []
    watch = ResidualWatch(lambda key, r: seen.append(r))
    with watch:
        watch.watch("layer", out)
        op(out, other)
    assert all(r is other for r in seen)
    return seen


def _iadd(o: Tensor, a: Tensor) -> Tensor:
    a += o
    return a


@pytest.mark.parametrize(
    "op",
    [lambda o, a: a + o, lambda o, a: o + a, lambda o, a: torch.add(a, o), _iadd],
    ids=["a+o", "o+a", "torch.add", "a+=o"],
)
def test_a_residual_add_reports_the_other_operand_once(op: Callable) -> None:
    assert len(_reported(op)) == 1


@pytest.mark.parametrize(
    "op",
    [
        lambda o, a: torch.add(a, o, alpha=2.0),
        lambda o, a: a - o,
        lambda o, a: a * o,
        lambda o, a: a + o.clone(),
        lambda o, a: o + 1.0,
    ],
    ids=["alpha", "sub", "mul", "copy", "scalar"],
)
def test_other_uses_of_the_output_are_not_residuals(op: Callable) -> None:
    assert _reported(op) == []


def test_only_the_first_add_of_a_call_is_its_residual() -> None:
    out, a, b = torch.randn(2), torch.randn(2), torch.randn(2)
    seen: list[Tensor] = []
    watch = ResidualWatch(lambda key, r: seen.append(r))
    with watch:
        watch.watch("layer", out)
        _ = a + out
        _ = b + out
    assert len(seen) == 1 and seen[0] is a
