"""Tables of rules keyed by ATen operator packet (the channel rules of ``graph.rules``, the
row rules of ``masks.rows``): one way to enter a rule, with one set of errors."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["enter_rule"]


def enter_rule(table: dict[Any, Any], ops: tuple[Any, ...], fn: Any, kind: str) -> Any:
    """Enter ``fn`` in ``table`` under the packet of each operator in ``ops`` and return it
    (``kind``: the rules' name in errors, ``"channel"`` or ``"row"``). Changes: ``table``.

    Raises:
        TypeError: a key is not an ATen operator.
        ValueError: an operator already has a rule in ``table`` (nothing is entered then
            for it or the operators after it).
    """
    for op in ops:
        key = getattr(op, "overloadpacket", op)
        if not isinstance(key, torch._ops.OpOverloadPacket):
            raise TypeError(f"register_{kind}_rule expects ATen operators, got {op!r}")
        if key in table:
            raise ValueError(f"{key} already has a {kind} rule")
        table[key] = fn
    return fn
