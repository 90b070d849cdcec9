"""The label-free Fisher loss: the model's own predictive distribution instead of labels.

The Fisher information of a mask is ``E_x E_{y ~ p(y|x)} [g^2]``, with ``g`` the derivative of
``-log p(y|x)`` with respect to the mask (Theis et al. 2018 use the empirical Fisher, with the
data's labels, for the same quantity). Sampling ``y`` from the model itself gives the true
Fisher, which needs no labels, so unlabelled calibration data suffices:

* ``"classification"``: ``p(y|x) = softmax(logits)`` over the last dim; one label per example
  and position is sampled from it; the loss is the cross-entropy summed over positions.
* ``"regression"`` (also embeddings and hidden states): a unit-variance Gaussian around the
  output, ``y = output + N(0, 1)`` noise, and ``-log p = 1/2 ||y - output||^2`` summed over
  every output element of the example (the Fisher of ``N(output, I)``).

Either loss is then averaged over the batch, which ``loss_reduction="mean"`` undoes.

``labels="expected"`` (classification only) takes the expectation over ``y`` in closed form
instead of drawing one label: ``E_y[g^2] = J^T (diag(p) - p p^T) J`` with ``J`` the derivative
of the logits w.r.t. the mask, estimated without bias by one backward through the direction
``v = sum_y eps_y sqrt(p_y) (p - e_y)``, ``eps ~ N(0, I)`` (``E[v v^T] = diag(p) - p p^T``),
as the regression loss's Gaussian noise already does. One sampled label gives a confident
example (``p_y ~ 1``) a zero gradient unless it draws a rare class, so a calibration set the
model fits leaves the signal to the few examples that drew one; the direction ``v`` lets
every example contribute its expected share, ``~ (1 - p_y)``.
``"auto"`` picks ``"classification"`` for an output with ``.logits`` (Hugging Face task heads)
and for a plain tensor with a last dim of at least 2, and ``"regression"`` otherwise (a
``.last_hidden_state``, one output per example). An embedding model returning a plain
(N, D) tensor is therefore taken for a classifier: pass ``task="regression"`` for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LABELS", "SAMPLE_ELEMENTS", "TASKS", "LabelFreeLoss", "output_tensor", "resolve_task"]

#: the predictive distributions a label-free loss can sample from
TASKS: tuple[str, ...] = ("auto", "classification", "regression")
#: how a classification label enters: one label drawn per example, or the expectation over
#: labels through one random direction (the module docstring)
LABELS: tuple[str, ...] = ("sampled", "expected")

_OUTPUT_FIELDS = ("logits", "last_hidden_state", "pooler_output")

#: the most float64 probabilities ``LabelFreeLoss.sample`` widens at once (8 MiB): a language
#: model's logits are sampled a few positions at a time, not widened whole (a (2, 512, 32000)
#: batch is 262 MB in float64, twice with its softmax)
SAMPLE_ELEMENTS = 2**20


def output_tensor(outputs: Any) -> Tensor:
    """The tensor a model's outputs stand for: a tensor itself, ``.logits`` or
    ``.last_hidden_state`` of a Hugging Face ``ModelOutput`` (also as dict keys), or the
    first element of a tuple or list.

    Raises:
        TypeError: none of these is a floating-point tensor.
    """
    if isinstance(outputs, Tensor):
        return outputs
    for field in _OUTPUT_FIELDS:
        value = outputs.get(field) if isinstance(outputs, Mapping) else None
        value = getattr(outputs, field, None) if value is None else value
        if isinstance(value, Tensor):
            return value
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], Tensor):
        return outputs[0]
    raise TypeError(
        f"cannot tell which tensor the model's output ({type(outputs).__name__}) is: return a "
        "tensor, a tuple starting with one, or an object with .logits or .last_hidden_state; "
        "or give prune_to_target a loss_fn"
    )


def resolve_task(task: str, outputs: Any) -> str:
    """``"classification"`` or ``"regression"`` for ``task`` (``"auto"``: see the module
    docstring).

    Raises:
        ValueError: an unknown task.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if task != "auto":
        return task
    if not isinstance(outputs, Tensor):
        has_logits = isinstance(getattr(outputs, "logits", None), Tensor) or (
            isinstance(outputs, Mapping) and isinstance(outputs.get("logits"), Tensor)
        )
        if has_logits:
            return "classification"
        if not isinstance(outputs, (tuple, list)):
            return "regression"
    out = output_tensor(outputs)
    return "classification" if out.dim() >= 2 and out.shape[-1] >= 2 else "regression"


class LabelFreeLoss:
    """``loss(outputs, targets)`` that ignores ``targets`` and samples them from the model's
    own predictive distribution (see the module docstring), with its own seeded generator.

    Args:
        task: ``"auto"``, ``"classification"`` or ``"regression"``.
        seed: seed of the sampling stream (the same seed draws the same labels for the same
            outputs).
        labels: ``"sampled"`` (default): one label per example and position drawn from the
            model; ``"expected"``: the expectation over labels through a random direction
            (classification only; regression is unchanged).

    Raises:
        ValueError: an unknown ``task`` or ``labels``.

    Example:
        >>> loss_fn = LabelFreeLoss("classification", seed=0)
        >>> loss_fn(model(x), None).backward()
    """

    def __init__(self, task: str = "auto", seed: int = 0, labels: str = "sampled") -> None:
        resolve_task(task, torch.zeros(1))  # validates the name
        if labels not in LABELS:
            raise ValueError(f"labels must be one of {', '.join(LABELS)}, got {labels!r}")
        self.task = task
        self.labels = labels
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, outputs: Any) -> Tensor:
        """The sampled targets for ``outputs``: class indices (shape of the output without its
        last dim) or the direction ``v`` of ``labels="expected"`` (the output's shape, on the
        logits' device in their dtype), each from softmaxes taken in float64 on at most
        ``SAMPLE_ELEMENTS`` of the outputs at a time; or Gaussian targets (the output's shape),
        drawn from this loss's stream.

        Changes: advances the generator.
        """
        out = output_tensor(outputs).detach()
        if resolve_task(self.task, outputs) == "classification":
            rows = out.reshape(-1, out.shape[-1])
            step = max(1, SAMPLE_ELEMENTS // rows.shape[1])
            probs = (
                torch.softmax(rows[i : i + step].double().cpu(), dim=-1)
                for i in range(0, rows.shape[0], step)
            )
            if self.labels == "expected":
                v = torch.cat([self._direction(p).to(out.dtype) for p in probs])
                return v.view(out.shape).to(out.device)
            labels = torch.cat([torch.multinomial(p, 1, generator=self.generator) for p in probs])
            return labels.view(out.shape[:-1]).to(out.device)
        noise = torch.randn(out.shape, generator=self.generator, dtype=out.dtype)
        return out + noise.to(out.device)

    def _direction(self, probs: Tensor) -> Tensor:
        """``v = sum_y eps_y sqrt(p_y) (p - e_y)`` per row of ``probs`` (float64), ``eps`` drawn
        from this loss's stream: ``E[v v^T] = diag(p) - p p^T``."""
        eps = torch.randn(probs.shape, generator=self.generator, dtype=probs.dtype)
        root = probs.sqrt() * eps  # (rows, C): eps_y sqrt(p_y)
        return probs * root.sum(-1, keepdim=True) - root

    def loss(self, outputs: Any, sampled: Tensor) -> Tensor:
        """The batch mean of each example's ``-log p(sampled | x)`` (up to a constant); with
        ``labels="expected"``, of ``<logits, v>`` (its derivative w.r.t. the logits is ``v``)."""
        out = output_tensor(outputs)
        task = resolve_task(self.task, outputs)
        if task == "regression":
            per = 0.5 * (out - sampled).square()
        elif self.labels == "expected":
            per = out * sampled
        else:
            logits = out.movedim(-1, 1) if out.dim() > 2 else out  # classes on dim 1
            per = F.cross_entropy(logits, sampled, reduction="none")
        return per.reshape(out.shape[0], -1).sum(1).mean()

    def __call__(self, outputs: Any, targets: Any = None) -> Tensor:
        return self.loss(outputs, self.sample(outputs))
