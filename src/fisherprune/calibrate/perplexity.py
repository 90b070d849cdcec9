"""Perplexity of a causal language model on held-out tokens, and the sliding windows that cut a
token stream longer than the model's context into model inputs.

Perplexity is ``exp(sum_t -log p(x_t | x_<t) / T)``: the exponential of the token-weighted mean
next-token cross-entropy (natural log) over the ``T`` predicted tokens of every batch together,
so that a long sequence weighs more than a short one. A token is predicted from the model's
logits one position earlier; the first token of each sequence has nothing before it and is not
predicted, and padding (attention mask 0) is neither predicted nor a token to predict from.

A stream longer than the context is read in windows of ``window`` tokens that start every
``stride`` tokens (the Hugging Face guide's "perplexity of fixed-length models"): each window
predicts only the tokens no earlier window predicted, with the ``window - stride`` tokens before
them as context, so every token of the stream but the first is predicted exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fisherprune.calibrate.label_free import output_tensor
from fisherprune.inputs import call_model
from fisherprune.modes import eval_mode

__all__ = ["IGNORE", "Perplexity", "perplexity", "token_windows"]

#: a ``labels`` value that is not predicted (Hugging Face's convention)
IGNORE = -100


@dataclass(frozen=True)
class Perplexity:
    """The summed negative log-likelihood (nats) of ``tokens`` predicted tokens."""

    nll: float
    tokens: int

    @property
    def mean_nll(self) -> float:
        """The mean next-token cross-entropy, nats per token."""
        return self.nll / self.tokens

    @property
    def value(self) -> float:
        """``exp(mean_nll)``; ``inf`` where that overflows a float."""
        try:
            return math.exp(self.mean_nll)
        except OverflowError:
            return math.inf


def perplexity(model: nn.Module, batches: Iterable[Mapping[str, Tensor]]) -> Perplexity:
    """The perplexity of the causal language model ``model`` on ``batches`` (module docstring).

    Each batch is the model's keyword inputs: ``input_ids`` ``(B, L)``, ``attention_mask``
    ``(B, L)`` (optional: all ones), and optionally ``labels`` ``(B, L)``, Hugging Face's
    convention: the token at a position where it is to be predicted, ``IGNORE`` where not
    (not given to the model). Without ``labels`` every token is predicted whose attention
    mask and whose predecessor's are 1, so padding on either side is left out. The model's
    output is its logits ``(B, L, V)`` (a tensor, or ``.logits``). The cross-entropy is taken
    in the logits' dtype, at least float32, and summed in float64; run in eval mode under
    ``torch.no_grad``, one batch at a time (memory: one batch's logits), on the device of the
    model's parameters.

    Changes nothing: every module of ``model`` gets its own training flag back.

    Raises:
        ValueError: no token is predicted in any batch.

    Example:
        >>> ppl = perplexity(lm, token_windows(ids, window=128, stride=64, batch_size=8))
        >>> ppl.value, ppl.tokens
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    nll = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    with eval_mode(model), torch.no_grad():
        for batch in batches:
            inputs = {k: v.to(device) for k, v in batch.items() if k != "labels"}
            ids = inputs["input_ids"]  # (B, L)
            attended = inputs.get("attention_mask", torch.ones_like(ids)).bool()  # (B, L)
            labels = batch["labels"].to(device) if "labels" in batch else ids
            scored = (labels[:, 1:] != IGNORE) & attended[:, 1:] & attended[:, :-1]  # (B, L-1)
            logits = output_tensor(call_model(model, inputs))[:, :-1][scored]  # (T, V)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            loss = F.cross_entropy(logits, labels[:, 1:][scored], reduction="sum")
            nll += loss.double()
            tokens += int(scored.sum())
    if tokens == 0:
        raise ValueError("no token to predict: every sequence is one token or padding")
    return Perplexity(float(nll), tokens)


def token_windows(
    ids: Sequence[int] | Tensor, window: int, stride: int, batch_size: int
) -> list[dict[str, Tensor]]:
    """Batches of ``window``-token windows over the token stream ``ids`` that start every
    ``stride`` tokens, for ``perplexity`` (module docstring): ``input_ids``,
    ``attention_mask`` and ``labels`` ``(b, window)`` each, at most ``batch_size`` windows a
    batch; ``labels`` keep only the tokens no earlier window predicts (``IGNORE`` elsewhere).
    The last window may be shorter: it is padded on the right (id 0, mask 0, ``IGNORE``).
    Changes nothing.

    Raises:
        ValueError: ``window`` below 2, ``stride`` not in ``1..window``, ``batch_size``
            below 1, or fewer than 2 tokens (nothing to predict).
    """
    if window < 2 or not 1 <= stride <= window or batch_size < 1:
        raise ValueError(
            f"windows need window >= 2, 1 <= stride <= window and batch_size >= 1, got "
            f"window={window}, stride={stride}, batch_size={batch_size}"
        )
    stream = torch.as_tensor(ids, dtype=torch.long).flatten()  # (N,)
    n = stream.numel()
    if n < 2:
        raise ValueError(f"{n} token{'s' if n != 1 else ''}: perplexity needs at least 2")
    rows: list[tuple[Tensor, Tensor]] = []  # (tokens, labels) per window
    done = 0  # tokens of the stream predicted by the windows so far (the first never is)
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        piece = stream[begin:end]
        labels = piece.clone()
        labels[: max(done - begin, 0)] = IGNORE  # predicted by an earlier window
        rows.append((piece, labels))
        done = end
        if end == n:
            break
    return [_padded(rows[i : i + batch_size], window) for i in range(0, len(rows), batch_size)]


def _padded(rows: list[tuple[Tensor, Tensor]], length: int) -> dict[str, Tensor]:
    """``rows`` of (tokens, labels) padded on the right to ``length``, as one batch."""
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for r, (piece, target) in enumerate(rows):
        ids[r, : piece.numel()] = piece
        mask[r, : piece.numel()] = 1
        labels[r, : piece.numel()] = target
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
