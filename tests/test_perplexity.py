"""Perplexity of a causal language model (``calibrate.perplexity``) against a float64 loop over
tokens, the windows that cut a stream to the context, and ``fisherprune prune --eval_text``:
the report's dense and pruned perplexity are the function's on the dense and the reloaded
``hf/`` model; what cannot be measured is refused before any work."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fisherprune.calibrate import perplexity, token_windows
from fisherprune.calibrate.perplexity import IGNORE
from fisherprune.cli.prune_perplexity import held_out_text
from tests.test_cli import run_cli

transformers = pytest.importorskip("transformers")

V = 45  # the vocabulary of the tokenizer below


def _reference(model: nn.Module, sequences: list[list[int]]) -> tuple[float, int]:
    """Perplexity and tokens predicted, by a float64 loop: each sequence run alone (no
    padding), ``-log p(x_t | x_<t)`` summed over t >= 1 one token at a time."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for seq in sequences:
            logits = model(input_ids=torch.tensor([seq])).logits[0].double()  # (L, V)
            for t in range(1, len(seq)):
                nll -= float(torch.log_softmax(logits[t - 1], -1)[seq[t]])
                count += 1
    return math.exp(nll / count), count


def _right_padded(sequences: list[list[int]], pad: int) -> dict[str, Tensor]:
    """One batch of ``sequences`` padded on the right with the token ``pad``."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for r, s in enumerate(sequences):
        ids[r, : len(s)], mask[r, : len(s)] = torch.tensor(s), 1
    return {"input_ids": ids, "attention_mask": mask}


def _tiny_lm(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config).eval()
    config = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_perplexity_equals_a_float64_loop_over_each_sequence_alone(kind: str) -> None:
    """Two right-padded batches of sequences of unequal lengths (float64 model): the same
    perplexity and token count as the loop over each sequence alone, so padding is neither
    predicted nor read, the first token of each sequence is not predicted, and tokens are
    weighed alike across batches (not batch means averaged)."""
    model = _tiny_lm(kind).double()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 3, 14, 2, 6)]
    batches = [_right_padded(seqs[:2], pad=7), _right_padded(seqs[2:], pad=0)]
    got = perplexity(model, batches)
    want, count = _reference(model, seqs)
    assert got.tokens == count == sum(len(s) - 1 for s in seqs)
    assert got.value == pytest.approx(want, rel=1e-10)
    means = [perplexity(model, [b]).mean_nll for b in batches]
    assert math.exp(sum(means) / 2) != pytest.approx(want, rel=1e-3)  # not a mean of means
    assert model.training is False and not any(p.grad is not None for p in model.parameters())


class _Bigram(nn.Module):
    """Logits that depend only on the current token: the reference needs no context."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(V, V)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.table(input_ids)  # (B, L, V)


def _bigram_reference(model: _Bigram, stream: list[int]) -> float:
    table = model.table.weight.detach().double()
    nll = sum(-float(F.log_softmax(table[a], -1)[b]) for a, b in itertools.pairwise(stream))
    return math.exp(nll / (len(stream) - 1))


def test_left_and_right_padding_are_both_left_out() -> None:
    """With the labels left to the attention mask, a left-padded batch scores the same tokens
    as a right-padded one: a token after padding is not predicted from it."""
    torch.manual_seed(0)
    model = _Bigram()
    seqs = [[3, 5, 9, 2, 11], [8, 1], [4, 4, 6]]
    right = _right_padded(seqs, pad=12)
    left = {k: v.clone() for k, v in right.items()}
    for r, s in enumerate(seqs):
        width = left["input_ids"].shape[1]
        left["input_ids"][r] = torch.cat([torch.full((width - len(s),), 13), torch.tensor(s)])
        left["attention_mask"][r] = torch.arange(width) >= width - len(s)
    a, b = perplexity(model, [right]), perplexity(model, [left])
    assert a.tokens == b.tokens == 4 + 1 + 2
    assert a.value == pytest.approx(b.value, rel=1e-6)
    nll = sum(math.log(_bigram_reference(model, s)) * (len(s) - 1) for s in seqs)
    assert a.value == pytest.approx(math.exp(nll / 7), rel=1e-6)


def test_logits_uniform_over_the_vocabulary_give_a_perplexity_of_its_size() -> None:
    class Uniform(nn.Module):
        def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
            return torch.zeros(*input_ids.shape, V, dtype=torch.float64)

    batches = token_windows(list(range(30)), window=8, stride=5, batch_size=2)
    got = perplexity(Uniform(), batches)
    assert got.value == pytest.approx(V, rel=1e-12) and got.tokens == 29


@pytest.mark.parametrize(("n", "window", "stride"), [(23, 8, 3), (23, 8, 8), (5, 8, 4), (9, 2, 1)])
def test_windows_predict_every_token_but_the_first_once_with_context(
    n: int, window: int, stride: int
) -> None:
    """Over the windows, every token of the stream but the first is a label once (a bigram
    model's perplexity over them is the stream's, from a float64 loop); a window after the
    first leaves its first ``window - stride`` tokens as context; only the last is padded.
    With ``stride == window`` the windows are disjoint and each one's first token is lost."""
    torch.manual_seed(0)
    stream = torch.randint(0, V, (n,)).tolist()
    batches = token_windows(stream, window, stride, batch_size=2)
    rows = [(b["input_ids"][r], b["labels"][r], b["attention_mask"][r])
            for b in batches for r in range(b["input_ids"].shape[0])]  # fmt: skip
    assert all(b["input_ids"].shape[1] == window for b in batches)
    assert all(int(mask.sum()) == window for _, _, mask in rows[:-1])
    for k, (ids, labels, mask) in enumerate(rows):
        start = k * stride
        assert ids[mask.bool()].tolist() == stream[start : start + window]
        if k > 0 and stride < window:
            assert (labels[: window - stride] == IGNORE).all()
    model = _Bigram()
    got = perplexity(model, batches)
    lost = len(rows) - 1 if stride == window else 0
    assert got.tokens == n - 1 - lost
    if not lost:
        assert got.value == pytest.approx(_bigram_reference(model, stream), rel=1e-6)


def test_a_stream_within_the_window_is_one_sequence() -> None:
    """A float64 Llama on a stream shorter than the window: the loop's perplexity."""
    model = _tiny_lm("llama").double()
    stream = torch.randint(0, V, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    got = perplexity(model, token_windows(stream, window=32, stride=16, batch_size=4))
    assert got.value == pytest.approx(_reference(model, [stream])[0], rel=1e-10)


@pytest.mark.parametrize(
    ("ids", "window", "stride", "batch"),
    [([1, 2, 3], 1, 1, 1), ([1, 2, 3], 4, 0, 1), ([1, 2, 3], 4, 5, 1), ([1, 2], 4, 2, 0),
     ([1], 4, 2, 1)],
)  # fmt: skip
def test_windows_refuse_what_predicts_nothing(
    ids: list[int], window: int, stride: int, batch: int
) -> None:
    with pytest.raises(ValueError):
        token_windows(ids, window, stride, batch)


def test_a_text_of_one_token_is_refused() -> None:
    def one_token(text: str, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": [5]}

    with pytest.raises(ValueError, match="1 token"):
        held_out_text(__file__, one_token, transformers.LlamaForCausalLM, 16, 64)


def text_folder(tmp_path: Path, model: nn.Module) -> tuple[Path, Path, Path]:
    """``model`` saved with a word-piece tokenizer as a Hugging Face folder, 40 calibration
    sentences over its words, and a held-out text of 30 more."""
    words = [f"w{i}" for i in range(40)]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    folder = tmp_path / "model"
    transformers.BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(folder)
    model.save_pretrained(folder)
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(words, size=rng.integers(4, 12))) for _ in range(70)]
    text, held = tmp_path / "sentences.txt", tmp_path / "held_out.txt"
    text.write_text("\n".join(lines[:40]) + "\n")
    held.write_text("\n".join(lines[40:]) + "\n")
    return folder, text, held


def test_prune_reports_the_dense_and_the_written_models_perplexity(tmp_path: Path) -> None:
    """A Llama causal LM folder with --eval_text: report.json's dense and pruned perplexity
    are ``perplexity`` of the folder's model and of ``hf/`` reloaded by from_pretrained, on
    the held-out file tokenized whole, in windows of --seq_len every half window; the summary
    line gives both."""
    folder, text, held = text_folder(tmp_path, _tiny_lm("llama"))
    out = tmp_path / "out"
    cli = run_cli("prune", folder, "--text", text, "--eval_text", held, "--seq_len", 16,
                  "--target", "70%", "--uniform", "--out", out)  # fmt: skip
    assert cli.code == 0, cli.err
    got = json.loads((out / "report.json").read_text())["perplexity"]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok(held.read_text())["input_ids"]
    batches = token_windows(ids, window=16, stride=8, batch_size=3)
    dense = perplexity(transformers.LlamaForCausalLM.from_pretrained(folder), batches)
    pruned = perplexity(transformers.AutoModelForCausalLM.from_pretrained(out / "hf"), batches)
    assert got["tokens"] == dense.tokens == len(ids) - 1 > 16
    assert got["dense"] == pytest.approx(dense.value, rel=1e-6)
    assert got["pruned"] == pytest.approx(pruned.value, rel=1e-5)
    assert abs(got["pruned"] - got["dense"]) > 1e-3  # the pruned model is another model
    assert (got["window"], got["stride"], got["eval_text"]) == (16, 8, str(held))
    assert f"perplexity {got['dense']:.2f} -> {got['pruned']:.2f}" in cli.out


def _bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.BertModel(config)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "no such file"),
        ("empty", "holds no text"),
        ("not causal", "read as AutoModel, which predicts no next token"),
        ("built-in", "not a built-in model"),
    ],
)
def test_eval_text_that_cannot_be_measured_exits_2_writing_nothing(
    tmp_path: Path, case: str, message: str
) -> None:
    """A missing or blank --eval_text, a model that predicts no next token (a BERT encoder)
    or a built-in model: exit 2, one line, before any work, and no output folder."""
    folder, text, held = text_folder(
        tmp_path, _bert() if case == "not causal" else _tiny_lm("gpt2")
    )
    if case == "missing":
        held = tmp_path / "absent.txt"
    if case == "empty":
        held.write_text("\n \n")
    model = ["mlp", "--weights", text, "--data", text] if case == "built-in" else [folder]
    out = tmp_path / "out"
    cli = run_cli("prune", *model, "--text", text, "--eval_text", held, "--out", out)
    assert cli.code == 2, cli.err
    assert message in cli.err and len(cli.err.strip().splitlines()) == 1, cli.err
    assert not out.exists()
