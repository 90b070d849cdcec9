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
plain Fisher signal (``FisherCoupled``), or ``FisherMean``'s signal of replacing the channel
by its mean (``FisherCoupledMean``, the joint increments then summed over the mean-replaced
gradients as in ``fisher_joint_mean``). "Read by" counts the modules ``apply_masks`` placed
a mask point on (``MaskHolder.points``); norms are not consumers here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from fisher_joint import FisherJoint
from fisher_joint_mean import FisherJointMean
from torch import Tensor, nn

from fisherprune.masks import MaskLayer
from fisherprune.masks.points import find_holder


def coupled_masks(model: nn.Module) -> set[int]:
    """The ids of the masks ``apply_masks`` placed at the input of more than one module."""
    found = find_holder(model)
    if found is None:
        return set()
    readers: Counter[int] = Counter()
    for point in found[1].points:
        readers.update({id(m) for m, _, _ in point.parts})
    return {m for m, n in readers.items() if n > 1}


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


class FisherCoupledMean(_CoupledOnly, FisherJointMean):
    """``FisherJointMean`` on coupled masks, ``FisherMean``'s signal elsewhere (the Fisher of
    replacing a channel by its mean, which fixed the digits MLP at 50%)."""
