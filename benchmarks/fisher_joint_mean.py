"""``FisherJointMean``: ``FisherJoint(at_least_own=True)``'s joint increments of the Fisher loss,
computed on ``FisherMean``'s mean-replaced per-example gradients (a candidate default for
issue 31, point 2; ``one_shot_defaults.py``'s ``fisher_joint_mean``).

``FisherJoint`` scores each kept channel of a group by the increment of
``1/2 mean_n (sum of g[n,k] over the group's lowest channels)^2`` (``fisher_joint.py``). When a
group's gradients share a common mode (the FFN units of a transformer, whose ``g`` agree in
sign), the cross terms make the group expensive to thin, although the repair's refit bias
absorbs such a mode: it replaces each removed channel by its calibration mean. Here the cross
terms are summed over ``g'[n,k] = g[n,k] - abar_k s[n,k]`` (``fisher_mean.py``), the
first-order loss change of replacing channel ``k`` by its mean, so that the part of the
common mode a bias absorbs is removed first. The order within a group and each channel's own
score (the floor of ``at_least_own``) are ``FisherMean``'s signal, ``1/2 mean_n g'[n,k]^2``.

Composed from both classes, no logic of its own: ``FisherMean.statistic`` corrects each
pass's ``g`` before ``FisherJoint.statistic`` keeps it, and ``FisherMean.update`` (which must
see every mask in one call, as it drops its gradient sums at the end) hands the masks one at a
time to ``FisherJoint.update``, whose per-mask records are kept across those calls.
One process only (both parents refuse more).
"""

from __future__ import annotations

import torch.distributed as dist
from fisher_joint import FisherJoint
from fisher_mean import FisherMean
from torch import Tensor

from fisherprune.masks import MaskSet


class _JointPerMask(FisherJoint):
    """``FisherJoint.update`` for masks passed one call at a time: each call's per-example
    gradients are added to the earlier calls' records instead of replacing them."""

    def update(
        self,
        masks: MaskSet,
        decay: float = 0.96,
        *,
        loss_reduction: str = "mean",
        process_group: dist.ProcessGroup | None = None,
    ) -> Tensor | None:
        kept = self._grads
        got = super().update(masks, decay, loss_reduction=loss_reduction,
                             process_group=process_group)  # fmt: skip
        self._grads = {**kept, **self._grads}
        return got


class FisherJointMean(FisherMean, _JointPerMask):
    """``FisherJoint(at_least_own=True).importance`` of ``FisherMean``'s corrected gradients
    (module docstring). Method order: ``FisherMean``, then ``FisherJoint``, then ``Fisher``."""

    def __init__(self) -> None:
        super().__init__()
        self.at_least_own = True

    def update(
        self,
        masks: MaskSet,
        decay: float = 0.96,
        *,
        loss_reduction: str = "mean",
        process_group: dist.ProcessGroup | None = None,
    ) -> Tensor | None:
        """``FisherMean.update``; an earlier update's per-example gradients are dropped."""
        self._grads = {}
        return super().update(masks, decay, loss_reduction=loss_reduction,
                              process_group=process_group)  # fmt: skip
