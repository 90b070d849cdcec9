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
never go) always uses query slots, one per query head; grouped-query attention uses
``"kv"`` unless ``set_grouped_query_units("query")`` says otherwise.
"""

from __future__ import annotations

import numpy as np

from fisherprune.graph.types import RuleContext

__all__ = ["GROUPED_QUERY_UNITS", "grouped_query_units", "set_grouped_query_units", "tie_heads"]

#: the ways grouped-query attention's heads can be pruned (see the module docstring)
GROUPED_QUERY_UNITS: tuple[str, ...] = ("kv", "query")
_SETTING: dict[str, str] = {"units": "kv"}


def set_grouped_query_units(units: str) -> None:
    """Choose the prunable units of grouped-query attention in models traced from now on:
    ``"kv"`` (the default: a key/value head with the query heads that read it) or ``"query"``
    (query slots, the key/value heads kept). Multi-query attention always uses query slots.
    Changes a process-wide setting; masks already applied keep their units.

    Raises:
        ValueError: ``units`` is not one of ``GROUPED_QUERY_UNITS``.
    """
    if units not in GROUPED_QUERY_UNITS:
        raise ValueError(f"grouped-query units must be one of {GROUPED_QUERY_UNITS}, got {units!r}")
    _SETTING["units"] = units


def grouped_query_units() -> str:
    """The units grouped-query attention is pruned in now (``set_grouped_query_units``)."""
    return _SETTING["units"]


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
    if len(groups) > 1 and grouped_query_units() != "query":
        return None
    readers = np.stack([q[g] for g in groups])
    return readers, np.asarray([kv[g[0]] for g in groups])
