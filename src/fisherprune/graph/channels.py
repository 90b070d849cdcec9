"""Channel components of a trace, and which mask entries remove which component.

A component (a root of the atom union-find) is *removed* when every place that
consumes it (a layer input, the model output, an opaque op) sees it zeroed by a
mask entry that is 0: "the channel is removed when every consumer sees zero for
it" (docs/design.md, "Where masks act"). This is what makes the cost model and the
masked forward agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fisherprune.graph.trace import Trace

__all__ = ["ChannelGraph"]


@dataclass
class _Consumers:
    roots: np.ndarray  # (P,) component of each consumed index
    cover: np.ndarray  # (P,) mask entry zeroing it, -1 for none


class ChannelGraph:
    """Components of a traced model, with their consumers and blocked reasons."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.roots = trace.atoms.roots()
        if trace.consumers:
            r = np.concatenate([self.roots[c.labels] for c in trace.consumers])
            cv = np.concatenate([c.cover for c in trace.consumers]).astype(np.int64)
        else:
            r = np.zeros(0, np.int64)
            cv = np.zeros(0, np.int64)
        self.consumers = _Consumers(r, cv)
        self.n_entries = trace.entry_count()
        self._consumed_count = np.bincount(r, minlength=len(self.roots))

    def is_consumed(self, root: int) -> bool:
        """Whether some layer, op or output reads component ``root``."""
        return bool(self._consumed_count[root] > 0)

    def removed(self, entries: np.ndarray) -> np.ndarray:
        """Boolean per root: removed under mask entry values ``entries`` (0/1 floats)."""
        c = self.consumers
        zero = np.zeros(c.cover.size, dtype=bool)
        has = c.cover >= 0
        zero[has] = entries[c.cover[has]] < 0.5
        zcount = np.bincount(c.roots[zero], minlength=len(self.roots))
        return (self._consumed_count > 0) & (zcount == self._consumed_count)

    def killers(self, entries: np.ndarray, removed: np.ndarray) -> np.ndarray:
        """Per root: the one mask entry whose zeroing would remove it now, else -1."""
        c = self.consumers
        out = np.full(len(self.roots), -1, dtype=np.int64)
        live = np.ones(c.cover.size, dtype=bool)
        has = c.cover >= 0
        live[has] = entries[c.cover[has]] >= 0.5
        live &= ~removed[c.roots]
        if not live.any():
            return out
        lr, lc = c.roots[live], c.cover[live]
        uncovered = np.zeros(len(self.roots), dtype=bool)
        uncovered[lr[lc < 0]] = True
        pairs = np.unique(np.stack([lr, lc], 1), axis=0)
        pairs = pairs[pairs[:, 1] >= 0]
        n_distinct = np.bincount(pairs[:, 0], minlength=len(self.roots))
        single = pairs[(n_distinct[pairs[:, 0]] == 1) & ~uncovered[pairs[:, 0]]]
        out[single[:, 0]] = single[:, 1]
        return out
