"""Block gates: whole repeated blocks (decoder layers) as prunable units.

A model's repeated blocks are the entries of its longest ``nn.ModuleList`` of modules of one
class whose outputs feed the next one's input (Hugging Face Llama / Qwen2 / Mistral
``model.model.layers``, GPT-2 ``transformer.h``). ``BlockGate`` is one mask of
``num_blocks`` entries; entry ``i`` scales block ``i``'s residual branches,

    out_i = in_i + g_i * (block_i(in_i) - in_i),

through a forward hook on the block (``BlockGatePoint``), so that ``g_i = 0`` makes the block
the identity. The per-example derivative of the loss with respect to ``g_i`` is
``sum over positions of (block_i(in_i) - in_i) * dL/d out_i``: the per-example channel dot of
``MaskLayer`` with one channel, gathered in the backward that training runs
(``masks.layer.gather_through``), so the gate's Fisher signal is ``1/2 mean_n g[n, i]^2`` like
every channel's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from fisherprune.inputs import Inputs
from fisherprune.masks import tracing
from fisherprune.masks.compiled import SignalOwner, compiling, masked_product
from fisherprune.masks.layer import MaskLayer, gather_through, gathering_enabled
from fisherprune.modes import eval_mode

__all__ = [
    "BlockGate",
    "BlockGatePoint",
    "block_input",
    "block_output",
    "find_block_list",
    "install_block_gate",
]

#: the key of the gate in the ``fisherprune_masks`` holder
GATE_KEY = "blocks"


class BlockGate(MaskLayer):
    """A mask over the blocks of one ``nn.ModuleList``: entry ``i`` is block ``i``'s gate.

    Buffers as ``MaskLayer`` (``mask``: ones, ``signal``: zeros, one entry per block). It is
    not applied to a tensor of its own: ``BlockGatePoint`` hooks apply it to each block.

    Args:
        list_path: qualified name of the ``nn.ModuleList`` holding the blocks.
        num_blocks: its length.

    Raises:
        ValueError: ``num_blocks`` < 1.
    """

    def __init__(self, list_path: str, num_blocks: int) -> None:
        super().__init__(num_blocks, dim=1)
        #: qualified name of the ModuleList whose entries the gate scales
        self.list_path = list_path
        # every block kept: known without reading the new mask back
        self._kept_known: tuple[Tensor, int, int, list[bool]] = (
            self.mask,
            self.mask._version,
            self.mask.data_ptr(),
            [True] * num_blocks,
        )

    def record_values(self, all_ones: bool) -> None:
        """As ``MaskLayer.record_values``, and read which blocks are kept now, in the caller
        that has just written the gate (a prune), not in the next forward."""
        super().record_values(all_ones)
        self._kept_known = self._read_kept()

    def kept_blocks(self) -> list[bool]:
        """Whether each block is kept (its entry above 0.5), read from the mask on the host
        once per write to it: a forward makes no host read (a GPU no synchronisation) unless
        the gate changed since the last (a prune, a load)."""
        known, mask = self._kept_known, self.mask
        if known[0] is not mask or known[1] != mask._version or known[2] != mask.data_ptr():
            known = self._kept_known = self._read_kept()
        return known[3]

    def _read_kept(self) -> tuple[Tensor, int, int, list[bool]]:
        """The kept flags read back now, keyed by the mask, its version and its storage (a
        copy's mask starts its version again, in storage of its own)."""
        mask = self.mask
        return (mask, mask._version, mask.data_ptr(), (mask > 0.5).tolist())

    def block_names(self) -> list[str]:
        """Qualified module name of each gated block, in order."""
        return [f"{self.list_path}.{i}" for i in range(self.num_channels)]

    def extra_repr(self) -> str:
        return f"list_path={self.list_path!r}, {super().extra_repr()}"


def block_input(args: tuple, kwargs: dict[str, Any]) -> Tensor | None:
    """The block's input hidden state: its first tensor argument (positional, then keyword)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            return a
    return None


def block_output(out: Any) -> tuple[Tensor | None, Callable[[Tensor], Any]]:
    """The block's output hidden state (the tensor, or a tuple's first entry) and a function
    that puts a replacement back in the same structure."""
    if isinstance(out, Tensor):
        return out, lambda t: t
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0], lambda t: type(out)((t, *out[1:]))
    return None, lambda t: t


class BlockGatePoint(SignalOwner):
    """The forward hook (``with_kwargs``) gating block ``index`` by ``gate.mask[index]``.

    Changes nothing while a tracer runs (the trace sees the block as it is; the cost model
    prices the gate from the block's operators) or while the gate entry is 1 and no signal is
    collected; with the entry 0 the block returns its input. Under ``torch.compile`` a
    collecting step gates through ``masked_product``, whose compiled backward hands the
    per-example dot to this point (``accumulate``), for gate entry ``index``.
    """

    def __init__(self, gate: BlockGate, index: int) -> None:
        self.gate = gate
        self.index = index
        self.init_owner()

    def accumulate(self, g: Tensor, _index: None) -> None:
        """Hand ``g`` (examples, 1), the compiled backward's per-example dot, to the gate's
        entry ``index``. Changes: the gate's gathered gradients."""
        self.gate.accumulate(g, torch.full((1,), self.index, device=g.device))

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], out: Any) -> Any:
        if tracing.active() is not None:
            return None
        x = block_input(args, kwargs)
        y, rebuild = block_output(out)
        if x is None or y is None or x.shape != y.shape:
            raise ValueError(
                f"block {self.gate.list_path}.{self.index} cannot be gated: its input and "
                "output hidden states differ in shape or are not tensors"
            )
        gate = self.gate
        collect = gate.collecting and gathering_enabled()
        if not collect and compiling():
            # in a graph, chosen by the gate's value itself: the host's copy of which blocks
            # are kept (``kept_blocks``) would be read once, when traced, and kept in the graph
            # however the gate changed since (a block written off before the trace ran on)
            keep = gate.mask[self.index] > 0.5
            return rebuild(torch.where(keep.to(y.device), y, x))
        if not collect:
            return None if gate.kept_blocks()[self.index] else rebuild(x)
        delta = (y - x).reshape(y.shape[0], 1, -1)  # (N, 1, positions x width)
        entry = gate.mask[self.index : self.index + 1]
        if compiling():  # (the eager gather's Python backward would break the graph)
            return rebuild(x + masked_product(self, delta, entry, [gate], 1, 0).reshape(y.shape))
        gate.start_pass()
        mult = entry.to(delta.dtype).view(1, 1, 1)
        index = torch.full((1,), self.index, device=delta.device)  # a fill, not a copy
        gated = gather_through(delta, mult, gate, index, 1, False)
        return rebuild(x + gated.reshape(y.shape))


def _same_class_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """ModuleLists of at least two modules of one class, longest first (then model order)."""
    found = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2 and len({type(c) for c in mod}) == 1
    ]
    return sorted(found, key=lambda item: -len(item[1]))


def _chains(model: nn.Module, blocks: nn.ModuleList, inputs: Inputs) -> bool:
    """Whether, in one forward pass, each block runs once, keeps its input's shape, and its
    output is the next block's input."""
    seen: list[tuple[Tensor | None, Tensor | None]] = []

    def hook(_m: nn.Module, args: tuple, kwargs: dict[str, Any], out: Any) -> None:
        seen.append((block_input(args, kwargs), block_output(out)[0]))

    handles = [b.register_forward_hook(hook, with_kwargs=True) for b in blocks]
    try:
        with eval_mode(model), torch.no_grad():
            inputs.call(model)
    finally:
        for h in handles:
            h.remove()
    if len(seen) != len(blocks):
        return False
    for (x, y), (nxt, _) in zip(seen, [*seen[1:], (None, None)], strict=True):
        if x is None or y is None or x.shape != y.shape:
            return False
        if nxt is not None and nxt is not y:
            return False
    return True


def find_block_list(model: nn.Module, example_inputs: Any) -> tuple[str, nn.ModuleList]:
    """The model's repeated blocks: ``(qualified name, ModuleList)`` of the longest list of
    same-class modules that run in a chain (runs one forward pass in eval mode, no grad; the
    model is left as it was).

    Raises:
        ValueError: no such list.
    """
    inputs = Inputs.of(example_inputs)
    for name, blocks in _same_class_lists(model):
        if _chains(model, blocks, inputs):
            return name, blocks
    raise ValueError(
        "blocks=True: the model has no nn.ModuleList of same-class blocks that run one after "
        "another, each output feeding the next block's input with the same shape"
    )


def install_block_gate(
    model: nn.Module, example_inputs: Any
) -> tuple[BlockGate, list[RemovableHandle]]:
    """Find the repeated blocks and hook a new ``BlockGate`` on them.

    Changes: one forward hook per block (the returned handles remove them). The gate module
    itself is returned, not attached: the caller holds it (``apply_masks`` puts it in its
    ``fisherprune_masks`` holder).

    Raises:
        ValueError: as ``find_block_list``.
    """
    path, blocks = find_block_list(model, example_inputs)
    gate = BlockGate(path, len(blocks))
    gate.to(next((p.device for p in model.parameters()), torch.device("cpu")))
    handles = [
        b.register_forward_hook(BlockGatePoint(gate, i), with_kwargs=True)
        for i, b in enumerate(blocks)
    ]
    return gate, handles
