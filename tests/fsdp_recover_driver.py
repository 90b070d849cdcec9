"""One rank of a sharded distillation run (``fisherprune.recover.distill_sharded``) for
``tests/test_fsdp_recover.py``, started by torchrun on two gloo ranks:

    torchrun --nproc_per_node=2 -m tests.fsdp_recover_driver ROOT KILL_AT RUN [RUN...]

For each RUN folder in turn (one launch serves several runs: starting the processes is what
takes time), it distils ``ROOT/teacher`` (the dense Llama) into a fresh copy of
``ROOT/student`` (the shrunk one) for ``STEPS`` steps on ``batches()``, checkpointing into
``RUN/checkpoints`` every ``EVERY`` steps (resuming from there when it holds one); then rank
0 writes the gathered weights and the losses (``RUN/final.pt``) and
``save_pretrained_gathered`` writes ``RUN/hf``. In a RUN named ``from_rank0`` only rank 0
reads the folders; rank 1 builds both models on the meta device and receives from rank 0
its shards of the student and the whole teacher (replicated, not sharded); rank 1 writes
``RUN/meta_rank1.pt``, how many elements it held before training (none). With KILL_AT > 0,
every rank sends itself SIGKILL once that step (and any checkpoint of it) is done: kill -9
mid-run.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from fisherprune.recover import distill_sharded, full_state_dict, save_pretrained_gathered
from fisherprune.train.interrupts import init_distributed
from tests.ddp_step_driver import leave_group

STEPS = 6
EVERY = 2
LR = 1e-2
VOCAB = 64


def batches() -> list[dict[str, torch.Tensor]]:
    """Three batches of 4 token sequences of 8, the same in every process."""
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(0, VOCAB, (4, 8), generator=g)} for _ in range(3)]


def load(folder: Path, on_meta: bool = False) -> torch.nn.Module:
    """The Llama in ``folder``; with ``on_meta``, built from its configuration on the meta
    device (no weights read, no memory for them)."""
    if not on_meta:
        return transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager")
    config = transformers.AutoConfig.from_pretrained(folder, attn_implementation="eager")
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def distil(root: Path, run: Path, kill_at: int) -> None:
    """One sharded run into ``run`` (see the module docstring)."""

    def on_step(done: int) -> None:
        if done == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    on_meta = run.name == "from_rank0" and dist.get_rank() != 0
    student, teacher = load(root / "student", on_meta), load(root / "teacher", on_meta)
    if on_meta:
        run.mkdir(parents=True, exist_ok=True)
        held = sum(t.numel() for m in (student, teacher) for t in m.state_dict().values()
                   if not t.is_meta)  # fmt: skip
        torch.save(held, run / "meta_rank1.pt")
    result = distill_sharded(
        student, teacher, batches(), steps=STEPS, lr=LR,
        checkpoint_dir=run / "checkpoints", every=EVERY, on_step=on_step,
        shard_teacher=run.name != "from_rank0",
    )  # fmt: skip
    state = full_state_dict(student)
    if dist.get_rank() == 0:
        saved = {"state": state, "losses": result.losses, "start": result.start_step}
        torch.save(saved, run / "final.pt")
    save_pretrained_gathered(student, run / "hf")


def main(root: Path, kill_at: int, runs: list[Path]) -> None:
    torch.set_num_threads(1)
    init_distributed(60.0)
    for run in runs:
        distil(root, run, kill_at)
    leave_group(dist.get_rank(), runs[-1])


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), [Path(a) for a in sys.argv[3:]])
