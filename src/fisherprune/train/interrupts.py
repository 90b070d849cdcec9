"""Stopping a run cleanly: on Ctrl-C / SIGTERM after the step under way, on a loss that is no
longer finite before a prune, a checkpoint or the export uses it (on the CPU, before it reaches
the weights); under ``torchrun`` every rank stops at the same step, and a rank that stops
answering ends the job after ``dist_timeout`` seconds.
"""

from __future__ import annotations

import contextlib
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

from fisherprune._dist import in_group

__all__ = [
    "ACCELERATOR_READ_EVERY",
    "DivergedError",
    "Interrupted",
    "PeerTimeoutError",
    "StopGuard",
    "init_distributed",
    "leave_process_group",
    "loss_read_every",
    "monitored_barrier",
    "peer_timeout",
]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DivergedError(RuntimeError):
    """The training loss became NaN or infinite; the run stopped before anything was pruned,
    checkpointed or exported from that step on."""


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


def leave_process_group(timeout_s: float) -> None:
    """Destroy the process group at the end of a run that went well, rank 0 last: it hosts
    the TCP store, and a rank still tearing its group down after rank 0 had torn down the
    store aborted under load ("terminate called without an active exception", exit -6, which
    torchrun reports as a failed job). Every other rank destroys its group, then says so in
    the store; rank 0 waits up to ``timeout_s`` seconds for all of them, then destroys its
    own. Does nothing outside a process group. Changes: ends the process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    default_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if default_store is None:  # (a torch without it: every rank ends the group at once)
        dist.destroy_process_group()
        return
    store = default_store()  # (kept: it outlives the group)
    if rank != 0:
        dist.destroy_process_group()
        store.set(f"fisherprune/left/{rank}", "1")
        return
    left = [f"fisherprune/left/{r}" for r in range(1, world)]
    with contextlib.suppress(RuntimeError):  # (a rank silent past the timeout: end it anyway)
        store.wait(left, timedelta(seconds=timeout_s))
    dist.destroy_process_group()


def monitored_barrier(timeout_s: float, where: str) -> None:
    """Wait until every rank gets here; after ``timeout_s`` seconds raise PeerTimeoutError
    naming the ranks that did not (does nothing outside a process group)."""
    if not in_group():
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


#: steps between two reads of the training loss on an accelerator: each read waits for the
#: device, so the losses are kept there and read together
ACCELERATOR_READ_EVERY = 20


def loss_read_every(device: torch.device) -> int:
    """How many steps' losses ``StopGuard`` keeps before it reads them: 1 on the CPU (a read
    waits for nothing there, and each loss is checked before its update),
    ``ACCELERATOR_READ_EVERY`` on a GPU or another accelerator."""
    return 1 if device.type == "cpu" else ACCELERATOR_READ_EVERY


class StopGuard:
    """While entered, SIGINT and SIGTERM only ask the run to stop (a second one stops it at
    once, with KeyboardInterrupt); ``poll`` tells the training loop whether to stop, agreed by
    every rank under torchrun, and stops it on a loss that is NaN or infinite.

    The losses are kept on their device and read to the host in one go every ``read_every``
    steps (``poll``), and whenever the loop is about to use the weights (``flush``: before a
    prune, an evaluation, a checkpoint or the export), so that a step on a GPU does not wait
    for the device; with ``read_every=1`` (the CPU) every step's loss is read before its update.

    Changes: the process's SIGINT and SIGTERM handlers while entered (only in the main
    thread; elsewhere signals keep their handlers and ``poll`` sees none).
    """

    def __init__(self, timeout_s: float, read_every: int = 1) -> None:
        self.timeout_s = timeout_s
        self.read_every = read_every
        self.signum = 0
        self.loss = math.nan  # the last loss read
        self._pending: list[Tensor] = []  # losses not read yet, of steps _first, _first + 1...
        self._first = 0
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
        if not in_group():
            return values
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces on the GPU
        t = torch.tensor(values, dtype=torch.float64, device=device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        except RuntimeError as e:
            raise peer_timeout(e, f"did not answer within {self.timeout_s:g} s") from None
        return t.tolist()

    @property
    def unread(self) -> int:
        """How many kept losses have not been read to the host yet."""
        return len(self._pending)

    def poll(self, loss: Tensor, step: int, read: bool = False) -> int:
        """Keep ``loss``, the loss of step ``step`` (counted from 0) before it reaches
        ``backward`` and the optimizer; read the kept losses (``flush``) when ``read``, every
        ``read_every`` steps, or once a signal came outside torchrun (where no other rank has
        to agree on the step). Returns the signal that asked the run to stop, on any rank (0
        if none, or nothing was read); ``self.loss`` is the last loss read.

        Raises:
            DivergedError: a kept loss is NaN or infinite on any rank.
        """
        if not self._pending:
            self._first = step
        self._pending.append(loss.detach().float().reshape(()))
        if read or len(self._pending) >= self.read_every or (self.signum and not in_group()):
            return self.flush()
        return 0

    def flush(self) -> int:
        """Read the kept losses to the host (one read; one reduction under torchrun, so every
        rank must call it at the same step) and agree on a stop; see ``poll``.

        Raises:
            DivergedError: a kept loss is NaN or infinite on any rank; it names the step.
        """
        if not self._pending:
            return 0
        values = torch.stack(self._pending).tolist()
        first, now = self._first, self._first + len(values) - 1
        self._pending = []
        self.loss = values[-1]
        bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
        signum, other = self._agree([float(self.signum), 0.0 if bad is None else 1.0])
        if bad is None and not other:
            return int(signum)
        if bad is None:
            what = f"not finite on another rank by step {now + 1}"
        else:
            what = f"{values[bad]} at step {first + bad + 1}"
            if first + bad < now:
                what += (
                    f" (read at step {now + 1}: on an accelerator the loss is read every "
                    f"{self.read_every} steps, so that steps do not wait for the device)"
                )
        raise DivergedError(
            f"the training loss is {what}: training diverged, so the run stopped before "
            "anything was pruned, checkpointed or exported from that step on (nothing "
            "exported). Lower --learning_rate, or check the data for NaN or huge values"
        )
