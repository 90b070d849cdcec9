"""``Loop``: everything the phases of a ``fisherprune train`` run work on
(``fisherprune.train.phases``), and the checkpoint and stop it makes between steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from torch import Tensor, nn

from fisherprune.pruner import PruningOptimizer
from fisherprune.train.checkpoint import CheckpointManager
from fisherprune.train.config import TrainConfig
from fisherprune.train.devices import Precision
from fisherprune.train.interrupts import Interrupted, StopGuard
from fisherprune.train.progress import Progress
from fisherprune.train.schedule import DenseCheck
from fisherprune.train.shrunk import Pruned
from fisherprune.train.state import MetricsLog, RunState

__all__ = ["Loop"]


def _unwrapped(model: nn.Module) -> nn.Module:
    return model


@dataclass
class Loop:
    """What the phases work on; ``PruningTrainer.run`` makes one per run."""

    config: TrainConfig
    net: nn.Module  # the trainer's model, in DistributedDataParallel under torchrun
    popt: PruningOptimizer
    state: RunState  # advanced by every step, saved in every checkpoint
    metrics: MetricsLog  # appends to state.metrics
    ckpts: CheckpointManager
    progress: Progress
    precision: Precision
    burn_in: int  # steps of the dense phase
    cap: int  # the step count no run goes beyond
    batch: Callable[[int], tuple[Tensor, Tensor]]  # step -> (inputs, labels) on the device
    loss: Callable[[Tensor, Tensor], Tensor]  # (outputs, labels) -> loss
    evaluate: Callable[..., float]  # (limit=None) -> the eval metric of the model as it stands
    metric_name: str  # "accuracy" or "mse"
    check_dense: Callable[[float], DenseCheck]  # did the dense model learn?
    checkpoint: Callable[[], dict[str, Any]]  # what a checkpoint holds now
    write: bool  # rank 0: writes checkpoints
    guard: StopGuard  # entered while the phases run: signals, a diverging loss
    model: nn.Module | None = None  # the trainer's model itself (``net`` may wrap it)
    teacher: nn.Module | None = None  # the dense model, frozen, with ``distill_alpha`` > 0
    #: writes the dense model's file (``export_dense``), called once when the dense phase ends
    save_dense: Callable[[], None] | None = None
    example: Tensor | None = None  # one input on the device: what the shrink traces with
    #: model -> what the steps train (``net``): DistributedDataParallel under torchrun, else
    #: the model itself; called again once the model is shrunk (its parameters are new)
    wrap: Callable[[nn.Module], nn.Module] = _unwrapped
    #: ``model`` shrunk in place once pruning finished (``shrink_for_fine_tune``); None while
    #: the model is masked
    pruned: Pruned | None = None

    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint holds now: ``checkpoint()`` and, once it is kept, the teacher's
        weights (on the CPU), so that a resumed fine-tune still distils."""
        saved = self.checkpoint()
        if self.teacher is not None:
            weights = self.teacher.state_dict().items()
            saved["teacher"] = {k: v.detach().cpu() for k, v in weights}
        return saved

    def read_losses(self) -> None:
        """Read the losses kept on the device (``StopGuard.flush``; every rank calls it at the
        same step); a stop agreed there stops the run as ``train_step`` does.

        Raises:
            DivergedError: one of them is NaN or infinite (nothing written).
            Interrupted: a rank was asked to stop (a checkpoint of the step reached written).
        """
        signum = self.guard.flush()
        if signum:
            self.stop(signum)

    def stop(self, signum: int) -> NoReturn:
        """End the run on ``signum``: a checkpoint of the step reached (rank 0, after step 0).

        Raises:
            Interrupted: always; it names the checkpoint.
        """
        saved = self.write and self.state.step > 0
        path = self.ckpts.save(self.state.step, self.snapshot()) if saved else None
        raise Interrupted(signum, self.state.step, path)

    def save_checkpoint(self) -> None:
        """Write a checkpoint of the run as it stands (rank 0 only), once the losses not read
        yet are read and finite (``read_losses``).

        Raises:
            DivergedError, Interrupted: as ``read_losses``.
        """
        self.read_losses()
        if self.write:
            self.ckpts.save(self.state.step, self.snapshot())
