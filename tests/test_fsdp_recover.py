"""Recovery past one device: a Llama shrunk by fisherprune distilled from its dense self
under torchrun with FSDP2 (two gloo ranks on 127.0.0.1, ``tests/fsdp_recover_driver.py``),
and ``fisherprune distill`` run in this process (a process group of one).

Two launches serve every test: one run killed with SIGKILL after step 5 (checkpoints at
steps 2 and 4), then one launch running in turn the same run uninterrupted, the killed run
resumed, and a copy of the killed run's checkpoints with the newest damaged and a
half-written one beside it resumed. The reference is a plain loop in this process: AdamW on
``distill_loss`` over each whole batch, no process group.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import transformers
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.distill import distill_loss
from fisherprune.recover import distill_sharded, find_blocks
from tests import fsdp_recover_driver as driver
from tests.cli_run import run_cli
from tests.launch import ROOT, free_port, subprocess_env

TIMEOUT = 120  # seconds per launch
KILL_AT = 5


def _dense() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=driver.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="eager", initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _shrunk(dense: nn.Module) -> nn.Module:
    """``dense`` less half of every block's MLP units (the same ones in each block, so that
    the shrunk model is a standard Llama configuration), shrunk by fisherprune. (With wider
    weights than Llama's default and half the units gone, the student's distillation
    gradients stand well above float32 rounding, which AdamW's first steps would otherwise
    blow up to whole steps of size ``lr``.)"""
    inputs = driver.batches()[0]
    model = _dense()
    model.load_state_dict(dense.state_dict())
    masks = fp.apply_masks(model, inputs)
    mlp = [m for name, m in masks.items() if "mlp" in name]
    assert len(mlp) == 2
    with torch.no_grad():
        for m in mlp:
            m.mask[::2] = 0
    return fp.shrink(model, inputs)


def _torchrun(root: Path, kill_at: int, *runs: Path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        "-m", "tests.fsdp_recover_driver", str(root), str(kill_at), *map(str, runs),
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=subprocess_env(), cwd=ROOT,
    )  # fmt: skip


def _reference(
    root: Path, data: list[dict[str, Tensor]] | None = None, steps: int = driver.STEPS
) -> tuple[nn.Module, list[float]]:
    """The student trained in this process alone: AdamW (as ``distill_sharded`` makes it) on
    ``distill_loss`` over each whole batch, step ``i`` on ``data[i % len(data)]`` (default:
    the driver's batches)."""
    student, teacher = driver.load(root / "student"), driver.load(root / "teacher").eval()
    opt = torch.optim.AdamW(student.parameters(), lr=driver.LR, weight_decay=0.0)
    data, losses = data or driver.batches(), []
    student.train()
    for step in range(steps):
        batch = data[step % len(data)]
        with torch.no_grad():
            t_out = teacher(**batch)
        loss = distill_loss(student(**batch), t_out)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return student.eval(), losses


def _damage(checkpoints: Path) -> None:
    """Flip bytes in the middle of the newest checkpoint's largest DCP file (its size stays
    the same) and leave beside it what a writer that does not rename would: a ``step-*``
    folder with DCP's metadata and no manifest, and a temporary folder of a killed save."""
    newest = checkpoints / "step-00000004"
    target = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(255 - b for b in data[middle : middle + 8])
    target.write_bytes(bytes(data))
    half = checkpoints / "step-00000006"
    half.mkdir()
    shutil.copy(newest / ".metadata", half / ".metadata")
    killed_save = checkpoints / ".step-00000006.abcd1234.tmp"
    killed_save.mkdir()
    (killed_save / "__0_0.distcp").write_bytes(b"partial")


@dataclass
class Runs:
    root: Path
    killed_code: int
    killed_checkpoints: list[str]  # what the SIGKILLed run left
    output: str  # of the second launch
    reference: nn.Module
    reference_losses: list[float]
    initial: dict[str, Tensor]  # the student before training

    def final(self, run: str) -> dict:
        return torch.load(self.root / run / "final.pt", weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("fsdp")
    dense = _dense()
    dense.save_pretrained(root / "teacher")
    small = _shrunk(dense)
    assert small.config.intermediate_size == 32
    small.save_pretrained(root / "student")
    killed = _torchrun(root, KILL_AT, root / "killed")
    try:
        reference, losses = _reference(root)  # meanwhile
        killed_log = killed.communicate(timeout=TIMEOUT)[0]
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
    left = sorted(p.name for p in (root / "killed" / "checkpoints").iterdir())
    assert not (root / "killed" / "final.pt").exists(), killed_log[-3000:]
    shutil.copytree(root / "killed" / "checkpoints", root / "damaged" / "checkpoints")
    _damage(root / "damaged" / "checkpoints")
    resumed = _torchrun(
        root, 0, root / "straight", root / "killed", root / "damaged", root / "from_rank0"
    )
    try:
        output = resumed.communicate(timeout=3 * TIMEOUT)[0]
    finally:
        if resumed.poll() is None:
            resumed.kill()
            resumed.wait()
    assert resumed.returncode == 0, output[-3000:]
    initial = {k: v.clone() for k, v in driver.load(root / "student").state_dict().items()}
    return Runs(root, killed.returncode, left, output, reference, losses, initial)


@pytest.mark.torchrun
def test_sharded_training_equals_one_process_on_whole_batches(runs: Runs) -> None:
    """Two ranks, each on half of every batch with FSDP2-sharded student and teacher, end
    with the weights (and losses) of one process training on the whole batches."""
    got = runs.final("straight")
    expected = runs.reference.state_dict()
    assert got["state"].keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    moved = max((expected[k] - runs.initial[k]).abs().max().item() for k in expected)
    assert moved > 1e-3, "training changed nothing: the comparison would be vacuous"
    torch.testing.assert_close(got["losses"], runs.reference_losses, rtol=1e-4, atol=1e-6)


@pytest.mark.torchrun
def test_kill_9_then_resume_gives_the_uninterrupted_weights(runs: Runs) -> None:
    """A run SIGKILLed after step 5 (checkpoints at 2 and 4) resumes from step 4 and ends with
    exactly the weights of the uninterrupted run: optimizer state and data position resume."""
    assert runs.killed_code != 0
    assert runs.killed_checkpoints == ["step-00000002", "step-00000004"]
    resumed = runs.final("killed")
    assert resumed["start"] == 4
    assert f"resumed from {runs.root / 'killed' / 'checkpoints' / 'step-00000004'}" in runs.output
    straight = runs.final("straight")["state"]
    different = [k for k in straight if not torch.equal(resumed["state"][k], straight[k])]
    assert different == []


@pytest.mark.torchrun
def test_damaged_and_half_written_checkpoints_are_passed_over(runs: Runs) -> None:
    """A checkpoint folder without its manifest (half-written) and one whose file differs from
    its hash are each reported and set aside; the run resumes from the whole one before them
    and still ends with the uninterrupted run's weights."""
    folder = runs.root / "damaged" / "checkpoints"
    out = runs.output
    assert f"checkpoint {folder / 'step-00000006'} is damaged (its manifest.json" in out, out
    assert f"checkpoint {folder / 'step-00000004'} is damaged (" in out, out
    assert ".distcp differ from the hashes written with them" in out, out
    assert f"resumed from {folder / 'step-00000002'} at step 2" in out, out
    assert (folder / "step-00000004.damaged").is_dir()
    resumed = runs.final("damaged")
    assert resumed["start"] == 2
    straight = runs.final("straight")["state"]
    assert all(torch.equal(resumed["state"][k], v) for k, v in straight.items())


@pytest.mark.torchrun
def test_models_read_on_rank_0_only_train_to_the_same_weights(runs: Runs) -> None:
    """Rank 1 builds student and teacher on the meta device (it holds no element of either)
    and receives from rank 0 its shards of the student and the whole teacher (replicated):
    the run ends with the weights and losses of the run where both ranks read the folders."""
    assert torch.load(runs.root / "from_rank0" / "meta_rank1.pt", weights_only=True) == 0
    got, straight = runs.final("from_rank0"), runs.final("straight")
    assert got["state"].keys() == straight["state"].keys()
    for name, value in straight["state"].items():
        torch.testing.assert_close(got["state"][name], value, rtol=0, atol=0, msg=name)
    assert got["losses"] == straight["losses"]


@pytest.mark.torchrun
def test_gathered_folder_loads_with_from_pretrained_as_the_student(runs: Runs) -> None:
    """The folder ``save_pretrained_gathered`` wrote loads with plain ``from_pretrained`` (a
    LlamaForCausalLM of the shrunk width) and gives the trained student's logits."""
    back = transformers.LlamaForCausalLM.from_pretrained(
        runs.root / "straight" / "hf", attn_implementation="eager"
    ).eval()
    assert back.config.intermediate_size == 32
    batch = driver.batches()[1]
    untrained = driver.load(runs.root / "student").eval()
    with torch.no_grad():
        got, expected = back(**batch).logits, runs.reference(**batch).logits
        before = untrained(**batch).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(expected, before, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------- fisherprune distill, one process
def test_cli_distill_resumes_when_run_again_and_matches_one_process(tmp_path: Path) -> None:
    """``fisherprune distill`` without torchrun (a group of one process), run for 3 steps and
    then again with --steps 4, resumes from its step-3 checkpoint and writes a folder that
    from_pretrained loads with the logits of a plain loop of 4 steps on the text cut into
    windows of --seq_len tokens, --batch_size windows a step."""
    words = [f"w{i}" for i in range(40)]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(vocab))
    dense = _dense()
    dense.save_pretrained(tmp_path / "teacher")
    _shrunk(dense).save_pretrained(tmp_path / "student")
    tokenizer.save_pretrained(tmp_path / "student")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(np.random.default_rng(0).choice(words, size=60)))
    out = tmp_path / "out"
    args = ["distill", "--student", tmp_path / "student", "--teacher", tmp_path / "teacher",
            "--text", text, "--out", out, "--seq_len", 8, "--batch_size", 2,
            "--lr", driver.LR, "--every", 2]  # fmt: skip
    code, stdout, err = run_cli(*args, "--steps", 3)
    assert code == 0, err
    code, stdout, err = run_cli(*args, "--steps", 4)
    assert code == 0, err
    assert f"resumed from {tmp_path / 'out.ckpt' / 'step-00000003'} at step 3" in stdout
    ids = torch.tensor(tokenizer(text.read_text())["input_ids"])
    batches = [{"input_ids": w} for w in ids[: len(ids) // 16 * 16].reshape(-1, 2, 8)]
    assert len(batches) == 3  # 62 tokens: the 4th step goes round to the first batch
    expected, _ = _reference(tmp_path, batches, steps=4)
    back = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(
            back.eval()(**batches[1]).logits, expected(**batches[1]).logits, rtol=1e-4, atol=1e-4
        )
    assert transformers.AutoTokenizer.from_pretrained(out).vocab == tokenizer.vocab


# ------------------------------------------------------------------------ without processes
def test_blocks_found_by_chain_are_the_decoder_layers_found_by_class() -> None:
    """The blocks sharded one by one are the decoder layers, whether found as the chain of
    repeated blocks or named by class; a class the model lacks is refused by name."""
    model = _dense()
    inputs = driver.batches()[0]
    layers = list(model.model.layers)
    assert find_blocks(model, inputs) == layers
    decoder = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    assert find_blocks(model, inputs, (decoder,)) == layers
    with pytest.raises(ValueError, match="no module of LlamaForCausalLM is a Conv2d"):
        find_blocks(model, inputs, (nn.Conv2d,))


def test_distill_sharded_outside_torchrun_says_how_to_start() -> None:
    """Without a process group, distill_sharded stops before changing the model and says to
    start it under torchrun with a process group."""
    model = _dense()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="start it with torchrun"):
        distill_sharded(model, None, driver.batches(), steps=1, loss_fn=lambda out, _: out.loss)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_model_on_the_meta_device_on_rank_0_is_refused_by_name() -> None:
    """Rank 0 must hold the weights that the other ranks receive: a student built on the
    meta device there is refused before anything is sharded, saying what to do."""
    config = _dense().config
    with torch.device("meta"):
        student = transformers.LlamaForCausalLM(config)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="student is on the meta device on rank 0"):
            distill_sharded(student, _dense(), driver.batches(), steps=1)
    finally:
        dist.destroy_process_group()
    assert all(p.is_meta for p in student.parameters())
