"""Stopping a run cleanly: on Ctrl-C / SIGTERM after the step under way, on a loss that is no
longer finite before it reaches the weights or the pruner; under ``torchrun`` every rank stops
at the same step, and a rank that stops answering ends the job after ``dist_timeout`` seconds.
"""

from __future__ import annotations

import math
import signal
import threading
from datetime import timedelta
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "DivergedError",
    "Interrupted",
    "PeerTimeoutError",
    "StopGuard",
    "init_distributed",
    "monitored_barrier",
    "peer_timeout",
]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DivergedError(RuntimeError):
    """The training loss became NaN or infinite; the run stopped before that step changed
    the weights or pruned anything."""


class PeerTimeoutError(RuntimeError):
    """Under torchrun, another rank did not answer within ``dist_timeout`` seconds."""


class Interrupted(Exception):
    """The run was stopped by SIGINT or SIGTERM after a checkpoint of its last step.

    Attributes:
        signum: the signal; the command line exits with ``128 + signum`` (130, 143).
        step: the step reached.
        checkpoint: the checkpoint written then, or None (nothing to save at step 0, or a
            rank other than 0).
    """

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint
        saved = f"saved {checkpoint}" if checkpoint else "no checkpoint written"
        super().__init__(f"{signal.Signals(signum).name} at step {step}: {saved}")


def init_distributed(timeout_s: float, backend: str = "gloo") -> None:
    """Join the torchrun process group (``backend``: gloo, or NCCL on CUDA) with collectives
    that fail after ``timeout_s`` seconds instead of waiting on a dead or frozen rank; then
    wait for every rank, naming any that does not arrive (``monitored_barrier``, gloo only:
    NCCL has none, its collectives time out instead)."""
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    if backend == "gloo":
        monitored_barrier(timeout_s, "start")


def monitored_barrier(timeout_s: float, where: str) -> None:
    """Wait until every rank gets here; after ``timeout_s`` seconds raise PeerTimeoutError
    naming the ranks that did not (does nothing outside a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as e:
        raise peer_timeout(e, f"did not reach the {where} barrier within {timeout_s:g} s") from None


def peer_timeout(e: BaseException, what: str) -> PeerTimeoutError:
    """The error for a collective that failed because another rank ``what`` (its first line
    from ``e``). Changes: leaves the process group (destroyed), so that the process can exit
    instead of aborting in gloo's teardown."""
    rank = dist.get_rank()
    dist.destroy_process_group()
    detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return PeerTimeoutError(
        f"rank {rank}: another rank {what} ({detail}); is a rank frozen or dead? (raise "
        "--dist_timeout if a rank is only slow, e.g. loading data)"
    )


def _lost_peer(e: BaseException) -> bool:
    """Whether ``e``, raised in a process group, says another rank did not answer (gloo's
    "Timed out" or a connection closed by a rank that died)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    text = str(e)
    return isinstance(e, dist.DistError) or (
        isinstance(e, RuntimeError) and ("gloo/transport" in text or "Timed out" in text)
    )


class StopGuard:
    """While entered, SIGINT and SIGTERM only ask the run to stop (a second one stops it at
    once, with KeyboardInterrupt); ``check`` tells the training loop, at each step, whether to
    stop, agreed by every rank under torchrun.

    Changes: the process's SIGINT and SIGTERM handlers while entered (only in the main
    thread; elsewhere signals keep their handlers and ``check`` sees none).
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.signum = 0
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopGuard:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in _SIGNALS}
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old = {}
        if exc is not None and _lost_peer(exc):  # in DDP's own collectives
            raise peer_timeout(exc, f"did not answer within {self.timeout_s:g} s") from None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:  # asked twice: stop now
            raise KeyboardInterrupt
        self.signum = signum

    def _agree(self, values: list[float]) -> list[float]:
        """The largest of each value over all ranks (the values themselves outside torchrun)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return values
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces on the GPU
        t = torch.tensor(values, dtype=torch.float64, device=device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        except RuntimeError as e:
            raise peer_timeout(e, f"did not answer within {self.timeout_s:g} s") from None
        return t.tolist()

    def poll(self, loss: Tensor, step: int) -> tuple[int, float]:
        """What every rank must agree on before ``loss`` reaches ``backward`` and the
        optimizer, in one reduction: the signal that asked the run to stop (on any rank, 0 if
        none), and the loss as a number (one host read per step, reused for the progress line).

        Raises:
            DivergedError: ``loss`` is NaN or infinite on any rank.
        """
        value = float(loss.detach())
        signum, bad = self._agree([float(self.signum), 0.0 if math.isfinite(value) else 1.0])
        if bad:
            what = f"{value}" if not math.isfinite(value) else "not finite on another rank"
            raise DivergedError(
                f"the training loss is {what} at step {step + 1}: training diverged, so the run "
                "stopped before that step changed the weights or pruned anything (nothing "
                "exported). Lower "
                "--learning_rate, or check the data for NaN or huge values"
            )
        return int(signum), value
