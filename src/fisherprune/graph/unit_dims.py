"""Labels of dimensions of size 1 across a view: a batch of one, a single key/value head.

The common factors a reshape is cut into (``rules._reshape_labels``) never see a dimension of
size 1: it adds no factor. Size-1 dims sit in *runs* between the factors instead: the run at
place ``p`` is every size-1 dim with ``p`` elements inside it. A run of the input and the
run of the output at the same place hold the same values, so labels move between them; they
are matched by position in the run, never by size (a batch of one and a single key/value
head are both of size 1, and matching by size swapped them: the key/value head landed on the
batch dim and fused attention saw two heads of keys beside one query head).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np
from torch import Tensor

from fisherprune.graph.types import Labels, RuleContext, TensorInfo

__all__ = ["carry_unit_dims"]


def carry_unit_dims(
    ctx: RuleContext, x: TensorInfo, shape: tuple[int, ...], lab: list[Labels], cov: list[Labels]
) -> None:
    """Put the labels of ``x``'s size-1 dims on the view's output (``shape``; ``lab`` and
    ``cov`` hold what the common factors gave it, and are filled in place).

    ``unsqueeze`` and ``squeeze`` insert or remove known dims: every other dim keeps its
    place. Another view matches each run of ``x`` with the output's run at the same place:

    - as many dims on both sides: in order;
    - more in ``x``: the innermost goes into the output dim just inside the run when that dim
      is otherwise made of copies (``expand`` then ``reshape``: Hugging Face's ``repeat_kv``
      of one key/value head, whose label then marks every copy, as the query heads reading
      them are marked); the others in order, those beyond the output's run merged into its
      last dim, which takes their one channel label (a batch label gives way, as in a merge
      of larger dims);
    - fewer in ``x``: in order, the output's extra dims carry none.

    A channel label that finds no place (merged with another, or squeezed away) is blocked.
    """
    moved = _known_moves(ctx, x.shape, shape)
    if moved is not None:
        groups = [([s], moved.get(s)) for s in range(len(x.shape)) if x.shape[s] == 1]
    else:
        groups = _match_runs(ctx.args[0], x, shape, lab, cov)
    for dims, e in groups:
        labelled = [s for s in dims if x.labels[s] is not None]
        channels = [s for s in labelled if not ctx.atoms.is_batch(x.labels[s])]
        if e is not None and len(channels) <= 1 and labelled:
            s = (channels or labelled)[0]
            lab[e], cov[e] = x.labels[s], x.cover[s]
            continue
        reason = f"{ctx.where()} merges or drops a dimension of size 1 that holds a channel"
        for s in channels:
            ctx.stop(x.labels[s], x.cover[s], reason)


def _known_moves(
    ctx: RuleContext, src: tuple[int, ...], shape: tuple[int, ...]
) -> dict[int, int] | None:
    """Where ``unsqueeze`` or ``squeeze`` puts each size-1 dim of ``src`` (absent: removed);
    None for another view."""
    nd = len(src)
    if ctx.name == "unsqueeze":
        new = int(ctx.args[1]) % len(shape)
        return {s: s + (s >= new) for s in range(nd) if src[s] == 1}
    if ctx.name != "squeeze":
        return None
    asked = ctx.args[1] if len(ctx.args) > 1 else range(nd)
    asked = [asked] if isinstance(asked, int) else asked
    gone = {int(d) % nd for d in asked if nd and src[int(d) % nd] == 1}
    kept = [s for s in range(nd) if s not in gone]
    return {s: i for i, s in enumerate(kept) if src[s] == 1}


def _runs(shape: tuple[int, ...]) -> dict[int, list[int]]:
    """The size-1 dims of ``shape`` by place (the elements inside them), outermost first."""
    runs: dict[int, list[int]] = defaultdict(list)
    for d, size in enumerate(shape):
        if size == 1:
            runs[math.prod(shape[d + 1 :])].append(d)
    return runs


def _match_runs(
    src: Any, x: TensorInfo, shape: tuple[int, ...], lab: list[Labels], cov: list[Labels]
) -> list[tuple[list[int], int | None]]:
    """For a view: groups of ``x``'s size-1 dims and the output dim each group goes to (None:
    nowhere); a dim merged into copies is labelled here (see ``carry_unit_dims``)."""
    out_runs = _runs(shape)
    groups: list[tuple[list[int], int | None]] = []
    for place, dims in _runs(x.shape).items():
        into = out_runs.get(place, [])
        if len(dims) > len(into) and x.labels[dims[-1]] is not None:
            e = _copies_inside(src, x.shape, shape, place)
            if e is not None and lab[e] is None:
                s = dims.pop()
                lab[e] = np.repeat(x.labels[s], shape[e])
                cov[e] = None if x.cover[s] is None else np.repeat(x.cover[s], shape[e])
        if not into:
            groups += [([s], None) for s in dims]
            continue
        k = len(into) - 1
        groups += [([s], e) for s, e in zip(dims[:k], into, strict=False)]
        if len(dims) > k:
            groups.append((dims[k:], into[k]))
    return groups


def _copies_inside(
    src: Any, src_shape: tuple[int, ...], shape: tuple[int, ...], place: int
) -> int | None:
    """The dim of the reshaped ``shape`` just inside the size-1 run at ``place`` (it holds
    ``place`` elements with the run) if it is made of copies: the dims of tensor ``src`` it is
    made of that are larger than 1 all have stride 0 (``expand``)."""
    e = next((e for e, n in enumerate(shape) if n > 1 and math.prod(shape[e:]) == place), None)
    if e is None or not isinstance(src, Tensor):
        return None
    lo = math.prod(shape[e + 1 :])
    dims = [
        d
        for d, n in enumerate(src_shape)
        if n > 1 and math.prod(src_shape[d + 1 :]) >= lo and math.prod(src_shape[d:]) <= place
    ]
    return e if dims and all(src.stride(d) == 0 for d in dims) else None
