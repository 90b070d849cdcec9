"""PruningOptimizer: train, gather Fisher signals, and prune one channel (or one block of
``round_to`` channels) every few steps."""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fisherprune._dist import in_group
from fisherprune.cost import CostModel, CostReport, LatencySpec
from fisherprune.cost.conventions import check_conventions, cost_unit
from fisherprune.cost.latency import round_to_for
from fisherprune.masks import MaskLayer, find_masks
from fisherprune.pruner.prune import PruneEvent, lowest_kept, mask_floor, prune, rounding
from fisherprune.pruner.scoring import FlopsWeight, score_all
from fisherprune.pruner.uniform import copies_of, plan_uniform
from fisherprune.settings import (
    check_decay,
    check_flops_weight,
    check_int,
    check_loss_reduction,
    check_method,
    check_min_channels,
)
from fisherprune.signals import Criterion, resolve_criterion

__all__ = ["PruningOptimizer", "resolve_target"]

log = logging.getLogger("fisherprune")


#: microseconds (the ``latency`` convention's unit) per unit of a time target (``"12ms"``)
_TIME_UNITS = (("ms", 1e3), ("us", 1.0), ("s", 1e6))


def _time_target(text: str) -> float | None:
    """Microseconds of a time such as ``"12ms"``, ``"800us"`` or ``"0.5s"``; None if ``text``
    is not a number followed by one of those units."""
    for unit, micro in _TIME_UNITS:
        if text.endswith(unit):
            try:
                return float(text.removesuffix(unit).strip()) * micro
            except ValueError:
                return None
    return None


def resolve_target(
    flops_target: float | int | str, start_cost: float, convention: str = "flops"
) -> float:
    """Absolute cost target from a user's ``flops_target``, in ``convention`` units.

    ``"25%"`` and numbers in (0, 1) are fractions of ``start_cost``; numbers
    >= 1 are absolute; 0 means "no target" (prune until nothing can be). With
    ``convention="latency"`` a time such as ``"12ms"``, ``"800us"`` or ``"0.5s"`` is
    absolute too, in that convention's microseconds per forward pass (a bare number keeps
    the rules above).

    Raises:
        ValueError: a string that is not a number, a percentage or (for latency) a time; a
            time with another convention; a negative or non-finite number.
    """
    if isinstance(flops_target, str):
        text = flops_target.strip()
        micro = _time_target(text)
        if micro is not None:
            if convention != "latency":
                raise ValueError(
                    f"flops_target {flops_target!r} is a time; a time target needs "
                    f"convention='latency' (the cost is {convention!r}), or give a percentage"
                )
            if not (micro > 0 and math.isfinite(micro)):
                raise ValueError(f"flops_target {flops_target!r} must be a positive time")
            return micro
        try:
            value = float(text.removesuffix("%"))
        except ValueError:
            raise ValueError(
                f"flops_target {flops_target!r} is not a number or a percentage such as '25%'"
                + (" or a time such as '12ms'" if convention == "latency" else "")
            ) from None
        if not text.endswith("%"):
            return resolve_target(value, start_cost, convention)
        frac = value / 100.0
        if not frac > 0:
            raise ValueError(f"flops_target {flops_target!r} must be a positive percentage")
        return frac * start_cost
    if isinstance(flops_target, bool) or not isinstance(flops_target, (int, float)):
        raise ValueError(f"flops_target must be a number or a percentage, got {flops_target!r}")
    t = float(flops_target)
    if not math.isfinite(t):
        raise ValueError(f"flops_target must be finite, got {flops_target!r}")
    if t < 0:  # once read as "no target": every group pruned to its floor
        raise ValueError(f"flops_target must be >= 0 (0: no target), got {flops_target!r}")
    if 0 < t < 1:
        return t * start_cost
    return t


class PruningOptimizer:
    """Momentum SGD (or any torch optimizer) that also prunes channels by Fisher signal.

    Each ``step()``: (1) the parameters are updated, (2) while pruning is still
    possible, each mask's Fisher signal EMA is updated from the batch, (3) with
    ``counter`` starting at 1, one channel (one block with ``round_to``) is pruned iff
    ``counter > burn_in``, ``counter % prune_every == 0`` and the cost is above the target.
    Once the
    target is reached (or nothing more can be pruned) signals are no longer
    collected and the masks stay as they are.

    Args:
        model: the network, holding MaskLayers (placed by hand or by ``apply_masks``).
        example_inputs: inputs used once to trace the model for its cost.
        lr, momentum, nesterov, weight_decay: the default SGD's settings.
        prune_every: steps between prunes (>= 1).
        burn_in: steps of statistics before the first prune (>= 0).
        decay: signal EMA factor in [0, 1).
        flops_weight: ``"auto"`` (signal / cost), a float ``w`` (signal - w * cost) or 0.
            The cost is the marginal cost in ``score_convention`` units (FLOPs by default).
            A float has no stable meaning over a long run: the Fisher signal grows by orders
            of magnitude while pruning (and the EMA starts at 0 without bias correction, as
            in the seed), so a fixed ``w`` weighs cost ever less; ``"auto"`` is a ratio and
            does not drift (see docs/benchmarks.md).
        flops_target: cost per example to stop at: absolute (>= 1), a fraction in
            (0, 1) or a percentage string of the starting cost, or 0 (no target).
        optimizer: any ``torch.optim.Optimizer`` to use instead of SGD (the seed's
            ``update_params``); ``lr`` etc. are then ignored.
        min_channels: the fewest channels any mask keeps: an int, or a fraction in (0, 1)
            of each mask's width.
        round_to: every mask keeps a multiple of this many weight rows (a channel spanning
            several, an attention head, counts as ``channel_width`` rows; 1: any count; a mask
            with no multiple between its floor and its width keeps its width). CPU and
            GPU kernels work on channels in blocks of 8 or 16, so 9 channels cost about as
            much time as 16: with ``round_to=8`` each prune removes the block of channels that
            brings a mask to the next multiple of 8 (see ``prune``), and the FLOPs saved turn
            into latency saved (docs/benchmarks.md). None (the default): 1, or with a
            ``latency`` convention the table's ``LatencySpec.step`` (8 unless given), so that
            every width a prune reaches is one the table timed (``round_to_for``).
        uniform: every repeated block keeps the same widths: the copies of a mask in the
            blocks of a ``ModuleList`` (names equal up to block indices, same width; see
            ``fisherprune.pruner.uniform``) lose channels together, ranked by their mean
            score. A shrunk Hugging Face model then keeps a standard configuration
            (``save_pretrained`` / ``from_pretrained`` need no fisherprune code): classes its
            config has no field for (BERT's hidden width, whose head size is derived from it;
            a pooler) are left whole, listed in ``kept_whole`` and logged.
        convention: cost convention of ``flops_target`` and of the pruning events (see
            ``computational_cost``); ``"latency"`` times the model on the device ``latency``
            names, and ``flops_target`` may then be a time (``"12ms"``).
        score_convention: cost convention that the signal is weighed against when
            choosing a channel (default: ``convention``). ``"memory"`` with a FLOPs target is
            Group Fisher Pruning's memory-normalised selection (Liu et al. 2021, which
            reports it for GPU latency): channels are chosen by signal per activation element
            they remove. On CPU it cut latency more than FLOP-normalised selection at the same
            FLOPs for most networks in ``benchmarks/export_speed.py``, not all
            (docs/benchmarks.md); its accuracy cost is in ``benchmarks/quality.py``
            (``fisher_memory``).
        loss_reduction: ``"mean"`` or ``"sum"``: how the loss reduces over the batch.
        masks: the masks to prune (default: every MaskLayer in ``model``).
        method: pruning signal, ``"fisher"`` (the seed's only one) or ``"taylor"``: a shorthand
            for ``criterion``.
        latency: with ``convention`` or ``score_convention`` ``"latency"``: where and how
            it is timed (``fisherprune.LatencySpec``; default: this CPU as set now).
        latency_calibration: the ``"latency"`` entry of an earlier ``state_dict()`` of this
            model and settings (a resumed run): its cost models' slopes and offsets are used
            and the whole model is not timed again; None: timed.
        criterion: how channels are ranked: a ``fisherprune.criteria.Criterion`` (``Fisher()``,
            ``Taylor()``, ``L1()``, ``Random(seed)`` or your own subclass) or the name of a
            registered one (``"l1"``). Default: ``method``. Criteria that read only weights
            turn the masks' gradient gathering off.

    Raises:
        ValueError: a bad setting (named in the message), or a model with no masks.

    Example:
        >>> opt = PruningOptimizer(net, x[:1], lr=0.05, prune_every=10, flops_target="50%")
        >>> for xb, yb in data:
        ...     opt.minimize(loss_fn(net(xb), yb))
    """

    def __init__(
        self,
        model: nn.Module,
        example_inputs: Any,
        lr: float = 0.01,
        momentum: float = 0.9,
        *,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        prune_every: int = 100,
        burn_in: int = 0,
        decay: float = 0.96,
        flops_weight: FlopsWeight = "auto",
        flops_target: float | int | str = 0,
        optimizer: torch.optim.Optimizer | None = None,
        min_channels: int | float = 1,
        round_to: int | None = None,
        uniform: bool = False,
        convention: str = "flops",
        score_convention: str | None = None,
        loss_reduction: str = "mean",
        masks: dict[str, MaskLayer] | None = None,
        method: str = "fisher",
        criterion: Criterion | str | None = None,
        latency: LatencySpec | None = None,
        latency_calibration: dict[str, Any] | None = None,
    ) -> None:
        self.prune_every = check_int("prune_every", prune_every, 1)
        self.burn_in = check_int("burn_in", burn_in, 0)
        self.min_channels = check_min_channels(min_channels)
        check_conventions(convention, score_convention, latency)
        self.round_to = round_to_for(round_to, (convention, score_convention), latency)
        self.uniform = bool(uniform)
        self.decay = check_decay(decay)
        self.flops_weight = check_flops_weight(flops_weight)
        self.loss_reduction = check_loss_reduction(loss_reduction)
        method = check_method(method)
        if criterion is not None and method != "fisher":
            raise ValueError("give either method or criterion, not both")
        #: how channels are ranked
        self.criterion = resolve_criterion(criterion if criterion is not None else method)
        if self.criterion.uses_activations:
            raise ValueError(
                f"criterion {self.criterion.name!r} reads activation statistics from "
                "calibration passes, which training does not run: use it with "
                "fisherprune.prune_to_target, or choose fisher, taylor, l1 or random"
            )
        self.model = model
        self.masks = dict(masks) if masks is not None else find_masks(model)
        if not self.masks:
            raise ValueError(
                "the model has no MaskLayer: place fisherprune.MaskLayer modules where channels "
                "may be pruned, or call fisherprune.apply_masks(model, example_inputs) first"
            )
        #: the classes of masks that ``uniform`` prunes together, and the masks it leaves whole
        #: with the reason (a config with no field for them)
        self.uniform_classes, self.kept_whole = (
            plan_uniform(model, example_inputs, self.masks, self.round_to) if uniform else ([], {})
        )
        if self.kept_whole:
            for n in self.kept_whole:
                self.masks.pop(n).collecting = False
            log.warning(
                "uniform=True keeps these masks whole: %s",
                "; ".join(f"{n}: {r}" for n, r in self.kept_whole.items()),
            )
        if optimizer is None:
            if nesterov and momentum <= 0:
                raise ValueError("nesterov=True needs momentum > 0")
            optimizer = torch.optim.SGD(
                model.parameters(),
                lr=lr,
                momentum=momentum,
                nesterov=nesterov,
                weight_decay=weight_decay,
            )
        elif not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.convention = convention
        self.score_convention = score_convention or convention
        given = latency_calibration or {}

        def cost_model(conv: str, role: str) -> CostModel:
            """The cost of ``conv``, with the resumed calibration of ``role`` when timed."""
            timed = latency if conv == "latency" else None
            calibration = given.get(role) if timed else None
            return CostModel(model, example_inputs, conv, latency=timed,
                             latency_calibration=calibration)  # fmt: skip

        self.cost_model = cost_model(convention, "cost")
        #: the cost that scores are normalised by (the same object when the conventions agree)
        self.score_model = self.cost_model
        if score_convention not in (None, convention):
            with warnings.catch_warnings():  # the trace's warnings were given just above
                warnings.simplefilter("ignore")
                self.score_model = cost_model(score_convention, "score")
        self.start_cost = self.cost_model.total()
        self.target = resolve_target(flops_target, self.start_cost, convention)
        self.counter = 1
        self.history: list[PruneEvent] = []
        self.finished = False
        self._finish_logged = False  # the reason pruning finished was logged (once per run)
        #: the model was shrunk in place after pruning finished (``shrink(..., optimizer=)``):
        #: its masks are gone from it, and ``masks`` keep what was pruned (for ``cost``,
        #: ``state_dict``)
        self.shrunk = False
        #: the wrapped optimizer's state of a shrunk run loaded before the model was shrunk
        #: again (``load_state_dict``): loaded by ``mark_shrunk``
        self._pending_optimizer_state: dict[str, Any] | None = None
        self._set_collecting(True)
        for m in self.masks.values():  # known from here on: not read back in the first step
            m.is_all_ones()  # (after a .to() or DDP's broadcast, which rewrite the buffers)
        self._warned_silent: set[str] = set()
        #: masks no gradient has reached since the run began (a branch whose output the loss
        #: does not use, an expert no token was routed to): their signals say nothing, so they
        #: are kept whole until one does
        self._unreached: set[str] = set(self.masks) if self.criterion.uses_gradients else set()
        #: masks' batch estimates skipped as not finite since the last prune decision (0-d,
        #: on the device), and whether a prune skipped for it was warned about
        self._nonfinite: Tensor | None = None
        self._warned_nonfinite = False
        if self.target > 0 and self.start_cost <= self.target:
            warnings.warn(
                f"flops_target {self.target:.6g} is not below the starting cost "
                f"{self.start_cost:.6g} {cost_unit(self.convention)}: nothing will be pruned",
                stacklevel=2,
            )
            self._finish("the starting cost is already at or below the target")
        else:
            self._check_floor()

    # ------------------------------------------------------------- torch API
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the wrapped optimizer's parameters."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def minimize(self, loss: Tensor) -> Tensor:
        """``zero_grad()``, ``loss.backward()`` and ``step()``; returns ``loss``."""
        self.zero_grad()
        loss.backward()
        self.step()
        return loss

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update parameters, then signals, then maybe prune one channel or block (in that order).

        Raises:
            ValueError: on the first step, if no collecting mask received a gradient (no
                loss reaches them; under ``torch.distributed``, at the first prune decision if
                none did on any rank). A mask no gradient has reached yet is kept whole, with
                a warning naming it.
        """
        out = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self.after_update()
        return out

    def after_update(self) -> None:
        """What ``step`` does after the parameter update, for loops that update the parameters
        themselves (a Hugging Face ``Trainer``, Lightning): fold the gradients gathered since
        the last call into the signals, prune when due, count the step.

        Changes: the masks' signals (while collecting), possibly one prune (masks zeroed,
        ``history`` grows), ``counter``. A due prune is skipped, with a warning the first
        time, when a batch since the last prune decision gave a non-finite estimate or a
        signal is not finite: non-finite input never prunes.

        Raises:
            ValueError: on the first step, if no collecting mask received a gradient (under
                ``torch.distributed``: at the first prune decision, if none did on any rank).
        """
        if not self.finished and self.criterion.uses_gradients:
            self._check_received()
            skipped = self.criterion.update(
                self.masks, self.decay, loss_reduction=self.loss_reduction
            )
            if skipped is not None:  # summed on the device: read at the next prune decision
                self._nonfinite = skipped if self._nonfinite is None else self._nonfinite + skipped
        if self.prune_due:
            self._maybe_prune()
        self.counter += 1

    @property
    def prune_due(self) -> bool:
        """Whether the next ``step`` (``after_update``) may prune: it reads the signals and the
        cost on the host then, so a loop that keeps its loss on the device reads it first."""
        due = self.counter > self.burn_in and self.counter % self.prune_every == 0
        return due and not self.finished

    # --------------------------------------------------------------- pruning
    def cost(self) -> CostReport:
        """Cost report of the model as masked now (no re-trace)."""
        return self.cost_model.report()

    def _maybe_prune(self) -> None:
        report = self.cost_model.report()
        if self.target > 0 and report.total <= self.target:
            self._finish(f"cost {report.total:.6g} reached the target {self.target:.6g}")
            return
        signals = self.criterion.scores(self.masks, self.model)
        why = self._not_finite(signals)
        if why is not None:
            self._skip_prune(why)
            return
        weigh = report if self.score_model is self.cost_model else self.score_model.report()
        self._agree_on_unreached()
        if in_group() and self._unreached == set(self.masks):
            # every rank decides this at the same step on the same all-reduced flags: the ranks
            # raise together, never one alone while the others wait for it at an all-reduce
            raise ValueError(
                f"no gradient reached any of the {len(self.masks)} masks on any rank since the "
                "first step: no loss reaches them (call loss.backward() before step(), and "
                "make sure the masked channels feed the loss)"
            )
        # inside blocks gated off: gone with them; and no gradient has told of the unreached
        # (nor, with uniform, of their copies' share)
        unreached = copies_of(self._unreached, self.uniform_classes if self.uniform else [])
        skip = self.cost_model.inert_masks() | unreached
        live = {n: m for n, m in self.masks.items() if n not in skip}
        scores = score_all(
            {n: signals[n] for n in live}, {n: weigh.marginal[n] for n in live}, self.flops_weight
        )
        event = prune(
            live,
            scores,
            self.min_channels,
            cost=report,
            step=self.counter,
            round_to=self.round_to,
            uniform=self.uniform_classes if self.uniform else False,
        )
        if event is not None and event.count > 1:
            # a block's summed marginals can miss interactions (an emptied mask, a layer whose
            # input and output share the mask): take the exact cost, without a re-trace
            event = dataclasses.replace(event, cost_after=self.cost_model.total())
        if event is None:
            whole = (
                f" ({len(unreached)} kept whole: no gradient has reached them)" if unreached else ""
            )
            self._finish(
                f"every mask is down to min_channels={self.min_channels}{whole}"
                + (f" (round_to={self.round_to})" if self.round_to > 1 else "")
                + f"; cost "
                f"{report.total:.6g} {cost_unit(self.convention)}"
                + (f" stays above the target {self.target:.6g}" if self.target > 0 else ""),
                level=logging.WARNING if self.target > 0 else logging.INFO,
            )
            return
        self.history.append(event)
        log.info(
            "step %d: pruned %s (score %.4g, signal %.4g); cost %.6g -> %.6g",
            event.step,
            ", ".join(f"{n}{list(c)}" for n, c in event.removed.items()),
            event.score,
            event.signal,
            event.cost_before,
            event.cost_after,
        )
        if self.target > 0 and event.cost_after <= self.target:
            self._finish(f"cost {event.cost_after:.6g} reached the target {self.target:.6g}")

    def _agree_on_unreached(self) -> None:
        """Under ``torch.distributed``, a mask a gradient reached on any rank counts as reached
        on every rank (their signals are all-reduced), so that every rank leaves out the same
        masks: one all-reduce of a flag per mask, at each prune decision (every rank makes
        one at the same step). Changes: ``_unreached``."""
        if not in_group():
            return
        names = sorted(self.masks)
        device = next(iter(self.masks.values())).signal.device
        reached = torch.tensor([float(n not in self._unreached) for n in names], device=device)
        dist.all_reduce(reached, op=dist.ReduceOp.MAX)
        self._unreached = {n for n, r in zip(names, reached.tolist(), strict=True) if r == 0}

    def _not_finite(self, signals: dict[str, Tensor]) -> str | None:
        """Why ``signals`` are no ground to prune on: a mask's batch estimate was skipped as
        not finite since the last prune decision (its signal is then the older batches'
        alone), or a signal is not finite itself (a criterion reading NaN weights); None when
        neither. Reads the skip count back and starts it afresh."""
        skipped, self._nonfinite = self._nonfinite, None
        bad = [n for n, v in signals.items() if not bool(torch.isfinite(v).all())]
        if bad:
            return f"the pruning signal of mask {bad[0]!r} is not finite (NaN or inf weights?)"
        count = 0 if skipped is None else int(skipped)
        if count:
            return (
                f"{count} mask batch estimate(s) since the last prune were not finite (NaN or "
                "inf loss or gradients), so the signals do not hold those batches"
            )
        return None

    def _skip_prune(self, why: str) -> None:
        """Prune nothing at this due step; warn the first time (later skips are logged)."""
        log.info("step %d: no channel pruned: %s", self.counter, why)
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            warnings.warn(
                f"step {self.counter}: no channel pruned: {why}. A prune is skipped whenever "
                "the batches since the last one held a non-finite value (told once; check the "
                "data and the learning rate)",
                RuntimeWarning,
                stacklevel=4,
            )

    def _set_collecting(self, on: bool) -> None:
        """Masks gather gradients only while pruning can happen and the criterion reads them."""
        for m in self.masks.values():
            m.collecting = on and not self.finished and self.criterion.uses_gradients
            if not m.collecting:
                m.reset_statistics()

    def _finish(self, why: str, level: int = logging.INFO) -> None:
        self.finished = True
        self._set_collecting(False)
        if not self._finish_logged:
            self._finish_logged = True
            log.log(level, "pruning finished: %s", why)
            if level >= logging.WARNING:
                warnings.warn(f"pruning stopped: {why}", stacklevel=3)

    def _check_floor(self) -> None:
        if self.target <= 0:
            return
        floor = self.cost_model.entries().copy()
        for n, m in self.masks.items():
            start = self.cost_model.entry_start.get(n)
            if start is None:
                continue
            alive = [k for k in range(m.num_channels) if floor[start + k] > 0.5]
            keep = lowest_kept(
                len(alive),
                mask_floor(self.min_channels, m),
                rounding(m, self.round_to),
            )
            for k in alive[keep:]:
                floor[start + k] = 0.0
        lowest = self.cost_model.total(floor)
        if lowest > self.target:
            rounded = f" with round_to={self.round_to}" if self.round_to > 1 else ""
            warnings.warn(
                f"flops_target {self.target:.6g} is below what min_channels="
                f"{self.min_channels}{rounded} allows (about {lowest:.6g} "
                f"{cost_unit(self.convention)}); "
                "pruning will stop at that floor",
                stacklevel=3,
            )

    def _check_received(self) -> None:
        """Note which collecting masks a gradient reached this step. A mask none has reached
        yet is kept whole (``_maybe_prune`` leaves it out), with a warning naming it the first
        time; a first step that reaches no mask at all raises."""
        collecting = [n for n, m in self.masks.items() if m.collecting]
        silent = [n for n in collecting if not self.masks[n].received]
        self._unreached.difference_update(set(collecting) - set(silent))
        if not silent:
            return
        msg = (
            f"mask(s) {', '.join(repr(s) for s in silent)} received no gradient this step: "
            "no loss reaches them (call loss.backward() before step(), and make sure the "
            "masked channels feed the loss)"
        )
        if self.counter == 1 and len(silent) == len(collecting) and not in_group():
            raise ValueError(msg)  # under torch.distributed: at the first prune decision
        new = [s for s in silent if s not in self._warned_silent]
        if new:
            self._warned_silent.update(new)
            kept = [s for s in new if s in self._unreached]
            whole = (
                f"; {', '.join(repr(s) for s in kept)} stay whole until a gradient reaches "
                "them (their signal says nothing yet)"
                if kept
                else ""
            )
            warnings.warn(msg + whole, RuntimeWarning, stacklevel=3)

    # ----------------------------------------------------------------- state
    @property
    def awaiting_shrink(self) -> bool:
        """Whether ``load_state_dict`` restored a state saved after the model was shrunk, into
        a model not shrunk yet: its optimizer state is held back until
        ``fisherprune.shrink(model, inplace=True, optimizer=self)``, after which the saved
        shrunk weights load into the model."""
        return self._pending_optimizer_state is not None

    def mark_shrunk(self) -> None:
        """Record that the model was shrunk in place with this optimizer's state carried over
        (``fisherprune.shrink(model, inplace=True, optimizer=self)`` calls it): pruning is over
        for good. A wrapped-optimizer state that ``load_state_dict`` held back (a resumed run
        saved after its shrink) is loaded now, into the shrunk parameters. Changes:
        ``shrunk``, and the wrapped optimizer's state when one was held back."""
        self.shrunk = True
        self.finished = True
        self._set_collecting(False)
        pending, self._pending_optimizer_state = self._pending_optimizer_state, None
        if pending is not None:
            self.optimizer.load_state_dict(pending)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: counter, masks, signals, history, inner optimizer."""
        return {
            "counter": self.counter,
            "shrunk": self.shrunk,
            "finished": self.finished,
            "finish_logged": self._finish_logged,
            "target": self.target,
            "start_cost": self.start_cost,
            "settings": self._settings(),
            "latency": self.latency_calibration(),
            "history": [e.as_dict() for e in self.history],
            "unreached": sorted(self._unreached),
            "criterion": self.criterion.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "masks": {
                n: {"mask": m.mask.detach().clone(), "signal": m.signal.detach().clone()}
                for n, m in self.masks.items()
            },
        }

    def latency_calibration(self) -> dict[str, Any] | None:
        """What prices the ``latency`` convention's operators, by cost model (``"cost"``,
        ``"score"``: ``CostModel.latency_calibration``), for ``latency_calibration=`` of a
        resumed run; None when neither convention is ``latency``."""
        score = self.score_model if self.score_model is not self.cost_model else None
        cal = {
            "cost": self.cost_model.latency_calibration,
            "score": score.latency_calibration if score is not None else None,
        }
        return cal if any(cal.values()) else None

    def _settings(self) -> dict[str, Any]:
        """The settings that decide which channels go: a resume must not change them."""
        return {
            "convention": self.convention,
            "score_convention": self.score_convention,
            "round_to": self.round_to,
            "uniform": self.uniform,
            "criterion": self.criterion.settings(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()``: masks and signals are copied into the buffers in place.

        A state saved after the model was shrunk in place (``shrink(..., optimizer=self)``)
        restores the masks of the pruned model; its wrapped-optimizer state fits the shrunk
        parameters only, so it is held back until the model is shrunk again, with
        ``fisherprune.shrink(model, inplace=True, optimizer=self)`` (then
        ``model.load_state_dict`` of the saved shrunk weights).

        Raises:
            ValueError: the saved masks do not match this model's masks, or the state was
                saved with other cost conventions, ``round_to`` or criterion (a resumed run
                would then choose channels by another rule than the one it started with).
                States saved before these settings were recorded are accepted as they are.
        """
        saved_settings = state.get("settings", {})
        differ = [
            f"{k}={saved_settings[k]!r} (this optimizer: {v!r})"
            for k, v in self._settings().items()
            if k in saved_settings and saved_settings[k] != v
        ]
        if differ:
            raise ValueError(
                "the state was saved by a PruningOptimizer with "
                + ", ".join(differ)
                + ": construct the optimizer with the saved settings to resume"
            )
        if self.shrunk and not state.get("shrunk", False):
            raise ValueError(
                "this PruningOptimizer's model was shrunk; a state saved before the shrink "
                "needs the masked model: build it and the optimizer afresh to load it"
            )
        saved = state["masks"]
        if set(saved) != set(self.masks):
            raise ValueError(
                f"saved masks {sorted(saved)} do not match this model's masks {sorted(self.masks)}"
            )
        for n, m in self.masks.items():
            if saved[n]["mask"].shape != m.mask.shape:
                raise ValueError(
                    f"mask {n!r}: saved {tuple(saved[n]['mask'].shape)} channels, "
                    f"model has {tuple(m.mask.shape)}"
                )
        with torch.no_grad():
            for n, m in self.masks.items():
                m.mask.copy_(saved[n]["mask"])
                m.signal.copy_(saved[n]["signal"])
                m.reset_statistics()
        if state.get("shrunk", False) and not self.shrunk:
            self._pending_optimizer_state = state["optimizer"]
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.counter = int(state["counter"])
        self.target = float(state["target"])
        self.start_cost = float(state["start_cost"])
        self.history = [PruneEvent(**e) for e in state["history"]]
        # (a state saved before this was recorded comes from a run whose masks were all
        # reached: its first step raised otherwise)
        self._unreached = set(state.get("unreached", ())) & set(self.masks)
        self._finish_logged = bool(state.get("finish_logged", state.get("floor_reported")))
        self.finished = bool(state["finished"])
        self.criterion.load_state_dict(state.get("criterion", {}))
        self._set_collecting(True)
