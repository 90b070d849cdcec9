"""Pruning criteria as objects: how each channel's importance is measured and compared.

A criterion says what it needs (per-example mask gradients from the backward pass that
training runs anyway, or only the weights), how it turns that into one importance per channel,
and how the importances of a group are normalised before they are ranked against other
groups'. ``PruningOptimizer(criterion=...)``, ``update_pruning_signals`` and the quality
benchmark all take these objects, so every criterion the benchmark compares runs through the
public API.

* ``Fisher`` (default): the seed's signal, ``1/2 mean_n g[n,k]^2`` with ``g`` the derivative of
  example n's loss w.r.t. mask entry k (Theis et al. 2018, Eq. 8), summed over every place the
  mask acts before squaring (Liu et al. 2021).
* ``Taylor``: ``mean_n |g[n,k]|``, a first-order Taylor criterion after Molchanov et al. 2017
  (not the paper's normalised one unless ``normalize="l2"``; no average over positions).
* ``L1``: the L1 norm of each channel's producing weights (Li et al., ICLR 2017), by default
  divided by the group's mean (the layer-wise normalisation Torch-Pruning applies).
* ``Random(seed)``: uniform random importances, a cost-blind baseline.
* ``Activation`` (``fisherprune.signals.activation``): weight column norms times the RMS of the
  activations they read (structured Wanda / FLAP), from forward passes only.

Higher importance = kept longer; ``PruningOptimizer`` weighs it against the channel's marginal
cost (``flops_weight``) and prunes the lowest. Write your own by subclassing ``Criterion``
(weights only: implement ``importance``) or ``GradientCriterion`` (implement ``statistic``); see
docs/usage.md ("Writing a criterion").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fisherprune.masks import MaskLayer, MaskSet, as_mask_dict
from fisherprune.masks.points import find_holder
from fisherprune.settings import check_decay, check_loss_reduction
from fisherprune.signals.gather import fold_statistics

__all__ = [
    "CRITERIA",
    "L1",
    "NORMALIZE",
    "Criterion",
    "Fisher",
    "GradientCriterion",
    "Random",
    "Taylor",
    "alive_along",
    "groups_of",
    "register_criterion",
    "resolve_criterion",
]

#: how a group's importances are normalised over its kept channels before ranking
NORMALIZE: tuple[str, ...] = ("none", "mean", "l2")
#: criteria by name (``PruningOptimizer(criterion="l1")``, ``--pruning.criterion l1``)
CRITERIA: dict[str, type[Criterion]] = {}

C = TypeVar("C", bound="type[Criterion]")


def register_criterion(name: str) -> Callable[[C], C]:
    """Make a ``Criterion`` subclass constructible by ``name`` with no arguments.

    Raises:
        ValueError: ``name`` is taken.
        TypeError: the class is not a ``Criterion``.
    """

    def deco(cls: C) -> C:
        if not (isinstance(cls, type) and issubclass(cls, Criterion)):
            raise TypeError(f"register_criterion expects a Criterion subclass, got {cls!r}")
        if name in CRITERIA:
            raise ValueError(f"a criterion named {name!r} is already registered")
        CRITERIA[name] = cls
        return cls

    return deco


class Criterion:
    """How channels are ranked. Subclasses implement ``importance``.

    Args:
        normalize: ``"none"`` (default), ``"mean"`` (divide each group's importances by their
            mean over its kept channels) or ``"l2"`` (by their L2 norm there, as Molchanov et
            al. 2017 do per layer): makes raw values of different layers comparable.

    Raises:
        ValueError: an unknown ``normalize``.
    """

    #: whether masks must gather per-example mask gradients in backward for this criterion
    uses_gradients: ClassVar[bool] = False
    #: whether the criterion reads forward statistics gathered under ``observing``
    uses_activations: ClassVar[bool] = False

    def __init__(self, normalize: str = "none") -> None:
        if normalize not in NORMALIZE:
            raise ValueError(f"normalize must be one of {', '.join(NORMALIZE)}, got {normalize!r}")
        self.normalize = normalize

    @property
    def name(self) -> str:
        """The registered name of this criterion's class, or the class name."""
        for key, cls in CRITERIA.items():
            if type(self) is cls:
                return key
        return type(self).__name__

    def update(
        self,
        masks: MaskSet,
        decay: float = 0.96,
        *,
        loss_reduction: str = "mean",
        process_group: dist.ProcessGroup | None = None,
    ) -> Tensor | None:
        """Fold what the last backward pass gathered into the masks' signals. Called after
        every training step while pruning can still happen; nothing to do for a criterion
        that reads only weights (the default: returns None).

        Returns:
            How many masks' batch estimates were skipped as not finite (NaN or inf), as a 0-d
            tensor left on the device (reading it waits for the device); None when nothing
            was folded.
        """
        return None

    def observing(
        self, model: nn.Module, masks: Mapping[str, MaskLayer]
    ) -> AbstractContextManager[None]:
        """A context in which the model's forward passes feed the criterion's statistics
        (for a criterion that reads activations; ``prune_to_target`` runs a gradient
        criterion's signal passes in it too); changes nothing for the others."""
        return nullcontext()

    def importance(self, masks: Mapping[str, MaskLayer], model: nn.Module) -> dict[str, Tensor]:
        """Per mask, one importance per channel (higher = kept longer), before normalisation.

        Args:
            masks: ``{name: MaskLayer}`` as ``apply_masks`` or ``find_masks`` return them.
            model: the masked model.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement importance()")

    def scores(self, masks: Mapping[str, MaskLayer], model: nn.Module) -> dict[str, Tensor]:
        """``importance`` as float64 CPU tensors, normalised per group over kept channels."""
        raw = self.importance(masks, model)
        for name in masks:
            if name not in raw:
                raise ValueError(f"{type(self).__name__}.importance gave no values for {name!r}")
        host = _float64_on_host([raw[name] for name in masks])
        out: dict[str, Tensor] = {}
        for (name, m), v in zip(masks.items(), host, strict=True):
            if v.numel() != m.num_channels:
                raise ValueError(
                    f"{type(self).__name__}.importance gave {v.numel()} values for mask "
                    f"{name!r} of {m.num_channels} channels"
                )
            out[name] = self._normalized(v, m.host_mask() > 0.5)
        return out

    def _normalized(self, v: Tensor, alive: Tensor) -> Tensor:
        if self.normalize == "none" or not bool(alive.any()):
            return v
        kept = v[alive]
        d = kept.mean() if self.normalize == "mean" else kept.square().sum().sqrt()
        return v / d if float(d) > 0 else v

    def settings(self) -> dict[str, Any]:
        """What decides the ranking (recorded in optimizer states; a resume must match)."""
        return {"name": self.name, "normalize": self.normalize}

    def state_dict(self) -> dict[str, Any]:
        """State that changes while pruning (tensors and plain data only); none by default."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``."""

    def __repr__(self) -> str:
        extra = "" if self.normalize == "none" else f"normalize={self.normalize!r}"
        return f"{type(self).__name__}({extra})"


def _float64_on_host(tensors: list[Tensor]) -> list[Tensor]:
    """Each of ``tensors`` detached, flattened, as float64 on the CPU, with one copy from each
    device for all of them rather than one each (a prune decision reads every mask's signal,
    and on a GPU each copy waits for the device)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: dict[int, Tensor] = {}
    for idx in by_device.values():
        flat = torch.cat([tensors[i].detach().double().flatten() for i in idx]).cpu()
        out.update(zip(idx, flat.split([tensors[i].numel() for i in idx]), strict=True))
    return [out[i] for i in range(len(tensors))]


class GradientCriterion(Criterion):
    """A criterion computed from the per-example derivative ``g[n, k]`` of the loss w.r.t.
    each mask entry, gathered inside the ordinary backward pass. Subclasses implement
    ``statistic`` and set ``degree`` (and ``factor``).

    The importance is the mask's ``signal`` buffer: an exponential moving average of
    ``factor * mean_n statistic(g_n)`` over batches, all-reduced over ranks.
    """

    uses_gradients: ClassVar[bool] = True
    #: the statistic is homogeneous of this degree in ``g`` (a mean-reduced loss's 1/N in
    #: ``g`` is undone by ``N ** degree``)
    degree: ClassVar[int] = 2
    #: the constant in front of the per-example mean
    factor: ClassVar[float] = 1.0

    def statistic(self, g: Tensor) -> Tensor:
        """(N, C) per-example mask gradients of one pass -> (C,) their sum over examples."""
        raise NotImplementedError(f"{type(self).__name__} must implement statistic()")

    def update(
        self,
        masks: MaskSet,
        decay: float = 0.96,
        *,
        loss_reduction: str = "mean",
        process_group: dist.ProcessGroup | None = None,
    ) -> Tensor | None:
        """``signal <- decay * signal + (1 - decay) * batch estimate`` for every mask that
        received gradients (see ``update_pruning_signals``), in place; returns the count of
        masks whose estimate was skipped as not finite (``Criterion.update``)."""
        return fold_statistics(
            masks,
            check_decay(decay),
            loss_reduction=check_loss_reduction(loss_reduction),
            statistic=self.statistic,
            degree=self.degree,
            factor=self.factor,
            process_group=process_group,
        )

    def importance(self, masks: Mapping[str, MaskLayer], model: nn.Module) -> dict[str, Tensor]:
        """The masks' signals."""
        return {name: m.signal for name, m in masks.items()}


@register_criterion("fisher")
class Fisher(GradientCriterion):
    """``1/2 mean_n g[n,k]^2``: the Fisher pruning signal (Theis et al. 2018), the default."""

    degree = 2
    factor = 0.5

    def statistic(self, g: Tensor) -> Tensor:
        return torch.linalg.vecdot(g, g, dim=0)


@register_criterion("taylor")
class Taylor(GradientCriterion):
    """``mean_n |g[n,k]|``: first-order Taylor (after Molchanov et al. 2017). Without a cost
    weight it favours pruning wide late layers; ``normalize="l2"`` is the paper's layer-wise
    normalisation."""

    degree = 1
    factor = 1.0

    def statistic(self, g: Tensor) -> Tensor:
        return g.abs().sum(0)


@register_criterion("l1")
class L1(Criterion):
    """The L1 norm of each channel's producing weights (Li et al., ICLR 2017).

    For every producer of the channel's group (a conv or linear whose output makes it; several
    for channels coupled by a residual add) the absolute values of its ``weight`` along the
    group's dim are summed over every other dim. Weight slices that read an already pruned
    channel of another group are left out, so the norm is that of the network as ``shrink``
    would leave it. Needs the groups ``apply_masks`` found (hand-placed MaskLayers carry no
    producer information).

    Args:
        normalize: default ``"mean"``: raw L1 norms grow with fan-in and, before a BatchNorm,
            have an arbitrary scale, so each group's are divided by their mean.
    """

    def __init__(self, normalize: str = "mean") -> None:
        super().__init__(normalize)

    @torch.no_grad()
    def importance(self, masks: Mapping[str, MaskLayer], model: nn.Module) -> dict[str, Tensor]:
        groups = groups_of(masks, model)
        params = dict(model.named_parameters())
        kept_along = alive_along(masks, groups)
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
                for (other, odim), keep_idx in kept_along.items():  # drop pruned inputs' slices
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
            out[name] = scores
        return out


@register_criterion("random")
class Random(Criterion):
    """Uniform random importances in [0, 1): ``prune`` removes a channel drawn uniformly among
    the kept ones (with ``flops_weight=0``). The stream is its own, seeded, and saved with the
    optimizer's state, so a resumed run draws what an uninterrupted one would.

    Args:
        seed: the seed of the stream.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__("none")
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def importance(self, masks: Mapping[str, MaskLayer], model: nn.Module) -> dict[str, Tensor]:
        return {
            name: torch.rand(m.num_channels, generator=self.generator, dtype=torch.float64)
            for name, m in masks.items()
        }

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "seed": self.seed}

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "generator" in state:
            self.generator.set_state(state["generator"])

    def __repr__(self) -> str:
        return f"Random(seed={self.seed})"


def resolve_criterion(criterion: Criterion | str) -> Criterion:
    """A ``Criterion`` as it is, or the registered one of that name built with defaults.

    Raises:
        ValueError: an unknown name.
        TypeError: neither a name nor a ``Criterion``.
    """
    if isinstance(criterion, Criterion):
        return criterion
    if isinstance(criterion, str):
        cls = CRITERIA.get(criterion.lower())
        if cls is None:
            raise ValueError(
                f"unknown criterion {criterion!r}; choose one of {', '.join(CRITERIA)} or pass "
                "a fisherprune.criteria.Criterion object"
            )
        return cls()
    raise TypeError(
        f"criterion must be a name or a fisherprune.criteria.Criterion, got "
        f"{type(criterion).__name__}"
    )


def groups_of(masks: Mapping[str, MaskLayer], model: nn.Module) -> Mapping[str, Any]:
    """The ``ChannelGroup`` of each mask: from an ``AppliedMasks``' ``.groups``, else from
    what ``apply_masks`` recorded on the model.

    Raises:
        ValueError: a mask has no group (hand-placed MaskLayers carry no producer information).
    """
    groups = getattr(masks, "groups", None)
    if not isinstance(groups, Mapping):
        found = find_holder(model)
        groups = found[1].groups if found else {}
    missing = [n for n in masks if n not in groups]
    if missing:
        raise ValueError(
            f"no channel group for mask(s) {missing}: this criterion reads the weights that "
            "produce each channel, which only masks placed by fisherprune.apply_masks record"
        )
    return groups


def _producing_weights(group: Any) -> list[tuple[str, int]]:
    """The ``(parameter name, dim)`` pairs of the group that are producers' weights: their
    ``weight``, or the rows of weights named ``weight_*`` (a recurrent layer's ``weight_ih_l0``,
    ``weight_hh_l0``...: each hidden unit's gate rows)."""
    out: list[tuple[str, int]] = []
    for name, dim in group.members:
        module, _, leaf = name.rpartition(".")
        weight = leaf == "weight" or (leaf.startswith("weight_") and dim == 0)
        if weight and (module or "<model>") in group.producers:
            out.append((name, dim))
    return out


def alive_along(
    masks: Mapping[str, MaskLayer], groups: Mapping[str, Any]
) -> dict[tuple[str, int], Tensor]:
    """For each parameter dim a group touches: whether each index along it is still kept."""
    out: dict[tuple[str, int], Tensor] = {}
    for name, mask in as_mask_dict(masks).items():
        alive = torch.cat([mask.host_mask() > 0.5, torch.ones(1, dtype=torch.bool)])
        for key, channel in groups[name].members.items():
            idx = torch.as_tensor(channel, dtype=torch.long)  # -1: another group's -> True
            here = alive[idx]
            out[key] = out[key] & here if key in out else here
    return out
