"""The label-free Fisher signal against a float64 per-example loop with the same sampled labels.

Reference: for each example alone, ``-log p(y_n | x_n)`` (cross-entropy for a classifier, the
unit-variance Gaussian ``1/2 ||y_n - f(x_n)||^2`` for a regression output) is differentiated by
``torch.autograd.grad`` with respect to leaf masks of ones written into a plain functional
copy of the network; ``Delta = 1/2 mean_n g_n^2``. The sampled targets are drawn by a
``LabelFreeLoss`` with the same seed from the same outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.calibrate import LabelFreeLoss, estimate_signals, resolve_task
from fisherprune.criteria import Fisher

RTOL = 1e-9


class _Net(nn.Module):
    """fc1-ReLU-mask1-fc2-ReLU-mask2-fc3 on (N, 5) or (N, L, 5)."""

    def __init__(self, out: int) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(5, 7), nn.Linear(7, 6), nn.Linear(6, out)
        self.m1, self.m2 = fp.MaskLayer(7, dim=-1), fp.MaskLayer(6, dim=-1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc3(self.m2(F.relu(self.fc2(self.m1(F.relu(self.fc1(x)))))))


def _reference_forward(net: _Net, x: Tensor, l1: Tensor, l2: Tensor) -> Tensor:
    h = F.relu(F.linear(x, net.fc1.weight, net.fc1.bias)) * l1
    h = F.relu(F.linear(h, net.fc2.weight, net.fc2.bias)) * l2
    return F.linear(h, net.fc3.weight, net.fc3.bias)


def _reference(net: _Net, x: Tensor, targets: Tensor, task: str) -> dict[str, Tensor]:
    grads: dict[str, list[Tensor]] = {"m1": [], "m2": []}
    for n in range(x.shape[0]):
        l1 = torch.ones(7, dtype=torch.float64, requires_grad=True)
        l2 = torch.ones(6, dtype=torch.float64, requires_grad=True)
        out = _reference_forward(net, x[n : n + 1], l1, l2)
        if task == "classification":
            loss = F.cross_entropy(
                out.reshape(-1, out.shape[-1]), targets[n].reshape(-1), reduction="sum"
            )
        else:
            loss = 0.5 * (out - targets[n : n + 1]).square().sum()
        g1, g2 = torch.autograd.grad(loss, [l1, l2])
        grads["m1"].append(g1)
        grads["m2"].append(g2)
    return {k: 0.5 * torch.stack(v).square().mean(0) for k, v in grads.items()}


@pytest.mark.parametrize("tokens", [False, True])
@pytest.mark.parametrize("task", ["classification", "regression"])
def test_label_free_signal_matches_per_example_reference(task: str, tokens: bool) -> None:
    """estimate_signals with LabelFreeLoss == 1/2 mean_n g_n^2 of the per-example loop, with the
    targets sampled from the model's own outputs (two batches pooled)."""
    torch.manual_seed(0)
    net = _Net(4).double()
    x = torch.randn(12, 3, 5, dtype=torch.float64) if tokens else torch.randn(12, 5).double()
    with torch.no_grad():
        out = net(x)
    sampler = LabelFreeLoss(task, seed=3)
    targets = torch.cat([sampler.sample(out[:5]), sampler.sample(out[5:])])
    estimate_signals(
        net,
        fp.find_masks(net),
        [(x[:5], None), (x[5:], None)],
        LabelFreeLoss(task, seed=3),
        Fisher(),
    )
    want = _reference(net, x, targets, task)
    assert all(float(v.max()) > 0 for v in want.values())
    for name, m in fp.find_masks(net).items():
        torch.testing.assert_close(m.signal, want[name], rtol=RTOL, atol=1e-14)


def test_labels_are_sampled_from_the_softmax() -> None:
    """Sampled labels follow softmax(logits): their frequencies over many draws match it."""
    logits = torch.tensor([[2.0, 0.0, -1.0]]).repeat(20000, 1)
    labels = LabelFreeLoss("classification", seed=0).sample(logits)
    freq = torch.bincount(labels, minlength=3).double() / labels.numel()
    torch.testing.assert_close(freq, torch.softmax(logits[0].double(), 0), atol=0.01, rtol=0)


def test_gaussian_targets_have_unit_variance_around_the_output() -> None:
    """Regression targets are output + N(0, 1) noise."""
    out = torch.full((50000, 2), 3.0)
    noise = LabelFreeLoss("regression", seed=0).sample(out) - out
    assert abs(float(noise.mean())) < 0.02 and abs(float(noise.var()) - 1.0) < 0.02


@dataclass
class _Output:
    """Stands for a Hugging Face ModelOutput."""

    logits: Tensor | None = None
    last_hidden_state: Tensor | None = None


@pytest.mark.parametrize(
    ("outputs", "want"),
    [
        (torch.zeros(2, 3), "classification"),
        (torch.zeros(2, 1), "regression"),
        (torch.zeros(2), "regression"),
        (_Output(logits=torch.zeros(2, 3)), "classification"),
        (_Output(last_hidden_state=torch.zeros(2, 4, 3)), "regression"),
        ({"logits": torch.zeros(2, 3)}, "classification"),
        ((torch.zeros(2, 3), torch.zeros(2)), "classification"),
    ],
)
def test_auto_task(outputs: object, want: str) -> None:
    """'auto' reads .logits as a classifier, .last_hidden_state as regression, a plain tensor
    by its last dim."""
    assert resolve_task("auto", outputs) == want


def test_unknown_task_is_refused() -> None:
    with pytest.raises(ValueError, match="task must be one of"):
        LabelFreeLoss("ranking")


class _HFStyle(nn.Module):
    def __init__(self, field: str) -> None:
        super().__init__()
        self.field = field
        self.fc1, self.fc2 = nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> _Output:
        return _Output(**{self.field: self.fc2(F.relu(self.fc1(x)))})


@pytest.mark.parametrize("field", ["logits", "last_hidden_state"])
def test_prune_to_target_needs_no_labels(field: str) -> None:
    """With loss_fn=None, calibration batches without labels suffice, for outputs with .logits
    or .last_hidden_state."""
    torch.manual_seed(0)
    net = _HFStyle(field)
    x = torch.randn(32, 5)
    result = fp.prune_to_target(net, x[:1], [(x[:16], None), (x[16:], None)], "60%")
    assert result.cost_after <= result.target
    assert any(float(m.signal.max()) > 0 for m in fp.find_masks(net).values())


def test_expected_labels_estimate_the_expectation_over_labels() -> None:
    """labels="expected": the signal of many copies of one example == 1/2 sum_y p_y g_y^2,
    the exact expectation over the model's labels (g_y: the mask gradient of -log p(y|x),
    one per class, from the per-example loop), within the Monte Carlo error of 20,000
    random directions."""
    torch.manual_seed(1)
    net = _Net(4).double()
    x = torch.randn(1, 5, dtype=torch.float64)
    with torch.no_grad():
        probs = torch.softmax(net(x)[0], 0)
    per_class = [_reference(net, x, torch.tensor([y]), "classification") for y in range(4)]
    want = {k: sum(p * r[k] for p, r in zip(probs, per_class, strict=True)) for k in ("m1", "m2")}
    copies = [(x.repeat(20000, 1), None)]
    masks = fp.find_masks(net)
    estimate_signals(net, masks, copies, LabelFreeLoss(seed=0, labels="expected"), Fisher())
    for name, m in masks.items():
        assert float(want[name].max()) > 0
        torch.testing.assert_close(m.signal, want[name], rtol=0.05, atol=0)


def test_expected_labels_leave_regression_as_it_was() -> None:
    """labels="expected" changes only the classification draw: a regression output gets the
    same Gaussian targets from the same seed."""
    out = torch.randn(6, 3)
    sampled = LabelFreeLoss("regression", seed=2).sample(out)
    torch.testing.assert_close(
        LabelFreeLoss("regression", seed=2, labels="expected").sample(out), sampled, rtol=0, atol=0
    )


def test_unknown_labels_draw_is_refused() -> None:
    with pytest.raises(ValueError, match="labels must be one of sampled, expected"):
        LabelFreeLoss("classification", labels="argmax")
