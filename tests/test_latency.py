"""retain_freed_memory: glibc keeps freed activation buffers, so a pass does not fault them in.

Checked against the kernel's own count of minor page faults (``getrusage``), in a child
process each, since the setting is process-wide and cannot be undone.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

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
    import torch
    from torch import nn

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
