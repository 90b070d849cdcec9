"""Two gloo ranks on 127.0.0.1 training a masked CNN under DDP with ``PruningOptimizer``, each
on its own shard (of different sizes), while ``tests.host_reads`` records fisherprune's host
reads in every step. Run as ``python -m tests.ddp_step_driver PORT OUT_DIR``; each rank writes
``rank<r>.json``: the reads of each step, the prunes, and the signals after the first step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn

import fisherprune as fp
from tests.host_reads import spied_tensor_reads

WORLD = 2
SHARDS = (6, 10)  # examples per rank: unequal, so that the counts must be summed, not assumed
STEPS = 4
CLASSES = 3


def build_net() -> nn.Module:
    """A small CNN, the same on every rank (and in the test's single-process reference)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 6, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 3 * 3, CLASSES),
    )


def shard(rank: int, step: int) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s batch at ``step``: its own examples and labels."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(SHARDS[rank], 1, 12, 12, generator=g)
    return x, torch.randint(0, CLASSES, (SHARDS[rank],), generator=g)


def worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    model = build_net()
    example = torch.zeros(1, 1, 12, 12)
    fp.apply_masks(model, example)
    ddp = nn.parallel.DistributedDataParallel(model)
    popt = fp.PruningOptimizer(
        model, example, lr=0.05, prune_every=2, burn_in=0, decay=0.0, flops_target=0.3
    )
    record: dict = {"steps": [], "prune_time": []}
    with spied_tensor_reads() as reads:
        for step in range(STEPS):
            x, y = shard(rank, step)
            with reads.watching():
                popt.minimize(F.cross_entropy(ddp(x), y))
            record["steps"].append(reads.step)
            record["prune_time"].append(reads.prune_time)
            if step == 0:
                record["signals"] = {n: m.signal.tolist() for n, m in popt.masks.items()}
    record["prunes"] = len(popt.history)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))
    leave_group(rank, Path(out))


def leave_group(rank: int, out: Path) -> None:
    """Tear the process group down with rank 0, which hosts the TCP store, last: every rank
    meets at a barrier, the others destroy the group and say so in a file under ``out``, then
    rank 0 destroys it (a rank still talking to the store while rank 0 tore it down aborted
    in gloo under load: "terminate called without an active exception"). Then the process
    ends at once, its output flushed, without running the interpreter's teardown: a rank
    whose work and files were all done still aborted there now and then (the same message,
    from a background thread's destructor at exit; seen in CI in test_fsdp_recover), which
    failed the run. Call it last."""
    dist.barrier()
    if rank != 0:
        dist.destroy_process_group()
        (out / f"left{rank}").touch()
        _exit_now()
    others = [out / f"left{r}" for r in range(1, dist.get_world_size())]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(p.exists() for p in others):
        time.sleep(0.02)
    dist.destroy_process_group()
    _exit_now()


def _exit_now() -> None:
    """End the process with status 0 after flushing its output, skipping interpreter teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]), sys.argv[2]), nprocs=WORLD, join=True)
