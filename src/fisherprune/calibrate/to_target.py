"""``prune_to_target``: prune a trained model to a cost target from a little calibration data,
with no training (Kwon et al. 2022's workflow, for every architecture ``apply_masks`` handles).

Per round: the criterion's signals are estimated on the calibration batches (for a gradient
criterion, one forward and backward per batch in eval mode with every parameter frozen: no
weight, gradient or batch-norm statistic changes), then channels are removed one (or one
``round_to`` block) at a time, as ``prune`` chooses them, with ``score_all``'s cost-weighted
scores until the round's cost goal is reached (``prune_many``, in chunks between exact
cost reports). Goal ``g`` of ``R`` is ``start * (target / start) ** (g / R)``: equal cost
ratios per goal, the signals re-estimated on the thinner model between rounds
(``rounds="auto"``: ``R`` grows with the share of the cost removed, ``ROUND_RATIO``).

No round removes more than ``round_cap`` of the channels a mask keeps when the round starts
(at least one block): a channel's signal says what removing it alone costs in the network it
was measured in, and a layer whose channels each matter little beside the others (a wide last
convolution before a global pool) would otherwise lose nearly all of them to one scoring
(issue 31: 63 of 64, test accuracy 0.99 -> 0.40). A round stopped by the cap before its goal
is followed by another at the same goal, the signals re-estimated first. Then the layers that
read removed channels are refitted by least squares (``calibrate.repair``).
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from fisherprune.allocator import trim_freed_memory
from fisherprune.calibrate.checkpoint import (
    check_checkpoint,
    checkpointed_blocks,
    resolve_block_list,
)
from fisherprune.calibrate.label_free import LabelFreeLoss
from fisherprune.calibrate.latency_line import (
    LatencyCheck,
    LatencyLine,
    LatencyLoop,
    add_floor_knot,
    fit_latency_line,
)
from fisherprune.calibrate.norm_stats import NormStats
from fisherprune.calibrate.repair import RepairReport, check_passes, repair_consumers
from fisherprune.cost import CostModel, LatencySpec
from fisherprune.cost.conventions import check_conventions
from fisherprune.cost.latency import round_to_for
from fisherprune.graph import apply_masks, remove_masks
from fisherprune.inputs import batch_size, calibration_pairs, call_model
from fisherprune.masks import MaskLayer, find_masks
from fisherprune.masks.blocks import BlockGate
from fisherprune.masks.experts import ExpertGate
from fisherprune.modes import eval_mode
from fisherprune.pruner.optimizer import resolve_target
from fisherprune.pruner.prune import (
    OVERSHOOT,
    PruneEvent,
    block_size,
    lowest_kept,
    mask_floor,
    prune_many,
    rounding,
)
from fisherprune.pruner.scoring import FlopsWeight, score_all
from fisherprune.pruner.uniform import copies_of, plan_uniform
from fisherprune.settings import check_flops_weight, check_int, check_min_channels
from fisherprune.signals import Criterion, resolve_criterion

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - tqdm is optional
    tqdm = None

__all__ = ["PruneResult", "estimate_signals", "observe_activations", "prune_to_target"]

log = logging.getLogger("fisherprune")

LossFn = Callable[[Any, Any], Tensor]

#: the share of the remaining cost gap removed between two exact cost reports (``_Selection``)
STEP_FRACTION = 0.25

#: ``rounds="auto"``: the cost ratio of one round's goal, so ``ceil(log(target / start) /
#: log(ROUND_RATIO))`` rounds: 2 to 70% of the cost, 4 to 50%, 6 to 30%
#: (benchmarks/one_shot_defaults.py)
ROUND_RATIO = 0.8

#: the default ``round_cap``: the largest share of a mask's channels one round may remove
#: (0.25 kept more accuracy than 0.5 at 50% and 30% of the FLOPs of the MobileNetV3-shaped
#: network of benchmarks/one_shot_defaults.py, at the same number of rounds). The uniform pace
#: ``1 - sqrt(ROUND_RATIO)`` (0.106: every mask thinned alike to meet one goal) lifts the
#: digits ResNet-18 at 30% from 0.933 to 0.965 but costs the MiniLM at 70% (a cosine of 0.666
#: on seed 0 against 0.826 +- 0.015; ``fisher_cap_pace``): a round held to it is nearly uniform.
#: Ending the round at the first mask capped instead (``rescore_at_cap``, ``fisher_rescore``)
#: lifts the ResNet-18 at 30% to 0.956 +- 0.013 but lets re-scoring drain one mask of the
#: MobileNetV3 round after round (3% of it kept; 0.757 against 0.939 at 30% on seed 0).
#: A floor over all rounds with it (``floor_power=1``, ``fisher_rescore_floor``) stops the
#: drain and keeps the ResNet-18 at 30% at 0.956 +- 0.007, the MobileNetV3 at 0.943 +- 0.020
#: (fisher 0.956 +- 0.017), but at 70% of the cost it holds every mask to 70% of its width,
#: nearly uniform: the decoder LM's perplexity 6.36 +- 0.12 against 5.64 +- 0.15, the MiniLM's
#: cosine 0.744 against 0.827 on seed 0. The floor without re-scoring (``fisher_floor``) gains
#: less on the ResNet-18 (0.945) and loses on the MobileNetV3 (0.949); re-scoring with a
#: floor that does not follow the target (``min_channels=0.25``, ``fisher_rescore_min25``)
#: keeps the decoder LM but loses the MiniLM at 50% (0.531 against 0.682 on seed 0)
ROUND_CAP = 0.25

#: a round that takes more than this share of a mask's channels is warned about
COLLAPSE_SHARE = 0.5

#: ``criterion="auto"``: by ``reconstruct``. With the repair, ``fisher_mean`` (the Fisher of
#: replacing a channel by its mean, joint increments on widths several layers read and no
#: norm normalises across) is first
#: or within noise of first against l1, taylor and random on every row of
#: benchmarks/one_shot_defaults.py, where the seed's signal fell behind taylor on the digits
#: ResNet-18 at 30% and the digits MLP at 50%; without the repair a removed channel reads 0,
#: the removal the seed's signal measures
AUTO_CRITERION = {True: "fisher_mean", False: "fisher"}

#: the default ``repair_budget``: the FLOPs the repair's forwards may cost, about 2,450
#: forwards of a 224x224 image through a ResNet-50 (~4 minutes on 2 CPU cores): 8 passes over
#: 256 images there; a small network, or a MiniLM on 256 sentences, is repaired stage by stage
#: on every example
REPAIR_FLOPS = 2e13


#: why ``prune_to_target`` leaves a mask whole that its calibration passes gave no gradient
UNREACHED = (
    "no gradient reached it in the calibration passes (the loss does not use its output: a "
    "head or branch the task discards; or no example was routed through it), so its signal "
    "says nothing"
)
#: why ``uniform=True`` leaves a copy of such a mask whole with it (a gradient reached the copy)
UNREACHED_COPY = (
    "a copy of a mask no gradient reached in the calibration passes, and uniform=True keeps "
    "every copy at one width (the loss does not use that copy's output: build the model "
    "without it, as SigLIP's classifier with vision_use_head=False, to prune the copies)"
)


def _split_whole(whole: dict[str, str]) -> tuple[dict[str, str], str]:
    """The masks a setting keeps whole (``uniform=True``, ``blocks="only"``), and a clause
    naming those kept whole as ``UNREACHED`` ("" when none)."""
    unreached = [n for n, r in whole.items() if r == UNREACHED]
    copies = [n for n, r in whole.items() if r == UNREACHED_COPY]
    if not unreached:
        return whole, ""
    said = (
        f" (with {len(unreached)} mask(s) that no gradient reached in the calibration passes "
        f"kept whole, e.g. {unreached[0]}: the loss does not use their output"
        + (
            f"; and {len(copies)} of their copies, e.g. {copies[0]}: {UNREACHED_COPY}"
            if copies
            else ""
        )
        + ")"
    )
    return {n: r for n, r in whole.items() if r not in (UNREACHED, UNREACHED_COPY)}, said


def _stuck_message(
    result: PruneResult, goal: float, min_channels: Any, round_to: int, floor_power: Any
) -> str:
    """Why the cost stays above the target: every prunable mask at its floor (``floor_power``'s
    named where it is set), and the masks ``uniform=True`` or ``blocks="only"`` keeps whole
    (with the first reason) when there are any."""
    power = (
        ""
        if floor_power is None
        else f", floor_power={floor_power}: raise it (a higher power lowers the floor) or unset it"
    )
    floor = f"(min_channels={min_channels}, round_to={round_to}{power})"
    whole, unreached = _split_whole(result.kept_whole)
    gap = f"the cost {result.cost_after:.6g} stays above the target {goal:.6g}{unreached}"
    if not whole:
        return f"every mask is at its floor {floor}; {gap}"
    name, reason = next(iter(whole.items()))
    if reason.startswith("blocks='only'"):
        return (
            f"every block gate is at its floor {floor}; {gap}. blocks='only' keeps every "
            "channel: prune with blocks=True to narrow channels too, or choose a higher target"
        )
    return (
        f"every mask uniform=True may prune is at its floor {floor}; {gap}. uniform=True keeps "
        f"{len(whole)} mask(s) whole, e.g. {name}: {reason}. Prune with "
        "uniform=False to reach the target (the model then no longer saves as a standard "
        "configuration), or choose a higher target"
    )


@contextmanager
def _at_floor(
    masks: dict[str, MaskLayer],
    whole: dict[str, str],
    floors: tuple[int | float, int],
    width_floors: dict[str, int],
    marginal: Mapping[str, Tensor],
) -> Iterator[None]:
    """Inside: every mask it may prune (all but ``whole``) thinned, from where it is now, to
    its floor (``floors``: ``min_channels``, ``round_to``; above that, ``width_floors``:
    ``floor_power``'s), as the selection's own floor counts it, keeping the channels whose
    ``marginal`` cost now is lowest (the blocks of one list may differ in width, the channels
    of one mask in what a user pruned around them). On exit the masks are put back as they
    were."""
    min_channels, round_to = floors
    saved = {n: (m.mask.detach().clone(), m.is_all_ones()) for n, m in masks.items()}
    try:
        with torch.no_grad():
            for n, m in masks.items():
                alive = torch.nonzero(saved[n][0] > 0.5).flatten()
                least = max(mask_floor(min_channels, m), width_floors.get(n, 0))
                keep = lowest_kept(alive.numel(), least, rounding(m, round_to))
                if n not in whole and keep < alive.numel():
                    cost = marginal[n].to(alive.device)[alive]
                    dearest = alive[torch.argsort(cost, descending=True, stable=True)]
                    m.mask[dearest[: alive.numel() - keep]] = 0.0
        yield
    finally:
        with torch.no_grad():
            for n, (mask, ones) in saved.items():
                masks[n].mask.copy_(mask)
                masks[n].record_values(ones)


def _put_back(masks: Mapping[str, MaskLayer], saved: Mapping[str, tuple[Tensor, bool]]) -> None:
    """Undo a prune: write each saved mask value back into the mask of its name, with
    whether it was all ones (``MaskLayer.record_values``). Changes: those masks."""
    with torch.no_grad():
        for n, (values, ones) in saved.items():
            masks[n].mask.copy_(values)
            masks[n].record_values(all_ones=ones)


def _narrowest_copy(line: LatencyLine, start: float) -> float:
    """The price of the narrowest copy ``fit_latency_line`` timed and priced on (``start``:
    the dense price; 0 when the line was not fitted: nothing is extrapolated then)."""
    timed = [p["measured_share"] for p in line.points if p.get("measured_share") is not None]
    return min(timed) * start if line.fitted and timed else 0.0


@dataclass(frozen=True)
class _Reach:
    """What a prune may reach: the settings that bound it and the cost it starts from."""

    target: Any  # as the caller gave it
    start: float  # the starting cost (a share is of it)
    floors: tuple[int | float, int]  # min_channels, round_to
    floor_power: float | None
    uniform: bool
    whole: dict[str, str]  # masks left whole, with why (``uniform``, ``blocks="only"``)
    width_floors: dict[str, int]  # ``floor_power``'s floor per mask (0: none)

    def at_floor(
        self, masks: dict[str, MaskLayer], cost_model: CostModel
    ) -> AbstractContextManager[None]:
        """``_at_floor`` of ``masks`` under these settings."""
        marginal = cost_model.report().marginal
        return _at_floor(masks, self.whole, self.floors, self.width_floors, marginal)


def _check_reach(
    cost_model: CostModel, masks: dict[str, MaskLayer], goal: float, reach: _Reach
) -> None:
    """Refuse, before any signal is estimated or any weight changes, a target below the cost
    of the model with every mask it may prune at its floor (``_at_floor``): no selection
    reaches it, and pruning towards it would leave every layer at its floor. Changes nothing.

    Raises:
        ValueError: ``_refuse``'s.
    """
    with reach.at_floor(masks, cost_model):
        floor = cost_model.total()
    if goal < floor:
        _refuse(goal, floor, reach, cost_model.latency is not None)


def _check_timed_reach(
    loop: LatencyLoop,
    cost_model: CostModel,
    masks: dict[str, MaskLayer],
    goal: float,
    reach: _Reach,
) -> None:
    """After a latency check refitted the line: where the line prices every mask at its floor
    above ``goal``, time that floor whole (once a prune, ``LatencyLoop.time_floor``, which
    refits through it), and refuse the target if the floor is timed above it. The caller
    gives the model back as it came.

    Raises:
        ValueError: ``_refuse``'s, naming the floor as timed.
    """
    if not (loop.checks and loop.checks[-1].refitted) or any(c.floor for c in loop.checks):
        return
    with reach.at_floor(masks, cost_model):
        floor = cost_model.total()
    if floor <= goal:
        return
    check = loop.time_floor(lambda: reach.at_floor(masks, cost_model))
    if check.trusted and check.measured_share * loop.dense > goal:  # (load while timing: go on)
        how = "as timed whole (LatencySpec.checks)"
        _refuse(goal, check.measured_share * loop.dense, reach, True, how)


def _refuse(goal: float, floor: float, reach: _Reach, latency: bool, how: str = "") -> None:
    """Raise the refusal of ``goal``, below the ``floor`` the settings allow (``how``: where
    that floor comes from, when it was measured).

    Raises:
        ValueError: naming the reachable floor (a share of ``reach.start`` and a cost), the
            masks kept whole with the first reason (``uniform=True``, ``blocks="only"``),
            ``floor_power`` where it is set, and what to do instead.
    """
    min_channels, round_to = reach.floors
    start = reach.start
    whole, unreached = _split_whole(reach.whole)
    unit = "per forward pass" if latency else "per example"
    digits = 1 if f"{goal / start:.1%}" != f"{floor / start:.1%}" else 2  # never "0.5% < 0.5%"
    wanted = f"target {reach.target!r} ({goal / start:.{digits}%} of the cost, {goal:.6g} {unit})"
    scale = 10 ** (digits + 2)
    at_least = f"a target of at least {math.ceil(floor / start * scale) / scale * 100:g}%"
    power = "" if reach.floor_power is None else f", floor_power={reach.floor_power}"
    floor_text = f"(min_channels={min_channels}, round_to={round_to}{power})"
    found = f" {how}" if how else ""
    reach_text = f"its floor is {floor / start:.{digits}%} ({floor:.6g}){found}{unreached}"
    if reach.uniform:
        kept = ""
        if whole:
            name, reason = next(iter(whole.items()))
            kept = f" It keeps {len(whole)} mask(s) whole, e.g. {name}: {reason}."
        where = " with uniform=True"
        advice = (
            f"every mask it may prune at its floor {floor_text}.{kept} Prune without uniform "
            "(--uniform) for an uneven prune, whose Hugging Face folder loads with "
            f"trust_remote_code=True, or choose {at_least}"
        )
    elif whole:  # blocks="only": every channel is kept
        where = " with blocks='only'"
        advice = (
            f"every block gate at its floor {floor_text}. Prune with blocks=True to narrow "
            f"channels too, or choose {at_least}"
        )
    else:
        if reach.floor_power is not None:
            lower = "raise floor_power, a higher power lowers the floor, or unset it"
        elif (min_channels, round_to) == (1, 1):
            lower = "the rest is what removing channels does not change"
        else:
            lower = "lower min_channels or round_to"
        where = ""
        advice = (
            f"every mask at its floor {floor_text}, so pruning towards it would leave every "
            f"layer that thin and still miss it ({lower})"
            # (floor_power's floor moves with the target: no target is named)
            + ("" if reach.floor_power is not None else f". Choose {at_least}")
        )
    raise ValueError(
        f"{wanted} is out of reach{where}: {reach_text}, {advice}; nothing was changed"
    )


def _give_back(
    model: nn.Module,
    masks: dict[str, MaskLayer],
    found: tuple[dict[str, Tensor], dict[str, bool], dict[str, Tensor]],
    masked_here: bool,
) -> None:
    """Put every mask back as the call found it (``found``: its values, whether they were all
    ones, its ``signal`` buffer), and remove the masks the call added (``masked_here``).
    Changes: the masks."""
    dense, ones, signals = found
    with torch.no_grad():
        for n, m in masks.items():
            m.mask.copy_(dense[n])
            m.signal.copy_(signals[n])
            m.record_values(ones[n])
    if masked_here:
        remove_masks(model)


def _floor_message(
    result: PruneResult, masks: dict[str, MaskLayer], min_channels: Any, round_to: int
) -> str:
    """Which masks the selection pruned down to their floor, with their widths (and the floor
    of their own where a mask has one: an ``ExpertGate`` keeps its router's ``top_k``)."""

    def why(n: str) -> str:
        own = getattr(masks[n], "min_kept", 0)
        return f": its own floor, top_k={own}" if own and own == result.kept[n][0] else ""

    left = ", ".join(
        f"{n} ({result.kept[n][0]} of {result.kept[n][1]}{why(n)})" for n in result.at_floor
    )
    return (
        f"mask(s) left at their floor (min_channels={min_channels}, round_to={round_to}): "
        f"{left}; the selection would have removed more of them. A layer this thin may hold "
        "the network's accuracy back: check it, or raise min_channels"
    )


def _check_round_cap(round_cap: Any) -> float:
    """``round_cap`` as a float in (0, 1]."""
    if isinstance(round_cap, bool) or not isinstance(round_cap, (int, float)):
        raise ValueError(f"round_cap must be a number in (0, 1], got {round_cap!r}")
    if not 0 < round_cap <= 1:
        raise ValueError(f"round_cap must be in (0, 1], got {round_cap!r}")
    return float(round_cap)


def _check_floor_power(floor_power: Any) -> None:
    """Refuse a ``floor_power`` that is not None or a positive number."""
    if floor_power is None:
        return
    if isinstance(floor_power, bool) or not isinstance(floor_power, (int, float)):
        raise ValueError(f"floor_power must be a positive number or None, got {floor_power!r}")
    if not 0 < floor_power < math.inf:
        raise ValueError(f"floor_power must be a positive number or None, got {floor_power!r}")


def _auto_rounds(start: float, goal: float) -> int:
    """``rounds="auto"``: the goals needed to go from ``start`` to ``goal`` at a cost ratio of
    at most ``ROUND_RATIO`` each (1e-9: a ratio that is a power of it needs no extra goal)."""
    return max(1, math.ceil(math.log(goal / start) / math.log(ROUND_RATIO) - 1e-9))


def _warn_collapse(masks: dict[str, MaskLayer], before: dict[str, int], r: int) -> None:
    """Warn about every mask that round ``r`` took more than ``COLLAPSE_SHARE`` of its
    ``before`` channels from (possible only with a ``round_cap`` above it)."""
    lost = {n: (before[n] - m.kept, before[n]) for n, m in masks.items()}
    hit = {n: v for n, v in lost.items() if v[0] > COLLAPSE_SHARE * v[1]}
    if hit:
        which = ", ".join(f"{n} lost {a} of {b}" for n, (a, b) in hit.items())
        warnings.warn(
            f"round {r} removed most of a mask's channels in one scoring: {which}. The signals "
            "of those kept were measured beside the removed ones, not in the network they are "
            f"left in: lower round_cap (default {ROUND_CAP:.3g}) or raise rounds",
            stacklevel=3,
        )


@dataclass
class PruneResult:
    """What ``prune_to_target`` did.

    Attributes:
        cost_before: cost per example of the model as it came (``convention`` units).
        cost_after: cost per example as masked now.
        target: the absolute cost target per example.
        events: every ``PruneEvent``, in order (``step`` is the round, from 1).
        seconds: wall time of the whole call.
        phase_seconds: wall time of each phase: ``signals`` (estimation passes),
            ``selection`` (choosing channels; with ``convention="latency"`` the states timed
            whole, ``latency_checks``), ``repair`` (the least-squares passes and solves).
        phase_cpu_seconds: process CPU time of each phase (all threads; on a shared machine
            the wall time also holds the waits for a core).
        rounds: rounds run.
        examples: calibration examples per pass.
        repair: what the repair changed (None with ``reconstruct=False``).
        convention: the cost convention.
        kept_whole: the masks left whole and why: with ``uniform=True``, those a Hugging
            Face config has no field for; with ``blocks="only"``, every channel mask; and
            those no gradient reached in the calibration passes (``UNREACHED``: a head the
            loss does not use, as SigLIP's pooling head under image classification).
        kept: per mask, the channels it keeps and the channels it had.
        at_floor: the masks pruned down to their floor (``min_channels``, ``round_to``):
            the selection stopped there, not the scores.
        latency_line: with ``convention="latency"``, the line or curve the cost was first
            fitted to (``fit_latency_line``: the dense model and shrunk copies timed whole),
            else None.
        latency_checks: with ``convention="latency"``, the states the rounds reached, timed
            whole, that the line was refitted through (``LatencyLoop``; the last is the state
            at the end, ``cost_after`` priced on the line through it when refitted).
        criterion: the name of the criterion that ranked the channels (what ``"auto"``
            chose).
        round_to: the ``round_to`` the prune kept widths to (what None resolved to:
            ``round_to_for``).
    """

    cost_before: float
    cost_after: float
    target: float
    events: list[PruneEvent] = field(default_factory=list)
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    phase_cpu_seconds: dict[str, float] = field(default_factory=dict)
    rounds: int = 0
    examples: int = 0
    repair: RepairReport | None = None
    convention: str = "flops"
    kept_whole: dict[str, str] = field(default_factory=dict)
    kept: dict[str, tuple[int, int]] = field(default_factory=dict)
    at_floor: list[str] = field(default_factory=list)
    latency_line: LatencyLine | None = None
    latency_checks: list[LatencyCheck] = field(default_factory=list)
    criterion: str = ""
    round_to: int = 1

    @property
    def ratio(self) -> float:
        """``cost_after / cost_before``."""
        return self.cost_after / self.cost_before if self.cost_before else math.nan

    @property
    def min_kept_fraction(self) -> float:
        """The smallest share of its channels any mask keeps (NaN before pruning)."""
        return min((k / n for k, n in self.kept.values() if n), default=math.nan)


@contextmanager
def _frozen(model: nn.Module) -> Iterator[None]:
    """Parameters stop requiring grad for the block (no weight gradient is computed or
    stored), and get their flags back after it."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def estimate_signals(
    model: nn.Module,
    masks: dict[str, MaskLayer],
    batches: Iterable[tuple[Any, Any]],
    loss_fn: LossFn,
    criterion: Criterion,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
    blocks: nn.ModuleList | None = None,
    unreached: set[str] | None = None,
) -> int:
    """Set each mask's ``signal`` to the criterion's estimate over all of ``batches``.

    Runs one forward and backward per batch in eval mode with every parameter frozen, the
    masks collecting; then ``criterion.update(masks, decay=0)`` pools every example. With
    ``blocks`` (a repeated ``nn.ModuleList`` of ``model``), each block is checkpointed for the
    pass (``calibrate.checkpoint``): its activations are recomputed in backward instead of
    held, one block's at a time; the signals are the same.

    A mask no gradient reached in any batch (a branch whose output the loss does not use, an
    expert no example was routed to) has no estimate: with ``unreached``, its name is added
    to that set (its signal is 0), as long as the gradient reached some mask; without, it is
    an error.

    Changes: each mask's ``signal`` (replaced); the masks' ``collecting`` flag is left on;
    ``unreached`` (added to).
    Weights, their ``.grad``, batch-norm statistics, train/eval flags and the model's modules
    are unchanged.

    Returns:
        The number of calibration examples.

    Raises:
        ValueError: no batches, a mask the loss does not reach (with ``unreached``: no mask
            it reaches), or a signal that is not finite (NaN or inf in a batch: the message
            names the first such batch).
    """
    for m in masks.values():
        m.collecting = True
        m.reset_statistics()
    examples, losses = 0, []
    recomputed = checkpointed_blocks(model, blocks) if blocks is not None else nullcontext()
    with eval_mode(model), _frozen(model), recomputed, torch.enable_grad():
        for inputs, targets in progress(batches) if progress else batches:
            loss = loss_fn(call_model(model, inputs), targets)
            loss.backward()
            losses.append(loss.detach())  # read back only if the signal is not finite
            examples += batch_size(inputs)
    if examples == 0:
        raise ValueError("no calibration batches: give prune_to_target at least one batch")
    silent = [n for n, m in masks.items() if not m.received]
    if unreached is not None and len(silent) < len(masks):
        unreached.update(silent)
    elif silent:
        raise ValueError(
            f"mask(s) {silent} received no gradient: the loss does not reach them (check that "
            "loss_fn uses the model's outputs, or use a criterion that reads only weights)"
        )
    with warnings.catch_warnings():  # the error below says it for every mask at once
        warnings.filterwarnings("ignore", "mask .* pruning-signal estimate is not finite")
        skipped = criterion.update(masks, 0.0, loss_reduction="mean")
    if skipped is not None and int(skipped):
        raise ValueError(_not_finite_message(losses, int(skipped), len(masks)))
    return examples


def observe_activations(
    model: nn.Module,
    masks: dict[str, MaskLayer],
    batches: Iterable[tuple[Any, Any]],
    criterion: Criterion,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
) -> int:
    """Run every batch forward (eval mode, no gradient) under ``criterion.observing``, so that
    a criterion that ``uses_activations`` gathers its statistics over all of ``batches``.

    Changes: the criterion's statistics (replaced). Weights, masks and train/eval flags are
    unchanged.

    Returns:
        The number of calibration examples.

    Raises:
        ValueError: no batches.
    """
    examples = 0
    with eval_mode(model), torch.no_grad(), criterion.observing(model, masks):
        for inputs, _ in progress(batches) if progress else batches:
            call_model(model, inputs)
            examples += batch_size(inputs)
    if examples == 0:
        raise ValueError("no calibration batches: give prune_to_target at least one batch")
    return examples


def _not_finite_message(losses: list[Tensor], skipped: int, masks: int) -> str:
    """Why no channel is pruned: ``skipped`` of ``masks`` signals are not finite, and the
    first calibration batch whose loss is not (or that the gradients alone are not)."""
    bad = [i for i, v in enumerate(losses) if not math.isfinite(float(v))]
    if bad:
        others = f" (and {len(bad) - 1} other batch(es))" if len(bad) > 1 else ""
        where = (
            f"the loss of calibration batch {bad[0] + 1} of {len(losses)} is "
            f"{float(losses[bad[0]])}{others}"
        )
    else:
        where = "every batch's loss is finite but the gradients are not (an overflow)"
    return (
        f"no channel pruned: the pruning signal of {skipped} of {masks} mask(s) is not finite "
        f"on the calibration data: {where}. Remove the NaN or inf values from the calibration "
        "inputs and targets (or check the model's weights)"
    )


def _bar(progress: bool, what: str) -> Callable[[Iterable[Any]], Iterable[Any]] | None:
    if not progress:
        return None
    if tqdm is None:
        return lambda it: it
    return lambda it: tqdm(it, desc=what, leave=False)


def prune_to_target(
    model: nn.Module,
    example_inputs: Any,
    batches: Iterable[tuple[Any, Any]],
    target: float | int | str,
    *,
    loss_fn: LossFn | None = None,
    criterion: Criterion | str = "auto",
    rounds: int | str = "auto",
    round_cap: float = ROUND_CAP,
    rescore_at_cap: bool = False,
    floor_power: float | None = None,
    min_channels: int | float = 1,
    round_to: int | None = None,
    uniform: bool = False,
    blocks: bool | str = False,
    experts: bool = False,
    flops_weight: FlopsWeight = "auto",
    convention: str = "flops",
    score_convention: str | None = None,
    latency: LatencySpec | None = None,
    reconstruct: bool = True,
    recalibrate_norms: bool = True,
    task: str = "auto",
    seed: int = 0,
    ridge: float | None = None,
    repair_passes: int | None = None,
    repair_examples: int | None = None,
    repair_budget: float | None = REPAIR_FLOPS,
    checkpoint: bool | str = "auto",
    progress: bool = False,
) -> PruneResult:
    """Prune a trained ``model`` to ``target`` using calibration ``batches``, without training.

    Applies masks if the model has none (``apply_masks(model, example_inputs)``), then round
    after round estimates the criterion's signals on the batches and removes the
    lowest-scoring channels until the round's share of the cost reduction is reached or
    ``round_cap`` stops it (see the module docstring), then refits the layers that read
    removed channels (``reconstruct``).

    Changes: the masks (removed channels set to 0; ``collecting`` turned off at the end) and
    their ``signal`` buffers; with ``reconstruct``, the weights and biases of the repaired
    layers (``RepairReport``). The model comes back masked: ``fisherprune.shrink`` gives
    the small one. Batch-norm statistics (re-estimated between rounds with
    ``recalibrate_norms``, then put back, also when the call raises), ``.grad`` and
    train/eval flags come back as they were.

    Memory, besides the model: one calibration batch's activations, forward and backward
    (pass small batches to bound it: the signals are per example, whatever the batching; with
    ``checkpoint``, one repeated block's and each block's input), no
    weight gradient (parameters are frozen while signals are collected), and in the repair
    one stage's least-squares sums, one block of a layer's solution, one layer's original
    weights and one held-out batch's dense outputs at a time (the others wait in a temporary
    folder, ``TMPDIR``: about the fitted layers' bytes on disk).

    Args:
        model: a trained network.
        example_inputs: inputs to trace it with (a tensor, tuple or dict; a batch of one does).
        batches: calibration data, ``(inputs, targets)`` pairs or dicts of keyword inputs (a
            Hugging Face ``DataLoader``'s batches: ``fisherprune.inputs.as_pair``), iterated
            once per round and once per repair pass (an iterator is read into a list first).
            ``targets`` may be None with ``loss_fn=None``. Inputs must be on the model's
            device.
        target: the cost to reach per example: absolute (>= 1), a fraction in (0, 1) or a
            percentage string of the starting cost, in ``convention`` units.
        loss_fn: ``loss(outputs, targets)``, averaged over the batch; None: the label-free
            Fisher of the model's own predictive distribution (``calibrate.label_free``).
        criterion: a ``fisherprune.criteria.Criterion`` or a registered name (``"fisher"``,
            ``"fisher_mean"``, ``"taylor"``, ``"l1"``, ``"random"``, ``"activation"``: forward
            statistics from the calibration batches, ``observe_activations``); ``"auto"``
            (``AUTO_CRITERION``): ``"fisher_mean"``, the Fisher signal of the removal the
            repair makes (each channel replaced by its mean; joint increments on widths
            several layers read), with ``reconstruct=True``, else ``"fisher"``, the seed's
            signal of setting a channel to 0.
        rounds: the cost goals, equal cost ratios apart, each reached by one or more
            estimation-and-selection rounds; ``"auto"``: as many as the share of the cost
            removed needs at ``ROUND_RATIO`` each (4 to 50%); 1: one goal.
        round_cap: the largest share of the channels a mask keeps when a round starts that
            the round may remove (at least one channel or ``round_to`` block); a round that
            reaches it before its goal is followed by another with re-estimated signals.
            1: no cap (with ``rounds=1``: a single scoring, as before issue 31). A mask that
            loses more than ``COLLAPSE_SHARE`` (half) of them in one round is warned about.
        rescore_at_cap: end a round as soon as one mask reaches ``round_cap`` (the other
            masks keep what they have), re-estimate the signals and go on to the same goal;
            False: the round goes on pruning the other masks until its goal.
        floor_power: ``p``: no mask keeps fewer than ``(target / start) ** p`` of the
            channels it kept when the call started (rounded up; at most ``round_to`` blocks
            below it), over all rounds together; a mask there is left out of the selection
            as at ``min_channels``. None: no such floor.
        min_channels, round_to, uniform, flops_weight, convention, score_convention, latency:
            as in ``PruningOptimizer`` (with ``uniform``, the masks a config cannot describe
            are left whole, listed in ``PruneResult.kept_whole``; a target below the cost with
            every mask that may be pruned at its floor, ``floor_power``'s included, is
            refused up front, whatever ``uniform``, before anything changes (with
            ``LatencySpec.checks``, once a check's refitted line prices that floor above the
            target and the floor, timed whole, is too: the model is given back); a target
            met only with a
            mask at its floor, such as an MLP of one unit, is met and warned about
            (``at_floor``): raise ``min_channels`` to keep layers wider; with
            ``convention="latency"`` ``target`` may be a time, ``"12ms"``, or a share of the
            measured latency).
        blocks: with a model that has no masks yet, ``apply_masks(..., blocks=True)``: whole
            repeated blocks (decoder layers) are ranked with the channels in the one budget
            and ``shrink`` drops those removed (``fisherprune.masks.blocks``). A model already
            masked without a ``BlockGate`` is refused. ``"only"``: the same, but every other
            mask is left whole (depth pruning alone; listed in ``PruneResult.kept_whole``).
        experts: likewise ``apply_masks(..., experts=True)``: the experts of every
            mixture-of-experts layer are ranked with the channels, never below ``top_k`` a
            layer (``fisherprune.masks.experts``); a model already masked without an
            ``ExpertGate`` is refused.
        reconstruct: refit the layers that read removed channels by least squares, in forward
            order on the pruned, already repaired model's inputs (``calibrate.repair``).
        recalibrate_norms: before each round after the first, re-estimate the batch norms'
            running statistics on the calibration inputs through the model as pruned so far,
            so that the round's signals are measured on a network whose activations have not
            drifted (``calibrate.norm_stats``; one forward per batch); the dense statistics
            are put back before the repair. No effect on a model without batch norms.
        task: with ``loss_fn=None``: ``"auto"``, ``"classification"`` or ``"regression"``.
        seed: seed of the label-free sampling.
        ridge: the repair's ridge strength (relative to the mean diagonal of ``X^T X``);
            None: chosen per layer by the held-out calibration rows (``repair_consumers``).
        repair_passes: the repair's passes over the data, each fitting a group of consecutive
            stages (None: one stage per pass; ``repair_consumers``' ``passes``).
        repair_examples: the most calibration examples the repair reads (None: all).
        repair_budget: the most FLOPs the repair's forwards may cost (the dense model's FLOPs
            per example times about ``examples x (passes + 1)``); over it the stages are
            grouped into fewer passes, then fewer examples are read (``repair_consumers``'
            ``budget``; ``RepairReport`` says what ran). None: no limit.
        checkpoint: recompute each repeated block (decoder layer) in the signal passes'
            backward instead of holding its activations (``calibrate.checkpoint``): the same
            signals for about one more forward per batch; ``"auto"``: where the model has such
            a list (found by one forward pass), no ``ExpertGate`` and parameters of at least
            ``calibrate.checkpoint.AUTO_MIN_BYTES`` (32 MiB); True: refused without one.
        progress: show a progress bar over the calibration passes and rounds (tqdm).

    Returns:
        A ``PruneResult``: ``kept`` gives each mask's channels kept, ``at_floor`` the masks
        left at their floor (warned about: the selection wanted more of them).

    Raises:
        ValueError: a bad setting, no batches, a target not below the starting cost, a
            target below its reachable floor (named, before any signal is estimated or any
            weight changes; with ``LatencySpec.checks``, when a check's refitted line and
            then the floor timed whole say so), a prune that ends with every mask at its
            floor above the target, a mask the loss does not reach, or a signal
            (importance) that is not finite; ``apply_masks``' errors. Any error before the
            repair gives the model back as it came (masks this call added are removed).

    Example:
        >>> result = fisherprune.prune_to_target(net, x[:1], loader, "50%", loss_fn=F.cross_entropy)
        >>> small = fisherprune.shrink(net)
    """
    start_time = time.perf_counter()
    if rounds != "auto":
        rounds = check_int('rounds ("auto" or an integer)', rounds, 1)
    round_cap = _check_round_cap(round_cap)
    if not isinstance(rescore_at_cap, bool):
        raise ValueError(f"rescore_at_cap must be True or False, got {rescore_at_cap!r}")
    _check_floor_power(floor_power)
    names = ("repair_passes", "repair_examples", "repair_budget")
    check_passes(repair_passes, repair_examples, repair_budget, names)
    min_channels = check_min_channels(min_channels)
    flops_weight = check_flops_weight(flops_weight)
    crit = resolve_criterion(
        AUTO_CRITERION[bool(reconstruct)] if criterion == "auto" else criterion
    )
    check_conventions(convention, score_convention, latency)
    round_to = round_to_for(round_to, (convention, score_convention), latency)
    check_checkpoint(checkpoint)
    if blocks not in (True, False, "only"):
        raise ValueError(f'blocks must be True, False or "only", got {blocks!r}')
    loss = loss_fn if loss_fn is not None else LabelFreeLoss(task, seed)
    data = calibration_pairs(batches)
    masks = find_masks(model)
    masked_here = not masks
    if masked_here:
        apply_masks(model, example_inputs, blocks=bool(blocks), experts=experts)
        masks = find_masks(model)
    try:  # until the first removal, an error gives the model back as it came
        for wanted, kind, what in ((blocks, BlockGate, "blocks"), (experts, ExpertGate, "experts")):
            if wanted and not any(isinstance(m, kind) for m in masks.values()):
                raise ValueError(
                    f"{what}=True gates whole {what}, but the model already has masks without a "
                    f"{kind.__name__}: remove_masks(model) first, or "
                    f"apply_masks(model, x, {what}=True)"
                )
        recompute = (
            resolve_block_list(model, example_inputs, masks, checkpoint)
            if crit.uses_gradients
            else None
        )
        timed = {c: latency if c == "latency" else None for c in (convention, score_convention)}
        cost_model = CostModel(model, example_inputs, convention, latency=timed[convention])
        score_model = cost_model
        if score_convention not in (None, convention):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                score_model = CostModel(
                    model, example_inputs, score_convention, latency=timed[score_convention]
                )
        latency_run = convention == "latency"
        line = fit_latency_line(cost_model, model, example_inputs) if latency_run else None
        start = cost_model.total()
        goal = resolve_target(target, start, convention)
        if not 0 < goal < start:
            unit = "per forward pass" if convention == "latency" else "per example"
            raise ValueError(
                f"target {target!r} ({goal:.6g} {unit}) must lie between 0 and the starting "
                f"cost {start:.6g}"
            )
        goals = _auto_rounds(start, goal) if rounds == "auto" else rounds
        loop = LatencyLoop.planned(cost_model, model, example_inputs, goal, goals)
        dense = {n: m.mask.detach().clone() for n, m in masks.items()}
        ones = {n: m.is_all_ones() for n, m in masks.items()}
        signals = {n: m.signal.detach().clone() for n, m in masks.items()}
        share = 0.0 if floor_power is None else (goal / start) ** floor_power
        width_floors = {n: math.ceil(m.kept * share - 1e-9) for n, m in masks.items()}
        dense_flops = start  # a forward of the masked model costs the dense model's FLOPs
        if reconstruct and repair_budget is not None and convention != "flops":
            dense_flops = CostModel(model, example_inputs, "flops").total()
        classes, whole = (
            plan_uniform(model, example_inputs, masks, round_to) if uniform else ([], {})
        )
        if blocks == "only":
            depth_only = "blocks='only' prunes whole blocks alone"  # (``_stuck_message`` reads it)
            whole.update({n: depth_only for n, m in masks.items() if not isinstance(m, BlockGate)})
        reach = _Reach(
            target, start, (min_channels, round_to), floor_power, uniform, whole, width_floors
        )
        if loop is None:  # (with checks, its floor is priced on the prune's own timed states)
            if line is not None and goal < _narrowest_copy(line, cost_model.dense_total()):
                at_floor = lambda: reach.at_floor(masks, cost_model)  # noqa: E731
                add_floor_knot(cost_model, model, example_inputs, at_floor, line)
            _check_reach(cost_model, masks, goal, reach)
        selection = _Selection(
            crit,
            cost_model,
            score_model,
            min_channels,
            round_to,
            flops_weight,
            classes,
            set(whole),
            round_cap,
            rescore_at_cap,
            width_floors,
        )
    except BaseException:
        if masked_here:  # the masks this call added (a refusal says nothing changed)
            remove_masks(model)
        raise
    result = PruneResult(start, start, goal, convention=convention, kept_whole=whole,
                         latency_line=line, criterion=crit.name, round_to=round_to)  # fmt: skip
    clock = _PhaseClock()
    norms = NormStats(model) if recalibrate_norms else None
    g, stuck = 1, False
    try:  # until the repair, an error (a refusal too) gives the model back as it came
        while not stuck and g <= goals:
            r = result.rounds + 1
            with clock("signals"):
                # what tracing, the last round's selection and its cost reports freed goes back
                # to the OS before the passes' activations are made (``allocator``)
                trim_freed_memory()
                if norms is not None and r > 1:
                    norms.reestimate(data)
                bar = _bar(progress, f"signals, round {r} (goal {g}/{goals})")
                if crit.uses_gradients:  # (forward statistics too, if it reads them)
                    unreached: set[str] = set()
                    with crit.observing(model, masks):
                        result.examples = estimate_signals(
                            model, masks, data, loss, crit, bar, recompute, unreached
                        )
                    if _keep_unreached(unreached, whole, selection) and loop is None:
                        _check_reach(cost_model, masks, goal, reach)
                elif crit.uses_activations:
                    result.examples = observe_activations(model, masks, data, crit, bar)
            with clock("selection"):
                round_goal = goal if g == goals else start * (goal / start) ** (g / goals)
                before = {n: m.kept for n, m in masks.items()}
                events, reached = selection.run(model, masks, round_goal, r)
                stuck = not reached and not selection.can_prune(masks)
            _warn_collapse(masks, before, r)
            result.events.extend(events)
            result.rounds = r
            g += reached
            if loop is not None and reached:
                with clock("selection"):
                    g -= loop.reached(g - 1)  # the last goal again, on the refitted line
                    if g <= goals:  # (a finished prune's end state is its last check)
                        _check_timed_reach(loop, cost_model, masks, goal, reach)
        result.cost_after = cost_model.total()
        if stuck:
            raise ValueError(
                f"target {target!r} is out of reach: "
                f"{_stuck_message(result, goal, min_channels, round_to, floor_power)}; "
                "nothing was changed"
            )
    except BaseException:
        _give_back(model, masks, (dense, ones, signals), masked_here)
        raise
    finally:
        if norms is not None:
            norms.restore()
        for m in masks.values():
            m.collecting = False
            m.reset_statistics()
    result.latency_checks = loop.checks if loop is not None else []
    result.kept = {n: (m.kept, m.num_channels) for n, m in masks.items()}
    result.at_floor = selection.at_floor(masks)
    if result.at_floor:
        warnings.warn(_floor_message(result, masks, min_channels, round_to), stacklevel=2)
    if reconstruct:
        with clock("repair"):
            result.repair = repair_consumers(
                model,
                data,
                dense,
                ridge=ridge,
                passes=repair_passes,
                max_examples=repair_examples,
                budget=None if repair_budget is None else repair_budget / max(dense_flops, 1.0),
                progress=_bar(progress, "repair"),
                cost_model=cost_model,
            )
        result.examples = result.examples or result.repair.examples
    result.phase_seconds, result.phase_cpu_seconds = clock.wall, clock.cpu
    result.seconds = time.perf_counter() - start_time
    log.info(
        "prune_to_target: cost %.6g -> %.6g (%d events, %.1f s: %s)",
        start,
        result.cost_after,
        len(result.events),
        result.seconds,
        ", ".join(f"{k} {v:.1f} s" for k, v in clock.wall.items()),
    )
    return result


class _PhaseClock:
    """Wall and process CPU seconds per phase, summed over the phase's blocks."""

    def __init__(self) -> None:
        self.wall = dict.fromkeys(("signals", "selection", "repair"), 0.0)
        self.cpu = dict.fromkeys(self.wall, 0.0)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.wall[phase] += time.perf_counter() - wall
            self.cpu[phase] += time.process_time() - cpu


def _keep_unreached(unreached: set[str], whole: dict[str, str], selection: _Selection) -> bool:
    """Leave the masks in ``unreached`` whole (with their copies, under ``uniform=True``),
    with a warning naming them the first time. Returns whether any was new.

    Changes: ``whole`` and ``selection.whole`` (added to)."""
    new = sorted(copies_of(unreached, selection.classes) - set(whole))
    if not new:
        return False
    whole.update({n: UNREACHED if n in unreached else UNREACHED_COPY for n in new})
    selection.whole.update(new)
    more = f" (+{len(new) - 3} more)" if len(new) > 3 else ""
    warnings.warn(
        f"prune_to_target: keeps mask(s) {', '.join(new[:3])}{more} whole: {UNREACHED} "
        "(listed in PruneResult.kept_whole)",
        stacklevel=3,
    )
    return True


@dataclass
class _Selection:
    """How channels are chosen: the criterion, the cost models and the pruning settings."""

    criterion: Criterion
    cost_model: CostModel
    score_model: CostModel
    min_channels: int | float
    round_to: int
    flops_weight: str | float
    classes: list[list[str]]  # uniform=True: masks pruned together ([]: each on its own)
    whole: set[str]  # masks left whole (uniform=True, no config field for them)
    round_cap: float  # the largest share of a mask's kept channels one round removes
    rescore_at_cap: bool  # a mask reaching round_cap ends the round
    width_floors: dict[str, int]  # floor_power's floor per mask (0: none)

    def run(
        self, model: nn.Module, masks: dict[str, MaskLayer], goal: float, step: int
    ) -> tuple[list[PruneEvent], bool]:
        """Remove channels until the cost is at most ``goal``, no mask losing more than
        ``round_cap`` of the channels it keeps now (at least one block: ``_least``; with
        ``rescore_at_cap``, until the first mask reaches that). Returns the events and
        whether ``goal`` was reached. Changes: the masks.

        The importances are read once. The exact cost report (marginal costs) is taken, then
        ``prune_many`` removes what ``prune`` called once per channel would under those scores,
        until their marginal costs add up to ``STEP_FRACTION`` of the gap to ``goal`` (at
        least one channel), then the report is taken again: the gap shrinks geometrically, so
        a few dozen reports replace one per channel (0.14-0.3 s each on a ResNet-50), while
        the marginal costs used are never staler than a quarter of the remaining gap. Events
        carry the costs estimated from the report's marginals; the last of each chunk the
        exact cost.

        A chunk of several removals that leaves the exact cost more than ``OVERSHOOT`` below
        ``goal`` is undone, and the rest of the way goes one removal per exact report: the
        report prices a mask's later blocks at its first one's marginal cost, which is exact
        for FLOPs but not across a latency table's staircase (ResNet-50 at one CPU thread: a
        convolution at 56 channels ran as slow as at 64 and much slower than at 48, so two
        blocks priced at 39 us saved 328 us, and prunes aimed at 25% of the latency landed at
        21-23%).

        Raises:
            ValueError: an importance is not finite (nothing is pruned in this round).
        """
        importances = self.criterion.scores(masks, model)
        bad = [n for n, v in importances.items() if not bool(torch.isfinite(v).all())]
        if bad:
            raise ValueError(
                f"no channel pruned in round {step}: the {self.criterion.name} importance of "
                f"mask {bad[0]!r} is not finite (NaN or inf weights or calibration data)"
            )
        least = {n: self._least(m) for n, m in masks.items() if n not in self.whole}
        events: list[PruneEvent] = []
        one_by_one = False  # after a chunk went past the goal: one removal per report
        while True:
            report = self.cost_model.report()
            if report.total <= goal:
                return events, True
            free = self._selectable(masks)
            weigh = report if self.score_model is self.cost_model else self.score_model.report()
            marginal = {n: weigh.marginal[n] for n in free}
            scores = score_all({n: importances[n] for n in free}, marginal, self.flops_weight)
            gap = report.total - goal
            until = report.total - (1e-9 * gap if one_by_one else STEP_FRACTION * gap)
            undo = {n: (m.mask.detach().clone(), m.is_all_ones()) for n, m in free.items()}
            chunk = prune_many(
                free,
                scores,
                self.min_channels,
                cost=report,
                until=until,
                step=step,
                round_to=self.round_to,
                uniform=self.classes if self.classes or self.whole else False,
                keep=least,
                stop_at_keep=self.rescore_at_cap,
                floors=self.width_floors,
                goal=goal,
                importance=importances,
            )
            exact = self.cost_model.total()
            if len(chunk) > 1 and exact < goal * (1 - OVERSHOOT) and not one_by_one:
                _put_back(free, undo)  # (the docstring says why; once only: no loop)
                one_by_one = True
                continue
            if not chunk:
                return events, exact <= goal
            events.extend(chunk[:-1])
            events.append(replace(chunk[-1], cost_after=exact))
            if exact > until:
                return events, exact <= goal

    def _least(self, m: MaskLayer) -> int:
        """The fewest channels ``m`` may keep after this round: ``round_cap`` of those it
        keeps now may go, or its next block if that is more."""
        kept = m.kept
        block = block_size(kept, rounding(m, self.round_to))
        return min(math.ceil(kept * (1 - self.round_cap) - 1e-9), kept - block)

    def _floor(self, m: MaskLayer, extra: int = 0) -> int:
        """The fewest channels ``m`` can be pruned to from where it is (``extra``: a floor
        above ``min_channels``')."""
        floor = max(mask_floor(self.min_channels, m), extra)
        return lowest_kept(m.kept, floor, rounding(m, self.round_to))

    def _selectable(self, masks: dict[str, MaskLayer]) -> dict[str, MaskLayer]:
        """The masks this selection may prune now: not left whole, not inside a block gated
        off (``CostModel.inert_masks``)."""
        inert = self.cost_model.inert_masks()
        return {n: m for n, m in masks.items() if n not in self.whole and n not in inert}

    def can_prune(self, masks: dict[str, MaskLayer]) -> bool:
        """Whether any mask this selection prunes is above its floor (``floor_power``'s
        included)."""
        free = self._selectable(masks).items()
        return any(self._floor(m, self.width_floors[n]) < m.kept for n, m in free)

    def at_floor(self, masks: dict[str, MaskLayer]) -> list[str]:
        """The masks that lost channels and can lose no more."""
        return [
            n
            for n, m in self._selectable(masks).items()
            if m.kept < m.num_channels and self._floor(m) == m.kept
        ]
