"""Recovery of a pruned (shrunk) model past one device: distillation from the dense model
under ``torchrun`` with FSDP2, sharded checkpoints, resume after ``kill -9``.

Every rank runs ``distill_sharded`` with the same arguments. Step ``i`` trains on
``batches[i % len(batches)]``, each rank on its own equal slice of that batch (rank ``r`` of
``w`` takes rows ``r*n/w`` to ``(r+1)*n/w``); FSDP2 averages the gradients over the ranks, so
a step is the step one process would take on the whole batch, and the data a step sees
depends on its number alone: a resumed run takes the steps an uninterrupted one takes.

The teacher is sharded like the student by default: it is the dense model, larger than the
student, so a student that needs sharding has a teacher that needs it more; it is frozen
(no gradients, no optimizer state), so sharding it costs one all-gather per block and
forward. ``shard_teacher=False`` keeps a whole copy on every rank instead (no gathers; for
a teacher that fits on one device with room to spare).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fisherprune.distill import LossFn, distill_loss
from fisherprune.inputs import Inputs, as_pair, call_model
from fisherprune.modes import eval_mode
from fisherprune.recover.checkpoints import Position, ShardedCheckpoints
from fisherprune.recover.rank0 import agreed_blocks, fill_from_rank0, held_on_meta
from fisherprune.recover.sharding import data_parallel_mesh, device_of, shard_model
from fisherprune.train.interrupts import Interrupted, StopGuard, loss_read_every

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Recovery", "distill_sharded"]


@dataclass(frozen=True)
class Recovery:
    """What ``distill_sharded`` did.

    Attributes:
        losses: the loss of each step this call ran, averaged over the ranks.
        start_step: the step it started from (0, or the resumed checkpoint's).
        resumed_from: the checkpoint it resumed from, or None.
        checkpoint: the last checkpoint it wrote, or None.
    """

    losses: list[float]
    start_step: int
    resumed_from: Path | None
    checkpoint: Path | None


@dataclass(frozen=True)
class _Objective:
    """The loss of a step: ``distill_loss`` against the teacher, or ``loss_fn`` alone."""

    teacher: nn.Module | None
    loss_fn: LossFn | None
    alpha: float
    temperature: float
    task: str

    def __call__(self, student: nn.Module, inputs: Any, targets: Any) -> Tensor:
        out = call_model(student, inputs)
        if self.teacher is None:
            return self.loss_fn(out, targets)  # type: ignore[misc]
        with torch.no_grad():
            t_out = call_model(self.teacher, inputs)
        return distill_loss(
            out, t_out, targets, loss_fn=self.loss_fn, alpha=self.alpha,
            temperature=self.temperature, task=self.task,
        )  # fmt: skip


def distill_sharded(
    student: nn.Module,
    teacher: nn.Module | None,
    batches: Sequence[Any],
    *,
    steps: int,
    lr: float = 1e-4,
    weight_decay: float = 0.0,
    checkpoint_dir: Path | str | None = None,
    every: int = 0,
    keep: int = 2,
    block_types: Sequence[type[nn.Module]] = (),
    shard_teacher: bool = True,
    loss_fn: LossFn | None = None,
    alpha: float = 1.0,
    temperature: float = 2.0,
    task: str = "auto",
    dist_timeout_s: float = 1800.0,
    report: Callable[[str], None] = print,
    on_step: Callable[[int], None] | None = None,
) -> Recovery:
    """Distil ``teacher`` into ``student`` for ``steps`` steps with AdamW, both sharded with
    FSDP2 over every rank of the process group, resuming from the newest whole checkpoint in
    ``checkpoint_dir`` when there is one. A collective: every rank calls it alike.

    Changes: ``student`` is sharded in place (``fully_shard`` on each repeated block, then on
    the root: its parameters become DTensors on this rank's device) and trained;
    ``save_pretrained_gathered`` writes it whole. ``teacher`` is put in eval mode, its
    parameters frozen, and sharded the same way (``shard_teacher``) or moved whole to this
    rank's device. Checkpoints ``step-*`` are written in ``checkpoint_dir`` every ``every``
    steps, after the last step, and on SIGINT / SIGTERM (then ``Interrupted`` is raised).

    Args:
        student: the shrunk model, the same weights on every rank; or loaded on rank 0
            only, the other ranks building it on the meta device (``with
            torch.device("meta"): Model(config)``), to receive their shards from rank 0
            (``fisherprune.recover.rank0``: one whole copy in memory on rank 0, never more
            than a shard elsewhere).
        teacher: the dense model (loaded alike), or None to train on ``loss_fn`` alone.
        batches: ``(inputs, targets)`` pairs or dicts of keyword inputs, the same on every
            rank, indexed by step (cycled); each batch's size a multiple of the world size.
        steps: the step to train to (counted from the start of the first run, not resumed).
        lr, weight_decay: AdamW's.
        checkpoint_dir: where checkpoints are written and resumed from; None: neither.
        every: steps between checkpoints (0: only after the last step).
        keep: how many checkpoints are kept (2 or more, so that a damaged newest one has one
            to fall back to).
        block_types: the classes of the blocks to shard one by one; empty: the model's chain
            of repeated blocks, found by one forward pass on the first batch on rank 0 and
            named to the other ranks.
        shard_teacher: shard the teacher too (see the module docstring) or replicate it.
        loss_fn, alpha, temperature, task: as in ``distill_loss`` (default: the teacher only).
        dist_timeout_s: the process group's timeout, named when a rank stops answering.
        report: called with one line for each checkpoint passed over or resumed from.
        on_step: called with the number of steps done after each step (and its checkpoint).

    Raises:
        ValueError: no teacher and no ``loss_fn``, no batches, a negative ``steps`` /
            ``every``, ``every`` without a ``checkpoint_dir``, a batch that does not split
            evenly over the ranks, a checkpoint saved with a different number of batches, or
            a model on the meta device on rank 0 or built unlike rank 0's on another rank.
        RuntimeError: no process group.
        fisherprune.train.interrupts.DivergedError: the loss is not finite on some rank.
        fisherprune.train.interrupts.Interrupted: SIGINT or SIGTERM, after its checkpoint.
        fisherprune.train.checkpoint.DamagedCheckpointError: every checkpoint is damaged.
    """
    _check(teacher, loss_fn, batches, steps, every, checkpoint_dir)
    data = [as_pair(b) for b in batches]
    mesh = data_parallel_mesh()
    device = device_of(mesh)
    rank, world = dist.get_rank(), dist.get_world_size()

    def first() -> Any:  # called on rank 0 only, whose models hold their weights
        return _share(data[0][0], rank, world, _device_of(student))

    _place(student, first, block_types, mesh, device, shard=True, what="student")
    if teacher is not None:
        teacher.eval().requires_grad_(False)
        _place(teacher, first, block_types, mesh, device, shard=shard_teacher, what="teacher")
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=weight_decay)
    store = ShardedCheckpoints(Path(checkpoint_dir), keep) if checkpoint_dir else None
    start, resumed = _resume(store, student, opt, len(data), report)
    objective = _Objective(teacher, loss_fn, alpha, temperature, task)

    def save(done: int) -> Path | None:
        if store is None:
            return None
        return store.save(Position(done, len(data)), student, opt)

    losses: list[Tensor] = []
    written = None
    with eval_mode(student), StopGuard(dist_timeout_s, loss_read_every(device)) as guard:
        student.train()
        for step in range(start, steps):
            inputs, targets = data[step % len(data)]
            loss = objective(
                student, _share(inputs, rank, world, device), _share(targets, rank, world, device)
            )
            signum = guard.poll(loss, step)  # on the CPU read now: a NaN stops the update
            if signum:
                raise Interrupted(signum, step, save(step))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach().float().reshape(()))
            if step + 1 == steps or (every and (step + 1) % every == 0):
                guard.flush()
                written = save(step + 1)
            if on_step is not None:
                on_step(step + 1)
    return Recovery(_mean_over_ranks(losses), start, resumed, written)


def _place(
    model: nn.Module,
    example: Callable[[], Any],
    block_types: Sequence[type[nn.Module]],
    mesh: DeviceMesh,
    device: torch.device,
    *,
    shard: bool,
    what: str,
) -> None:
    """Shard ``model`` block by block over ``mesh`` (or, not ``shard``, put it whole on
    ``device``), then fill the copies that ranks other than 0 built on the meta device from
    rank 0's weights (``fisherprune.recover.rank0``). A collective."""
    meta = held_on_meta(model, what)
    whole = model.state_dict() if meta and shard and dist.get_rank() == 0 else None
    if shard:
        shard_model(model, agreed_blocks(model, example, block_types), mesh)
    if meta:
        fill_from_rank0(model, whole, device, sharded=shard)
    elif not shard:
        model.to(device)


def _check(
    teacher: nn.Module | None,
    loss_fn: LossFn | None,
    batches: Sequence[Any],
    steps: int,
    every: int,
    checkpoint_dir: Path | str | None,
) -> None:
    if teacher is None and loss_fn is None:
        raise ValueError("distill_sharded needs a teacher, a loss_fn, or both")
    if not len(batches):
        raise ValueError("distill_sharded got no batches")
    if steps < 0 or every < 0:
        raise ValueError(f"steps and every must be >= 0, got steps={steps}, every={every}")
    if every and not checkpoint_dir:
        raise ValueError(f"every={every} asks for checkpoints: give a checkpoint_dir too")


def _device_of(model: nn.Module) -> torch.device:
    """Where ``model``'s first parameter is (the CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _share(value: Any, rank: int, world: int, device: torch.device) -> Any:
    """Rank ``rank``'s slice of a batch (inputs or targets) on ``device``: rows
    ``rank*n/world`` to ``(rank+1)*n/world`` of every tensor whose dim 0 is the batch ``n``;
    other tensors whole, other values as they are. None stays None.

    Raises:
        ValueError: ``n`` is not a multiple of ``world``.
    """
    if value is None:
        return None
    inputs = Inputs.of(value)
    n = inputs.batch_size
    if n % world:
        raise ValueError(
            f"a batch of {n} examples does not split evenly over {world} ranks: give batches "
            f"whose size is a multiple of the number of processes ({world})"
        )
    size = n // world

    def part(x: Any, batched: bool) -> Any:
        if not isinstance(x, Tensor):
            return x
        return (x[rank * size : (rank + 1) * size] if batched else x).to(device)

    return inputs.map_leaves(part).value()


def _resume(
    store: ShardedCheckpoints | None,
    student: nn.Module,
    opt: torch.optim.Optimizer,
    num_batches: int,
    report: Callable[[str], None],
) -> tuple[int, Path | None]:
    """The step to start from and the checkpoint loaded (0 and None when there is none)."""
    found = store.load_newest(student, opt, report) if store is not None else None
    if found is None:
        return 0, None
    path, position = found
    if position.num_batches != num_batches:
        raise ValueError(
            f"checkpoint {path} was saved while training on {position.num_batches} batches, "
            f"not {num_batches}: resume with the same data, or start afresh in another "
            "checkpoint directory"
        )
    if dist.get_rank() == 0:
        report(f"resumed from {path} at step {position.step}")
    return position.step, path


def _mean_over_ranks(losses: list[Tensor]) -> list[float]:
    """Each step's loss averaged over the ranks (one reduction for all of them)."""
    if not losses:
        return []
    t = torch.stack(losses).double()
    dist.all_reduce(t)  # a sum: gloo has no average
    return (t / dist.get_world_size()).tolist()
