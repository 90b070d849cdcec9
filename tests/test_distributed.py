"""Pruning under torch.distributed (gloo, 2 processes on 127.0.0.1): every rank prunes the same
channels, and only rank 0 writes files.

Both runs are subprocesses with bounded waits: ``torchrun`` of the real ``fisherprune train``
(through a small driver that records each rank's masks after every step), and a
``torch.multiprocessing.spawn`` driver using the library (``apply_masks``, DDP,
``PruningOptimizer``) that all-gathers every mask after every step.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.launch import free_port, subprocess_env

TIMEOUT = 120  # seconds

# Run by torchrun on every rank: chdir into rank<r>/ so that a relative --save_dir gives each
# rank its own directory (anything rank 1 writes shows up there), record the masks and signals
# after every optimizer step and the batch each rank trained on, then run `fisherprune train`.
TORCHRUN_DRIVER = """
import json
import os
import sys
from pathlib import Path

rank = int(os.environ["RANK"])
root = Path(sys.argv[1])
os.chdir(root / f"rank{rank}")

from fisherprune.pruner import PruningOptimizer
from fisherprune.train.trainer import PruningTrainer

masks, signals, batches, weights = [], [], [], []
_step, _batch = PruningOptimizer.step, PruningTrainer._batch


def step(self, closure=None):
    out = _step(self, closure)
    masks.append({n: m.mask.tolist() for n, m in self.masks.items()})
    signals.append({n: m.signal.tolist() for n, m in self.masks.items()})
    params = [p for g in self.param_groups for p in g["params"]]
    weights.append([p.detach().double().flatten().tolist() for p in params])
    return out


def batch(self, i):
    x, y = _batch(self, i)
    batches.append(float(x.double().sum()))
    return x, y


PruningOptimizer.step, PruningTrainer._batch = step, batch

from fisherprune.cli.main import main

code = main(sys.argv[2:])
record = {"masks": masks, "signals": signals, "batches": batches, "weights": weights}
(root / f"record{rank}.json").write_text(json.dumps(record))
sys.exit(code)
"""

# Library-level: DDP over a masked model, PruningOptimizer(prune_every=2), a different data
# shard per rank; after every step every mask and signal is all-gathered and compared.
# What every spawned driver below starts with: the imports, ``start`` (join the gloo group,
# mask ``net`` and wrap it in DDP under a PruningOptimizer) and ``spawn`` (two ranks, each
# called as ``worker(rank, 2, port, out, *extra command-line arguments)``).
_SPAWN_COMMON = """
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import fisherprune
from tests.ddp_step_driver import leave_group


def start(rank, world, port, net, find_unused=False, **pruning):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.manual_seed(0)
    model = net()
    example = torch.zeros(1, 8)
    fisherprune.apply_masks(model, example)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
    return ddp, fisherprune.PruningOptimizer(model, example, lr=0.05, **pruning)


def spawn(worker):
    mp.spawn(worker, args=(2, int(sys.argv[1]), sys.argv[2], *sys.argv[3:]), nprocs=2, join=True)
"""


def _run_spawned(tmp_path: Path, driver_text: str, *args: str) -> tuple[dict, dict]:
    """Run a driver (``_SPAWN_COMMON`` and ``driver_text``) on two spawned ranks with
    ``args``; the records rank 0 and rank 1 wrote."""
    driver = tmp_path / "spawn_driver.py"
    driver.write_text(textwrap.dedent(_SPAWN_COMMON) + textwrap.dedent(driver_text))
    done = subprocess.run(
        [sys.executable, str(driver), str(free_port()), str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=subprocess_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    return r0, r1


SPAWN_DRIVER = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 12)
        self.out = nn.Linear(12, 3)

    def forward(self, x):
        return self.out(F.relu(self.fc2(F.relu(self.fc1(x)))))


def worker(rank, world, port, out):
    ddp, popt = start(
        rank, world, port, Net, prune_every=2, burn_in=2, decay=0.5, flops_target=0.3
    )
    shard = torch.Generator().manual_seed(1000 + rank)  # this rank's own data
    w = torch.randn(8, 3, generator=torch.Generator().manual_seed(7))
    history, first_batch = [], None
    for step in range(24):
        x = torch.randn(32, 8, generator=shard)
        if first_batch is None:
            first_batch = float(x.sum())
        loss = F.cross_entropy(ddp(x), (x @ w).argmax(1))
        popt.minimize(loss)
        state = {}
        for name, m in popt.masks.items():
            for kind, t in (("mask", m.mask), ("signal", m.signal)):
                got = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(got, t.detach().contiguous())
                if not all(torch.equal(g, got[0]) for g in got):
                    raise AssertionError(f"step {step}: {name} {kind} differs across ranks: {got}")
            state[name] = m.mask.tolist()
        history.append(state)
    record = {"masks": history, "first_batch": first_batch, "prunes": len(popt.history)}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))
    leave_group(rank, Path(out))


if __name__ == "__main__":
    spawn(worker)
"""


def _write_table(path: Path, n: int = 200) -> Path:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 4))
    y = (x[:, 0] > 0).astype(int) + (x[:, 1] > 0).astype(int)
    rows = [",".join(f"{v:.6f}" for v in r) + f",{t}" for r, t in zip(x, y, strict=True)]
    path.write_text("a,b,c,d,label\n" + "\n".join(rows) + "\n")
    return path


def _files(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


# =================================================================== torchrun of the trainer
@dataclass
class TorchrunRun:
    root: Path
    done: subprocess.CompletedProcess
    records: list[dict[str, Any]]


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory: pytest.TempPathFactory) -> TorchrunRun:
    """`torchrun --nproc_per_node=2` of `fisherprune train` on a 200-row CSV, each rank in its
    own working directory with the relative --save_dir `out`."""
    return _torchrun(tmp_path_factory.mktemp("torchrun"))


def _torchrun(root: Path, *extra: str) -> TorchrunRun:
    """`torchrun --nproc_per_node=2` of the driver and `fisherprune train ... *extra` in
    ``root``, and what each rank recorded."""
    for r in (0, 1):
        (root / f"rank{r}").mkdir()
    data = _write_table(root / "t.csv")
    driver = root / "driver.py"
    driver.write_text(textwrap.dedent(TORCHRUN_DRIVER))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(driver), str(root),
        "train", "--data", str(data), "--model", "mlp", "--width", "8", "--depth", "1",
        "--train.steps", "30", "--pruning.burn_in", "5", "--pruning_iter", "2",
        "--eval_every", "10", "--fine_tune_steps", "5", "--checkpoint_every", "10",
        "--export_formats", "state_dict", "--threads", "1", "--progress", "plain",
        "--save_dir", "out", *extra,
    ]  # fmt: skip
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=TIMEOUT, env=subprocess_env(), cwd=root
    )
    records = []
    for r in (0, 1):
        path = root / f"record{r}.json"
        records.append(json.loads(path.read_text()) if path.exists() else {})
    return TorchrunRun(root, done, records)


def test_torchrun_exits_0_and_only_rank_0_writes(torchrun: TorchrunRun) -> None:
    """Two processes under torchrun finish with exit code 0; rank 0 writes the checkpoints,
    metrics, report and export, and rank 1 writes nothing at all."""
    t = torchrun
    assert t.done.returncode == 0, t.done.stderr[-3000:]
    written = {str(p) for p in _files(t.root / "rank0")}
    for rel in ("result.json", "metrics.jsonl", "report.md", "export/model.pt", "export/plan.json"):
        assert f"out/{rel}" in written, sorted(written)
    assert any(p.startswith("out/checkpoints/ckpt-") for p in written)
    assert list((t.root / "rank1").iterdir()) == []


def test_torchrun_ranks_hold_the_same_masks_after_every_step(torchrun: TorchrunRun) -> None:
    """Under torchrun each rank trains on its own share of every batch, yet after every
    optimizer step (so after every prune) both ranks hold identical masks and signals."""
    r0, r1 = torchrun.records
    assert r0 and r1, torchrun.done.stderr[-3000:]
    assert r0["batches"] != r1["batches"]  # different data on each rank
    assert len(r0["masks"]) == len(r1["masks"]) > 0
    kept = [sum(sum(m) for m in s.values()) for s in r0["masks"]]
    assert kept[-1] < kept[0], "nothing was pruned"
    for step, (a, b) in enumerate(zip(r0["masks"], r1["masks"], strict=True), 1):
        assert a == b, f"masks differ across ranks after step {step}"
    assert r0["signals"] == r1["signals"]


def test_torchrun_ranks_fine_tune_the_shrunk_model_in_step(torchrun: TorchrunRun) -> None:
    """Once pruning finishes each rank shrinks its model and trains the smaller one under a
    DistributedDataParallel built again around it: on different shares of every batch, the
    ranks still hold the same weights after every step (the gradients are averaged)."""
    r0, r1 = torchrun.records
    assert r0 and r1, torchrun.done.stderr[-3000:]
    sizes = [sum(len(p) for p in step) for step in r0["weights"]]
    assert sizes[-1] < sizes[0], "the model was not shrunk"
    shrunk = sizes.index(sizes[-1])
    assert shrunk < len(sizes) - 1, "no step on the shrunk model"
    assert r0["weights"][shrunk:] == r1["weights"][shrunk:]


def test_torchrun_prints_the_summary_once(torchrun: TorchrunRun) -> None:
    """Only rank 0 prints: the end-of-run summary appears once in the combined output."""
    out = torchrun.done.stdout
    assert torchrun.done.returncode == 0, torchrun.done.stderr[-3000:]
    assert out.count("\npruned: accuracy") == 1, out
    assert out.count("world size 2") == 1, out


def test_torchrun_compiled_steps_prune_as_the_eager_run(
    torchrun: TorchrunRun, tmp_path: Path
) -> None:
    """With ``--compile`` (``aot_eager``: traced and partitioned, no kernels built) the
    steps of both ranks run compiled around DistributedDataParallel, before and after the
    shrink, and every rank holds after every step the masks the eager run held."""
    compiled = _torchrun(tmp_path, "--compile", "--compile_backend", "aot_eager")
    assert compiled.done.returncode == 0, compiled.done.stderr[-3000:]
    eager = torchrun.records[0]["masks"]
    assert eager and [r["masks"] for r in compiled.records] == [eager, eager]


# ============================================================ library under mp.spawn and DDP
def test_spawned_ddp_ranks_prune_identically_on_different_shards(tmp_path: Path) -> None:
    """Two spawned processes (gloo, DDP, PruningOptimizer with prune_every=2) fed different data
    hold the same masks and signals after every step, and do prune."""
    r0, r1 = _run_spawned(tmp_path, SPAWN_DRIVER)
    assert r0["first_batch"] != r1["first_batch"]
    assert r0["prunes"] == r1["prunes"] > 1
    assert r0["masks"] == r1["masks"]


# A branch only rank 0's loss reads: its mask is reached on rank 0 alone, every step.
SPAWN_BRANCH_DRIVER = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.out = nn.Linear(8, 16), nn.Linear(16, 3)
        self.side, self.side_out = nn.Linear(8, 12), nn.Linear(12, 3)

    def forward(self, x, side=True):
        main = self.out(F.relu(self.fc1(x)))
        return main + self.side_out(F.relu(self.side(x))) if side else main


def worker(rank, world, port, out):
    warnings.simplefilter("ignore")
    ddp, popt = start(
        rank, world, port, Net, True, prune_every=1, burn_in=0, decay=0.5, flops_target=0.1
    )
    shard = torch.Generator().manual_seed(1000 + rank)
    w = torch.randn(8, 3, generator=torch.Generator().manual_seed(7))
    masks = []
    for _ in range(30):
        x = torch.randn(32, 8, generator=shard)
        popt.minimize(F.cross_entropy(ddp(x, side=rank == 0), (x @ w).argmax(1)))
        masks.append({n: m.mask.tolist() for n, m in popt.masks.items()})
    record = {"masks": masks, "unreached": sorted(popt._unreached)}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))
    leave_group(rank, Path(out))


if __name__ == "__main__":
    spawn(worker)
"""


def test_spawned_ddp_ranks_agree_on_a_mask_only_one_rank_reaches(tmp_path: Path) -> None:
    """A mask whose branch only rank 0's loss reads is reached on rank 0 alone: both ranks
    count it reached (its signal is all-reduced), so they prune the same channels at every
    step (each rank kept whole the masks it saw no gradient for, and the ranks diverged)."""
    r0, r1 = _run_spawned(tmp_path, SPAWN_BRANCH_DRIVER)
    assert r0["unreached"] == r1["unreached"] == []
    assert r0["masks"] == r1["masks"]
    side = [n for n in r0["masks"][-1] if "side" in n]
    assert side and any(0.0 in r0["masks"][-1][n] for n in side)


# On the first step no mask is reached on the silent ranks (their loss reads an unmasked
# path only): rank 1 alone ("one"), or both ("all").
SPAWN_SILENT_DRIVER = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.out, self.direct = nn.Linear(8, 16), nn.Linear(16, 3), nn.Linear(8, 3)

    def forward(self, x, masked=True):
        direct = self.direct(x)
        return direct + self.out(F.relu(self.fc1(x))) if masked else direct


def worker(rank, world, port, out, mode):
    warnings.simplefilter("ignore")
    ddp, popt = start(rank, world, port, Net, True, prune_every=1, burn_in=0, flops_target=0.5)
    shard = torch.Generator().manual_seed(1000 + rank)
    record = {"raised": None, "steps": 0}
    for step in range(6):
        x = torch.randn(16, 8, generator=shard)
        silent = step == 0 and (mode == "all" or rank == 1)
        loss = F.cross_entropy(ddp(x, masked=not silent), torch.zeros(16, dtype=torch.long))
        try:
            popt.minimize(loss)
        except ValueError as e:
            record["raised"] = str(e)
            break
        record["steps"] += 1
    record["masks"] = {n: m.mask.tolist() for n, m in popt.masks.items()}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))
    leave_group(rank, Path(out))


if __name__ == "__main__":
    spawn(worker)
"""


@pytest.mark.parametrize("mode", ["one", "all"])
def test_spawned_ddp_ranks_raise_together_or_not_at_all_on_a_first_step_unreached(
    mode: str, tmp_path: Path
) -> None:
    """A loss that reaches no mask raises on every rank, at the first prune decision, when it
    is so on every rank ("all"), and on none when another rank's loss reached one ("one": the
    silent rank warns and goes on with the others, who prune): a rank never raises alone
    (rank 1 raised at its first step and rank 0 waited for it at its next all-reduce until
    killed), and no step reads anything back to decide it."""
    r0, r1 = _run_spawned(tmp_path, SPAWN_SILENT_DRIVER, mode)
    if mode == "all":
        assert r0["steps"] == r1["steps"] == 0
        assert r0["raised"] == r1["raised"]
        assert "no gradient reached any of the 1 masks on any rank" in r0["raised"]
    else:
        assert r0["raised"] is None and r1["raised"] is None
        assert r0["steps"] == r1["steps"] == 6
        assert r0["masks"] == r1["masks"]
        assert any(0.0 in m for m in r0["masks"].values())
