"""Where block gates (``fisherprune.masks.blocks.BlockGate``) sit in a ``CostModel``.

A block gate is not traced as a mask (its hook changes nothing while the tracer runs): its
entries come after the traced masks' entries, and entry ``i`` owns every priced term whose
module is block ``i`` or inside it. A term of a gated-off block costs nothing; the marginal
cost of a gate entry is the cost of its block's terms at the widths they have now, so that
removing a whole block and narrowing it are priced in one currency.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fisherprune.masks import MaskLayer
from fisherprune.masks.blocks import BlockGate

__all__ = ["GateEntries"]


@dataclass
class GateEntries:
    """The block gates of a costed model and the entry that owns each priced term.

    Attributes:
        starts: the first entry of each gate, by mask name (after ``first`` traced entries).
        count: entries of all gates together.
        term_entry: per term, the gate entry that removes it, or -1 (set by ``assign``).
    """

    starts: dict[str, int]
    count: int
    blocks: list[tuple[int, str]]  # (entry, qualified block name)
    term_entry: np.ndarray

    @classmethod
    def of(cls, masks: Mapping[str, MaskLayer], first: int) -> GateEntries:
        """The gates among ``masks``, numbered from entry ``first``."""
        starts: dict[str, int] = {}
        blocks: list[tuple[int, str]] = []
        at = first
        for name, m in masks.items():
            if isinstance(m, BlockGate):
                starts[name] = at
                blocks += [(at + i, b) for i, b in enumerate(m.block_names())]
                at += m.num_channels
        return cls(starts, at - first, blocks, np.zeros(0, dtype=np.int64))

    def assign(self, modules: Sequence[str]) -> None:
        """Give each term (by the module it was priced in) the gate entry that removes it.

        Changes: ``term_entry``.
        """
        out = np.full(len(modules), -1, dtype=np.int64)
        for i, mod in enumerate(modules):
            for entry, block in self.blocks:
                if mod == block or mod.startswith(block + "."):
                    out[i] = entry
                    break
        self.term_entry = out

    def live_terms(self, entries: np.ndarray) -> np.ndarray:
        """Per term: whether its block (if any) is kept under ``entries``."""
        owner = self.term_entry
        live = np.ones(owner.size, dtype=bool)
        gated = owner >= 0
        live[gated] = entries[owner[gated]] >= 0.5
        return live
