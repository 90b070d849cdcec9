"""Distillation from the dense model: a loss that mixes the labels with the teacher's outputs,
and a short fine-tune of a pruned (masked) model with it.

``distill_loss`` is ``(1 - alpha) * loss_fn(student, targets) + alpha * soft``, with ``soft``
(Hinton et al. 2015) the KL divergence from the teacher's to the student's softmax at
temperature ``T``, times ``T^2`` so that its gradients keep their scale as ``T`` changes, for
a classifier; the mean squared error between the outputs for a regression or embedding model
(the task is decided as in ``calibrate.label_free``). Theis et al. 2018 combined Fisher
pruning with distillation for their 10x speed-up.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fisherprune.calibrate.label_free import output_tensor, resolve_task
from fisherprune.inputs import as_pair, call_model
from fisherprune.masks import find_masks
from fisherprune.modes import eval_mode

__all__ = ["distill_loss", "finetune", "frozen_teacher"]

LossFn = Callable[[Any, Any], Tensor]


def _check(alpha: float, temperature: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"distillation alpha must lie in [0, 1], got {alpha!r}")
    if not temperature > 0:
        raise ValueError(f"distillation temperature must be > 0, got {temperature!r}")


def distill_loss(
    student: Any,
    teacher: Any,
    targets: Any = None,
    *,
    loss_fn: LossFn | None = None,
    alpha: float = 0.5,
    temperature: float = 2.0,
    task: str = "auto",
) -> Tensor:
    """``(1 - alpha) * loss_fn(student, targets) + alpha * soft(student, teacher)``.

    Args:
        student: the pruned model's outputs (a tensor, or an object with ``.logits`` /
            ``.last_hidden_state``).
        teacher: the dense model's outputs for the same inputs (detached here).
        targets: the labels, read by ``loss_fn``; unused when ``alpha`` is 1.
        loss_fn: ``loss(outputs, targets)``; None: distillation only (``alpha`` taken as 1).
        alpha: the weight of the teacher term, in [0, 1].
        temperature: ``T`` of the softened softmax (classifiers).
        task: ``"auto"``, ``"classification"`` (KL at ``T``, times ``T^2``) or ``"regression"``
            (mean squared error).

    Raises:
        ValueError: ``alpha`` outside [0, 1], ``temperature`` <= 0, or an unknown task.
    """
    _check(alpha, temperature)
    s = output_tensor(student)
    t = output_tensor(teacher).detach()
    if resolve_task(task, student) == "classification":
        log_p = F.log_softmax(s / temperature, dim=-1).reshape(-1, s.shape[-1])
        log_q = F.log_softmax(t / temperature, dim=-1).reshape(-1, t.shape[-1])
        soft = F.kl_div(log_p, log_q, reduction="batchmean", log_target=True) * temperature**2
    else:
        soft = F.mse_loss(s, t)
    if loss_fn is None or alpha == 1.0:
        return soft
    return (1.0 - alpha) * loss_fn(student, targets) + alpha * soft


def frozen_teacher(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` in eval mode with every parameter frozen and its masks (if any)
    not collecting: the dense teacher. ``model`` is unchanged."""
    teacher = copy.deepcopy(model).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    for m in find_masks(teacher).values():
        m.collecting = False
        m.reset_statistics()
    return teacher


def finetune(
    model: nn.Module,
    teacher: nn.Module | None,
    batches: Iterable[tuple[Any, Any]],
    steps: int,
    *,
    loss_fn: LossFn | None = None,
    alpha: float = 0.5,
    temperature: float = 2.0,
    task: str = "auto",
    lr: float = 1e-3,
    optimizer: torch.optim.Optimizer | None = None,
    on_step: Callable[[int, Tensor], None] | None = None,
) -> list[float]:
    """Train a pruned (masked) ``model`` for ``steps`` steps on ``batches`` (cycled), learning
    from ``teacher``'s outputs and/or the labels (``distill_loss``).

    Changes: ``model``'s parameters (Adam at ``lr`` unless ``optimizer`` is given) and its
    batch-norm statistics (it trains in train mode; its train/eval flags are given back). The
    masks stay as they are and keep the removed channels at zero, so ``shrink`` still gives
    the masked model's outputs. ``teacher`` is only read (in eval mode, without gradients).

    Args:
        model: the pruned model, with its masks.
        teacher: the dense model (``frozen_teacher`` of it before pruning), or None to train
            on the labels alone.
        batches: ``(inputs, targets)`` pairs or dicts of keyword inputs
            (``fisherprune.inputs.as_pair``), cycled until ``steps``.
        steps: optimizer steps (0: nothing is done).
        loss_fn, alpha, temperature, task: as in ``distill_loss``.
        lr: the learning rate of the default Adam.
        optimizer: any optimizer over ``model``'s parameters instead.
        on_step: called after every step with its number (1-based) and its loss (a detached
            tensor, on the device: reading it waits for the step), e.g. to show progress.

    Returns:
        The loss of each step.

    Raises:
        ValueError: neither a teacher nor a ``loss_fn``, bad ``alpha`` / ``temperature``, or
            no batches with ``steps`` > 0.
    """
    _check(alpha, temperature)
    if teacher is None and loss_fn is None:
        raise ValueError("finetune needs a teacher, a loss_fn, or both")
    if steps <= 0:
        return []
    data = [as_pair(b) for b in batches]
    if not data:
        raise ValueError("finetune got no batches")
    for m in find_masks(model).values():
        m.collecting = False
    opt = optimizer or torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr)
    losses: list[Tensor] = []  # kept on the device, read once at the end (no wait per step)
    with eval_mode(model):  # gives every submodule its train/eval flag back afterwards
        model.train()
        for step in range(steps):
            inputs, targets = data[step % len(data)]
            out = call_model(model, inputs)
            if teacher is None:
                loss = loss_fn(out, targets)  # type: ignore[misc]
            else:
                with eval_mode(teacher), torch.no_grad():
                    t_out = call_model(teacher, inputs)
                loss = distill_loss(
                    out,
                    t_out,
                    targets,
                    loss_fn=loss_fn,
                    alpha=alpha,
                    temperature=temperature,
                    task=task,
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach().float().reshape(()))
            if on_step is not None:
                on_step(step + 1, losses[-1])
    return torch.stack(losses).tolist()
