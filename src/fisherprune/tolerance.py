"""The tolerances of the library's own output checks, in one place, by dtype.

Shrink compares a half-precision model through float32 copies, where slicing changes no value
and the two agree to float32 rounding at any depth (``export.shrink``). Where a check must
compare the model as it is (a folder reloaded by ``from_pretrained`` computes in the dtype it
was saved in), the tolerance scales with the dtype's precision: bf16 keeps 8 bits of
mantissa, so two orders of the same sums differ by about 1% of the largest output, and a
width must never be refused for that rounding (issue 36).
"""

from __future__ import annotations

import torch

__all__ = ["OUTPUT_RTOL", "output_rtol"]

#: the largest difference allowed between two outputs that should be equal, relative to the
#: larger of 1 and the largest output, by the outputs' dtype
OUTPUT_RTOL: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 4e-2,
}


def output_rtol(dtype: torch.dtype) -> float:
    """``OUTPUT_RTOL`` of ``dtype`` (float32's for a dtype it does not list)."""
    return OUTPUT_RTOL.get(dtype, OUTPUT_RTOL[torch.float32])
