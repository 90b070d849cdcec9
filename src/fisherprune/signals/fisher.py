"""Fold the statistics of the last batch into each mask's signal (the seed's
``update_pruning_signals``).

Per example n and channel k, with ``g[n, k]`` the derivative of example n's loss with respect to
mask entry k (summed over every place the mask acts), the Fisher batch estimate is
``Delta_k = 1/2 * mean_n g[n, k]^2`` (Theis et al. 2018, Eq. 8). It does not depend on the batch
size: with a mean-reduced loss each ``g`` carries a factor 1/N, which is undone here (the seed
did not; docs/design.md). Other gradient criteria (``fisherprune.criteria``) fold their own
per-example statistic the same way.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from fisherprune.masks import MaskSet, as_mask_dict
from fisherprune.settings import check_decay, check_loss_reduction, check_method
from fisherprune.signals.criteria import GradientCriterion, resolve_criterion

__all__ = ["update_pruning_signals"]


def update_pruning_signals(
    masks: MaskSet,
    decay: float = 0.96,
    *,
    loss_reduction: str = "mean",
    method: str = "fisher",
    criterion: GradientCriterion | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> list[Tensor]:
    """Update every collecting mask's ``signal`` with the batch gathered since the last call.

    Call after ``loss.backward()``. Changes, for each mask that received gradients,
    ``mask.signal <- decay * signal + (1 - decay) * batch_estimate`` in place and
    clears the gathered statistics. A batch whose estimate is not finite (NaN or
    inf gradients) is skipped with a warning, leaving the signal as it was. With
    ``torch.distributed`` initialised, the sums are all-reduced first, so every
    rank gets the same signal.

    Args:
        masks: the masks, as ``{name: MaskLayer}`` or a sequence.
        decay: EMA factor in [0, 1); 0 makes the signal equal the batch estimate.
        loss_reduction: ``"mean"`` if the loss was averaged over the batch (the
            per-example gradients are rescaled by the batch size), ``"sum"`` if summed.
        method: ``"fisher"`` (default): ``1/2 mean_n g^2``; ``"taylor"``: ``mean_n |g|``
            (shorthands for ``fisherprune.criteria.Fisher()`` and ``Taylor()``).
        criterion: a ``fisherprune.criteria.GradientCriterion`` (your own, say) instead of
            ``method``.
        process_group: the group to all-reduce over (default: the world, when initialised).

    Returns:
        The signal tensors, in the order of ``masks``.

    Raises:
        ValueError: ``decay`` outside [0, 1), an unknown ``loss_reduction`` or ``method``, or
            both ``method`` and ``criterion`` given.
        TypeError: ``criterion`` is not a ``GradientCriterion``.
    """
    check_decay(decay)
    check_loss_reduction(loss_reduction)
    method = check_method(method)
    if criterion is None:
        criterion = resolve_criterion(method)  # type: ignore[assignment]
    elif method != "fisher":
        raise ValueError("give either method or criterion, not both")
    if not isinstance(criterion, GradientCriterion):
        raise TypeError(
            f"update_pruning_signals needs a GradientCriterion (one that reads mask gradients), "
            f"got {type(criterion).__name__}"
        )
    criterion.update(masks, decay, loss_reduction=loss_reduction, process_group=process_group)
    return [m.signal for m in as_mask_dict(masks).values()]
