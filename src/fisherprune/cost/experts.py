"""Where expert gates (``fisherprune.masks.experts.ExpertGate``) sit in a ``CostModel``.

An expert gate is not traced as a mask: its entries come after the traced masks' and the
block gates' entries. Entry ``e`` of a layer's gate removes the channel components (roots)
that index expert ``e`` along dim 0 of the router's weight and of the experts' stacked
parameters: the router's logits lose a column, the stacked weights a slice, so every priced
term that reads them is priced at the kept count, under any convention. The marginal cost of
an entry is then what its components save, computed like a channel's.

Convention (``"flops"``, equal to ``FlopCounterMode`` on the shrunk model): top-k routing sends
every token to ``top_k`` experts however many there are, so the experts' products cost
``tokens x top_k`` rows either way (``_grouped_mm`` and batched products read every routed
row; a loop over experts hit reads each expert's rows, and their sum is the same). Removing
an expert saves its router row, ``2 x hidden`` FLOPs per token; ``"params"`` also counts its
weights, ``"memory"`` the router logits it no longer produces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fisherprune.graph.trace import Trace
from fisherprune.masks import MaskLayer
from fisherprune.masks.experts import ExpertGate

__all__ = ["ExpertEntries"]


@dataclass
class ExpertEntries:
    """The expert gates of a costed model and the components each entry removes.

    Attributes:
        starts: the first entry of each gate, by mask name.
        count: entries of all gates together.
        roots: components (of ``ChannelGraph.roots``) that index one expert.
        entry: per component, the gate entry that removes it.
    """

    starts: dict[str, int]
    count: int
    roots: np.ndarray
    entry: np.ndarray

    @classmethod
    def of(
        cls, masks: Mapping[str, MaskLayer], first: int, trace: Trace, roots: np.ndarray
    ) -> ExpertEntries:
        """The expert gates among ``masks``, numbered from entry ``first``; ``roots`` maps the
        trace's labels to components.

        Raises:
            ValueError: a gated tensor the trace did not see with a labelled dim 0, or
                components shared by two experts (the gate could not remove one alone).
        """
        starts: dict[str, int] = {}
        owner: dict[int, int] = {}
        at = first
        for name, m in masks.items():
            if not isinstance(m, ExpertGate):
                continue
            starts[name] = at
            for tname in m.tensor_names:
                info = trace.param_infos.get(tname)
                labels = None if info is None else info.labels[0]
                if labels is None or len(labels) != m.num_channels:
                    raise ValueError(
                        f"expert gate {name!r}: the trace did not see {tname} with one "
                        "labelled entry per expert along dim 0; its experts cannot be priced"
                    )
                for e, r in enumerate(roots[labels].tolist()):
                    if owner.setdefault(r, at + e) != at + e:
                        raise ValueError(
                            f"expert gate {name!r}: {tname} couples expert {e} with another "
                            "expert's entries; they cannot be removed one by one"
                        )
            at += m.num_channels
        r = np.fromiter(owner.keys(), dtype=np.int64, count=len(owner))
        e = np.fromiter(owner.values(), dtype=np.int64, count=len(owner))
        return cls(starts, at - first, r, e)

    def removed(self, entries: np.ndarray, removed: np.ndarray) -> np.ndarray:
        """``removed`` (per component) with the components of gated-off experts added."""
        if not self.count:
            return removed
        out = removed.copy()
        out[self.roots[entries[self.entry] < 0.5]] = True
        return out

    def killers(self, entries: np.ndarray, killer: np.ndarray) -> np.ndarray:
        """``killer`` (per component, the entry whose zeroing removes it) with each kept
        expert's components given to its gate entry."""
        if not self.count:
            return killer
        out = killer.copy()
        live = entries[self.entry] >= 0.5
        out[self.roots[live]] = self.entry[live]
        return out
