"""The sequence length at which ``fisherprune prune`` defines a text model's cost target.

A transformer's cost per example grows with its input's length, and not evenly: the MLPs and
projections grow linearly, attention's score and value products quadratically, so the share of
the cost a head holds grows with the length and the same pruned model keeps a different share
of the FLOPs at 16 tokens than at 128. The target is therefore met at ``--seq_len`` tokens (by
default ``--max_length``, the length the model is served at), not at the padded length the
calibration batches happen to have; the report gives the cost at both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from fisherprune.cost import computational_cost

__all__ = ["LengthCost", "cost_at_length", "example_at_length", "resolve_seq_len"]


def resolve_seq_len(seq_len: int | None, max_length: int, config: Any) -> int:
    """The length the cost target is defined at: ``seq_len`` when given, else ``max_length``
    capped at the positions the model reads (``config.max_position_embeddings``, when it has
    one). Changes nothing.

    Raises:
        ValueError: ``seq_len`` below 1, or beyond the positions the model reads.
    """
    limit = getattr(config, "max_position_embeddings", None)
    limit = limit if isinstance(limit, int) else None
    if seq_len is None:
        return max_length if limit is None else min(max_length, limit)
    if seq_len < 1:
        raise ValueError(f"--seq_len must be an integer >= 1, got {seq_len}")
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"--seq_len {seq_len} is beyond what the model reads (its config has "
            f"max_position_embeddings={limit}): give at most {limit}"
        )
    return seq_len


def example_at_length(encoded: dict[str, Tensor], length: int) -> dict[str, Tensor]:
    """A one-sentence input of exactly ``length`` tokens, none of them padding: the tokens of
    the first sentence of ``encoded`` (a tokenizer's batch, ``(B, L)`` per key) repeated, or
    cut, to ``length``, with an attention mask of ones. For costing and tracing: what the
    tokens say does not matter, how many there are does. ``encoded`` is not changed."""
    mask = encoded["attention_mask"][0].bool()  # (L,)
    repeats = math.ceil(length / int(mask.sum()))
    out = {k: v[0][mask].repeat(repeats)[:length].unsqueeze(0) for k, v in encoded.items()}
    out["attention_mask"] = out["attention_mask"].new_ones(1, length)
    return out  # each (1, length)


@dataclass(frozen=True)
class LengthCost:
    """The cost per example of the dense and the pruned model at one input length."""

    tokens: int
    before: float
    after: float

    @property
    def ratio(self) -> float:
        """The pruned model's share of the dense model's cost."""
        return self.after / self.before


def cost_at_length(pruned: nn.Module, dense: nn.Module, example: dict[str, Tensor]) -> LengthCost:
    """The cost (FLOPs per example) of ``pruned`` (masked) and ``dense`` on ``example``, a
    tokenizer's input of one or more sentences of one padded length. Changes nothing."""
    return LengthCost(
        tokens=int(example["input_ids"].shape[1]),
        before=computational_cost(dense, example).total,
        after=computational_cost(pruned, example).total,
    )
