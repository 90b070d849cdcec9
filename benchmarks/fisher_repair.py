"""``FisherRepair``: a repair-aware Fisher signal, a candidate default for issue 31 (point 2).

After a channel is removed, the least-squares repair (``calibrate.repair``) refits each layer
that read it from the kept channels, so the loss only feels the part of the channel's
activation that the kept channels cannot linearly predict. For one consumer input with Gram
matrix ``G = sum over rows of x x^T`` (rows: every calibration example and position, the input
as masked now), the share of channel ``k`` the others cannot predict is

    r_k = (G_kk - G_k,rest G_rest^-1 G_rest,k) / G_kk = 1 / (G_kk (G^-1)_kk)

(in [0, 1]; ``G`` gets a ridge of ``RIDGE`` times its mean diagonal). A channel that covers a
block ``B`` of positions (an attention head) has ``r_B = trace(((G^-1)_BB)^-1) / trace(G_BB)``,
the same Schur complement for a block. A mask read by several consumers pools them:
``r_k = sum_c unexplained_c / sum_c G_c,kk``. The importance is ``Fisher_k * r_k ** power``.

``r_k`` is leave-one-out: two copies of one channel both score near 0 while the other is
kept. Nothing here re-computes ``r`` as a group is thinned; ``prune_to_target``'s rounds
(``round_cap``: at most a quarter of a group a round at the defaults) re-score on the thinned
network, where a copy whose twin went is unique again. An input wider than ``MAX_WIDTH``
positions is not observed: its channels keep ``r = 1`` (plain Fisher).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from fisherprune.criteria import Fisher
from fisherprune.masks import MaskLayer
from fisherprune.masks.points import MaskPoint
from fisherprune.signals.activation import hook_points

#: ridge added to a consumer's Gram matrix, relative to its mean diagonal entry
RIDGE = 1e-3
#: widest consumer input whose Gram matrix is kept (its square in float64: 32 MiB)
MAX_WIDTH = 2048


class _InputGram:
    """The Gram matrix ``sum over rows of x x^T`` (float64) of one mask point's input."""

    def __init__(self, point: MaskPoint) -> None:
        self.point = point
        self.gram: Tensor | None = None  # (size, size)

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if self.point.size > MAX_WIDTH:
            return
        x = args[self.point.arg].detach()
        rows = x.movedim(self.point.dim, -1).reshape(-1, self.point.size).double()
        part = rows.T @ rows
        self.gram = part if self.gram is None else self.gram + part

    def solved(self) -> tuple[Tensor, Tensor] | None:
        """``(G, (G + ridge I)^-1)`` on the CPU; None when no forward was seen (or the input
        is too wide)."""
        if self.gram is None:
            return None
        g = self.gram.cpu()
        ridge = RIDGE * float(g.diagonal().mean()) + 1e-30
        inv = torch.linalg.inv(g + ridge * torch.eye(len(g), dtype=g.dtype))
        return g, inv


class FisherRepair(Fisher):
    """The Fisher signal times the share of each channel the repair cannot rebuild from the
    kept ones (module docstring), to the power ``power``."""

    uses_activations: ClassVar[bool] = True

    def __init__(self, power: float = 1.0) -> None:
        super().__init__()
        self.power = power
        self._grams: list[_InputGram] = []

    @contextmanager
    def observing(self, model: nn.Module, masks: Mapping[str, MaskLayer]) -> Iterator[None]:
        """Within the ``with`` block every forward adds to each masked input's Gram matrix
        (earlier ones dropped on entry). Changes: one forward pre-hook per masked consumer,
        removed on exit."""
        self._grams, handles = hook_points(model, _InputGram, "fisher_repair")
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def shares(self, masks: Mapping[str, MaskLayer]) -> dict[str, Tensor]:
        """``r`` per mask channel (1 where no consumer input was observed)."""
        name_of = {id(m): n for n, m in masks.items()}
        lost = {n: torch.zeros(m.num_channels, dtype=torch.float64) for n, m in masks.items()}
        total = {n: torch.zeros(m.num_channels, dtype=torch.float64) for n, m in masks.items()}
        for gram in self._grams:
            got = gram.solved()
            if got is None:
                continue
            g, inv = got
            for mask, pos, idx in gram.point.parts:
                name = name_of.get(id(mask))
                if name is None:
                    continue
                for k in idx.unique().tolist():
                    block = pos[idx == k]
                    lost[name][k] += torch.linalg.inv(inv[block][:, block]).trace()
                    total[name][k] += g.diagonal()[block].sum()
        return {
            n: torch.where(total[n] > 0, lost[n] / total[n].clamp_min(1e-300), 1.0).clamp(0, 1)
            for n in masks
        }

    def importance(self, masks: Mapping[str, MaskLayer], model: nn.Module) -> dict[str, Tensor]:
        r = self.shares(masks)
        return {n: m.signal.double().cpu() * r[n] ** self.power for n, m in masks.items()}

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "power": self.power}
