"""Baseline channel criteria to compare the Fisher signal against: weight norm and random.

Both take the masks returned by ``apply_masks`` (an ``AppliedMasks``: ``{name: MaskLayer}``
plus the ``ChannelGroup`` of each mask in ``.groups``) and return ``{mask name: scores}``, one
float64 score per channel of the mask, lower = pruned first, ready for
``fisherprune.prune(masks, scores)``. Channels already pruned keep a score (``prune`` never
picks them again).

* ``l1_norm_scores``: the L1 norm of each channel's *producing* weights (Li et al., *Pruning
  filters for efficient ConvNets*, ICLR 2017): for every producer module of the group (a conv
  or linear whose output makes the channel; several for channels coupled by a residual add)
  the absolute values of its ``weight`` along the group's parameter dim are summed over every
  other dim, and mapped to the group's channels with ``ChannelGroup.members``. Weight slices
  that read an already pruned channel of another group (e.g. the input columns of a conv whose
  input lost channels) are left out, so the norm is that of the network as it would be after
  ``shrink``, whatever the masks' state. Raw L1 norms
  are not comparable between layers (they grow with fan-in and, before a BatchNorm, their
  scale is arbitrary), so by default each group's scores are divided by their mean over the
  group's unpruned channels (the layer-wise normalisation Torch-Pruning applies by default).
* ``random_scores``: i.i.d. uniform scores, so ``prune`` removes a channel chosen uniformly
  among all unpruned channels.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from fisherprune.graph import ChannelGroup
from fisherprune.masks import MaskLayer

__all__ = ["NORMALIZE", "l1_norm_scores", "random_scores"]

NORMALIZE: tuple[str, ...] = ("mean", "none")


def _groups_of(masks: Mapping[str, MaskLayer]) -> Mapping[str, ChannelGroup]:
    groups = getattr(masks, "groups", None)
    if not isinstance(groups, Mapping):
        raise ValueError(
            "these criteria need the masks returned by fisherprune.apply_masks (an AppliedMasks "
            "with .groups); hand-placed MaskLayers carry no producer information"
        )
    missing = [n for n in masks if n not in groups]
    if missing:
        raise ValueError(f"no ChannelGroup for mask(s) {missing}")
    return groups


def _producing_weights(group: ChannelGroup) -> list[tuple[str, int]]:
    """The ``(parameter name, dim)`` pairs of the group that are producers' ``weight``s."""
    out: list[tuple[str, int]] = []
    for name, dim in group.members:
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and (module or "<model>") in group.producers:
            out.append((name, dim))
    return out


@torch.no_grad()
def l1_norm_scores(
    masks: Mapping[str, MaskLayer], model: nn.Module, *, normalize: str = "mean"
) -> dict[str, Tensor]:
    """L1 norm of each channel's producing weights, per mask.

    Args:
        masks: the ``AppliedMasks`` of ``model`` (from ``fisherprune.apply_masks``).
        model: the masked model whose parameters are read.
        normalize: ``"mean"`` (default): divide each group's scores by their mean over its
            unpruned channels, so that groups with different fan-in are comparable; ``"none"``:
            the raw L1 norms.

    Returns:
        ``{mask name: float64 tensor of shape (num_channels,)}``.

    Raises:
        ValueError: ``masks`` is not an ``AppliedMasks``, a group has no producing weight in
            ``model``, or ``normalize`` is unknown.

    Example:
        >>> masks = fisherprune.apply_masks(net, x[:1])
        >>> fisherprune.prune(masks, l1_norm_scores(masks, net))
    """
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {NORMALIZE}, got {normalize!r}")
    groups = _groups_of(masks)
    params = dict(model.named_parameters())
    # for each parameter dim a group touches: is each index along it still alive?
    alive_along: dict[tuple[str, int], Tensor] = {}
    for name, mask in masks.items():
        alive = torch.cat([mask.mask.detach().cpu() > 0.5, torch.ones(1, dtype=torch.bool)])
        for key, channel in groups[name].members.items():
            idx = torch.as_tensor(channel, dtype=torch.long)  # -1: another group's -> last = True
            here = alive[idx]
            alive_along[key] = alive_along[key] & here if key in alive_along else here
    out: dict[str, Tensor] = {}
    for name, mask in masks.items():
        group = groups[name]
        scores = torch.zeros(mask.num_channels, dtype=torch.float64)
        found = False
        for pname, dim in _producing_weights(group):
            p = params.get(pname)
            if p is None:
                continue
            found = True
            w = p.detach().abs().double().cpu()
            for (other, odim), keep_idx in alive_along.items():  # drop slices of pruned inputs
                if other == pname and odim != dim and keep_idx.numel() == w.shape[odim]:
                    shape = [1] * w.dim()
                    shape[odim] = -1
                    w = w * keep_idx.to(w.dtype).view(shape)
            rows = w.movedim(dim, 0).flatten(1).sum(1)  # (size of dim,)
            channel = torch.as_tensor(group.members[(pname, dim)], dtype=torch.long)
            keep = channel >= 0  # indices along dim that belong to this group
            scores.index_add_(0, channel[keep], rows[keep])
        if not found:
            raise ValueError(
                f"mask {name!r}: none of its producers {group.producers} has a 'weight' "
                "parameter in this model"
            )
        if normalize == "mean":
            alive = mask.mask.detach().cpu() > 0.5
            mean = scores[alive].mean() if bool(alive.any()) else torch.tensor(0.0)
            if float(mean) > 0:
                scores = scores / mean
        out[name] = scores
    return out


def random_scores(
    masks: Mapping[str, MaskLayer], generator: torch.Generator | None = None
) -> dict[str, Tensor]:
    """Uniform random scores in [0, 1), one per channel of each mask.

    Args:
        masks: ``{name: MaskLayer}`` (any masks; no groups needed).
        generator: the random stream (default: torch's global one).

    Returns:
        ``{mask name: float64 tensor of shape (num_channels,)}``.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> fisherprune.prune(masks, random_scores(masks, g))
    """
    return {
        name: torch.rand(m.num_channels, generator=generator, dtype=torch.float64)
        for name, m in masks.items()
    }
