"""benchmarks/fisher_mean.py's FisherMean (a candidate default, issue 31): the Fisher signal of
replacing each hidden unit by its mean, against a float64 loop over examples."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from counted import benchmark_module
from torch import Tensor, nn

import fisherprune as fp

FisherMean = benchmark_module("fisher_mean").FisherMean


def shifted(head: nn.Linear, h: Tensor, keep: Tensor, y: Tensor, abar: Tensor) -> Tensor:
    """g'[n, k] = (h_nk - abar_k) dL_n/dz_nk with z = h * keep what ``head`` reads, one example
    at a time: (N, units) float64."""
    rows = []
    for n in range(h.shape[0]):
        z = (h[n] * keep).requires_grad_(True)
        loss = F.cross_entropy(F.linear(z, head.weight, head.bias)[None], y[n : n + 1])
        (delta,) = torch.autograd.grad(loss, z)
        rows.append((h[n] - abar) * delta)
    return torch.stack(rows)


def reference(head: nn.Linear, h: Tensor, keep: Tensor, y: Tensor, abar: Tensor) -> Tensor:
    """1/2 mean_n g'[n, k]^2 (``shifted``; abar = 0 gives the library's Fisher)."""
    return 0.5 * (shifted(head, h, keep, y, abar) ** 2).mean(0)


def calibrated(crit: fp.criteria.Fisher) -> tuple[nn.Sequential, dict, Tensor, Tensor, Tensor]:
    """A float64 Linear(5, 6)-ReLU-Linear(6, 3) with its hidden units masked and unit 2 pruned,
    two mean-reduced batches (4 and 5 examples) passed under ``crit.observing``, then
    ``crit.update(decay=0)``: the net, its masks, the hidden activations h (9, 6), the mask
    as a float64 keep vector, and the labels."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    x, y = torch.randn(9, 5, dtype=torch.float64), torch.randint(0, 3, (9,))
    masks = fp.apply_masks(net, x[:2])
    (mask,) = masks.values()
    mask.mask[2] = 0.0
    mask.collecting = True
    with crit.observing(net, masks):
        for part in (slice(0, 4), slice(4, 9)):
            F.cross_entropy(net(x[part]), y[part]).backward()
    crit.update(masks, decay=0.0)
    with torch.no_grad():
        h, keep = torch.relu(net[0](x)), mask.mask.double()
    return net, masks, h, keep, y


def test_mean_replacement_signal_matches_a_float64_loop_over_examples() -> None:
    """Linear-ReLU-Linear, two mean-reduced calibration batches of different sizes, one unit
    already pruned: the signal is 1/2 mean_n ((h_nk - abar_k) dL_n/dz_nk)^2 with abar_k the
    unit's mean over both batches as the second layer reads it (z), each example's gradient
    taken alone in float64."""
    net, masks, h, keep, y = calibrated(FisherMean())
    (mask,) = masks.values()
    want = reference(net[2], h, keep, y, (h * keep).mean(0))
    torch.testing.assert_close(mask.signal.double(), want, rtol=1e-6, atol=0.0)  # float32 buffer
    plain = reference(net[2], h, keep, y, torch.zeros(6, dtype=torch.float64))  # Fisher
    assert not torch.allclose(want, plain)  # the mean changed something
