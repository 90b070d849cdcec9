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
        # the distinct (root, entry) pairs of the consumers, -1 for no entry: a consumer is
        # live or not by its pair alone, so ``killers`` reads these instead of sorting the
        # live consumers at every call (host time at every prune decision)
        width = int(cv.max(initial=-1)) + 2  # entries from -1
        codes = np.unique(r.astype(np.int64) * width + (cv + 1))
        self._pair_roots, self._pair_entries = codes // width, codes % width - 1
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
        roots, ents = self._pair_roots, self._pair_entries
        covered = ents >= 0
        live = ~removed[roots]
        live[covered] &= entries[ents[covered]] >= 0.5
        uncovered = np.zeros(len(self.roots), dtype=bool)
        uncovered[roots[live & ~covered]] = True
        live &= covered
        n_distinct = np.bincount(roots[live], minlength=len(self.roots))
        single = live & (n_distinct[roots] == 1) & ~uncovered[roots]
        out = np.full(len(self.roots), -1, dtype=np.int64)
        out[roots[single]] = ents[single]
        return out
