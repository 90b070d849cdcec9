"""``FisherJoint``: the Fisher signal of removing a group's channels together, not one by one
(a candidate default for issue 31, point 2; ``one_shot_defaults.py``'s ``fisher_joint``).

The Fisher signal of channel ``k``, ``F_k = 1/2 mean_n g[n,k]^2`` (``criteria.Fisher``), is the
second-order loss of removing that channel alone (Theis et al. 2018). Removing a set ``S`` of
one group's channels at once costs ``1/2 mean_n (sum_{k in S} g[n,k])^2``: the cross terms
between channels count too (the group-level view of Group Fisher Pruning, Liu et al. 2021,
applied to a set of a group's channels rather than to coupled layers). Here the kept channels
of each mask are ordered by their own signal, lowest first, and the channel at rank ``m``
scores the increment

    J_m - J_(m-1),   J_m = 1/2 mean_n (sum of g[n,k] over the m lowest-ranked kept k)^2,

the increments made non-decreasing along the order (a running maximum), so that a group is
still thinned from its lowest channel up and the sum of the ``m`` lowest scores is at least
``J_m``. Channels whose gradients agree in sign cost more together than their signals add up
to, and their group stays wider; channels that cancel are thinned further. The first channel
scores its own ``F_k``; pruned channels keep ``F_k`` (never ranked).

The per-example gradients of the last ``update`` (``N x C`` values per mask: every calibration
example in ``prune_to_target``, which folds all its batches in one update) are kept until the
next one; the order uses the signal, which in training is a moving average over updates.
One process only: the gradients of other ranks are not gathered.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fisherprune.criteria import Fisher
from fisherprune.masks import MaskLayer, MaskSet, as_mask_dict
from fisherprune.signals.fisher_mean import joint_increments


class FisherJoint(Fisher):
    """The increment of the joint Fisher loss each channel adds within its group, in the
    order of the plain Fisher signal (module docstring). Changes nothing but its own record of
    the last update's per-example gradients.

    Args:
        at_least_own: score each channel at least its own signal, so that channels whose
            gradients cancel are never cheaper together than alone (a norm downstream makes
            a width scale-invariant: its channels' ``g`` then sum to about 0 per example, and
            the joint loss of removing many is a second-order artefact).
    """

    def __init__(self, at_least_own: bool = False) -> None:
        super().__init__()
        self.at_least_own = at_least_own
        self._passes: list[Tensor] = []
        self._mean = True  # whether the last update's loss was mean-reduced
        self._grads: dict[str, Tensor] = {}  # per mask: (examples, C), float64 on the CPU

    def statistic(self, g: Tensor) -> Tensor:
        """``Fisher.statistic``, keeping ``g`` (a mean-reduced loss's ``1/N`` undone)."""
        scale = g.shape[0] if self._mean else 1
        self._passes.append(g.detach().double().cpu() * scale)
        return super().statistic(g)

    def update(
        self,
        masks: MaskSet,
        decay: float = 0.96,
        *,
        loss_reduction: str = "mean",
        process_group: dist.ProcessGroup | None = None,
    ) -> Tensor | None:
        """``Fisher.update`` one mask at a time, keeping each mask's per-example gradients
        (those of an earlier update are dropped).

        Raises:
            ValueError: ``torch.distributed`` runs more than one process.
        """
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                "fisher_joint scores channels from this process's per-example gradients only: "
                "run it on one process, or use fisher, which all-reduces its signal"
            )
        self._mean = loss_reduction == "mean"
        self._grads, skipped = {}, None
        for name, m in as_mask_dict(masks).items():
            self._passes = []
            got = super().update({name: m}, decay, loss_reduction=loss_reduction,
                                 process_group=process_group)  # fmt: skip
            if self._passes:
                self._grads[name] = torch.cat(self._passes)
            if got is not None:
                skipped = got if skipped is None else skipped + got
        return skipped

    @torch.no_grad()
    def importance(self, masks: Mapping[str, MaskLayer], model: nn.Module) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for name, m in masks.items():
            g = self._grads.get(name)
            score = m.signal.detach().double().cpu()
            out[name] = (
                joint_increments(score, g, m.mask, at_least_own=self.at_least_own)
                if g is not None
                else score.clone()
            )
        return out
