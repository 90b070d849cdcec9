"""Grouped-query and multi-query attention: the units their heads are pruned in.

With grouped-query attention, G key/value heads are each read by R = H / G query heads
(Hugging Face's ``repeat_kv``, ``repeat_interleave``, ``expand`` + ``reshape``, or fused
attention with ``enable_gqa=True``). The attention rules (a batched matrix product, fused
attention) see which query head reads which key/value head and call ``tie_heads``, which
makes the heads prunable in one of two ways:

- ``"kv"``: a key/value head and every query head that reads it are one channel (one unit per
  key/value head). Shrinking keeps R query heads per key/value head.
- ``"query"``: query *slots*: slot j, the j-th query head of every key/value head, is one
  channel, and the key/value heads stay (a key/value head is removed only once every query
  head reading it is: ``Atoms.follow``). Shrinking keeps G key/value heads and as many query
  heads per key/value head as slots are kept, so the counts stay equal, as Hugging Face's
  ``num_key_value_groups`` requires (``shrink`` sets it).

A channel is one union-find component removed by one mask entry, so a query head cannot belong
to a key/value-head unit and to a slot unit at once (it would be removed when either mask is
zero): each layer uses one of the two. Multi-query attention (one key/value head, which can
never go) always uses query slots, one per query head; grouped-query attention uses ``"kv"``
unless ``set_grouped_query_units(module, "query")`` marked the layer or a module holding it.
The mark is an attribute of the module, so every trace of the model (``apply_masks``, the cost,
``shrink``) sees the same units.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
from torch import nn

from fisherprune.graph.types import RuleContext

__all__ = [
    "GROUPED_QUERY_UNITS",
    "UNITS_ATTRIBUTE",
    "grouped_query_units",
    "set_grouped_query_units",
    "tie_heads",
    "units_while_tracing",
]

#: the ways grouped-query attention's heads can be pruned (see the module docstring)
GROUPED_QUERY_UNITS: tuple[str, ...] = ("kv", "query")
#: the module attribute ``set_grouped_query_units`` sets
UNITS_ATTRIBUTE = "fisherprune_grouped_query_units"
_TRACED: dict[str, str] = {}  # while a model is traced: units by module name ("": the model)


def set_grouped_query_units(module: nn.Module, units: str) -> None:
    """Choose the prunable units of the grouped-query attention in ``module`` (a model, or
    some of its layers): ``"kv"`` (the default: a key/value head with the query heads that
    read it) or ``"query"`` (query slots, the key/value heads kept). Call it before
    ``apply_masks``; multi-query attention always uses query slots.

    Changes: sets ``module.fisherprune_grouped_query_units`` (a plain attribute, kept by
    ``copy.deepcopy`` and pickling, not in the ``state_dict``).

    Raises:
        ValueError: ``units`` is not one of ``GROUPED_QUERY_UNITS``.
    """
    if units not in GROUPED_QUERY_UNITS:
        raise ValueError(f"grouped-query units must be one of {GROUPED_QUERY_UNITS}, got {units!r}")
    setattr(module, UNITS_ATTRIBUTE, units)


@contextlib.contextmanager
def units_while_tracing(model: nn.Module) -> Iterator[None]:
    """While ``model`` is traced, ``grouped_query_units`` answers from its modules' marks."""
    marks = {
        name: getattr(m, UNITS_ATTRIBUTE)
        for name, m in model.named_modules()
        if getattr(m, UNITS_ATTRIBUTE, None) in GROUPED_QUERY_UNITS
    }
    before = dict(_TRACED)
    _TRACED.clear()
    _TRACED.update(marks)
    try:
        yield
    finally:
        _TRACED.clear()
        _TRACED.update(before)


def grouped_query_units(module: str) -> str:
    """The units of the grouped-query attention run by the module called ``module`` in the
    model being traced: the mark of the innermost module holding it, ``"kv"`` if none."""
    holders = [n for n in _TRACED if n in ("", module) or module.startswith(n + ".")]
    return _TRACED[max(holders, key=len)] if holders else "kv"


def tie_heads(ctx: RuleContext, q: np.ndarray, kv: np.ndarray) -> None:
    """Query head atom ``q[i]`` reads key/value head atom ``kv[i]`` (aligned arrays: one entry
    per head, or per example and head when heads are merged with the batch). Ties them as the
    units of this layer say (see the module docstring). Anything but whole groups of equally
    many distinct query heads per key/value head (plain multi-head attention among them) is
    tied head to head, as before grouped-query attention was known. Pruned by query slot,
    ``kv``'s entries (the repeated key/value heads, as the product reads them) are relabelled
    in place as the query heads reading them."""
    slots = _query_slots(ctx, q, kv)
    if slots is None:
        ctx.atoms.union(q, kv)
        return
    readers, kv_heads = slots
    ctx.record_query_slots(readers.T)
    ctx.atoms.follow(np.repeat(kv_heads, readers.shape[1]), readers.ravel())
    # each copy of a key/value head (``repeat_kv``) exists once per query head reading it: it
    # is labelled as that query head, so the cost of the product shrinks with the slots
    kv[:] = q


def _query_slots(
    ctx: RuleContext, q: np.ndarray, kv: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """The query heads reading each key/value head, (G, R) in order of appearance, and one atom
    of each key/value head (G,); None when the layer is not pruned by query slot."""
    atoms = ctx.atoms
    if q.size == 0 or atoms.is_batch(q) or atoms.is_batch(kv):
        return None
    rk = atoms.find(kv)
    if np.intersect1d(atoms.find(q), rk).size:
        return None  # already one channel
    # by the query heads' own atoms, not their channels: the second product (with v) sees the
    # slots the first (with k) made
    _, first = np.unique(np.stack([q, rk], 1), axis=0, return_index=True)
    first = np.sort(first)
    if np.unique(q[first]).size != first.size:
        return None  # a query head reading two key/value heads
    _, kv_first = np.unique(rk[first], return_index=True)
    order = rk[first][np.sort(kv_first)]
    groups = [first[rk[first] == r] for r in order]
    sizes = {g.size for g in groups}
    if len(sizes) != 1 or sizes == {1}:
        return None
    if len(groups) > 1 and grouped_query_units(ctx.module) != "query":
        return None
    readers = np.stack([q[g] for g in groups])
    return readers, np.asarray([kv[g[0]] for g in groups])
