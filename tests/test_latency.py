"""retain_freed_memory: glibc keeps freed activation buffers, so a pass does not fault them in.

Checked against the kernel's own count of minor page faults (``getrusage``), in a child
process each, since the setting is process-wide and cannot be undone.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import fisherprune.export as fpe
from fisherprune.export.latency import _glibc

_CHILD = """
import resource, sys, torch
from fisherprune.export import retain_freed_memory
applied = retain_freed_memory() if sys.argv[1] == "retain" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.randn(64, 48, 64, 64)  # 48 MiB: glibc maps anything above 32 MiB afresh by default
for _ in range(10):
    (x * 2).sum()
blocks = []  # the quietest of 5 blocks: a page the kernel reclaims once is not the effect
for _ in range(5):
    before = faults()
    for _ in range(4):
        (x * 2).sum()
    blocks.append((faults() - before) / 4)
print(applied, min(blocks))
"""


# what the platform says, independently of the function under test
_GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def _clean_env() -> dict[str, str]:
    """This environment without what changes the allocator: a preloaded malloc (jemalloc,
    tcmalloc) or glibc's MALLOC_* tunables."""
    drop = ("LD_PRELOAD", "GLIBC_TUNABLES")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("MALLOC_")}


def _faults_per_pass(mode: str) -> tuple[str, float]:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, env=_clean_env()
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.split()
    return out[0], float(out[1])


@pytest.mark.skipif(not _GLIBC, reason="glibc malloc only")
def test_retained_memory_removes_the_page_faults_of_each_pass() -> None:
    """A 48 MiB temporary faults in ~12k pages per pass with glibc's defaults and none once
    freed memory is retained."""
    _, default = _faults_per_pass("default")
    if default < 1000:  # e.g. transparent huge pages or a kernel that pre-faults mappings
        pytest.skip(f"no page faults to remove here ({default:.0f} per pass with defaults)")
    applied, retained = _faults_per_pass("retain")
    assert applied == "True"
    assert retained < default / 20


def test_glibc_is_found_exactly_where_the_platform_says_so() -> None:
    """retain_freed_memory finds glibc's mallopt whenever Python reports glibc, and not
    otherwise (a failed lookup would silently turn the call into a no-op)."""
    assert (_glibc() is not None) == _GLIBC


def test_measure_latency_times_eager_and_frozen_torchscript_side_by_side() -> None:
    """measure_latency accepts a frozen TorchScript module (which has no train/eval flag) next
    to an eager one, returns a positive time for each, and gives the eager module back its
    training flag."""
    eager = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        frozen = torch.jit.freeze(torch.jit.trace(eager.eval(), x))
    eager.train()
    lat = fpe.measure_latency({"eager": eager, "frozen": frozen}, x, repeats=2, rounds=2)
    assert set(lat) == {"eager", "frozen"} and min(lat.values()) > 0
    assert eager.training and all(m.training for m in eager.modules())


@pytest.mark.parametrize("limit", [0, -1, 2**31])
def test_retain_freed_memory_rejects_a_limit_out_of_range(limit: int) -> None:
    """A limit outside [1, 2**31) raises ValueError naming limit_bytes."""
    with pytest.raises(ValueError, match="limit_bytes"):
        fpe.retain_freed_memory(limit)


@pytest.mark.parametrize("limit", [1.5, "1G", True])
def test_retain_freed_memory_rejects_a_limit_that_is_not_an_int(limit: object) -> None:
    """A limit that is not an int (a bool included) raises TypeError naming limit_bytes."""
    with pytest.raises(TypeError, match="limit_bytes"):
        fpe.retain_freed_memory(limit)  # type: ignore[arg-type]


def _conv_net() -> nn.Module:
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(5),
    )  # fmt: skip
    net(torch.randn(2, 3, 8, 8))  # materialise the lazy layer
    with torch.no_grad():
        for m in net.modules():  # running statistics that batch-norm folding must honour
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    return net.train()


def test_frozen_for_serving_gives_the_eval_outputs_in_channels_last() -> None:
    """For a 4-D input, frozen_for_serving returns a frozen module with the eval-mode outputs of
    the model (batch norm folded with its running statistics) and the input in channels-last
    layout, at another batch size than it was traced at too."""
    net = _conv_net()
    x = torch.randn(3, 3, 8, 8)
    frozen, args = fpe.frozen_for_serving(net, x)
    assert isinstance(frozen, torch.jit.ScriptModule)
    assert args[0].is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        expected = net.eval()(x)
        torch.testing.assert_close(frozen(*args), expected, rtol=1e-4, atol=1e-5)
        x7 = torch.randn(7, 3, 8, 8)
        torch.testing.assert_close(
            frozen(x7.contiguous(memory_format=torch.channels_last)), net(x7), rtol=1e-4, atol=1e-5
        )


def _weight_layouts(frozen: torch.jit.ScriptModule) -> list[bool]:
    """For each 4-D tensor constant of a frozen graph (the conv weights): is it channels-last?"""
    return [
        t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
        for n in frozen.graph.nodes()
        if n.kind() == "prim::Constant" and n.output().type().kind() == "TensorType"
        for t in [n.output().toIValue()]
        if t.dim() == 4
    ]


@pytest.mark.parametrize(
    ("channels_last", "expected"), [(None, True), (True, True), (False, False)]
)
def test_frozen_for_serving_puts_the_conv_weights_in_the_layout_asked_for(
    channels_last: bool | None, expected: bool
) -> None:
    """Every conv weight of the frozen graph, and the returned image input, is channels-last
    by default for a 4-D input and when asked, and in NCHW with channels_last=False."""
    x = torch.randn(2, 3, 8, 8)
    frozen, args = fpe.frozen_for_serving(_conv_net(), x, channels_last)
    layouts = _weight_layouts(frozen)
    assert len(layouts) == 2 and set(layouts) == {expected}
    assert args[0].is_contiguous(memory_format=torch.channels_last) == expected
    assert args[0].is_contiguous() != expected


def test_frozen_for_serving_leaves_the_model_as_it_was() -> None:
    """The model keeps its training flag, parameters and NCHW weight layout."""
    net = _conv_net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    fpe.frozen_for_serving(net, torch.randn(2, 3, 8, 8))
    assert net.training and all(m.training for m in net.modules())
    assert net[0].weight.is_contiguous()  # not channels-last
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_frozen_for_serving_keeps_a_2d_input_as_it_is() -> None:
    """A table input is not put in another layout, and the frozen MLP gives the eval outputs."""
    net = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2)).eval()
    x = torch.randn(4, 6)
    frozen, args = fpe.frozen_for_serving(net, x)
    assert args[0] is x
    with torch.no_grad():
        torch.testing.assert_close(frozen(*args), net(x), rtol=1e-4, atol=1e-5)


def test_frozen_for_serving_without_inputs_names_the_problem() -> None:
    """No example inputs: a ValueError saying inputs are needed, not a tracing traceback."""
    with pytest.raises(ValueError, match="needs example inputs"):
        fpe.frozen_for_serving(_conv_net(), None)


class _AlternatingSleeper:
    """A plain callable (not a module) whose calls sleep 0 and 40 ms in turn."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls % 2 == 0:
            time.sleep(0.04)
        return x


def test_measure_latency_min_is_the_fastest_block_and_median_the_middle() -> None:
    """With single-call blocks of a callable that sleeps 0 and 40 ms in turn, statistic="min"
    reports a call without the sleep and "median" (of an even count: the mean of the middle
    two) at least half the sleep; a plain callable is accepted."""
    x = torch.zeros(1)
    fast = fpe.measure_latency({"f": _AlternatingSleeper()}, x, 1, 0, 4, statistic="min")["f"]
    mid = fpe.measure_latency({"f": _AlternatingSleeper()}, x, 1, 0, 4, statistic="median")["f"]
    assert fast < 0.01
    assert mid >= 0.02


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"statistic": "mean"}, "statistic must be one of median, min"),
        ({"rounds": 0}, "at least 1"),
    ],
)
def test_measure_latency_rejects_bad_settings(kwargs: dict, message: str) -> None:
    """An unknown statistic or no rounds raises ValueError naming the setting."""
    with pytest.raises(ValueError, match=message):
        fpe.measure_latency({"f": lambda x: x}, torch.zeros(1), **kwargs)
