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
    derived: np.ndarray  # (P,) an index a follower is read through, not a use of its own


class ChannelGraph:
    """Components of a traced model, with their consumers and blocked reasons."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.roots = trace.atoms.roots()
        # a use that passes channels on is removed with them: their own uses decide
        uses = [c for c in trace.consumers if not c.passed_on]
        if uses:
            r = np.concatenate([self.roots[c.labels] for c in uses])
            cv = np.concatenate([c.cover for c in uses]).astype(np.int64)
        else:
            r = np.zeros(0, np.int64)
            cv = np.zeros(0, np.int64)
        own = np.bincount(r, minlength=len(self.roots)) > 0
        n_own = r.size
        r, cv = self._add_followers(r, cv)
        self.consumers = _Consumers(r, cv, np.arange(r.size) >= n_own)
        self.n_entries = trace.entry_count()
        self._consumed_count = np.bincount(r, minlength=len(self.roots))
        #: per root: used only through the channels it follows (``Atoms.follow``): removed with
        #: them, never a channel of a group of its own
        self.followers = (self._consumed_count > 0) & ~own

    def _add_followers(self, r: np.ndarray, cv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Consumer indices with the follow pairs added: a component read only through others
        is used wherever they are, under the same mask entries."""
        a, b = self.trace.atoms.follow_pairs()
        if a.size == 0 or r.size == 0:
            return r, cv
        pairs = np.unique(np.stack([self.roots[a], self.roots[b]], 1), axis=0)
        pairs = pairs[pairs[:, 0] != pairs[:, 1]]
        order = np.argsort(r, kind="stable")
        lo = np.searchsorted(r[order], pairs[:, 1], side="left")
        hi = np.searchsorted(r[order], pairs[:, 1], side="right")
        extra = [order[s:e] for s, e in zip(lo.tolist(), hi.tolist(), strict=True)]
        roots = [np.full(ix.size, ra, np.int64) for ra, ix in zip(pairs[:, 0], extra, strict=True)]
        return np.concatenate([r, *roots]), np.concatenate([cv, *(cv[ix] for ix in extra)])

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
        # distinct (root, entry) pairs, through one integer code per pair (a 1-d sort)
        width = int(lc.max()) + 2  # entries from -1
        codes = np.unique(lr.astype(np.int64) * width + (lc + 1))
        pairs = np.stack([codes // width, codes % width - 1], 1)
        pairs = pairs[pairs[:, 1] >= 0]
        n_distinct = np.bincount(pairs[:, 0], minlength=len(self.roots))
        single = pairs[(n_distinct[pairs[:, 0]] == 1) & ~uncovered[pairs[:, 0]]]
        out[single[:, 0]] = single[:, 1]
        return out
