"""``fisherprune prune --eval_text FILE``: a causal language model's perplexity on held-out
text, of the dense model and of the written (shrunk) one.

The file is read whole, as one stream of text (its line breaks kept, as the Hugging Face guide
and llama.cpp's ``perplexity`` read a test set such as WikiText's), tokenized with the folder's
tokenizer and its special tokens (a beginning-of-text token where the tokenizer adds one), and
cut into windows of the length the cost target is defined at (``--seq_len``; default
``--max_length``, capped at ``max_position_embeddings``) that start every half window: each
token but the first is predicted once, with at least half a window of context after the first
window (``calibrate.perplexity``). A forward pass holds at most as many tokens as a
calibration batch (``--batch_size`` x ``--max_length``), one window at least.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from fisherprune.calibrate.perplexity import Perplexity, perplexity, token_windows

__all__ = [
    "CAUSAL_HEADS",
    "HeldOutText",
    "add_perplexity_argument",
    "check_eval_text",
    "held_out_text",
    "perplexity_fields",
    "perplexity_text",
]

#: class-name endings of the heads that predict the next token
CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")  # LMHeadModel: GPT-2's


def add_perplexity_argument(p: argparse.ArgumentParser) -> None:
    """Add ``--eval_text`` to ``p``."""
    p.add_argument(
        "--eval_text",
        help="causal language model (Hugging Face folder): held-out text, read whole as one "
        "stream, on which the dense and the pruned model's perplexity are reported, in "
        "windows of --seq_len tokens every half window",
    )


def check_eval_text(path: str | None, hugging_face_folder: bool) -> None:
    """Refuse, before any work, an ``--eval_text`` that is not a file, holds no text, or
    comes with a model that is not a Hugging Face folder. Reads the file; changes nothing.

    Raises:
        ValueError: it names the file or the model.
    """
    if path is None:
        return
    if not hugging_face_folder:
        raise ValueError(
            "--eval_text measures a causal language model's perplexity: give a Hugging Face "
            "model folder (a ...ForCausalLM or GPT-2 LMHeadModel), not a built-in model"
        )
    if not Path(path).is_file():
        raise ValueError(f"--eval_text {path}: no such file")
    if not Path(path).read_text().strip():
        raise ValueError(f"--eval_text {path} holds no text")


@dataclass(frozen=True)
class HeldOutText:
    """The model inputs ``--eval_text`` was cut into, and how."""

    path: str
    batches: list[dict[str, Tensor]]
    window: int
    stride: int

    def measure(self, model: nn.Module) -> Perplexity:
        """``model``'s perplexity on these windows; changes nothing."""
        return perplexity(model, self.batches)


def held_out_text(
    path: str, tokenizer: Any, model_class: type, window: int, tokens_per_pass: int
) -> HeldOutText:
    """``path`` tokenized whole by ``tokenizer`` and cut into windows of ``window`` tokens
    every half window (module docstring), at most ``tokens_per_pass`` tokens a batch (one
    window at least), for a model of ``model_class``. Reads the file; changes nothing.

    Raises:
        ValueError: ``model_class`` is no causal language model, or the text has fewer than
            2 tokens (nothing to predict).
    """
    if not model_class.__name__.endswith(CAUSAL_HEADS):
        raise ValueError(
            f"--eval_text measures a causal language model's perplexity; the folder is read "
            f"as {model_class.__name__}, which predicts no next token (a folder saved as a "
            f"class ending in {' or '.join(CAUSAL_HEADS)} is)"
        )
    ids = tokenizer(Path(path).read_text(), add_special_tokens=True, verbose=False)["input_ids"]
    if len(ids) < 2:
        raise ValueError(
            f"--eval_text {path} gives {len(ids)} token(s): perplexity needs at least 2"
        )
    if window < 2:
        raise ValueError(f"--eval_text needs windows of at least 2 tokens, --seq_len is {window}")
    stride = window // 2
    batches = token_windows(ids, window, stride, max(1, tokens_per_pass // window))
    return HeldOutText(path, batches, window, stride)


def perplexity_fields(text: HeldOutText, dense: Perplexity, pruned: Perplexity) -> dict[str, Any]:
    """The report's ``perplexity`` entry: dense and pruned perplexity, the tokens predicted,
    the file and the windows."""
    return {
        "perplexity": {
            "dense": dense.value,
            "pruned": pruned.value,
            "tokens": pruned.tokens,
            "eval_text": text.path,
            "window": text.window,
            "stride": text.stride,
        }
    }


def perplexity_text(dense: Perplexity, pruned: Perplexity) -> str:
    """``; perplexity 31.20 -> 35.84 on 1,234 tokens`` for the printed summary line."""
    return f"; perplexity {dense.value:.2f} -> {pruned.value:.2f} on {pruned.tokens:,} tokens"
