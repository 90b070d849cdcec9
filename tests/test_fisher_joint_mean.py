"""benchmarks/fisher_joint_mean.py's FisherJointMean (a candidate default, issue 31): the joint
Fisher increments of mean-replaced gradients, against a float64 loop over examples."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from counted import benchmark_module
from test_fisher_mean import _reference
from torch import Tensor, nn

import fisherprune as fp

FisherJointMean = benchmark_module("fisher_joint_mean").FisherJointMean


def _shifted(head: nn.Linear, h: Tensor, keep: Tensor, y: Tensor, abar: Tensor) -> Tensor:
    """g'[n, k] = (h_nk - abar_k) dL_n/dz_nk with z = h * keep what ``head`` reads, one example
    at a time: (N, units) float64."""
    rows = []
    for n in range(h.shape[0]):
        z = (h[n] * keep).requires_grad_(True)
        loss = F.cross_entropy(F.linear(z, head.weight, head.bias)[None], y[n : n + 1])
        (delta,) = torch.autograd.grad(loss, z)
        rows.append((h[n] - abar) * delta)
    return torch.stack(rows)


def test_joint_increments_of_mean_replaced_gradients_match_a_float64_loop() -> None:
    """Linear-ReLU-Linear, two mean-reduced calibration batches of different sizes, one unit
    already pruned: each kept unit, in the order of its mean-replaced signal, scores the
    increment of 1/2 mean_n (sum of g'[n,k] over the lowest units up to it)^2, made
    non-decreasing and at least its own signal; the pruned unit keeps its own signal."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    x, y = torch.randn(9, 5, dtype=torch.float64), torch.randint(0, 3, (9,))
    masks = fp.apply_masks(net, x[:2])
    (mask,) = masks.values()
    mask.mask[2] = 0.0
    mask.collecting = True
    crit = FisherJointMean()
    with crit.observing(net, masks):
        for part in (slice(0, 4), slice(4, 9)):
            F.cross_entropy(net(x[part]), y[part]).backward()
    crit.update(masks, decay=0.0)
    (got,) = crit.importance(masks, net).values()
    with torch.no_grad():
        h, keep = torch.relu(net[0](x)), mask.mask.double()
    abar = (h * keep).mean(0)
    own = _reference(net[2], h, keep, y, abar)  # 1/2 mean_n g'^2, test_fisher_mean's loop
    g = _shifted(net[2], h, keep, y, abar)
    want, total, floor = own.clone(), torch.zeros(9, dtype=torch.float64), 0.0
    before = 0.0
    for k in sorted([0, 1, 3, 4, 5], key=lambda k: float(own[k])):
        total = total + g[:, k]
        joint = float(0.5 * (total**2).mean())
        floor = max(floor, joint - before, 0.0)
        want[k], before = max(floor, float(own[k])), joint
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
    assert not torch.allclose(want[[0, 1, 3, 4, 5]], own[[0, 1, 3, 4, 5]])  # cross terms count
