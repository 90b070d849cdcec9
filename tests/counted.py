"""What the architecture tests compare against: a model's first output, FlopCounterMode's count
per example (with the grouped matrix product counted as torch's own formula does), and the
shrunk model against the masked one after a random prune; the tiny Hugging Face
mixture-of-experts decoders the MoE tests share; and the benchmark scripts' import."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import fisherprune as fp
from fisherprune.cost.formulas import SAME_AS_TORCH

ATOL = 1e-9  # float64 output difference, relative to max(1, max |expected|)
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def benchmark_module(name: str) -> ModuleType:
    """A benchmark script, imported as the scripts import each other (siblings on sys.path)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def call(model: nn.Module, inputs: object) -> Tensor:
    """``model`` on ``inputs`` (a tensor, or a dict of keyword inputs); its first output."""
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return out if isinstance(out, Tensor) else out[0]


def batch_of(inputs: object) -> int:
    """The batch size of ``inputs``: dim 0 of the tensor, or of the dict's first value."""
    t = next(iter(inputs.values())) if isinstance(inputs, dict) else inputs
    return int(t.shape[0])


def flops_per_example(model: nn.Module, inputs: object) -> float:
    """FlopCounterMode's count on ``model`` (autograd on), per example."""
    with FlopCounterMode(display=False, custom_mapping=dict(SAME_AS_TORCH)) as counter:
        call(model, inputs)
    return counter.get_total_flops() / batch_of(inputs)


def prune_at_random(masks: fp.AppliedMasks, seed: int) -> None:
    """Zero 30-50% (at least one, at most all but one) of every mask's entries."""
    gen = torch.Generator().manual_seed(seed)
    for m in masks.values():
        n = m.num_channels
        k = min(n - 1, max(1, round((0.3 + 0.2 * float(torch.rand(1, generator=gen))) * n)))
        m.mask[torch.randperm(n, generator=gen)[:k]] = 0.0


def assert_exact(model: nn.Module, masks: fp.AppliedMasks, check: object) -> nn.Module:
    """Prune at random; the shrunk model gives the masked model's output on ``check`` (another
    batch than the traced one) and FlopCounterMode on it equals computational_cost of the
    masked model. Returns the shrunk model."""
    prune_at_random(masks, 0)
    with torch.no_grad():
        expected = call(model, check)
        small = fp.shrink(model)
        actual = call(small, check)
    assert actual.shape == expected.shape
    scale = max(1.0, float(expected.abs().max()))
    assert float((actual - expected).abs().max()) <= ATOL * scale
    assert flops_per_example(small, check) == fp.computational_cost(model, check).total
    return small


#: tiny MoE decoder configs by model type: 2 layers, 4 experts, top 2
_MOE_COMMON = dict(
    hidden_size=32, vocab_size=99, max_position_embeddings=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, intermediate_size=24, num_experts_per_tok=2,
)  # fmt: skip
_MOE_EXTRA = {
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=16, head_dim=8),
    "mixtral": dict(num_local_experts=4, head_dim=8),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=20),
    "olmoe": dict(num_experts=4, eos_token_id=2),
    "deepseek_v3": dict(
        n_routed_experts=4, moe_intermediate_size=16, n_group=1, topk_group=1,
        first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8,
    ),
}  # fmt: skip


def hf_moe(kind: str, experts: str = "batched_mm") -> tuple[nn.Module, dict[str, Tensor]]:
    """A 2-layer Hugging Face MoE causal LM of model type ``kind`` (4 experts, top 2) built
    from a tiny config, eager attention, running its experts with ``experts`` (``grouped_mm``
    in float32, ``batched_mm`` or ``eager`` in float64), and its inputs: 2 sequences of 8."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(kind, **_MOE_COMMON, **_MOE_EXTRA[kind])
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = experts
    dtype = torch.float32 if experts == "grouped_mm" else torch.float64
    ids = torch.randint(3, 99, (2, 8), generator=torch.Generator().manual_seed(0))
    return model.to(dtype).eval(), {"input_ids": ids}
