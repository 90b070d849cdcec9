"""Which masks count as coupled (``fisherprune.criteria.coupled_masks``), and that
benchmarks/fisher_coupled.py's candidate takes the joint increments on those only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from counted import benchmark_module
from torch import Tensor, nn

import fisherprune as fp

coupled = benchmark_module("fisher_coupled")
FisherJoint = benchmark_module("fisher_joint").FisherJoint


class _TwoReaders(nn.Module):
    """A hidden width of 6 read by two layers (``a`` and ``b``), and ``a``'s width of 4 read
    by ``c`` alone."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.a, self.b, self.c = (
            nn.Linear(5, 6),
            nn.Linear(6, 4),
            nn.Linear(6, 3),
            nn.Linear(4, 3),
        )

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        return self.c(torch.relu(self.a(h))) + self.b(h)


def _masked() -> tuple[nn.Module, dict[str, fp.MaskLayer], Tensor, Tensor]:
    torch.manual_seed(2)
    net = _TwoReaders().double()
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    fp.apply_masks(net, x[:1])
    return net, fp.find_masks(net), x, y


def test_a_width_read_by_two_layers_is_coupled_and_one_read_by_one_is_not() -> None:
    """The inner width (6, read by ``a`` and ``b``) is the only coupled mask; ``a``'s output
    width (4, read by ``c``) is not."""
    net, masks, _, _ = _masked()
    by_width = {m.num_channels: m for m in masks.values()}
    assert set(by_width) == {6, 4}
    assert fp.criteria.coupled_masks(net) == {id(by_width[6])}


def test_joint_increments_on_coupled_masks_and_own_signals_elsewhere() -> None:
    """FisherCoupled's importance is FisherJoint(at_least_own=True)'s on the coupled mask and
    the plain Fisher signal on the other, from the same calibration pass."""
    net, masks, x, y = _masked()
    scores = {}
    for key, crit in (
        ("joint", FisherJoint(at_least_own=True)),
        ("coupled", coupled.FisherCoupled()),
    ):
        for m in masks.values():
            m.reset_statistics()
        F.cross_entropy(net(x), y).backward()
        crit.update(masks, decay=0.0)
        scores[key] = crit.importance(masks, net)
    for name, m in masks.items():
        want = scores["joint"][name] if m.num_channels == 6 else m.signal.double()
        torch.testing.assert_close(scores["coupled"][name], want, rtol=0, atol=0)
    four = next(n for n, m in masks.items() if m.num_channels == 4)
    assert not torch.equal(scores["joint"][four], scores["coupled"][four])  # not vacuous
