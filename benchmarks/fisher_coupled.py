"""``FisherCoupled``: the joint Fisher increments on coupled groups only (a candidate default
for issue 31, point 2; ``one_shot_defaults.py``'s ``fisher_coupled``).

``fisher_joint_own`` (``FisherJoint(at_least_own=True)``) scores each channel by the increment
of its group's joint Fisher loss, never below its own signal. It fixed ResNet-18 at 30% (the
widths of the last stage, read by the residual adds and the head, stayed wider, as Taylor
keeps them) but cost both transformers: the FFN units' gradients agree in sign and the joint
increments kept the FFN widths wider, although the repair's refit of the one layer that reads
them absorbs what they share.

This candidate applies the joint increments only where no single refit can absorb a common
mode: on a mask whose channels are read by more than one consuming module (a residual
stream: every block's first layer, the shortcut, the head; a transformer's hidden width).
A mask read by one module (a block's inner width, an FFN's units, a head's values) keeps the
plain Fisher signal. "Read by" counts the modules ``apply_masks`` placed a mask point on
(``fisherprune.criteria.coupled_masks``); norms are not consumers here. The same with the
mean-replaced signal is the library's ``FisherMean()``, ``prune_to_target``'s default.
"""

from __future__ import annotations

from collections.abc import Mapping

from fisher_joint import FisherJoint
from torch import Tensor, nn

from fisherprune.criteria import coupled_masks
from fisherprune.masks import MaskLayer


class _CoupledOnly:
    """Keeps a joint criterion's importance on coupled masks; elsewhere each channel scores
    its own signal (whatever signal the criterion folds)."""

    def importance(self, masks: Mapping[str, MaskLayer], model: nn.Module) -> dict[str, Tensor]:
        joint = super().importance(masks, model)  # type: ignore[misc]
        coupled = coupled_masks(model)
        return {
            n: joint[n] if id(m) in coupled else m.signal.detach().double().cpu().clone()
            for n, m in masks.items()
        }


class FisherCoupled(_CoupledOnly, FisherJoint):
    """``FisherJoint(at_least_own=True)`` on coupled masks, the Fisher signal elsewhere."""

    def __init__(self) -> None:
        super().__init__(at_least_own=True)
