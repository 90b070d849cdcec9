"""The values the tracer, the channel rules and the cost model share.

They live apart from ``trace.py`` (which runs the forward pass) and ``rules.py`` (which says
how channels flow through each operator) so that imports flow one way: both of those, and
``cost``, import this module, and this module imports neither.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fisherprune.graph.atoms import Atoms
from fisherprune.masks.rows import Rows

__all__ = [
    "ConsumerPoint",
    "DimInfo",
    "HeadSplit",
    "Labels",
    "ModuleCall",
    "NormUse",
    "OpRecord",
    "RuleContext",
    "SizeSplit",
    "Slot",
    "TensorInfo",
]

#: per index of one dimension, the atom it descends from; None: the dimension holds no channel
Labels = np.ndarray | None


@dataclass
class TensorInfo:
    """What the trace knows of one tensor: shape, per-dim labels and covers."""

    shape: tuple[int, ...]
    labels: list[Labels]
    cover: list[Labels]
    param: bool = False  # a parameter or buffer, or a view of one: never needs masking
    #: stops to make only if an op reads this tensor's values (or it is an output): a channel
    #: picked by position whose value code may only use for its shape
    on_use: tuple[tuple[Labels, Labels, str], ...] = ()

    @staticmethod
    def blank(shape: tuple[int, ...]) -> TensorInfo:
        """A tensor none of whose dimensions carries a channel (a constant, a spatial map)."""
        return TensorInfo(tuple(shape), [None] * len(shape), [None] * len(shape))


DimInfo = tuple[Labels, Labels]


class Slot:
    """Stands for the ``i``-th tensor of an ``OpRecord`` in its recorded arguments; cost
    formulas substitute each slot by that tensor's (possibly pruned) shape."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __repr__(self) -> str:
        return f"<slot {self.i}>"


@dataclass
class OpRecord:
    """One traced operator call.

    ``args`` / ``kwargs`` are the call's arguments with every tensor replaced by
    its ``Slot`` in ``slots``; cost formulas substitute (pruned) shapes.
    """

    op: Any
    args: tuple
    kwargs: dict
    slots: list[TensorInfo]
    n_inputs: int
    is_mask: bool = False
    module: str = ""
    #: the dtype of each slot's tensor, in slot order (what a measured cost times the op in)
    dtypes: tuple[torch.dtype, ...] = ()


@dataclass
class ModuleCall:
    """One call of a module during the trace, with what its positional tensor inputs held."""

    name: str
    args: list[TensorInfo | None]
    op_index: int = -1  # the index the first operator it runs gets in the trace
    #: the row map of each positional input (``fisherprune.masks.rows``; None: not a tensor,
    #: or its rows were not followed)
    rows: list[Rows | None] = field(default_factory=list)
    parent: int = -1  # the call it ran inside (an index into ``Trace.calls``), or -1
    #: the positional inputs that were ``PackedSequence`` s (``args`` holds their data's info)
    packed: tuple[int, ...] = ()


@dataclass
class ConsumerPoint:
    """A place that uses a channel dimension: a layer's input, the model output, an opaque op.

    ``labels`` / ``cover`` are arrays of equal length: the atom of each index and
    the mask entry that zeroes it (-1: none).
    """

    labels: np.ndarray
    cover: np.ndarray
    what: str
    op_index: int
    calls: tuple[int, ...] = ()  # module calls in progress, outermost first
    #: for the model's output: the output tensor's pytree key path (``keystr``: "" for a lone
    #: tensor, "[0]", "['last_hidden_state']") and the dim of it these labels index
    output: tuple[str, int] | None = None
    #: a use that only passes each channel on to uses of its own that are recorded too (a
    #: grouped convolution's input, each group read by that group's outputs alone): masked
    #: where a module's input holds it, and needing no mask where none does
    passed_on: bool = False
    #: a use inside a module whose own forward masks it (an LSTM's projection reading its
    #: cells, masked at every step by ``masks.recurrent_units``): a use, with no mask point
    hooked: bool = False


@dataclass
class HeadSplit:
    """A width split into (heads, head_dim) inside a module's forward: ``blocks`` holds the
    atoms of each head, one row per head (the first of each row labels the head from then on);
    ``inferred``: the code asked for -1 heads (the count follows the width); ``attributes``
    names the module's attributes that hold the head count (set when the trace is resolved
    against the model; ``shrink`` updates them: a head count to the heads kept, the heads' total
    width to that times the head size). A width that code writes as a number held in an
    attribute (``RuleContext.record_width``) is a split into blocks of one channel."""

    module: str
    blocks: np.ndarray
    inferred: bool = False
    where: str = ""  # the call, for messages
    attributes: tuple[str, ...] = ()
    #: parts of a fused projection each row holds the head in (q, k and v: 3)
    parts: int = 1

    @property
    def head_size(self) -> int:
        """Channels of one head in one part (what a heads' total width counts per head)."""
        return int(self.blocks.shape[1]) // self.parts

    @property
    def count(self) -> int:
        """Number of heads."""
        return int(self.blocks.shape[0])

    @property
    def labels(self) -> np.ndarray:
        """One atom per head."""
        return self.blocks[:, 0]


@dataclass
class SizeSplit:
    """A width split at unequal sizes that a module holds in an attribute (timm's
    ``MixedConv2d`` splits its input at ``self.splits``): ``pieces`` holds the atoms of each
    piece; ``shrink`` sets ``attributes`` to the channels each piece keeps."""

    module: str
    pieces: tuple[np.ndarray, ...]
    attributes: tuple[str, ...]
    where: str = ""


@dataclass
class NormUse:
    """A registered norm (``fisherprune.norms``) normalising a width: the module, its call
    (an index into ``Trace.calls``), the width's labels and which dim, counted from the end,
    and how many trailing dims the norm normalises (its ``NormSpec.trailing``)."""

    module: str
    call: int
    labels: np.ndarray
    from_end: int
    norm_dims: int = 1


class RuleContext:
    """What a channel rule sees of one operator call: the call itself, what the trace knows
    of its input tensors, and the atoms it may tie together or block.

    Args:
        func: the ATen operator.
        args, kwargs: its arguments, tensors included.
        ins, outs: its tensor inputs and outputs, in order.
        atoms: the trace's atoms (a rule may ``union`` or ``block`` them).
        info: what the trace knows of a tensor.
        consumers: the trace's list of consumer points (``consume`` appends to it).
        op_index: the index this call's record will have in the trace.
        module: the innermost module running the call (``""``: none).
        calls: the module calls in progress, outermost first.
        heads: the trace's list of head splits (``record_heads`` appends to it).
        width_attributes: for a width, the current module's attributes holding it.
        group_attributes: for a number of query heads per key/value head, the current
            module's attributes holding it.
        head_attributes: for a head count, a head size and whether the code asked for -1
            heads, the current module's attributes holding that count (or the heads' total
            width), or why it cannot lose heads.
        size_splits: the trace's list of splits at sizes held in attributes
            (``record_split_sizes`` appends to it).
        sizes_attributes: for a list of split sizes, the current module's attributes holding
            it.
    """

    def __init__(
        self,
        func: Any,
        args: tuple,
        kwargs: dict,
        ins: list[Tensor],
        outs: list[Tensor],
        *,
        atoms: Atoms,
        info: Callable[[Tensor], TensorInfo],
        consumers: list[ConsumerPoint],
        op_index: int,
        module: str = "",
        calls: tuple[int, ...] = (),
        heads: list[HeadSplit] | None = None,
        head_attributes: Callable[[int, int, bool], tuple[str, ...] | str] | None = None,
        module_type: str = "",
        norm_dims: int = 0,
        norm_channel_dim: int | None = None,
        norms: list[NormUse] | None = None,
        width_attributes: Callable[[int], tuple[str, ...]] | None = None,
        group_attributes: Callable[[int], tuple[str, ...]] | None = None,
        size_splits: list[SizeSplit] | None = None,
        sizes_attributes: Callable[[tuple[int, ...]], tuple[str, ...]] | None = None,
    ) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.in_tensors = ins
        self.out_tensors = outs
        self.atoms = atoms
        self._info = info
        self._consumers = consumers
        self.op_index = op_index
        self.module = module
        self.calls = calls
        self._heads = heads if heads is not None else []
        self._head_attributes = head_attributes
        self.module_type = module_type
        self.norm_dims = norm_dims
        self.norm_channel_dim = norm_channel_dim
        self._norms = norms if norms is not None else []
        self._width_attributes = width_attributes
        self._group_attributes = group_attributes
        self._size_splits = size_splits if size_splits is not None else []
        self._sizes_attributes = sizes_attributes

    @property
    def name(self) -> str:
        """The operator's name (``"convolution"``, ``"add"``...)."""
        packet = getattr(self.func, "overloadpacket", None)
        return str(packet.__name__) if packet is not None else str(self.func)

    def info(self, t: Any) -> TensorInfo | None:
        """What the trace knows of ``t``; None if ``t`` is not a tensor."""
        return self._info(t) if isinstance(t, Tensor) else None

    def arg(self, name: str, default: Any = None) -> Any:
        """The argument called ``name`` in the operator's schema, whether it was passed by
        position or by keyword; ``default`` when it was not passed or the overload has no
        such argument (overloads of one operator differ: ``var(x, unbiased)`` and
        ``var.correction(x, dim)`` both put something in position 1)."""
        schema = getattr(self.func, "_schema", None)
        if schema is None:
            return self.kwargs.get(name, default)
        for i, a in enumerate(schema.arguments):
            if a.name != name:
                continue
            if not a.kwarg_only and i < len(self.args):
                return self.args[i]
            return self.kwargs.get(name, default)
        return default

    def has_arg(self, name: str) -> bool:
        """Whether the operator overload's schema has an argument called ``name``."""
        schema = getattr(self.func, "_schema", None)
        if schema is None:
            return name in self.kwargs
        return any(a.name == name for a in schema.arguments)

    def consume(self, labels: Labels, cover: Labels, what: str, passed_on: bool = False) -> None:
        """Record a place where a channel dimension is used up (``passed_on``: used only to
        make channels tied to it, whose uses are recorded too; see ``ConsumerPoint``)."""
        if labels is None:
            return
        cv = cover if cover is not None else np.full(labels.size, -1, dtype=np.int64)
        self._consumers.append(
            ConsumerPoint(labels, cv, what, self.op_index, self.calls, passed_on=passed_on)
        )

    def record_heads(self, blocks: np.ndarray, inferred: bool, parts: int = 1) -> str | None:
        """This call splits a width into heads, ``blocks`` holding each head's atoms in a row
        (``inferred``: the call asked for -1 heads; ``parts``: the row holds the head in each
        of that many parts of a fused projection). If the module can lose heads, tie each
        head's atoms into one channel, record the split and return None; else return why."""
        head_size = blocks.shape[1] // parts
        verdict = (
            self._head_attributes(blocks.shape[0], head_size, inferred)
            if self._head_attributes
            else ()
        )
        if isinstance(verdict, str):
            return verdict
        for row in blocks:
            self.atoms.union_all(row)
        split = HeadSplit(self.module, blocks, inferred, self.where(), verdict, parts)
        self._heads.append(split)
        return None

    def record_query_slots(self, slots: np.ndarray) -> None:
        """Grouped-query attention pruned by query slot: row j of ``slots`` holds the j-th
        query head of every key/value head. Tie each row into one channel and record it as a
        split of the heads per key/value head, so that ``shrink`` sets the module's attributes
        holding that number (``heads.GROUP_SIZE_ATTRIBUTES``) to the slots kept."""
        for row in slots:
            self.atoms.union_all(row)
        names = self._group_attributes(slots.shape[0]) if self._group_attributes else ()
        self._heads.append(HeadSplit(self.module, slots.copy(), False, self.where(), names))

    def heads_split_before(self, head_dim: int) -> bool:
        """Whether the innermost module already split a width into several heads of
        ``head_dim`` channels (the query heads, before a single key/value head is split)."""
        return any(
            h.module == self.module and h.count > 1 and h.head_size == head_dim for h in self._heads
        )

    def record_width(self, labels: np.ndarray) -> None:
        """This call writes the width of ``labels`` as a number (a reshape's size): if the
        module holds that number in a width attribute (``heads.WIDTH_ATTRIBUTES``), record it
        as a split into blocks of one channel, so that ``shrink`` sets the attribute to the
        channels kept."""
        names = self._width_attributes(labels.size) if self._width_attributes else ()
        if names:
            blocks = labels.reshape(-1, 1).copy()
            self._heads.append(HeadSplit(self.module, blocks, False, self.where(), names))

    def record_split_sizes(self, labels: np.ndarray, sizes: list[int]) -> bool:
        """This call splits the width of ``labels`` at ``sizes``: if the innermost module holds
        those sizes in an attribute (``heads.sizes_attributes``), record the split, so that
        ``shrink`` sets the attribute to the channels each piece keeps, and return True (the
        pieces stay prunable, each on its own); else False."""
        names = self._sizes_attributes(tuple(sizes)) if self._sizes_attributes else ()
        if not names:
            return False
        pieces = tuple(p.copy() for p in np.split(labels, np.cumsum(sizes)[:-1]))
        self._size_splits.append(SizeSplit(self.module, pieces, names, self.where()))
        return True

    def record_norm(self, labels: Labels, nd: int, d: int) -> bool:
        """If the innermost module is a registered norm and dim ``d`` of an ``nd``-dim tensor is
        among the dims it normalises, record that it normalises ``labels`` there and return
        True (the width stays prunable: the norm's hook follows its mask); else False."""
        if self.norm_dims <= 0:
            return False
        along = self.norm_channel_dim  # (a norm over one dim its module names: only that one)
        if (d != along % nd) if along is not None else (d < nd - self.norm_dims):
            return False
        if labels is not None and self.calls:
            self._norms.append(NormUse(self.module, self.calls[-1], labels, nd - d, self.norm_dims))
        return True

    def norm_hint(self) -> str:
        """How to make the innermost module's width prunable, if it is a normalisation layer."""
        kind = self.module_type or "the model"
        return (
            f" ({kind} is not a registered norm: if it is a layer or RMS norm, declare it with "
            f"fisherprune.register_norm({kind}, kind='layer' or 'rms'))"
        )

    def block(self, labels: Labels, reason: str) -> None:
        """Mark the channels of ``labels`` unprunable, for ``reason``."""
        if labels is not None:
            self.atoms.block(labels, reason)

    def stop(self, labels: Labels, cover: Labels, reason: str) -> None:
        """Stop channels here: block ``labels`` (for ``reason``) and record this op as a place
        that uses them. For an op that mixes or moves channels in a way pruning cannot follow;
        nothing happens for ``labels`` None (a dimension that holds no channel)."""
        self.block(labels, reason)
        self.consume(labels, cover, reason)

    def where(self) -> str:
        """``"<operator> in <module>"``, for messages."""
        packet = getattr(self.func, "overloadpacket", self.func)
        return f"{packet} in {self.module or '<model>'}"
