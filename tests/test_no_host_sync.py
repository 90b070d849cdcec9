"""No host read inside a collecting training step, as users run one: forward, backward and
``PruningOptimizer.step`` (or the Hugging Face ``Trainer`` with ``FisherPruningCallback``, two
ranks under DDP, or ``PruningTrainer``'s own loop) make no ``.item()`` / ``.tolist()`` /
``.cpu()`` / ``.numpy()`` / ``bool()`` / ``float()`` / ``int()`` call from fisherprune's code,
in any step, including the first and the one after a prune; only the prune decision itself
reads the signals (``tests.host_reads`` says how calls are told apart), and the trainer reads
its losses only every few steps on an accelerator."""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import fisherprune as fp
import fisherprune.train.phases as phases
import fisherprune.train.trainer as trainer_module
from fisherprune.distill import finetune, frozen_teacher
from fisherprune.integrations.hf import FisherPruningCallback
from fisherprune.masks.blocks import BlockGate
from fisherprune.train import PruningTrainer, TrainConfig
from tests import ddp_step_driver as driver
from tests.host_reads import HostReads, spied_tensor_reads
from tests.zoo import build_resnet_basic, image_input

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 120  # seconds, for the two spawned ranks


def _steps(
    popt: fp.PruningOptimizer, reads: HostReads, loss_of: Callable[[int], Tensor], steps: int
) -> tuple[list[list[str]], list[list[str]]]:
    """``steps`` training steps (forward inside ``loss_of``, then ``popt.minimize``), each
    watched; returns the reads of each step outside and inside the prune decision."""
    outside, pruning = [], []
    for i in range(steps):
        with reads.watching():
            popt.minimize(loss_of(i))
        outside.append(reads.step)
        pruning.append(reads.prune_time)
    return outside, pruning


def _assert_clean(popt: fp.PruningOptimizer, outside: list[list[str]], pruning: list[list[str]]):
    assert outside == [[]] * len(outside), outside
    assert popt.history, "nothing was pruned: the step after a prune was not checked"
    assert all(pruning[e.step - 1] for e in popt.history)  # the spy saw the prune's reads


def test_the_spy_sees_a_read_made_by_fisherprune() -> None:
    """The spy is live: ``MaskLayer.kept`` (which reads the mask back) is recorded, and a read
    made by the test itself is not."""
    m = fp.MaskLayer(4)
    with spied_tensor_reads() as reads, reads.watching():
        assert m.kept == 4
        float(torch.ones(()))
    assert len(reads.step) == 1 and reads.step[0].startswith("item at masks/layer.py")


def test_small_cnn_steps_read_nothing_back() -> None:
    """A residual CNN with batch norm, masked by ``apply_masks``: every step (the first, the
    ones that prune, the ones after a prune) is free of host reads outside the prune decision."""
    model = build_resnet_basic()
    x, y = image_input(8), torch.arange(8) % 5
    fp.apply_masks(model, x[:1])
    popt = fp.PruningOptimizer(model, x[:1], lr=0.01, momentum=0.9, prune_every=2, decay=0.5)
    with spied_tensor_reads() as reads:
        outside, pruning = _steps(popt, reads, lambda i: F.cross_entropy(model(x), y), 4)
    _assert_clean(popt, outside, pruning)


def _tiny_bert() -> tuple[torch.nn.Module, dict[str, Tensor]]:
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(0))
    return transformers.BertForSequenceClassification(config), {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
    }


@pytest.mark.parametrize("blocks", [False, True])
def test_bert_steps_read_nothing_back(blocks: bool) -> None:
    """A tiny Hugging Face BERT built from a config, every mask ``apply_masks`` finds (heads,
    MLP units, hidden width; with ``blocks``, its layers gated too), trained by
    ``PruningOptimizer``: no host read in any step (a block gate's forward read its entry
    back: a GPU synchronisation per block per step)."""
    model, inputs = _tiny_bert()
    labels = torch.tensor([0, 1, 2, 0])
    fp.apply_masks(model, inputs, blocks=blocks)
    assert blocks == any(isinstance(m, BlockGate) for m in fp.find_masks(model).values())
    popt = fp.PruningOptimizer(model, inputs, lr=0.01, prune_every=2, decay=0.5)

    def loss(i: int) -> Tensor:
        return model(**inputs, labels=labels).loss

    with spied_tensor_reads() as reads:
        outside, pruning = _steps(popt, reads, loss, 4)
    _assert_clean(popt, outside, pruning)


class _Watch(transformers.TrainerCallback):
    """Watches each Trainer step, from before its forward to after the pruner's fold."""

    def __init__(self, reads: HostReads) -> None:
        self.reads, self.outside, self.pruning = reads, [], []
        self.watching: Any = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.watching = self.reads.watching()
        self.watching.__enter__()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.watching.__exit__(None, None, None)
        self.outside.append(self.reads.step)
        self.pruning.append(self.reads.prune_time)


def test_trainer_callback_steps_read_nothing_back(tmp_path: Path) -> None:
    """The Hugging Face ``Trainer`` with ``FisherPruningCallback``: from the start of each step
    to the end of the callback's fold, fisherprune reads nothing back."""
    pytest.importorskip("accelerate")
    model, inputs = _tiny_bert()
    g = torch.Generator().manual_seed(2)
    data = [
        {"input_ids": torch.randint(0, 100, (8,), generator=g), "labels": i % 3} for i in range(32)
    ]
    prune = FisherPruningCallback(inputs, prune_every=2, decay=0.5)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    with spied_tensor_reads() as reads:
        watch = _Watch(reads)  # after the pruner: its step end closes the watch
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=data, callbacks=[prune, watch]
        )
        trainer.train()
    assert prune.pruner is not None and len(watch.outside) == 4
    _assert_clean(prune.pruner, watch.outside, watch.pruning)


@pytest.mark.parametrize("compiled", [False, True])
def test_trainer_steps_read_nothing_back_between_loss_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    """``PruningTrainer`` as it runs on a GPU (its losses kept on the device and read every 5
    steps): every step that does not read them (no prune, eval or checkpoint due) makes no host
    read at all, across the dense, pruning and fine-tuning phases (it read ``float(loss)`` in
    every step); with ``compiled``, the steps under ``torch.compile`` (``--compile``, here
    ``aot_eager``) as well."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 4, generator=g)
    rows = [",".join(f"{v:.5f}" for v in r) + f",{int(r[0] > 0)}" for r in x.tolist()]
    (tmp_path / "t.csv").write_text("a,b,c,d,label\n" + "\n".join(rows) + "\n")
    monkeypatch.setattr(trainer_module, "loss_read_every", lambda device: 5)
    original, watched = phases.train_step, []

    def watched_step(loop: phases.Loop) -> None:
        with reads.watching():
            original(loop)
        watched.append((loop.guard.unread > 0, reads.step, reads.prune_time))

    monkeypatch.setattr(phases, "train_step", watched_step)
    cfg = TrainConfig(
        data=str(tmp_path / "t.csv"), label="label", model="mlp", width=16, depth=2, steps=60,
        pruning_burn_in=10, pruning_iter=7, eval_every=25, fine_tune_steps=5,
        save_dir=str(tmp_path / "run"), export_formats=["state_dict"], progress="none",
        weight_decay=5e-4, compile=compiled, compile_backend="aot_eager",
    )  # fmt: skip
    with spied_tensor_reads() as reads:
        trainer = PruningTrainer(cfg)
        trainer.run()
    unread = [step for kept, step, _ in watched if kept]
    assert len(watched) == 60 and len(unread) >= 30
    assert unread == [[]] * len(unread), unread
    assert any(prune for _, _, prune in watched), "no prune: the pruning phase was not watched"


def test_distilled_finetune_reads_its_losses_once() -> None:
    """``finetune`` (the fine-tune after ``prune_to_target``) keeps its losses on the device:
    8 steps make one host read, at the end, not one per step; the losses are still returned."""
    model = build_resnet_basic()
    x, y = image_input(8), torch.arange(8) % 5
    fp.apply_masks(model, x[:1])
    teacher = frozen_teacher(model)
    finetune(model, teacher, [(x, y)], 1, loss_fn=F.cross_entropy)  # masks read once, cached
    with spied_tensor_reads() as reads, reads.watching():
        losses = finetune(model, teacher, [(x, y)], 8, loss_fn=F.cross_entropy)
    assert len(losses) == 8 and all(isinstance(v, float) for v in losses)
    assert len(reads.step) == 1 and reads.step[0].startswith("tolist at distill.py"), reads.step


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ddp_records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The records of ``tests.ddp_step_driver``'s two ranks."""
    out = tmp_path_factory.mktemp("ddp")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "tests.ddp_step_driver", str(_free_port()), str(out)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(driver.WORLD)]


def test_ddp_steps_read_nothing_back(ddp_records: list[dict[str, Any]]) -> None:
    """Two gloo ranks under DDP: the signal's all-reduce (sums and example counts) and every
    other part of each step read nothing back on either rank; the prunes do."""
    for rank in ddp_records:
        assert rank["steps"] == [[]] * driver.STEPS, rank["steps"]
        assert rank["prunes"] > 0 and any(rank["prune_time"])


def test_ddp_signal_is_the_signal_of_the_whole_batch(ddp_records: list[dict[str, Any]]) -> None:
    """With the counts summed on the device, the all-reduced signal (decay 0, shards of 6 and
    10 examples) equals one process's signal over the 16 examples together."""
    model = driver.build_net()
    masks = fp.apply_masks(model, torch.zeros(1, 1, 12, 12))
    shards = [driver.shard(r, 0) for r in range(driver.WORLD)]
    x, y = (torch.cat(t) for t in zip(*shards, strict=True))
    F.cross_entropy(model(x), y).backward()
    fp.update_pruning_signals(masks, decay=0.0)
    for rank in ddp_records:
        assert set(rank["signals"]) == set(masks)
        for name, m in masks.items():
            assert m.signal.abs().max() > 0
            torch.testing.assert_close(torch.tensor(rank["signals"][name]), m.signal)


def test_a_copied_block_gate_reads_its_own_kept_flags() -> None:
    """A deep copy's gate starts its mask's version again: the flags it reads are its own
    after a prune's write (``record_values``) and after a write it was not told of, never the
    original's cached ones."""
    gate = BlockGate("blocks", 4)
    for i in (0, 1):
        with torch.no_grad():
            gate.mask[i] = 0.0
        gate.record_values(False)
    twin = copy.deepcopy(gate)
    with torch.no_grad():
        twin.mask[2] = 0.0
    twin.record_values(False)
    assert twin.kept_blocks() == [False, False, False, True]
    other = copy.deepcopy(gate)
    with torch.no_grad():
        other.mask[3] = 0.0
    assert other.kept_blocks() == [False, False, True, False]
    assert gate.kept_blocks() == [False, False, True, True]


@pytest.mark.parametrize("placed", ["apply_masks", "by hand"])
def test_ddp_built_around_a_masked_model_broadcasts_its_buffers_but_not_the_masks(
    tmp_path: Path, placed: str
) -> None:
    """DDP copies rank 0's buffers into every rank's at each forward; the masks are left out
    of that (every rank prunes alike, and torch 2.11's copy bumped their versions, so each step
    read every mask back), the BatchNorms' statistics are not, and ``remove_masks`` gives the
    model back with no ignore list. Masks placed by hand are left out by the exclusion
    ``PruningTrainer`` makes before it builds its DDP."""
    import torch.distributed as dist

    from fisherprune.masks.ddp_sync import BroadcastExclusion

    model = build_resnet_basic()
    norms = {n for n, _ in model.named_buffers()}
    if placed == "apply_masks":
        fp.apply_masks(model, image_input(1))
    else:
        model = torch.nn.Sequential(model, fp.MaskLayer(5))
        norms = {f"0.{n}" for n in norms}
        BroadcastExclusion(model)
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        assert set(ddp.named_module_buffers) == norms
        if placed == "apply_masks":
            fp.remove_masks(model)
            assert not hasattr(model, "_ddp_params_and_buffers_to_ignore")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("packed", [False, True])
def test_lstm_steps_read_nothing_back(packed: bool) -> None:
    """A bidirectional two-layer LSTM tagger (``test_recurrent``), its input width and hidden
    units masked, padded or packed: the steps (collecting inside the recurrence, pruning, after
    a prune) make no host read outside the prune decision. (A packed sequence's step sizes
    live on the host: reading them waits for nothing.)"""
    from tests.test_recurrent import PackedTagger, Tagger

    torch.manual_seed(0)
    model = (PackedTagger if packed else Tagger)(torch.nn.LSTM, batch_first=True, bidir=True)
    x, y = torch.randint(0, 50, (4, 7)), torch.arange(4) % 4
    lengths = torch.tensor([5, 7, 3, 6])
    inputs = (x, lengths) if packed else x
    fp.apply_masks(model, (x[:2], lengths[:2]) if packed else x[:1])
    popt = fp.PruningOptimizer(model, inputs, lr=0.01, momentum=0.9, prune_every=2, decay=0.5)
    model.train()
    with spied_tensor_reads() as reads:
        outside, pruning = _steps(
            popt, reads, lambda i: F.cross_entropy(model(*inputs) if packed else model(x), y), 4
        )
    _assert_clean(popt, outside, pruning)
