"""``fisherprune train --compile``: the training steps' forward and backward through
``torch.compile``, masks and all.

The masks keep collecting inside the compiled graph (``fisherprune.masks.compiled``): a
collecting step is one graph, with no break at each mask, and its per-example signal is the
eager one. What compiling changes for a run:

* the graph is traced again when the collection starts and stops, and once more for the
  shrunk model (new parameters, new shapes);
* evaluation, the teacher's forward and the export run eager, on the same weights;
* the run's graphs count apart from other runs' where torch can (``compile_regions``), so a
  run after seven others in one process is still compiled.

``check_compiler`` compiles a one-line function with the run's backend on its device before
anything is trained, so that a backend that cannot build kernels here (inductor on a CPU
without a C++ compiler) is refused with a message, not a traceback at the first step.
"""

from __future__ import annotations

import torch
from torch import nn

from fisherprune._errors import first_line
from fisherprune.compile_regions import ISOLATED

__all__ = [
    "COMPILE_MODES",
    "REFUSED_BACKENDS",
    "check_compile_settings",
    "check_compiler",
    "compiled",
]

#: ``--compile_mode`` values; the CUDA-graph modes (``reduce-overhead``, ``max-autotune``) are
#: left out: a step that prunes writes the masks a replay reads, and the compiled backward
#: hands each pass's per-example dots to Python (``fisherprune::hand_over``), which a replay
#: would skip
COMPILE_MODES: tuple[str, ...] = ("default", "max-autotune-no-cudagraphs")
#: backends refused for the same reason: ``cudagraphs`` replays every graph it captured, the
#: backward's hand-over included, as a CUDA graph
REFUSED_BACKENDS: tuple[str, ...] = ("cudagraphs",)


def _backends() -> list[str]:
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def check_compile_settings(backend: str, mode: str) -> None:
    """Refuse a backend ``torch.compile`` does not know or one in ``REFUSED_BACKENDS``, or a
    mode not in ``COMPILE_MODES``.

    Raises:
        ValueError: naming the setting and what it may be.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(
            f"compile_mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r} (a CUDA "
            "graph's replay would skip the masks' hand-over of their signal)"
        )
    if backend in REFUSED_BACKENDS:
        raise ValueError(
            f"compile_backend {backend!r} replays CUDA graphs, which would skip the masks' "
            "hand-over of their signal; use inductor, or aot_eager"
        )
    known = _backends()
    if backend not in known:
        raise ValueError(
            f"compile_backend {backend!r} is not a torch.compile backend; use inductor, or "
            f"aot_eager (no kernels built: needs no compiler); known: {', '.join(known)}"
        )


def check_compiler(backend: str, mode: str, device: torch.device) -> None:
    """Compile and run ``x * 2 + 1`` with ``backend`` and ``mode`` on ``device``; changes
    nothing but torch's compile caches (one small graph).

    Raises:
        ValueError: the backend failed there; names it, the device and the first line of the
            failure, and what to use instead.
    """
    mode_arg = None if mode == "default" else mode
    try:
        fn = torch.compile(lambda x: x * 2 + 1, backend=backend, mode=mode_arg, fullgraph=True)
        fn(torch.ones(4, device=device))
    except Exception as e:  # (whatever the backend raises: it is reported, not swallowed)
        raise ValueError(
            f"--compile: torch.compile with backend {backend} could not compile on {device} "
            f"({first_line(e)}); use --compile_backend aot_eager (builds no kernels), or leave "
            "out --compile"
        ) from None


def compiled(model: nn.Module, backend: str, mode: str) -> nn.Module:
    """``model`` (or its DistributedDataParallel wrapper) under ``torch.compile``: calls trace
    and run compiled graphs; its parameters, buffers and masks are ``model``'s own (the
    checkpoints and exports read ``model``). Changes nothing in ``model``."""
    mode_arg = None if mode == "default" else mode
    # a count of graphs of its own: runs one after another in a process do not use up
    # torch's recompile limit for the model's forward (``fisherprune.compile_regions``)
    return torch.compile(model, backend=backend, mode=mode_arg, **ISOLATED)  # type: ignore[return-value]
