"""How the rows of each mask point's input relate to examples, read off the trace.

The tracer follows which example each row of every tensor belongs to (``fisherprune.masks.rows``)
and keeps, for each module call, the row map of each positional input. A point masks the input
of a module: its layout is that of the input in every call of the module (a module called with
inputs of different layouts gets ``"unknown"``). Rows selected by data are followed again at run
time inside the innermost enclosing module whose own inputs are batch or token rows: its scope.
"""

from __future__ import annotations

from fisherprune.graph.groups import MaskPointSpec
from fisherprune.graph.trace import Trace
from fisherprune.masks.rows import (
    BATCH,
    PACKED,
    SELECTED,
    TOKENS,
    UNKNOWN,
    RowLayout,
    Rows,
    batch_dim,
    classify_rows,
)

__all__ = ["layouts", "output_layouts", "point_layouts"]

_BATCH = RowLayout(BATCH)  # (frozen: one shared default)


def layouts(
    trace: Trace, specs: list[MaskPointSpec], doubled: Trace | None = None
) -> tuple[list[RowLayout], list[RowLayout]]:
    """``point_layouts`` and ``output_layouts`` of ``specs`` read off ``trace``; with
    ``doubled`` (a trace of the same batch twice over), each layout left unknown there is
    taken from it, where it saw that module or output."""
    rows: list[RowLayout] = point_layouts(trace, specs)  # type: ignore[assignment]
    outs: list[RowLayout] = output_layouts(trace, specs)  # type: ignore[assignment]
    if doubled is None:  # (with the default ``unseen``, no entry is None)
        return rows, outs

    def pick(first: RowLayout, second: RowLayout | None) -> RowLayout:
        return second if first.kind == UNKNOWN and second is not None else first

    rows2, outs2 = point_layouts(doubled, specs, None), output_layouts(doubled, specs, None)
    return (
        [pick(a, b) for a, b in zip(rows, rows2, strict=True)],
        [pick(a, b) for a, b in zip(outs, outs2, strict=True)],
    )


def point_layouts(
    trace: Trace, specs: list[MaskPointSpec], unseen: RowLayout | None = _BATCH
) -> list[RowLayout | None]:
    """The ``RowLayout`` of each module-input spec of ``specs`` (norms and outputs excluded),
    in order. A module the trace never saw called (one run through a registered forward) gets
    ``unseen``: by default batch rows, as every point was taken to read before rows were
    followed."""
    calls_of: dict[str, list[int]] = {}
    for i, c in enumerate(trace.calls):
        calls_of.setdefault(c.name, []).append(i)
    return [
        _layout(trace, calls_of[sp.module], sp.arg) if sp.module in calls_of else unseen
        for sp in specs
        if not sp.norm and sp.output is None
    ]


def output_layouts(
    trace: Trace, specs: list[MaskPointSpec], unseen: RowLayout | None = _BATCH
) -> list[RowLayout | None]:
    """The ``RowLayout`` of each output spec of ``specs``, in order (``unseen`` for an output
    the trace did not return)."""
    return [
        _rows_layout(trace.output_rows[sp.output], trace.batch_size)
        if sp.output in trace.output_rows
        else unseen
        for sp in specs
        if sp.output is not None and not sp.norm
    ]


def _rows_layout(rows: Rows | None, batch: int) -> RowLayout:
    """The layout of a tensor whose leading dims carry ``rows`` (traced with ``batch``
    examples), where data did not choose its rows."""
    kind = classify_rows(rows, batch)
    if kind == UNKNOWN and (k := batch_dim(rows, batch)) is not None:
        return RowLayout(BATCH, dim=k)  # a sequence-first tensor: the batch on dim k
    return RowLayout(kind)


def _layout(trace: Trace, calls: list[int], arg: int) -> RowLayout:
    found = {_call_layout(trace, i, arg) for i in calls}
    return found.pop() if len(found) == 1 else RowLayout(UNKNOWN)


def _call_layout(trace: Trace, call: int, arg: int) -> RowLayout:
    c = trace.calls[call]
    if arg in c.packed:
        return RowLayout(PACKED)
    rows = c.rows[arg] if arg < len(c.rows) else None
    if classify_rows(rows, trace.batch_size) != SELECTED:
        return _rows_layout(rows, trace.batch_size)
    parent = c.parent
    while parent >= 0:
        p = trace.calls[parent]
        seeds = tuple(
            (pos, k)
            for pos, r in enumerate(p.rows)
            if (k := classify_rows(r, trace.batch_size)) in (BATCH, TOKENS)
        )
        if seeds:
            return RowLayout(SELECTED, "" if p.name == "<model>" else p.name, seeds)
        parent = p.parent
    return RowLayout(UNKNOWN)
