"""The cost of a masked network and the exact marginal cost of each mask channel.

``CostModel`` traces the model once; afterwards it re-evaluates the cost from
the current mask values without running the model, so a pruning loop never
re-traces. The marginal cost of channel k of a mask is ``cost(now) -
cost(now with that entry zeroed)``, computed for every entry at once by
evaluating each operator's formula once per distinct shape change.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fisherprune._errors import first_line
from fisherprune.cost.blocks import GateEntries
from fisherprune.cost.conventions import get_convention
from fisherprune.cost.experts import ExpertEntries
from fisherprune.cost.formulas import Formula
from fisherprune.cost.latency import (
    UNIT,
    LatencySpec,
    LatencyTable,
    OpTimer,
    op_axes,
    time_op,
    timing_threads,
    whole_model_seconds,
    with_batch,
)
from fisherprune.cost.latency_curve import LatencyCurve
from fisherprune.graph.channels import ChannelGraph
from fisherprune.graph.trace import Trace, trace_model
from fisherprune.graph.types import OpRecord, Slot
from fisherprune.inputs import batch_size
from fisherprune.masks import MaskLayer, find_masks, masks_kept

__all__ = ["CostModel", "CostReport", "MarginalCosts", "computational_cost"]

#: term evaluations a ``CostModel`` remembers (shapes per term) before it starts afresh
EVAL_CACHE_SIZE = 200_000
_NO_ENTRIES = np.zeros(0, dtype=np.int64)
#: a term's cost now, the entries that would remove some of its channels, and what each saves
Margin = tuple[float, np.ndarray, np.ndarray]
_NO_SAVINGS = np.zeros(0)

log = logging.getLogger("fisherprune")


class MarginalCosts(Mapping[str, Tensor]):
    """Per-mask tensors of marginal cost, indexed by mask name or by the MaskLayer itself."""

    def __init__(self, values: dict[str, Tensor], names: dict[int, str]) -> None:
        self._values = values
        self._names = names

    def _key(self, key: str | MaskLayer) -> str:
        if isinstance(key, MaskLayer):
            try:
                return self._names[id(key)]
            except KeyError:
                raise KeyError("this MaskLayer is not one of the costed model's masks") from None
        return key

    def __getitem__(self, key: str | MaskLayer) -> Tensor:  # type: ignore[override]
        return self._values[self._key(key)]

    def __contains__(self, key: object) -> bool:
        try:
            return self._key(key) in self._values  # type: ignore[arg-type]
        except KeyError:
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


@dataclass
class CostReport:
    """Cost per example of a network as masked now.

    Attributes:
        total: cost per example (in ``convention`` units).
        marginal: per mask, a float64 tensor of the cost per example saved by
            zeroing each channel alone (0 for channels already pruned).
        convention: ``flops``, ``macs``, ``twml``, ``memory``, ``params`` or ``latency``
            (microseconds per forward pass of the ``LatencySpec``'s batch, not per example).
        by_module: cost per example of each module (innermost module that ran the op).
    """

    total: float
    marginal: MarginalCosts
    convention: str
    by_module: dict[str, float] = field(default_factory=dict)


@dataclass
class _Term:
    """One priced part of the model: an operator's formula on its slots' shapes (``op``), or
    a function of one shape (``op`` None): a parameter's, or a timed operator's kept widths
    per axis (``dims`` then index that one shape: (0, axis, its roots)).

    Dims that index the same channels (a Linear's input and its weight's input dim) lose
    channels together, so the channels are counted per distinct set: ``sets``, and per dim
    ``set_of`` its set's index; ``roots`` holds every set's channels, concatenated."""

    formula: Formula
    op: OpRecord | None  # None for a parameter term or a timed operator
    dims: list[tuple[int, int, np.ndarray]]  # (slot, dim, roots of its indices)
    shapes: list[tuple[int, ...]]
    module: str
    sets: list[np.ndarray] = field(init=False)
    set_of: list[int] = field(init=False)
    roots: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        """Sets ``sets``, ``set_of`` and ``roots`` from ``dims``."""
        self.sets, self.set_of = [], []
        for _s, _d, r in self.dims:
            same = (i for i, c in enumerate(self.sets) if np.array_equal(c, r))
            i = next(same, len(self.sets))
            if i == len(self.sets):
                self.sets.append(r)
            self.set_of.append(i)
        self.roots = np.concatenate(self.sets) if self.sets else _NO_ENTRIES

    def removed_per_set(self, removed: np.ndarray) -> list[int]:
        """How many channels of each set ``removed`` (per root) removes."""
        return [int(removed[r].sum()) for r in self.sets]

    def shapes_less(self, gone: list[int]) -> list[tuple[int, ...]]:
        """``shapes`` with ``gone[i]`` channels fewer in every dim of set ``i``."""
        shapes = [list(s) for s in self.shapes]
        for (s, d, _r), i in zip(self.dims, self.set_of, strict=True):
            shapes[s][d] -= gone[i]
        return [tuple(s) for s in shapes]


class CostModel:
    """A traced model whose cost can be re-evaluated for any mask state.

    Args:
        model: the network, with MaskLayers placed by hand or by ``apply_masks``.
        example_inputs: a tensor, a tuple of positional inputs or a dict of keyword inputs
            (``fisherprune.inputs``); traced costs are divided by their batch size.
        convention: a name in ``CONVENTIONS``; see ``fisherprune.cost.conventions``.
        loss_fn: optional callable on the model output, traced and costed too
            (the seed counted its loss's own ops).
        latency: where and how ``convention="latency"`` times the model (default
            ``LatencySpec()``: the CPU as it is set now, the model's dtype, the example
            inputs' batch). Building the model then times every operator not yet in the
            spec's table (``fisherprune.cost.latency``) and the dense model once, with the
            masks as they are (all ones for a dense model); the table is saved.
        latency_calibration: with ``latency``: a ``latency_calibration`` of an earlier cost
            model of this model and spec (a resumed run's checkpoint): its slope and offset are
            used and the whole model is not timed again; None: timed.
        trace: a trace of ``model`` on ``example_inputs`` with its masks placed as now (mask
            values may differ), made without ``loss_fn``: used instead of tracing again, as
            ``apply_masks`` shares the one it checked its masks with. Not with the ``latency``
            convention, which traces at its spec's batch.

    Raises:
        ValueError: unknown convention; ``latency`` or ``latency_calibration`` given with
            another convention; a table file measured under another device, dtype, torch
            version, thread count or form; ``trace`` with the latency convention or a
            ``loss_fn``.
    """

    def __init__(
        self,
        model: nn.Module,
        example_inputs: Any,
        convention: str = "flops",
        loss_fn: Callable[[Any], Tensor] | None = None,
        latency: LatencySpec | None = None,
        latency_calibration: dict[str, Any] | None = None,
        *,
        trace: Trace | None = None,
    ) -> None:
        self._calibration = latency_calibration
        self._counting = get_convention(convention)  # its formulas, parameter terms, divisor
        self.convention = convention
        if latency is not None and not self._counting.measured:
            raise ValueError(
                f"latency= describes how convention='latency' times the model; the "
                f"{convention!r} convention is computed, so drop latency= or choose 'latency'"
            )
        if latency_calibration is not None and not self._counting.measured:
            raise ValueError(
                f"latency_calibration= prices the latency convention's operators; the "
                f"{convention!r} convention has none, so drop it"
            )
        if trace is not None and (self._counting.measured or loss_fn is not None):
            raise ValueError(
                "trace= stands for the trace of the model alone on example_inputs; the latency "
                "convention traces at its own batch and loss_fn adds ops: drop trace="
            )
        if batch_size(example_inputs) == 0:
            raise ValueError(
                "example_inputs hold a batch of 0 examples; costs are per example, so give at "
                "least one (e.g. x[:1])"
            )
        #: how ``latency`` is timed (None for computed conventions)
        self.latency = (latency or LatencySpec()) if self._counting.measured else None
        #: ``latency``: what every operator's time is multiplied by: the dense model timed
        #: whole over its operators timed alone, or the slope of ``set_latency_line`` (1 else)
        self.latency_scale = 1.0
        #: ``latency``: microseconds per forward pass added to the operators' scaled sum (the
        #: offset of ``set_latency_line``; 0 else)
        self.latency_offset = 0.0
        #: ``latency``: the curve a state's operators are priced on (``set_latency_curve``;
        #: the line is then its widest segment); None: priced on the line
        self.latency_curve: LatencyCurve | None = None
        self._table_key: str | None = None  # ``latency``: the key of the table it was timed in
        if self.latency is not None and self.latency.batch is not None:
            example_inputs = with_batch(example_inputs, self.latency.batch)
        self.masks = find_masks(model)
        self.trace = trace if trace is not None else trace_model(model, example_inputs, loss_fn)
        self.graph = ChannelGraph(self.trace)
        self._names = {id(m): n for n, m in self.masks.items()}
        #: block gates: entries after the traced masks' (``fisherprune.cost.blocks``)
        self._gates = GateEntries.of(self.masks, self.graph.n_entries)
        #: expert gates: entries after the block gates' (``fisherprune.cost.experts``)
        first = self.graph.n_entries + self._gates.count
        self._experts = ExpertEntries.of(self.masks, first, self.trace, self.graph.roots)
        #: traced mask entries, block gate entries and expert gate entries together
        self.n_entries = first + self._experts.count
        self._entry_start = {
            **self.trace.entry_starts(),
            **self._gates.starts,
            **self._experts.starts,
        }
        unused = [n for n in self.masks if n not in self._entry_start]
        for n in unused:
            warnings.warn(
                f"mask {n!r} is never applied in the model's forward pass; "
                "it removes nothing and is never pruned",
                stacklevel=2,
            )
        self._terms = self._build_terms(model, example_inputs)
        self._gates.assign([t.module for t in self._terms])
        self._evals: dict[tuple[int, tuple[tuple[int, ...], ...]], float] = {}
        #: ``_term_margin``'s and ``_term_now``'s latest result per term (by ``id``), with the
        #: channel state it holds for
        self._margins: dict[int, tuple[tuple[bytes, bytes], Margin]] = {}
        self._nows: dict[int, tuple[bytes, float]] = {}
        self._warn_ineffective()

    @property
    def entry_start(self) -> dict[str, int]:
        """Where each traced mask's entries start in ``entries()``, by mask name (a mask the
        forward pass never applies has none), then each block gate's and expert gate's."""
        return self._entry_start

    # ----------------------------------------------------------------- terms
    def _build_terms(self, model: nn.Module, example_inputs: Any) -> list[_Term]:
        if self.latency is not None:
            return self._timed_terms(model, example_inputs, self.latency)
        return self._parameter_terms(model) + self._op_terms()

    def _timed_terms(self, model: nn.Module, example_inputs: Any, spec: LatencySpec) -> list[_Term]:
        """One term per traced operator the convention prices, timed per axis, every time
        scaled by ``latency_scale``: the dense model timed whole over the sum of its
        operators timed alone."""
        table = LatencyTable.open(spec)
        timer = OpTimer(spec, table)
        prunable = self._prunable_roots()
        with timing_threads(spec):
            terms = self._time_ops(timer, prunable)
            if table.fresh:  # what was measured now, measured again, the faster kept
                timer.second = True
                terms = self._time_ops(timer, prunable)
            summed = sum(self._eval(t, t.shapes) for t in terms)
            self._table_key = table.key
            if self._calibration is not None:
                self._calibrated(self._calibration, table)
            else:
                whole = self._scaled_to_whole(model, example_inputs, spec, table, summed)
                log.info(
                    "latency: %d operators timed (%d new), sum %.6g us; the model whole (%s) "
                    "%.6g us",
                    len(terms), table.measured, summed, spec.form, whole,
                )  # fmt: skip
        for t in terms:
            t.formula.scale = self.latency_scale
        return terms

    def _time_ops(self, timer: OpTimer, prunable: np.ndarray) -> list[_Term]:
        """One term per traced operator the convention prices, timed by ``timer`` along its
        axes.

        A build's operators are timed in two passes: the second times again every width the
        first measured, and the faster of the two is kept. A burst of other load shorter than
        a pass slows a run of operators in one pass only, where one pass would have kept them
        slow beside the rest: a BERT-base table built while the machine ran 9% slower priced
        its half copy's operators at 23.5% of the dense model's (24.6-25.3% in quiet builds),
        and its prunes ran 10-15% faster than predicted."""
        terms: list[_Term] = []
        for t in self._op_terms():
            assert t.op is not None
            axes = op_axes(t.dims, prunable)
            timed = time_op(timer, t.op, t.dims, t.shapes, axes)
            dims = [(0, j, a.roots) for j, a in enumerate(axes)]
            terms.append(_Term(timed, None, dims, [tuple(a.n for a in axes)], t.module))
        return terms

    def _scaled_to_whole(
        self,
        model: nn.Module,
        example_inputs: Any,
        spec: LatencySpec,
        table: LatencyTable,
        summed: float,
    ) -> float:
        """``latency_scale``: the dense model timed whole, in ``spec.form``, over the
        operators' sum ``summed``; the table is saved when its operators are plausible beside
        the model timed whole in eager (a compiled form may well run faster than its eager
        operators)."""
        with masks_kept(model, {}):  # the dense model, whatever the masks hold now
            whole = whole_model_seconds(model, example_inputs, spec) / UNIT
            eager = whole
            if spec.form != "eager":
                eager_spec = dataclasses.replace(spec, form="eager")
                eager = whole_model_seconds(model, example_inputs, eager_spec) / UNIT
        fused = any(isinstance(m, nn.RNNBase) for m in model.modules())  # (steps traced)
        table.save_if_plausible(summed, eager, fused)
        # what the operators alone miss (the Python between them, caches a lone operator
        # keeps warm) is spread over them in proportion
        self.latency_scale = whole / summed if summed > 0 else 1.0
        return whole

    def _calibrated(self, cal: dict[str, Any], table: LatencyTable) -> None:
        """``latency_scale`` and ``latency_offset`` from the calibration ``cal`` (not timed);
        a table of another key, or operators timed afresh, are said in one line each."""
        self.latency_scale, self.latency_offset = float(cal["slope"]), float(cal["offset"])
        if cal.get("curve") is not None:
            self.latency_curve = LatencyCurve.through(cal["curve"])
        if cal.get("table") != table.key:
            log.warning(
                "latency: the calibration given was measured with table %s, not %s as now: "
                "its slope and offset price this table's operators",
                cal.get("table"), table.key,
            )  # fmt: skip
        if table.measured:
            log.warning(
                "latency: %d operator times were not in %s and were timed afresh: costs may "
                "differ from those the calibration was measured with",
                table.measured, table.path,
            )  # fmt: skip
            table.save()

    @property
    def latency_calibration(self) -> dict[str, Any] | None:
        """``latency`` only: what prices its operators, to build the same cost model again
        without timing (``latency_calibration=``): ``slope``, ``offset`` (microseconds), the
        ``curve``'s knots (``LatencyCurve.as_list``, or None) and the ``table`` key
        (``LatencyTable.key``); None for another convention."""
        if self.latency is None:
            return None
        return {
            "slope": self.latency_scale,
            "offset": self.latency_offset,
            "curve": None if self.latency_curve is None else self.latency_curve.as_list(),
            "table": self._table_key,
        }

    def _parameter_terms(self, model: nn.Module) -> list[_Term]:
        """One term per parameter when the convention prices parameters (shapes pruned)."""
        formula = self._counting.parameter_formula
        if formula is None:
            return []
        roots = self.graph.roots
        terms: list[_Term] = []
        for name, p in model.named_parameters():
            info = self.trace.param_infos.get(name)
            if info is None:
                dims: list[tuple[int, int, np.ndarray]] = []
                shapes = [tuple(p.shape)]
            else:
                dims = [(0, d, roots[lab]) for d, lab in enumerate(info.labels) if lab is not None]
                shapes = [info.shape]
            terms.append(_Term(formula, None, dims, shapes, name.rpartition(".")[0] or "<model>"))
        return terms

    def _op_terms(self) -> list[_Term]:
        """One term per traced operator the convention has a formula for."""
        roots = self.graph.roots
        terms: list[_Term] = []
        for rec in self.trace.ops:
            if rec.is_mask:
                continue
            f = self._counting.formula(rec.op)
            if f is None:
                continue
            dims = [
                (s, d, roots[lab])
                for s, info in enumerate(rec.slots)
                for d, lab in enumerate(info.labels)
                if lab is not None
            ]
            terms.append(_Term(f, rec, dims, [s.shape for s in rec.slots], rec.module))
        return terms

    def _eval(self, term: _Term, shapes: list[tuple[int, ...]]) -> float:
        if term.op is None:  # a parameter term, or a timed operator's widths
            return max(0.0, float(term.formula(torch.Size(shapes[0]))))
        rec = term.op

        def sub(a: Any) -> Any:
            if isinstance(a, Slot):
                return torch.Size(shapes[a.i])
            if isinstance(a, (list, tuple)):
                return type(a)(sub(x) for x in a)
            return a

        outs = [torch.Size(s) for s in shapes[rec.n_inputs :]]
        out_shape: Any = outs[0] if len(outs) == 1 else tuple(outs)
        args = sub(rec.args)
        kwargs = {k: sub(v) for k, v in rec.kwargs.items()}
        if any(0 in s for s in shapes[: rec.n_inputs]):
            return 0.0  # an input with no channels left: the op is gone
        return max(0.0, float(term.formula(*args, out_shape=out_shape, **kwargs)))

    def _prunable_roots(self) -> np.ndarray:
        """Per root: whether zeroing mask entries can remove it (every place that reads it
        is covered by a mask entry)."""
        c = self.graph.consumers
        n = len(self.graph.roots)
        covered, uncovered = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        covered[c.roots[c.cover >= 0]] = True
        uncovered[c.roots[c.cover < 0]] = True
        return covered & ~uncovered

    # ------------------------------------------------------------ evaluation
    def entries(self) -> np.ndarray:
        """Current value (0/1) of every traced mask entry, in trace order, then of every block
        gate entry and every expert gate entry."""
        vals = np.ones(self.n_entries)
        for n, start in self._entry_start.items():
            m = self.masks[n].host_mask().double().numpy()
            vals[start : start + m.size] = m
        return vals

    def inert_masks(self) -> set[str]:
        """Traced masks whose channels are read only inside blocks gated off now.

        Removing such a channel saves nothing and changes no output: it goes with its block
        (``fisherprune.masks.blocks``). Its signal is 0 once the block is off, so a selection
        would take it first for nothing and, with ``uniform=True``, narrow the kept copies of
        the block with it; selections leave these masks out. Empty without a gated-off block.
        """
        e = self.entries()
        live = self._gates.live_terms(e)
        if live.all():
            return set()
        entries = {on: self._entries_reading(live == on) for on in (True, False)}
        starts = self.trace.entry_starts()
        out = set()
        for name, start in starts.items():
            own = np.arange(start, start + self.masks[name].num_channels)
            if np.isin(own, entries[False]).any() and not np.isin(own, entries[True]).any():
                out.add(name)
        return out

    def _entries_reading(self, terms: np.ndarray) -> np.ndarray:
        """The mask entries that remove some channel a selected term (``terms``: per term)
        prices."""
        parts = [r for t, on in zip(self._terms, terms, strict=True) if on for _s, _d, r in t.dims]
        if not parts:
            return np.zeros(0, dtype=np.int64)
        c = self.graph.consumers
        read = np.isin(c.roots, np.concatenate(parts)) & (c.cover >= 0)
        return np.unique(c.cover[read])

    def _cached_eval(self, term: _Term, shapes: list[tuple[int, ...]]) -> float:
        """``_eval``, remembered per term and shapes: a prune changes few terms, so the next
        report re-evaluates few formulas (each is a pure function of the shapes)."""
        key = (id(term), tuple(shapes))
        got = self._evals.get(key)
        if got is None:
            if len(self._evals) >= EVAL_CACHE_SIZE:
                self._evals.clear()
            got = self._evals[key] = self._eval(term, shapes)
        return got

    def _full(self, entries: np.ndarray) -> np.ndarray:
        """``entries`` with the gate entries (block, then expert) appended as kept when it
        stops at the traced ones or at the block gates' (callers that know no such gates)."""
        short = (self.graph.n_entries, self.graph.n_entries + self._gates.count)
        if entries.size in short and entries.size < self.n_entries:
            return np.concatenate([entries, np.ones(self.n_entries - entries.size)])
        return entries

    def removed(self, entries: np.ndarray) -> np.ndarray:
        """Per channel component (root): removed under mask entry values ``entries``, by a
        traced mask or by an expert gate (``fisherprune.cost.experts``)."""
        return self._experts.removed(entries, self.graph.removed(entries))

    def total(self, entries: np.ndarray | None = None) -> float:
        """Cost per example for mask entry values ``entries`` (default: the current masks;
        block and expert gate entries missing from ``entries`` count as kept); ``latency``:
        on the curve when there is one."""
        return float(self._on_curve(self._on_line(entries)))

    def _on_line(self, entries: np.ndarray | None) -> float:
        """``total`` with ``latency``'s operators priced on the line alone."""
        e = self.entries() if entries is None else self._full(entries)
        removed = self.removed(e)
        live = self._gates.live_terms(e)
        tot = sum(self._term_now(t, removed) for t, on in zip(self._terms, live, strict=True) if on)
        return tot / self._counting.divisor(self.trace.batch_size) + self.latency_offset

    def _on_curve(self, on_line: float | np.ndarray) -> float | np.ndarray:
        """Prices on the line (one or an array) moved onto ``latency_curve`` (unchanged
        without one)."""
        if self.latency_curve is None:
            return on_line
        return self.latency_curve((on_line - self.latency_offset) / self.latency_scale)

    def operators(self, entries: np.ndarray | None = None) -> float:
        """``latency`` only: the operators of mask entry values ``entries`` (default: the
        current masks) summed alone, in microseconds, unscaled."""
        return (self._on_line(entries) - self.latency_offset) / self.latency_scale

    def operators_at(self, price: float) -> float:
        """``latency`` only: the operators' sum (microseconds, unscaled) that the line, or the
        curve, prices at ``price``."""
        if self.latency_curve is not None:
            return self.latency_curve.operators_at(price)
        return (price - self.latency_offset) / self.latency_scale

    def set_latency_line(self, slope: float, offset: float) -> None:
        """``latency`` only: price a mask state at ``slope`` times its operators' summed
        times alone plus ``offset`` microseconds (``fisherprune.calibrate.fit_latency_line``
        fits both to the model timed whole at two sizes or more). Changes: ``latency_scale``,
        ``latency_offset`` and every timed operator's scale; marginal costs scale with
        ``slope``; a curve set before is dropped (the line prices every state).

        The offset may be negative (``fisherprune.calibrate.check_latency`` fits one where a
        pruned state ran relatively faster than its operators) as long as the dense model is
        priced positive.

        Raises:
            ValueError: another convention, a slope that is not positive, a non-finite
                offset, or one that prices the dense model at 0 or below.
        """
        if self.latency is None:
            raise ValueError(
                f"set_latency_line needs the latency convention, not {self.convention!r}"
            )
        operators = (self.dense_total() - self.latency_offset) / self.latency_scale
        if not (
            math.isfinite(slope) and slope > 0 and math.isfinite(offset)
            and slope * operators + offset > 0
        ):  # fmt: skip
            raise ValueError(
                f"a latency line needs a positive slope and an offset that prices the dense "
                f"model ({operators:.6g} us of operators) above 0, got {slope!r} and {offset!r}"
            )
        for t in self._terms:
            t.formula.scale = slope
        self.latency_scale, self.latency_offset = float(slope), float(offset)
        self.latency_curve = None
        for cache in (self._evals, self._margins, self._nows):
            cache.clear()

    def set_latency_curve(self, curve: LatencyCurve) -> None:
        """``latency`` only: price a mask state on ``curve`` of its operators' summed times
        alone (``fisherprune.calibrate.fit_latency_line`` fits one through the model timed
        whole at several sizes). Changes: the line (``set_latency_line``) becomes the curve's
        widest segment, extended, and ``latency_curve`` is ``curve``. A marginal cost is then
        exact on the curve: the price now less the price without that channel, so a channel
        whose removal crosses a knot is priced by both segments' slopes (within one segment,
        the slope is one factor on every channel and ranks them as the line did).
        ``CostReport.by_module`` stays on the line.

        Raises:
            ValueError: another convention, or a widest segment that is not a line
                ``set_latency_line`` takes.
        """
        top = len(curve.operators) - 2
        xs, ys = curve.operators[top:], curve.prices[top:]
        slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
        self.set_latency_line(slope, ys[1] - slope * xs[1])
        self.latency_curve = curve

    def dense_total(self) -> float:
        """Cost per example with every mask entry set to 1."""
        return self.total(np.ones(self.n_entries))

    def report(self) -> CostReport:
        """Total and marginal costs for the current mask values."""
        e = self.entries()
        removed = self.removed(e)
        killer = self._experts.killers(e, self.graph.killers(e, removed))
        marginal = np.zeros(self.n_entries)
        by_module: dict[str, float] = defaultdict(float)
        total = 0.0
        owner = self._gates.term_entry
        for t, on, gate in zip(self._terms, self._gates.live_terms(e), owner, strict=True):
            if not on:
                continue  # its block is gated off: gone with it
            now, ents, saved = self._term_margin(t, killer, removed)
            total += now
            by_module[t.module] += now
            if gate >= 0:
                marginal[gate] += now  # removing the block removes this term as it is now
            marginal[ents] += saved
        per = self._counting.divisor(self.trace.batch_size)
        on_line = total / per + self.latency_offset
        if self.latency_curve is not None:  # exact on the curve: the price less it without
            marginal = per * (self._on_curve(on_line) - self._on_curve(on_line - marginal / per))
        values = {
            n: torch.from_numpy(marginal[start : start + self.masks[n].num_channels] / per)
            for n, start in self._entry_start.items()
        }
        for n, m in self.masks.items():
            values.setdefault(n, torch.zeros(m.num_channels, dtype=torch.float64))
        return CostReport(
            float(self._on_curve(on_line)),
            MarginalCosts(values, self._names),
            self.convention,
            {k: v / per for k, v in by_module.items()},
        )

    def _term_now(self, t: _Term, removed: np.ndarray) -> float:
        """Term ``t``'s cost with channels ``removed``: for the state of the term's own
        channels it was last asked for, without building its shapes again (one state per term
        kept, as ``_term_margin`` keeps them)."""
        state = removed[t.roots].tobytes()
        kept = self._nows.get(id(t))
        if kept is not None and kept[0] == state:
            return kept[1]
        got = self._cached_eval(t, t.shapes_less(t.removed_per_set(removed)))
        self._nows[id(t)] = (state, got)
        return got

    def _term_margin(self, t: _Term, killer: np.ndarray, removed: np.ndarray) -> Margin:
        """Term ``t``'s cost now, the entries that would each remove some of its channels
        alone, and what removing each would save. Remembered per term for the state of its
        channels (which are removed, which entry removes each) it was last asked for: a prune
        changes few terms' channels, so the next report recomputes few terms (the rest of a
        report is host time every prune step pays). Only the latest state is kept: pruning
        removes channels and never asks for an earlier state again, and the states of every
        prune step kept (a key of 9 bytes per channel of the term, and its entries and
        savings, 16 more) were what ``prune_to_target`` held at its repair: 166 MiB on a
        16-layer Llama of width 512, growing with the depth and the width."""
        state = (killer[t.roots].tobytes(), removed[t.roots].tobytes())
        kept = self._margins.get(id(t))
        if kept is not None and kept[0] == state:
            return kept[1]
        gone = t.removed_per_set(removed)
        now = self._cached_eval(t, t.shapes_less(gone))
        # which entry would remove each live channel of each set: per killing entry, how
        # many channels of each set it takes (one row per entry)
        ents, counts = _counts_per_entry([_live_killers(killer, removed, r) for r in t.sets])
        saved = _NO_SAVINGS
        if ents.size:
            # entries that take the same channels save the same cost: evaluate each once
            rows, row_of = _unique_rows(counts)
            per_row = np.empty(len(rows))
            for i, vec in enumerate(rows.tolist()):
                shapes = t.shapes_less([g + c for g, c in zip(gone, vec, strict=True)])
                try:
                    per_row[i] = now - self._cached_eval(t, shapes)
                except (AssertionError, RuntimeError, ValueError) as e:  # torch asserts shapes
                    raise self._refusal(t, ents[row_of == i], e) from e
            saved = per_row[row_of]
        got = (now, ents, saved)
        self._margins[id(t)] = (state, got)
        return got

    def _refusal(self, term: _Term, entries: np.ndarray, error: BaseException) -> ValueError:
        """The error for an operator whose formula refuses the shapes it would have with one of
        ``entries`` zeroed: its dims were labelled inconsistently (one removal shrinks one
        operand's heads and not the other's), which ``apply_masks`` on these inputs blocks."""
        k = int(entries[0])
        name, start = max(
            ((n, s) for n, s in self._entry_start.items() if s <= k), key=lambda ns: ns[1]
        )
        where = getattr(term.op.op, "overloadpacket", term.op.op) if term.op else "a parameter"
        return ValueError(
            f"the cost of {where} in {term.module or '<model>'} cannot be computed with channel "
            f"{k - start} of mask {name!r} removed ({first_line(error)}): the trace labelled "
            "this operator's dimensions inconsistently, a fisherprune bug (please report it); "
            "apply_masks(model, these inputs) keeps such channels whole"
        )

    def _warn_ineffective(self) -> None:
        e = np.ones(self.graph.n_entries)
        killer = self.graph.killers(e, np.zeros(len(self.graph.roots), dtype=bool))
        effective = set(np.unique(killer[killer >= 0]).tolist())
        for n, start in self.trace.entry_starts().items():
            size = self.masks[n].num_channels
            if not any(start + k in effective for k in range(size)):
                warnings.warn(
                    f"zeroing mask {n!r} removes no channel on its own: either something "
                    "between it and the next layer keeps the channel alive (a BatchNorm, a "
                    "sigmoid, an add with an unmasked tensor), or other masks act on the same "
                    "channels and must be zeroed too. Place masks after normalisation and "
                    "activation, or use fisherprune.apply_masks",
                    stacklevel=3,
                )


def _live_killers(killer: np.ndarray, removed: np.ndarray, roots: np.ndarray) -> np.ndarray:
    """The entry that would remove each channel (root) of ``roots`` still present, for those
    one entry removes alone."""
    k = killer[roots[~removed[roots]]]
    return k[k >= 0]


def _counts_per_entry(found: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """From the killing entry of each channel of each set (``found[j]`` for set j): the
    entries that kill any channel (ascending) and, per entry, how many channels of each set
    it kills."""
    n = len(found)
    keys = np.concatenate([k * n + j for j, k in enumerate(found)] or [_NO_ENTRIES])
    if not keys.size:
        return _NO_ENTRIES, np.zeros((0, n), dtype=np.int64)
    # stable: a set's killers mostly ascend with its channels, and a stable sort (timsort)
    # merges such runs in linear time where quicksort sorts them anew (that was most of a
    # prune decision on BERT-base after a hidden-width prune, which changes every Linear)
    keys.sort(kind="stable")
    pairs, pair_of = _runs(keys)  # distinct (entry, set), as entry * n + set
    ents, row = _runs(pairs // n)
    out = np.zeros((ents.size, n), dtype=np.int64)
    out[row, pairs % n] = np.bincount(pair_of)
    return ents, out


def _unique_rows(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(m, axis=0, return_inverse=True)`` for a small non-negative int matrix,
    through one integer code per row (a 1-d sort; the axis form sorts void records, slowly)."""
    base = int(m.max()) + 1
    if base ** m.shape[1] >= 2**62:
        rows, inv = np.unique(m, axis=0, return_inverse=True)
        return rows, inv.reshape(-1)
    powers = base ** np.arange(m.shape[1], dtype=np.int64)
    codes = m @ powers
    order = np.argsort(codes, kind="stable")  # rows of equal counts come in runs, as above
    distinct, index = _runs(codes[order])
    inv = np.empty_like(index)
    inv[order] = index
    return distinct[:, None] // powers % base, inv


def _runs(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of the sorted, non-empty 1-d array ``s`` and, per element of
    ``s``, the index of its value among them."""
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    np.not_equal(s[1:], s[:-1], out=new[1:])
    return s[new], np.cumsum(new) - 1


def computational_cost(
    model: nn.Module,
    example_inputs: Any,
    convention: str = "flops",
    *,
    loss_fn: Callable[[Any], Tensor] | None = None,
    latency: LatencySpec | None = None,
) -> CostReport:
    """Cost per example of ``model`` as masked now, and the marginal cost of every channel.

    Traces the model once (in eval mode; nothing in the model changes).

    Args:
        model: the network with its masks.
        example_inputs: a tensor, a tuple of positional inputs or a dict of keyword inputs
            (``model(**example_inputs)``); per-example costs are divided by their batch size,
            read as ``fisherprune.inputs`` says (a list of images is a batch of its length).
        convention: ``"flops"`` (default; equals ``FlopCounterMode`` on the shrunk
            network, per example), ``"macs"``, ``"twml"`` (the seed's formula),
            ``"memory"``, ``"params"`` or ``"latency"`` (microseconds per forward pass,
            timed on the device ``latency`` names).
        loss_fn: optional callable applied to the model output and costed too.
        latency: with ``convention="latency"``, where and how to time (``LatencySpec``).

    Returns:
        A ``CostReport``; ``report.marginal[mask]`` is a tensor over the mask's channels.

    Raises:
        ValueError: unknown convention or unusable example inputs.

    Example:
        >>> cost = computational_cost(net, torch.randn(1, 20))
        >>> cost.total, cost.marginal["2"]
    """
    return CostModel(model, example_inputs, convention, loss_fn, latency).report()
