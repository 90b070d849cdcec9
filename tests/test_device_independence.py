"""A network's structure does not depend on the device it lives on: groups, mask placement and
costs found for a model on the CPU are found for the same model on any other device (the
tracer runs its forward on a CPU stand-in, ``fisherprune.graph.cpu_standin``). The ``meta``
device stands here for a device the tracer never runs on; ``test_cuda.py`` checks CUDA."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import fisherprune as fp
from fisherprune.cost import CostModel
from fisherprune.graph.channels import ChannelGraph
from fisherprune.graph.groups import find_groups
from fisherprune.graph.trace import trace_model
from tests.zoo import ARCHS


def structure(model: nn.Module, x: torch.Tensor) -> list[tuple[Any, ...]]:
    """Every group the tracer finds, as plain values, and what it skips."""
    trace = trace_model(model, x)
    groups, specs, skipped = find_groups(trace, ChannelGraph(trace))
    found = [
        (g.name, g.num_channels, tuple(g.params), tuple(g.producers), tuple(g.consumers))
        for g in groups
    ]
    points = [(sp.module, sp.arg, sp.dim, sp.size, sp.norm, sp.output) for sp in specs]
    return [*found, *points, *sorted(str(s) for s in skipped)]


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_groups_and_placements_equal_on_meta_and_cpu(name: str) -> None:
    """The zoo's groups, mask points and skips traced from ``meta`` equal those from the CPU."""
    arch = ARCHS[name]
    model, x = arch.build(), arch.example_input(2)
    expected = structure(model, x)
    assert expected == structure(copy.deepcopy(model).to("meta"), x.to("meta"))


@pytest.mark.parametrize("name", ["resnet_basic", "densenet", "transformer_sdpa"])
def test_costs_equal_on_meta_and_cpu(name: str) -> None:
    """The cost of a masked model, dense and with one channel of every mask removed, is the
    same when the model lives on ``meta`` (whose masks hold no values: the CPU's are given)."""
    arch = ARCHS[name]
    model, x = arch.build(), arch.example_input(2)
    masks = fp.apply_masks(model, x)
    meta_model = copy.deepcopy(model).to("meta")
    with torch.no_grad():
        for m in masks.values():
            m.mask[0] = 0.0
    cpu = CostModel(model, x)
    meta = CostModel(meta_model, x.to("meta"))
    pruned = cpu.entries()
    assert pruned.min() == 0.0
    assert meta.dense_total() == cpu.dense_total()
    assert meta.total(pruned) == cpu.total(pruned) < cpu.dense_total()


def test_masks_land_where_they_do_on_the_cpu() -> None:
    """``apply_masks`` on a model on ``meta`` (a CNN with batch norms, where a CUDA trace once
    put the masks before the norm) places the same masks at the same points."""
    arch = ARCHS["resnet_bottleneck"]
    x = arch.example_input(2)
    cpu_masks = fp.apply_masks(arch.build(), x)
    meta_masks = fp.apply_masks(arch.build().to("meta"), x.to("meta"))
    assert {n: m.num_channels for n, m in meta_masks.items()} == {
        n: m.num_channels for n, m in cpu_masks.items()
    }
    assert {n: g.consumers for n, g in meta_masks.groups.items()} == {
        n: g.consumers for n, g in cpu_masks.groups.items()
    }


class _Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[torch.device] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.device)
        return self.lin(x)


def test_trace_runs_on_cpu_and_leaves_the_model_where_it_was() -> None:
    """The traced forward sees CPU tensors; afterwards every parameter is the same object, on
    its own device, as before."""
    model = _Recorder().to("meta")
    before = {n: p for n, p in model.named_parameters()}
    trace_model(model, torch.zeros(2, 4, device="meta"))
    assert model.seen == [torch.device("cpu")]
    after = dict(model.named_parameters())
    assert all(after[n] is p and p.device.type == "meta" for n, p in before.items())
