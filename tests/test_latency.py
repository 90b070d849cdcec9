"""retain_freed_memory: glibc keeps freed activation buffers, so a pass does not fault them in.

Checked against the kernel's own count of minor page faults (``getrusage``), in a child
process each, since the setting is process-wide and cannot be undone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

import fisherprune.export as fpe

_CHILD = """
import resource, sys, torch
from fisherprune.export import retain_freed_memory
applied = retain_freed_memory() if sys.argv[1] == "retain" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.randn(64, 48, 64, 64)  # 48 MiB: glibc maps anything above 32 MiB afresh by default
for _ in range(10):
    (x * 2).sum()
before = faults()
for _ in range(20):
    (x * 2).sum()
print(applied, (faults() - before) / 20)
"""


def _is_glibc() -> bool:
    """Whether this process's C library is glibc (musl, macOS and Windows have no mallopt)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    return hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version")


_GLIBC = _is_glibc()


def _faults_per_pass(mode: str) -> tuple[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], float(out[1])


@pytest.mark.skipif(not _GLIBC, reason="glibc malloc only")
def test_retained_memory_removes_the_page_faults_of_each_pass() -> None:
    """A 48 MiB temporary faults in ~12k pages per pass with glibc's defaults and none once
    freed memory is retained."""
    _, default = _faults_per_pass("default")
    applied, retained = _faults_per_pass("retain")
    assert applied == "True"
    assert default > 1000  # the cost being removed is there to begin with
    assert retained < default / 20


@pytest.mark.parametrize("limit", [0, -1, 2**31, 1.5, "1G"])
def test_retain_freed_memory_rejects_a_bad_limit(limit: object) -> None:
    with pytest.raises(ValueError, match="limit_bytes"):
        fpe.retain_freed_memory(limit)  # type: ignore[arg-type]
