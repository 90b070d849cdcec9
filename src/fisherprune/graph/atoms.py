"""Channel atoms and their union-find.

Every index of every parameter, buffer and model input dimension that the trace
sees is an *atom*. Operations that tie indices together (an element-wise add
ties channel k of both operands; a convolution ties input channel k to column
k of its weight) union atoms. After the trace each connected component is one
unit that can only be kept or removed as a whole: one prunable channel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["AtomBlock", "Atoms"]


@dataclass(frozen=True)
class AtomBlock:
    """A run of consecutive atoms: the indices of one dimension of one leaf tensor.

    kind: ``"param"`` (parameter or buffer, ``name`` is its qualified name) or
    ``"input"`` (model input, ``name`` is its position).
    """

    kind: str
    name: str
    dim: int
    start: int
    size: int


class Atoms:
    """Atom allocation, union-find, and per-atom flags (blocked, producer, output)."""

    def __init__(self) -> None:
        self._parent = np.zeros(0, dtype=np.int64)
        self.blocks: list[AtomBlock] = []
        self._blocked: list[tuple[np.ndarray, str]] = []
        self._producer: list[np.ndarray] = []
        self._inputs: list[tuple[int, int]] = []  # atom ranges of model input dimensions
        self._batch: list[tuple[int, int]] = []  # those of the inputs' batch dimensions
        self._follows: list[tuple[np.ndarray, np.ndarray]] = []
        self._multiples: list[tuple[np.ndarray, int]] = []

    def __len__(self) -> int:
        return int(self._parent.size)

    def new_block(self, kind: str, name: str, dim: int, size: int) -> np.ndarray:
        """Allocate ``size`` fresh atoms for one dimension of a leaf tensor; return their ids."""
        start = len(self)
        self._parent = np.concatenate([self._parent, np.arange(start, start + size)])
        self.blocks.append(AtomBlock(kind, name, dim, start, size))
        if kind == "input":
            self._inputs.append((start, start + size))
        return np.arange(start, start + size, dtype=np.int64)

    def mark_batch(self, a: np.ndarray) -> None:
        """Mark atoms ``a`` (a fresh block: one model input's dim 0) as indexing the batch."""
        if a.size:
            self._batch.append((int(a.min()), int(a.max()) + 1))

    # ------------------------------------------------------------- union-find
    def find(self, a: np.ndarray) -> np.ndarray:
        """Roots of atoms ``a`` (vectorised, with path halving)."""
        p = self._parent
        r = p[a]
        while True:
            rr = p[r]
            if np.array_equal(rr, r):
                return r
            p[a] = rr
            r = rr

    def union(self, a: np.ndarray, b: np.ndarray) -> None:
        """Tie atom ``a[i]`` to atom ``b[i]`` for every i (vectorised: roots point to the
        smaller id; when one root gets several parents in a round, the rest wait a round)."""
        if a.size == 0:
            return
        p = self._parent
        while True:
            ra, rb = self.find(a), self.find(b)
            diff = ra != rb
            if not diff.any():
                return
            lo = np.minimum(ra[diff], rb[diff])
            hi = np.maximum(ra[diff], rb[diff])
            p[hi] = lo

    def union_all(self, a: np.ndarray) -> None:
        """Tie every atom of ``a`` together."""
        if a.size > 1:
            self.union(a[:-1], a[1:])

    # ------------------------------------------------------------------ flags
    def block(self, a: np.ndarray, reason: str) -> None:
        """Mark atoms ``a`` as not prunable, with the reason reported to the user."""
        if a.size:
            self._blocked.append((a.copy(), reason))

    def mark_producer(self, a: np.ndarray) -> None:
        """Mark atoms ``a`` as output channels of a layer (what makes a component a channel).
        Atoms that index a model input (token positions carried through a matmul) are not."""
        a = a[~self._from_input(a)] if a.size else a
        if a.size:
            self._producer.append(a.copy())

    def require_multiple(self, a: np.ndarray, k: int) -> None:
        """Declare that the count of atoms ``a`` a pruned model keeps must stay a multiple of
        ``k`` (a kernel's alignment: a grouped matrix product needs 16-byte rows)."""
        if a.size and k > 1:
            self._multiples.append((a.copy(), int(k)))

    def multiples(self, roots: np.ndarray) -> dict[int, int]:
        """For each component (by root) that some ``require_multiple`` touched, the least
        common multiple of what was required of it."""
        out: dict[int, int] = {}
        for a, k in self._multiples:
            for r in np.unique(roots[a]).tolist():
                out[r] = math.lcm(out.get(r, 1), k)
        return out

    def follow(self, a: np.ndarray, b: np.ndarray) -> None:
        """Declare that atom ``a[i]`` is read only through atom ``b[i]`` (a key/value head
        through each query head that attends to it): ``a[i]``'s channel is used wherever
        ``b[i]``'s is, so it is removed once every channel it is read through is."""
        if a.size:
            self._follows.append((a.copy(), b.copy()))

    def follow_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """All ``follow`` pairs, as two aligned atom arrays."""
        if not self._follows:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        a, b = zip(*self._follows, strict=True)
        return np.concatenate(a), np.concatenate(b)

    def _from_input(self, a: np.ndarray) -> np.ndarray:
        """Per atom of ``a``: whether it indexes a dimension of a model input."""
        return _within(a, self._inputs)

    def producer_arrays(self) -> list[np.ndarray]:
        """The atom arrays marked as layer outputs, one per producing op."""
        return list(self._producer)

    def roots(self) -> np.ndarray:
        """Root of every atom."""
        return self.find(np.arange(len(self)))

    def blocked_reasons(self, roots: np.ndarray) -> dict[int, str]:
        """First reason each blocked component (by root) was blocked for."""
        out: dict[int, str] = {}
        for a, reason in self._blocked:
            for r in np.unique(roots[a]):
                out.setdefault(int(r), reason)
        return out

    def producer_roots(self, roots: np.ndarray) -> np.ndarray:
        """Roots of the components that contain a producer atom."""
        if not self._producer:
            return np.zeros(0, dtype=np.int64)
        return np.unique(roots[np.concatenate(self._producer)])

    def batch_size(self) -> int | None:
        """The batch size of the model inputs (their dim 0), or None when they differ or
        none was marked."""
        sizes = {end - start for start, end in self._batch}
        return sizes.pop() if len(sizes) == 1 else None

    def is_batch(self, a: np.ndarray) -> bool:
        """Whether every atom of ``a`` indexes the batch dimension of a model input."""
        return bool(a.size) and bool(_within(a, self._batch).all())

    def locate(self, atom: int) -> tuple[AtomBlock, int]:
        """The block an atom belongs to and its index within that dimension."""
        starts = [b.start for b in self.blocks]
        i = int(np.searchsorted(starts, atom, side="right") - 1)
        b = self.blocks[i]
        return b, atom - b.start


def _within(a: np.ndarray, ranges: list[tuple[int, int]]) -> np.ndarray:
    """Per atom of ``a``: whether it lies in one of the ``[start, end)`` ranges (few: one per
    model input dimension)."""
    out = np.zeros(a.shape, dtype=bool)
    for lo, hi in ranges:
        out |= (a >= lo) & (a < hi)
    return out
