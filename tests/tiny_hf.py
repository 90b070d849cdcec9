"""Tiny Hugging Face models built from their configs, as a user brings them (no download),
and token inputs for them: shared by tests that need a model written by others."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

#: the widths every tiny text model here has
SIZE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 40,
}


def bert(head: str = "BertModel", **config: Any) -> nn.Module:
    """A 2-layer BERT (``transformers.<head>``), vocabulary 100, seeded; ``config`` overrides
    or adds config fields (``hidden_dropout_prob=0.0``, ``num_labels=3``, ...)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, **{**SIZE, **config})
    return getattr(transformers, head)(cfg)


def token_inputs(batch: int = 2, length: int = 12, device: str = "cpu") -> dict[str, Tensor]:
    """Token ids in [3, 100) and an all-ones attention mask, the same on every call."""
    ids = torch.randint(3, 100, (batch, length), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
