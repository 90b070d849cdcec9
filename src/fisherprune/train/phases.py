"""The phases of a ``fisherprune train`` run, in the order ``PruningTrainer.run`` calls them:

    dense_phase      train dense for the burn-in; measure and check the dense model
    pruning_phase    train while the pruner takes a channel every ``pruning_iter`` steps,
                     until the cost target (or the step cap) is reached
    fine_tune_phase  shrink the model in place (``shrunk.shrink_pruned``), then
                     ``fine_tune_steps`` more steps at the target, on the smaller model
    finish_phase     final eval, then time, export and report (``finish.finish_run``)

Each phase takes ``train_step``s on a ``Loop`` (everything the steps work on) and picks up
where a resumed run's ``RunState`` left off; how long each lasts is ``schedule``'s business.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import Tensor, nn

from fisherprune._errors import first_line
from fisherprune.cost.conventions import cost_unit
from fisherprune.distill import distill_loss, frozen_teacher
from fisherprune.pruner import PruningOptimizer
from fisherprune.train.finish import FinishedRun, RunOutput, finish_run
from fisherprune.train.loop import Loop
from fisherprune.train.result import TrainResult
from fisherprune.train.shrunk import shrink_pruned

__all__ = [
    "Loop",
    "channels_removed",
    "dense_phase",
    "fine_tune_phase",
    "finish_phase",
    "kept_channels",
    "pruning_phase",
    "restore_shrunk",
    "restore_teacher",
    "train_step",
]

log = logging.getLogger("fisherprune")


# ------------------------------------------------------------------------ phases
def dense_phase(loop: Loop) -> None:
    """Train dense until the burn-in ends (the pruner gathers its signal meanwhile); the
    dense model is measured at its end (in ``train_step``). With ``init_from`` the model is
    trained already: the steps have a learning rate of 0, so they only gather the signal, and
    the optimizer's state (momentum) is dropped afterwards."""
    state, end = loop.state, min(loop.burn_in, loop.cap)
    frozen = bool(loop.config.init_from)
    if state.dense is None and loop.burn_in == 0:
        state.dense = _dense_point(loop)
    if frozen and state.step < end:
        _set_learning_rate(loop.popt, 0.0)
    while state.step < end:
        train_step(loop)
    if frozen and state.step <= loop.burn_in:
        # set again on every run: a checkpoint of the dense phase holds the rate 0
        _set_learning_rate(loop.popt, loop.config.learning_rate)
        loop.popt.optimizer.state.clear()


def restore_teacher(loop: Loop, weights: dict[str, Tensor] | None) -> None:
    """On resume: rebuild the frozen dense teacher from the checkpoint's ``weights`` when the
    run distils and its dense phase is over (``loop.teacher`` is set); a checkpoint without
    them (written before teachers were saved) is said in a warning, and fine-tuning then
    learns from the labels only."""
    if loop.state.dense is None or loop.config.distill_alpha <= 0 or loop.model is None:
        return
    if weights is None:
        log.warning(
            "the checkpoint holds no distillation teacher (an older checkpoint): the resumed "
            "fine-tuning learns from the labels only"
        )
        return
    teacher = frozen_teacher(loop.model)
    teacher.load_state_dict(weights)
    loop.teacher = teacher


def _set_learning_rate(popt: PruningOptimizer, lr: float) -> None:
    for group in popt.param_groups:
        group["lr"] = lr


def pruning_phase(loop: Loop) -> None:
    """Train and prune until the pruner reaches its target or the step cap.

    Raises:
        ValueError: the dense model learned nothing and ``dense_check`` is ``"stop"`` (a
            checkpoint is written first: ``--resume`` with other settings goes on from it).
    """
    dense = loop.state.dense
    if dense is not None and not dense.get("learned", True) and loop.config.dense_check == "stop":
        loop.save_checkpoint()
        raise ValueError(
            f"{dense['check']}; nothing was pruned (--dense_check warn prunes it anyway)"
        )
    while loop.state.step < loop.cap and not loop.popt.finished:
        train_step(loop)


def fine_tune_phase(loop: Loop) -> None:
    """Once the target is reached, shrink the model in place (``shrink_for_fine_tune``; not
    with ``fine_tune_masked``), then ``fine_tune_steps`` more steps (counted from
    ``state.finished_at``, so a resumed run does not start them over), within the step cap.
    Does nothing when the cap came first."""
    state, popt = loop.state, loop.popt
    if not popt.finished or state.step >= loop.cap:
        return
    if state.finished_at is None:
        state.finished_at = state.step
        loop.progress.line(
            f"step {state.step}: {channels_removed(popt)} channels pruned; fine-tuning for "
            f"{loop.config.fine_tune_steps} steps"
        )
    if loop.pruned is None and not loop.config.fine_tune_masked:
        shrink_for_fine_tune(loop)
    while state.step < loop.cap and state.step - state.finished_at < loop.config.fine_tune_steps:
        train_step(loop)


def shrink_for_fine_tune(loop: Loop) -> None:
    """Shrink the trainer's model in place, its optimizer state carried over
    (``shrink_pruned``), so that the steps after it run at the smaller model's cost, and wrap
    it again (``loop.wrap``). Sets ``loop.pruned`` and ``loop.net``; prints a line.

    Raises:
        ValueError, ShrinkError: as ``fisherprune.shrink`` (nothing changed then).
    """
    model, example = loop.model, loop.example
    if model is None or example is None:
        raise ValueError("shrinking for the fine-tuning needs Loop.model and Loop.example")
    before = sum(p.numel() for p in model.parameters())
    loop.pruned = shrink_pruned(model, example, loop.popt, inplace=True)
    loop.net = loop.wrap(model)
    after = sum(p.numel() for p in model.parameters())
    loop.progress.line(
        f"step {loop.state.step}: shrunk the model in place ({before:,} -> {after:,} "
        "parameters, optimizer state carried over); it fine-tunes at its smaller cost"
    )


def restore_shrunk(loop: Loop, weights: dict[str, Tensor]) -> None:
    """On resume from a checkpoint written after the shrink: shrink the rebuilt model, whose
    masks (and held-back optimizer state) ``popt.load_state_dict`` restored, as the run did
    (``shrink_for_fine_tune``: ``popt`` loads the optimizer state then), and load the saved
    shrunk ``weights`` into it.

    Raises:
        ValueError: the weights do not fit the shrunk model.
    """
    shrink_for_fine_tune(loop)
    assert loop.model is not None  # shrink_for_fine_tune checked it
    try:
        loop.model.load_state_dict(weights)
    except RuntimeError as e:
        raise ValueError(
            f"the checkpoint's shrunk weights do not fit the model shrunk by its masks "
            f"({first_line(e, with_type=False)}); use another --save_dir or the original "
            "settings"
        ) from None


# ------------------------------------------------------------------------- steps
def train_step(loop: Loop) -> None:
    """One optimizer step (the pruner may prune in it), then what it is due: the dense
    point at the end of the burn-in, its prunes in the metrics, an eval every
    ``eval_every`` steps and a checkpoint every ``checkpoint_every`` steps."""
    cfg, popt, state = loop.config, loop.popt, loop.state
    x, y = loop.batch(state.step)
    loop.net.train()
    with loop.precision.autocast():
        loss = _train_loss(loop, loop.net(x), x, y)
    # before the update, and read before a prune: a stop or a diverged loss prunes nothing
    signum = loop.guard.poll(loss, state.step, read=popt.prune_due)
    if signum:
        loop.stop(signum)
    seen = len(popt.history)
    loop.precision.minimize(popt, loss)
    state.step += 1
    step = state.step
    if state.dense is None and step >= loop.burn_in:
        state.dense = _dense_point(loop)
    for ev in popt.history[seen:]:
        loop.metrics.record(
            {
                "step": ev.step,
                "kind": "prune",
                "mask": ev.mask,
                "channel": ev.channel,
                "channels": list(ev.channels),
                **({"also": {n: list(c) for n, c in ev.also}} if ev.also else {}),
                "cost": ev.cost_after,
            }
        )
    read = loop.guard.loss  # NaN until the first read (the losses are read every few steps)
    shown = "" if math.isnan(read) else f"loss {read:.4f} "
    loop.progress.update(step, f"{shown}pruned {channels_removed(popt)}")
    if step % cfg.eval_every == 0:
        _eval_point(loop)
    if step % cfg.checkpoint_every == 0:
        loop.save_checkpoint()


def _train_loss(loop: Loop, out: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """The label loss; once pruning is over and a dense teacher was kept (``distill_alpha`` >
    0), mixed with the teacher's outputs (``fisherprune.distill``)."""
    if loop.teacher is None or not loop.popt.finished:
        return loop.loss(out, y)
    with torch.no_grad():
        teacher_out = loop.teacher(x)
    return distill_loss(
        out,
        teacher_out,
        y,
        loss_fn=loop.loss,
        alpha=loop.config.distill_alpha,
        temperature=loop.config.distill_temperature,
        task="classification" if loop.metric_name == "accuracy" else "regression",
    )


def _dense_point(loop: Loop) -> dict[str, Any]:
    """Evaluate the model before pruning, check that it learned, record it and print it;
    return its entry (``learned`` and, when it did not, ``check``: the warning). With
    ``distill_alpha`` > 0, keep a frozen copy of it as the fine-tuning teacher; on rank 0,
    write it with ``loop.save_dense`` when given."""
    loop.read_losses()
    if loop.config.distill_alpha > 0 and loop.model is not None:
        loop.teacher = frozen_teacher(loop.model)
    value = loop.evaluate()
    metric, step = loop.metric_name, loop.state.step
    entry: dict[str, Any] = {
        "step": step,
        "kind": "dense",
        metric: value,
        "cost": loop.popt.cost().total,
    }
    check = loop.check_dense(value) if loop.config.dense_check != "off" else None
    if check is not None:
        entry["learned"] = check.learned
        if not check.learned:
            entry["check"] = check.message
    loop.metrics.record(entry)
    if loop.write and loop.save_dense is not None:
        loop.save_dense()
    loop.progress.line(
        f"dense model (step {step}): eval {metric} {value:.4f}, cost "
        f"{entry['cost']:,.0f} {cost_unit(loop.config.pruning_convention)}"
    )
    if check is not None and not check.learned:
        log.warning("%s", check.message)
        loop.progress.line(f"WARNING: {check.message}")
    return entry


def _eval_point(loop: Loop) -> None:
    """Evaluate the model as it stands on the first ``eval_rows`` eval rows (all with 0),
    record the entry with the last step's loss and print it. The dense and the final points
    read every eval row."""
    loop.read_losses()
    loss = loop.guard.loss
    limit = loop.config.eval_rows or None
    value = loop.evaluate(limit=limit)
    popt, metric, step = loop.popt, loop.metric_name, loop.state.step
    cost = popt.cost().total
    loop.metrics.record(
        {
            "step": step,
            "kind": "eval",
            metric: value,
            "cost": cost,
            "loss": loss,
            "kept": kept_channels(popt),
        }
    )
    loop.progress.line(
        f"step {step}: loss {loss:.4f}, eval {metric} {value:.4f}, cost {cost:,.0f} "
        f"({cost / popt.start_cost:.1%} of start)"
    )


def kept_channels(popt: PruningOptimizer) -> dict[str, int]:
    """Channels each mask keeps, by mask name."""
    return {n: m.kept for n, m in popt.masks.items()}


def channels_removed(popt: PruningOptimizer) -> int:
    """Channels pruned so far (a prune removes a block of them with ``round_to > 1``)."""
    return sum(e.count for e in popt.history)


def finish_phase(
    loop: Loop, model: nn.Module, example: Tensor, samples: Tensor, out: RunOutput
) -> TrainResult:
    """A last checkpoint, the final eval (the ``final`` metrics entry), then ``finish_run``
    (time, export, report, summary) on the shrunk model: ``loop.pruned``, or a shrunk copy of
    ``model`` when it is still masked (the step cap came before the target, or
    ``fine_tune_masked``). Moves ``model`` to the CPU, where the exports and the latency
    figures are made. Warns when the step cap came before the target."""
    popt, state, metric = loop.popt, loop.state, loop.metric_name
    warnings: list[str] = []
    if not popt.finished:
        warnings.append(
            f"the step cap {loop.cap} was reached before the target: cost "
            f"{popt.cost().total:.6g} > {popt.target:.6g}"
        )
        log.warning("%s", warnings[-1])
    loop.save_checkpoint()
    final = loop.evaluate()
    cost = popt.cost().total
    dense = state.dense or {metric: float("nan"), "cost": popt.start_cost}
    if "check" in dense:
        warnings.insert(0, dense["check"])
    loop.metrics.record(
        {
            "step": state.step,
            "kind": "final",
            metric: final,
            "cost": cost,
            "kept": kept_channels(popt),
        }
    )
    model, example = model.cpu(), example.cpu()
    pruned = loop.pruned or shrink_pruned(model, example, popt, inplace=False)
    run = FinishedRun(
        popt=popt,
        pruned=pruned,
        example=example,
        samples=samples,
        metrics=state.metrics,
        metric_name=metric,
        dense_metric=dense[metric],
        dense_cost=dense["cost"],
        final_metric=final,
        final_cost=cost,
        steps=state.step,
        prunes=channels_removed(popt),
        dense_learned=dense.get("learned"),
        warnings=tuple(warnings),
    )
    return finish_run(loop.config, run, out)
