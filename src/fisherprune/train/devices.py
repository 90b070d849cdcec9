"""Where and in what precision a training run computes: ``--device`` and ``--precision``.

``resolve_device`` turns the flag into a ``torch.device`` (an unavailable one is a ValueError,
which the CLI reports with exit code 2); ``Precision`` wraps the forward pass in
``torch.autocast`` and, for fp16 on CUDA, scales the loss with a ``GradScaler``.

The Fisher statistics stay in float32 whatever the precision: the masks' ``signal`` buffers are
float32 (autocast does not touch buffers), and ``MaskLayer.take_statistics`` casts each pass's
per-example gradients to the signal's dtype before squaring and summing them. What autocast
does change is the per-example, per-channel dot product of gradient and activation computed in
the backward pass (``masks/layer.py``): it runs in the activations' dtype (bf16 / fp16).

With fp16's ``GradScaler`` the masks gather gradients of the scaled loss, so each batch's
Fisher estimate carries the factor ``scale ** 2``; the ranking within a prune is unchanged
(every mask has the same factor) but the moving average mixes factors when the scale changes
(at most every 2,000 steps). A step the scaler skips (inf or NaN gradients) drops what the masks
gathered in it (``Precision.minimize``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from fisherprune.pruner import PruningOptimizer

__all__ = ["PRECISIONS", "Precision", "process_group_backend", "resolve_device"]

#: ``--precision`` name -> autocast dtype (None: no autocast)
PRECISIONS: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The device ``--device name`` asks for.

    ``auto`` is ``cuda:<local_rank>`` when CUDA is available, else ``mps`` when available,
    else ``cpu``; ``cuda`` under torchrun is ``cuda:<local_rank>`` (one GPU per process).

    Raises:
        ValueError: the name is not a device, or the device is not available on this machine.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(
            f"--device {name!r} is not a device; use auto, cpu, cuda, cuda:N or mps"
        ) from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {name}: CUDA is not available here (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda}); use --device cpu, or install a CUDA "
                "build of torch on a machine with an NVIDIA GPU"
            )
        count = torch.cuda.device_count()
        index = local_rank if device.index is None else device.index
        if index >= count:
            raise ValueError(f"--device {name}: this machine has {count} CUDA device(s)")
        return torch.device("cuda", index)
    if device.type == "mps":
        if not _mps_available():
            raise ValueError(f"--device {name}: MPS (Apple GPU) is not available here")
        return device
    raise ValueError(f"--device {name!r}: use auto, cpu, cuda, cuda:N or mps")


def process_group_backend(device: torch.device) -> str:
    """The ``torch.distributed`` backend for processes on ``device``: NCCL on CUDA, else gloo."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class Precision:
    """The run's arithmetic: ``autocast()`` around forward and loss, ``minimize`` for the
    backward pass and the step (through a ``GradScaler`` for fp16 on CUDA).

    Raises (on construction):
        ValueError: an unknown name, or fp16 on a device without fp16 autocast support.
    """

    name: str
    device: torch.device

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(f"--precision {self.name!r}: use one of {', '.join(PRECISIONS)}")
        self.dtype = PRECISIONS[self.name]
        if self.dtype is torch.float16 and self.device.type == "cpu":
            raise ValueError(
                "--precision fp16 needs a GPU (fp16 training on a CPU is slow and unscaled); "
                "use --precision bf16 on a CPU"
            )
        scaled = self.dtype is torch.float16 and self.device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda") if scaled else None

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Run the enclosed forward pass in the run's precision (nothing changes for fp32)."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device.type, dtype=self.dtype):
            yield

    def minimize(self, popt: PruningOptimizer, loss: Tensor) -> None:
        """Backward pass and one ``popt`` step (which may prune); with a scaler, the loss is
        scaled, the gradients (the masks' gathered per-example gradients too) unscaled before
        the step, and a step whose gradients overflowed is skipped (``GradScaler.step``)."""
        if self.scaler is None:
            popt.minimize(loss)
            return
        popt.zero_grad()
        self.scaler.scale(loss).backward()
        # the scale as a tensor on the device (get_scale() would read it back to the host)
        scale = self.scaler.scale(torch.ones((), device=loss.device))
        for m in popt.masks.values():  # the signal is that of the unscaled loss
            m.unscale_gradients(scale)
        counter = popt.counter
        self.scaler.step(popt)
        self.scaler.update()
        if popt.counter == counter:  # GradScaler skipped the step: its gradients overflowed
            for m in popt.masks.values():
                m.reset_statistics()
