"""Batch-norm statistics re-estimated between one-shot rounds (issue 31): what
``calibrate.norm_stats.NormStats`` computes, against statistics taken by hand in float64 from
the inputs each norm sees, and that ``prune_to_target`` measures rounds after the first with
them and gives the dense statistics back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fisherprune as fp
from fisherprune.calibrate import to_target
from fisherprune.calibrate.norm_stats import NormStats, batch_norms


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Conv2d(8, 12, 3, padding=1),
        nn.BatchNorm2d(12),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(12, 4),
    ).eval()


def _batches(n: int = 3, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 3, 6, 6, generator=g), torch.randint(0, 4, (size,), generator=g))
            for _ in range(n)]  # fmt: skip


def _by_hand(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """``_cnn``'s forward in float64 with each batch norm normalising by the batch's own
    statistics (as it does while its running statistics are re-estimated) and dropout off;
    returns the two norms' inputs."""
    d = {k: v.double() for k, v in model.state_dict().items()}
    h1 = F.conv2d(x.double(), d["0.weight"], d["0.bias"], padding=1)
    a = F.relu(F.batch_norm(h1, None, None, d["1.weight"], d["1.bias"], training=True))
    h2 = F.conv2d(a, d["4.weight"], d["4.bias"], padding=1)
    return [h1, h2]


def test_reestimate_averages_the_batch_statistics_of_what_each_norm_sees() -> None:
    model, batches = _cnn(), _batches()
    inputs = [_by_hand(model, x) for x, _ in batches]
    NormStats(model).reestimate(batches)
    for i, norm in enumerate((model[1], model[5])):
        per = [h[i].transpose(0, 1).flatten(1) for h in inputs]
        mean = torch.stack([p.mean(1) for p in per]).mean(0)
        var = torch.stack([p.var(1, unbiased=True) for p in per]).mean(0)
        torch.testing.assert_close(norm.running_mean.double(), mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norm.running_var.double(), var, rtol=1e-5, atol=1e-6)


def test_reestimate_gives_back_modes_and_momentum() -> None:
    model = _cnn()
    model[3].train()  # a dropout left in train mode by its owner
    NormStats(model).reestimate(_batches())
    assert [m.training for m in model.modules()] == [
        isinstance(m, nn.Dropout) for m in model.modules()
    ]
    assert all(m.momentum == 0.1 for m in batch_norms(model))


def test_restore_writes_back_the_dense_statistics_bit_for_bit() -> None:
    model = _cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = NormStats(model)
    stats.reestimate(_batches())
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])
    stats.restore()
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_norms_without_running_statistics_and_sync_norms_are_left_alone() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, track_running_stats=False), nn.SyncBatchNorm(4)
    )
    assert batch_norms(model) == []
    assert NormStats(model).reestimate(_batches()) == 0


def test_later_rounds_measure_signals_with_the_pruned_networks_statistics(monkeypatch) -> None:
    model, batches = _cnn(), _batches()
    dense_mean = model[5].running_mean.clone()
    seen: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
    real = to_target.estimate_signals

    def spy(model_, masks, *args, **kwargs):
        seen.append((model_[5].running_mean.clone(), {n: m.mask.clone() for n, m in masks.items()}))
        return real(model_, masks, *args, **kwargs)

    monkeypatch.setattr(to_target, "estimate_signals", spy)
    fp.prune_to_target(
        model, batches[0][0][:2], batches, "40%", loss_fn=F.cross_entropy, rounds=3,
        reconstruct=False,
    )  # fmt: skip
    assert len(seen) >= 2
    assert torch.equal(seen[0][0], dense_mean)
    # round 2: the statistics of the network masked as round 1 left it, taken by hand (the
    # first conv's mask acts after BN1, ReLU and dropout, which keep its zeros; the second
    # conv's acts after BN2)
    (mask,) = [m for m in seen[1][1].values() if m.numel() == 8]
    assert not bool(mask.all())
    keep = mask.double().view(1, -1, 1, 1)
    d = {k: v.double() for k, v in _cnn().state_dict().items()}
    means = []
    for x, _ in batches:
        h1 = F.conv2d(x.double(), d["0.weight"], d["0.bias"], padding=1)
        a = F.relu(F.batch_norm(h1, None, None, d["1.weight"], d["1.bias"], training=True)) * keep
        h2 = F.conv2d(a, d["4.weight"], d["4.bias"], padding=1)
        means.append(h2.transpose(0, 1).flatten(1).mean(1))
    torch.testing.assert_close(
        seen[1][0].double(), torch.stack(means).mean(0), rtol=1e-5, atol=1e-6
    )
    assert torch.equal(model[5].running_mean, dense_mean)  # given back at the end


def test_statistics_come_back_when_a_round_raises() -> None:
    model, batches = _cnn(), _batches()
    before = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    calls = {"n": 0}

    def loss(out, y):
        calls["n"] += 1
        if calls["n"] > len(batches):  # round 2
            return out.sum() * float("nan")
        return F.cross_entropy(out, y)

    with pytest.raises(ValueError, match="not finite"):
        fp.prune_to_target(model, batches[0][0][:2], batches, "40%", loss_fn=loss, rounds=3)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_without_recalibration_every_round_sees_the_dense_statistics(monkeypatch) -> None:
    model, batches = _cnn(), _batches()
    dense_mean = model[5].running_mean.clone()
    seen: list[torch.Tensor] = []
    real = to_target.estimate_signals

    def spy(model_, *args, **kwargs):
        seen.append(model_[5].running_mean.clone())
        return real(model_, *args, **kwargs)

    monkeypatch.setattr(to_target, "estimate_signals", spy)
    fp.prune_to_target(
        model, batches[0][0][:2], batches, "40%", loss_fn=F.cross_entropy, rounds=3,
        reconstruct=False, recalibrate_norms=False,
    )  # fmt: skip
    assert len(seen) >= 2 and all(torch.equal(s, dense_mean) for s in seen)
