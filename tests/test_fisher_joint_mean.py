"""benchmarks/fisher_joint_mean.py's FisherJointMean (a candidate default, issue 31): the joint
Fisher increments of mean-replaced gradients, against a float64 loop over examples."""

from __future__ import annotations

import torch
from counted import benchmark_module
from test_fisher_mean import calibrated, reference, shifted

FisherJointMean = benchmark_module("fisher_joint_mean").FisherJointMean


def test_joint_increments_of_mean_replaced_gradients_match_a_float64_loop() -> None:
    """Linear-ReLU-Linear, two mean-reduced calibration batches of different sizes, one unit
    already pruned: each kept unit, in the order of its mean-replaced signal, scores the
    increment of 1/2 mean_n (sum of g'[n,k] over the lowest units up to it)^2, made
    non-decreasing and at least its own signal; the pruned unit keeps its own signal."""
    crit = FisherJointMean()
    net, masks, h, keep, y = calibrated(crit)
    (got,) = crit.importance(masks, net).values()
    abar = (h * keep).mean(0)
    own = reference(net[2], h, keep, y, abar)  # 1/2 mean_n g'^2, test_fisher_mean's loop
    g = shifted(net[2], h, keep, y, abar)
    want, total, floor = own.clone(), torch.zeros(9, dtype=torch.float64), 0.0
    before = 0.0
    for k in sorted([0, 1, 3, 4, 5], key=lambda k: float(own[k])):
        total = total + g[:, k]
        joint = float(0.5 * (total**2).mean())
        floor = max(floor, joint - before, 0.0)
        want[k], before = max(floor, float(own[k])), joint
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
    assert not torch.allclose(want[[0, 1, 3, 4, 5]], own[[0, 1, 3, 4, 5]])  # cross terms count
