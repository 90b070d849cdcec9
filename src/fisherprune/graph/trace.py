"""Trace a model once, at the level of ATen operators, and label channels.

Why a dispatch mode: ``torch.fx`` fails on data-dependent Python control flow
and needs the model's code to be symbolically traceable; ``torch.export`` is
strict about the same things and slow. A ``TorchDispatchMode`` sees every
operator a real forward pass runs, with real shapes, whatever the Python code
around it does, and PyTorch's own ``FlopCounterMode`` counts at this very
level, so our FLOP counts agree with it by construction.

While the forward pass runs, every dimension of every tensor carries a label
array: for each index, the atom (see ``atoms.py``) it descends from, or no
labels for a dimension that holds no channel (spatial dims, constants). Per-op
rules (``rules.py``) say how labels flow through each operator and which atoms
an operator ties together. Each dimension also carries a *cover* array: the
mask entry that zeroes that index, or -1, propagated through operators that
map zero to zero; it tells which mask entries remove which channels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from fisherprune.allocator import trim_freed_memory
from fisherprune.graph.atoms import Atoms
from fisherprune.graph.cpu_standin import on_cpu
from fisherprune.graph.gqa import units_while_tracing
from fisherprune.graph.heads import (
    group_size_attributes,
    head_attributes,
    sizes_attributes,
    width_attributes,
)
from fisherprune.graph.module_forwards import module_forward, share_inputs_hooks
from fisherprune.graph.packed_order import PackedOrder, PaddedRows
from fisherprune.graph.rules import apply_rule
from fisherprune.graph.types import (
    ConsumerPoint,
    HeadSplit,
    Labels,
    ModuleCall,
    NormUse,
    OpRecord,
    RuleContext,
    SizeSplit,
    Slot,
    TensorInfo,
)
from fisherprune.inputs import Inputs
from fisherprune.masks import tracing
from fisherprune.masks.layer import MaskLayer
from fisherprune.masks.rows import Rows
from fisherprune.masks.rows_nd import rows_after_nd
from fisherprune.modes import eval_mode
from fisherprune.norms import detect_norms, norm_spec

__all__ = ["Trace", "on_cpu", "trace_model"]


@dataclass
class Trace:
    """The result of tracing: op records, atoms, consumer points and mask entries."""

    ops: list[OpRecord] = field(default_factory=list)
    atoms: Atoms = field(default_factory=Atoms)
    consumers: list[ConsumerPoint] = field(default_factory=list)
    mask_names: list[str] = field(default_factory=list)
    mask_ends: list[int] = field(default_factory=list)  # end of each mask's entry range
    calls: list[ModuleCall] = field(default_factory=list)
    param_infos: dict[str, TensorInfo] = field(default_factory=dict)
    output_infos: list[TensorInfo] = field(default_factory=list)
    batch_size: int = 1  # examples traced (fisherprune.inputs.Inputs.batch_size): the divisor
    head_splits: list[HeadSplit] = field(default_factory=list)
    size_splits: list[SizeSplit] = field(default_factory=list)
    norm_uses: list[NormUse] = field(default_factory=list)
    #: the row map of each output tensor (None: not followed), by its pytree key path
    #: (``keystr``)
    output_rows: dict[str, Rows | None] = field(default_factory=dict)

    def entry_count(self) -> int:
        return self.mask_ends[-1] if self.mask_ends else 0

    def entry_starts(self) -> dict[str, int]:
        """First entry id of each traced mask, by name."""
        starts, prev = {}, 0
        for name, end in zip(self.mask_names, self.mask_ends, strict=True):
            starts[name] = prev
            prev = end
        return starts


class _Tracer(TorchDispatchMode):
    def __init__(
        self,
        trace: Trace,
        names: dict[int, str],
        masks: dict[int, str],
        modules: dict[str, nn.Module],
    ) -> None:
        super().__init__()
        self.trace = trace
        self.modules = modules
        self.infos: dict[int, TensorInfo] = {}
        self.keep: list[Tensor] = []  # keep traced tensors alive so ids stay unique
        self.param_names = names
        self.mask_names = masks
        self.mask_index: dict[str, int] = {}
        self._suspended = 0
        self.module_stack: list[str] = []
        self.call_stack: list[int] = []
        self._norm_cache: dict[str, tuple[str, int, int | None]] = {}
        self.rows: dict[int, Rows] = {}  # the row map of traced tensors (kept alive), by id
        #: the PackedSequences modules were called with or returned (their padded rows)
        self.packed_order = PackedOrder()

    # ------------------------------------------------------------ bookkeeping
    def _head_attributes(self, count: int, head_dim: int, inferred: bool) -> tuple[str, ...] | str:
        name = self.module_stack[-1] if self.module_stack else "<model>"
        return head_attributes(self.modules.get(name), count, head_dim, inferred)

    def _group_attributes(self, size: int) -> tuple[str, ...]:
        name = self.module_stack[-1] if self.module_stack else "<model>"
        return group_size_attributes(self.modules.get(name), size)

    def _width_attributes(self, width: int) -> tuple[str, ...]:
        name = self.module_stack[-1] if self.module_stack else "<model>"
        return width_attributes(self.modules.get(name), width)

    def _sizes_attributes(self, sizes: tuple[int, ...]) -> tuple[str, ...]:
        name = self.module_stack[-1] if self.module_stack else "<model>"
        return sizes_attributes(self.modules.get(name), sizes)

    def _norm_context(self) -> dict[str, Any]:
        """What the rules need to know of the innermost module as a norm."""
        name = self.module_stack[-1] if self.module_stack else ""
        known = self._norm_cache.get(name)
        if known is None:  # once per module: the registry is looked up by class
            mod = self.modules.get(name)
            spec = norm_spec(mod)
            known = (
                type(mod).__name__ if mod is not None else "",
                spec.trailing(mod) if spec is not None and mod is not None else 0,
                spec.normalised_dim(mod) if spec is not None and mod is not None else None,
            )
            self._norm_cache[name] = known
        return {
            "module_type": known[0],
            "norm_dims": known[1],
            "norm_channel_dim": known[2],
            "norms": self.trace.norm_uses,
        }

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def info(self, t: Tensor) -> TensorInfo:
        got = self.infos.get(id(t))
        if got is not None and got.shape == tuple(t.shape):
            return got
        name = self.param_names.get(id(t))
        if name is not None:
            return self.leaf(t, "param", name)
        return TensorInfo.blank(tuple(t.shape))  # a constant made inside forward

    def leaf(self, t: Tensor, kind: str, name: str) -> TensorInfo:
        labels: list[Labels] = [
            self.trace.atoms.new_block(kind, name, d, s) for d, s in enumerate(t.shape)
        ]
        info = TensorInfo(tuple(t.shape), labels, [None] * t.dim(), param=kind == "param")
        self.set_info(t, info)
        if kind == "param":
            self.trace.param_infos[name] = info
        return info

    def set_info(self, t: Tensor, info: TensorInfo) -> None:
        self.infos[id(t)] = info
        self.keep.append(t)

    def set_rows(self, t: Tensor, rows: Rows) -> None:
        """Give traced tensor ``t`` the row map ``rows`` (a rule outside dispatch found it)."""
        if id(t) in self.infos:
            self.rows[id(t)] = rows

    def rows_of(self, t: Any) -> Rows | None:
        """The row map of a traced tensor (which example each index of its first dims is of)."""
        return self.rows.get(id(t)) if isinstance(t, Tensor) and id(t) in self.infos else None

    def _follow_rows(
        self, func: Any, args: tuple, kwargs: dict, outs: list[Tensor], flat_in: list[Any]
    ) -> None:
        try:
            found = self.packed_order.rows(func, args, outs)
            if found is None:
                found = rows_after_nd(func, args, kwargs, outs, self.rows_of, flat_in)
        except Exception:  # a rule that does not fit this call: its rows are not followed
            return
        for t, rows in zip(outs, found, strict=True):
            if rows is not None:
                self.rows[id(t)] = rows

    # --------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._suspended:
            return out
        flat_in, in_spec = tree_flatten((args, kwargs))
        in_tensors = [a for a in flat_in if isinstance(a, Tensor)]
        flat_out, _ = tree_flatten(out)
        out_tensors = [o for o in flat_out if isinstance(o, Tensor)]
        slot_of: dict[int, int] = {}
        slots: list[TensorInfo] = []
        dtypes: list[torch.dtype] = []
        for t in in_tensors:
            if id(t) not in slot_of:
                slot_of[id(t)] = len(slots)
                slots.append(self.info(t))
                dtypes.append(t.dtype)
        in_infos = list(slots)
        n_in = len(slots)
        ctx = RuleContext(
            func,
            args,
            kwargs,
            in_tensors,
            out_tensors,
            atoms=self.trace.atoms,
            info=self.info,
            consumers=self.trace.consumers,
            op_index=len(self.trace.ops),
            module=self.module_stack[-1] if self.module_stack else "",
            calls=tuple(self.call_stack),
            heads=self.trace.head_splits,
            head_attributes=self._head_attributes,
            width_attributes=self._width_attributes,
            group_attributes=self._group_attributes,
            size_splits=self.trace.size_splits,
            sizes_attributes=self._sizes_attributes,
            **self._norm_context(),
        )
        for info in in_infos:  # their values are read now
            for lab, cov, reason in info.on_use:
                ctx.stop(lab, cov, reason)
        out_infos = apply_rule(ctx)
        for t, oi in zip(out_tensors, out_infos, strict=True):
            self.set_info(t, oi)
            slots.append(oi)
        self._follow_rows(func, args, kwargs, out_tensors, flat_in)
        placeholder = _slot_replacer(slot_of)
        rec_args, rec_kwargs = tree_unflatten([placeholder(a) for a in flat_in], in_spec)
        rec = OpRecord(
            func,
            rec_args,
            rec_kwargs,
            slots,
            n_in,
            module=self.module_stack[-1] if self.module_stack else "",
            dtypes=(*dtypes, *(o.dtype for o in out_tensors)),
        )
        del in_infos
        self.trace.ops.append(rec)
        return out

    # ------------------------------------------------------------------ masks
    def _entry_start(self, mask: MaskLayer) -> int:
        name = self.mask_names.get(id(mask))
        if name is None:
            raise RuntimeError("a MaskLayer that is not part of the traced model was applied")
        if name not in self.mask_index:
            self.mask_index[name] = len(self.trace.mask_names)
            self.trace.mask_names.append(name)
            self.trace.mask_ends.append(self.trace.entry_count() + mask.num_channels)
        return self.trace.mask_ends[self.mask_index[name]] - mask.num_channels

    def record_mask(
        self,
        x: Tensor,
        out: Tensor,
        dim: int,
        parts: list[tuple[MaskLayer, np.ndarray | None, np.ndarray | None]],
    ) -> None:
        """Record ``out = x * mask`` along ``dim``.

        ``parts``: for each mask acting here, the positions of ``dim`` it covers
        (None: all) and the mask entry used at each of them (None: 0, 1, ...).
        """
        src = self.info(x)
        cov = src.cover[dim]
        cov = np.full(x.shape[dim], -1, dtype=np.int64) if cov is None else cov.copy()
        for mask, positions, index in parts:
            start = self._entry_start(mask)
            idx = np.arange(mask.num_channels) if index is None else index
            if positions is None:
                cov[:] = start + idx
            else:
                cov[positions] = start + idx
        cover = list(src.cover)
        cover[dim] = cov
        oi = TensorInfo(tuple(out.shape), list(src.labels), cover)
        self.set_info(out, oi)
        rows = self.rows_of(x)
        if rows is not None:
            self.rows[id(out)] = rows
        name = self.module_stack[-1] if self.module_stack else ""
        self.trace.ops.append(OpRecord("mask", (0,), {}, [src, oi], 1, is_mask=True, module=name))


def _slot_replacer(slot_of: dict[int, int]) -> Callable[[Any], Any]:
    def rep(a: Any) -> Any:
        if isinstance(a, Tensor):
            return Slot(slot_of[id(a)])
        return a

    return rep


def _param_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=True):
        names.setdefault(id(p), n)
    for n, b in model.named_buffers(remove_duplicate=True):
        names.setdefault(id(b), n)
    return names


def trace_model(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], Tensor] | None = None,
) -> Trace:
    """Run one forward pass of ``model`` in eval mode under the tracer.

    The model's parameters, buffers and training flags are left as they were. The forward
    always runs on the CPU (``on_cpu``), whatever device the model lives on: a GPU dispatches
    other ATen operators (cuDNN's batch norm, the flash and memory-efficient attention
    kernels, fused RMS norm), and a network's groups, mask placement and cost must not depend
    on where it lives. ``loss_fn`` therefore receives the output of that CPU forward.

    Args:
        model: the network.
        example_inputs: a tensor, a tuple of positional inputs or a dict of keyword inputs
            (``fisherprune.inputs``); every dimension of every input tensor is labelled and
            blocked, and ``Trace.batch_size`` is the inputs' batch (``Inputs.batch_size``).
        loss_fn: optional; called on the model's output inside the trace, so
            that its operators are traced too (the seed counted the loss).

    Raises:
        ValueError: no input with a batch dimension.
    """
    with on_cpu(model, Inputs.of(example_inputs)) as inputs:
        trace = _trace(model, inputs, loss_fn)
    # the forward's activations, freed, leave glibc's heap holding the pages (300 MiB after
    # a 24-layer decoder's trace, 38 MiB of them alive): back to the OS (``allocator``)
    trim_freed_memory()
    return trace


def _trace(model: nn.Module, inputs: Inputs, loss_fn: Callable[[Any], Tensor] | None) -> Trace:
    trace = Trace(batch_size=inputs.batch_size)
    detect_norms(model)  # before the tracer runs: the probe's own ops are not the model's
    masks = {id(m): n for n, m in model.named_modules() if isinstance(m, MaskLayer)}
    modules = {name or "<model>": m for name, m in model.named_modules()}
    tracer = _Tracer(trace, _param_names(model), masks, modules)
    for i, (t, batched) in enumerate(inputs.tensors()):
        info = tracer.leaf(t, "input", str(i))
        if batched and t.dim() > 0:
            tracer.rows[id(t)] = Rows(torch.arange(t.shape[0]))
        for d, lab in enumerate(info.labels):
            batch = d == 0 and batched
            if batch:
                tracer.trace.atoms.mark_batch(lab)
            tracer.trace.atoms.block(lab, "batch dimension" if batch else "model input")
    handles = (
        _module_stack_hooks(model, tracer)
        + _module_forward_hooks(model, tracer)
        + _unfused_recurrent_hooks(model)
    )
    tracing.set_active(tracer)
    try:
        with (
            eval_mode(model),
            torch.no_grad(),
            _unfused_attention(),
            PaddedRows(tracer.packed_order, tracer.set_rows),
            tracer,
            units_while_tracing(model),
        ):
            out = inputs.call(model)
            if loss_fn is not None:
                tracer.module_stack.append("<loss>")
                out = loss_fn(out)
        _record_outputs(trace, tracer, out)
    finally:
        tracing.set_active(None)
        for h in handles:
            h.remove()
    return trace


def _record_outputs(trace: Trace, tracer: _Tracer, out: Any) -> None:
    """Record each output tensor as a consumer of the channels it holds ("model output"),
    named by its pytree key path. A channel the model also reads inside (the hidden width a
    base model returns) stays prunable: masked in the output too, zero-filled by ``shrink``.
    One only the output reads (a classifier's classes, an LM head's vocabulary) is blocked,
    as is every channel of an output that is not floating point (indices, counts), which a
    mask cannot zero."""
    roots = trace.atoms.roots()  # the trace is over: the components are final
    inside = np.zeros(len(roots), dtype=bool)
    for cp in trace.consumers:
        inside[roots[cp.labels]] = True
    for path, t in tree_flatten_with_path(out)[0]:
        if not isinstance(t, Tensor):
            continue
        info = tracer.info(t)
        trace.output_infos.append(info)
        trace.output_rows[keystr(path)] = tracer.rows_of(t)
        for lab, _cov, reason in info.on_use:
            trace.atoms.block(lab, reason)
        for d, (lab, cov) in enumerate(zip(info.labels, info.cover, strict=True)):
            if lab is None:
                continue
            only_out = lab if not t.is_floating_point() else lab[~inside[roots[lab]]]
            trace.atoms.block(only_out, "reaches the model output")
            cover = cov if cov is not None else np.full(lab.size, -1, np.int64)
            trace.consumers.append(
                ConsumerPoint(lab, cover, "model output", len(trace.ops), output=(keystr(path), d))
            )


@contextlib.contextmanager
def _unfused_attention() -> Iterator[None]:
    """Without autograd, in eval mode, ``nn.MultiheadAttention`` and the transformer layers
    run as one fused op (their "fast path"), which has no channel rule and no FLOP formula:
    its projections would go uncounted and unexamined. Trace the ops they are made of."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


def _module_forward_hooks(model: nn.Module, tracer: _Tracer) -> list:
    """For modules with a registered forward (``module_forwards``): their own forward runs
    unrecorded, then the registered one computes the output again under the tracer, while the
    module is still the innermost call."""
    handles = []
    for mod in model.modules():
        entry = module_forward(mod)
        if entry is None:
            continue

        def pre(_m, _args):
            tracer._suspended += 1

        def post(m, args, kwargs, _out, entry=entry):
            tracer._suspended -= 1
            return entry.traced(m, args, kwargs, tracer.suspended)

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post, prepend=True, with_kwargs=True))
        handles += share_inputs_hooks(mod)
    return handles


def _unfused_recurrent_hooks(model: nn.Module) -> list:
    """A recurrent layer that runs its own forward under the tracer (a subclass of
    ``nn.LSTM`` overriding ``forward``, so not ``recurrent_forward``) runs with oneDNN off:
    in float32 a CPU would run an LSTM as one fused oneDNN operator, which has no channel rule
    and no FLOP formula; without it PyTorch runs the same steps as products the tracer follows
    (as it does in float64)."""
    handles = []
    for mod in model.modules():
        if not isinstance(mod, nn.RNNBase) or module_forward(mod) is not None:
            continue
        was: list[bool] = []

        def pre(_m, _args, was=was):
            was.append(torch.backends.mkldnn.enabled)
            torch.backends.mkldnn.enabled = False

        def post(_m, _args, _out, was=was):
            if was:
                torch.backends.mkldnn.enabled = was.pop()

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post, always_call=True))
    return handles


def _module_stack_hooks(model: nn.Module, tracer: _Tracer) -> list:
    handles = []
    for name, mod in model.named_modules():
        label = name or "<model>"

        def pre(_m, args, label=label):
            tracer.module_stack.append(label)
            tracer.packed_order.note(args)
            packed = tuple(i for i, a in enumerate(args) if isinstance(a, PackedSequence))
            tensors = [a.data if i in packed else a for i, a in enumerate(args)]  # (its rows)
            infos = [tracer.info(a) if isinstance(a, Tensor) else None for a in tensors]
            rows = [tracer.rows_of(a) for a in tensors]
            parent = tracer.call_stack[-1] if tracer.call_stack else -1
            tracer.call_stack.append(len(tracer.trace.calls))
            call = ModuleCall(label, infos, len(tracer.trace.ops), rows, parent, packed)
            tracer.trace.calls.append(call)

        def post(_m, _a, out, label=label):
            tracer.packed_order.note(out if isinstance(out, (tuple, list)) else (out,))
            if tracer.module_stack and tracer.module_stack[-1] == label:
                tracer.module_stack.pop()
                tracer.call_stack.pop()

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    return handles
