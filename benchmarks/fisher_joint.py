"""``FisherJoint``: a group-level joint Fisher signal, a candidate default for issue 31 (point 2).

The Fisher signal of one channel, ``1/2 mean_n g[n,k]^2``, is the second-order loss of removing
that channel alone. Removing a set ``S`` of a group's channels together costs
``1/2 mean_n (sum_{k in S} g[n,k])^2``: the channels' cross terms count. Here the kept channels
of each group are ordered by their own Fisher signal (lowest first), and the channel at rank
``m`` scores the increment ``J_m - J_(m-1)`` of ``J_m = 1/2 mean_n (sum of g[n,k] over the m
lowest)^2``, the increments made non-decreasing along the order (a running maximum) so that a
group is still thinned from its lowest channel up. A group whose channels' gradients agree in
sign costs more to thin than the sum of its channels' signals says, and stays wider; one whose
channels cancel is thinned further. Pruned channels keep their plain signal (never ranked).

The per-example gradients ``g`` (every calibration example, ``C`` values per mask) are kept
between ``update`` and ``importance``: 512 x C floats per mask on the benchmark's networks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fisherprune.criteria import Fisher
from fisherprune.masks import MaskLayer, MaskSet, as_mask_dict


class FisherJoint(Fisher):
    """The joint Fisher increment of each channel within its group (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._passes: list[Tensor] = []
        self._grads: dict[str, Tensor] = {}  # per mask: (examples, C), the 1/N undone

    def statistic(self, g: Tensor) -> Tensor:
        self._passes.append(g.detach().double() * g.shape[0])  # a mean loss's 1/N undone
        return super().statistic(g)

    def update(
        self,
        masks: MaskSet,
        decay: float = 0.96,
        *,
        loss_reduction: str = "mean",
        process_group: dist.ProcessGroup | None = None,
    ) -> Tensor | None:
        """``Fisher.update`` one mask at a time, keeping each one's per-example gradients."""
        if loss_reduction != "mean":
            raise ValueError("FisherJoint keeps per-example gradients of a mean-reduced loss only")
        skipped: Tensor | None = None
        self._grads = {}
        for name, m in as_mask_dict(masks).items():
            self._passes = []
            got = super().update({name: m}, decay, loss_reduction=loss_reduction,
                                 process_group=process_group)  # fmt: skip
            if self._passes:
                self._grads[name] = torch.cat(self._passes).cpu()
            if got is not None:
                skipped = got if skipped is None else skipped + got
        return skipped

    @torch.no_grad()
    def importance(self, masks: Mapping[str, MaskLayer], model: nn.Module) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for name, m in masks.items():
            signal = m.signal.detach().double().cpu()
            g = self._grads.get(name)
            kept = torch.nonzero(m.mask.detach().cpu() > 0.5).flatten()
            if g is None or len(kept) == 0:
                out[name] = signal
                continue
            order = kept[torch.argsort(signal[kept])]  # lowest first
            joint = 0.5 * g[:, order].cumsum(1).square().mean(0)  # J_1, ..., J_K
            steps = torch.diff(joint, prepend=joint.new_zeros(1)).cummax(0).values
            score = signal.clone()
            score[order] = steps.clamp_min(0.0)
            out[name] = score
        return out

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "joint": True}
