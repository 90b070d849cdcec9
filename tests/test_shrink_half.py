"""A model held in bf16 / fp16 is shrunk and checked like a float32 one: the check compares
float32 copies of the masked and the shrunk model (slicing changes no weight's value, so they
agree to float32 rounding at any depth), and the shrunk model keeps the model's dtype."""

from __future__ import annotations

import copy

import pytest
import torch

import fisherprune as fp
from fisherprune.export import widen
from fisherprune.export.shrink import _comparable_outputs
from fisherprune.export.widen import float32_outputs
from fisherprune.inputs import eval_outputs

transformers = pytest.importorskip("transformers")


def _llama(dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    return model, {"input_ids": torch.randint(0, 128, (2, 12), generator=torch.Generator())}


def test_half_precision_outputs_are_compared_through_float32_copies() -> None:
    """For a bf16 model the compared outputs are a float32 copy's on float32 inputs, and the
    model itself is left in bf16."""
    model, ids = _llama(torch.bfloat16)
    got = _comparable_outputs(model, ids)
    want = eval_outputs(copy.deepcopy(model).float(), ids)
    assert all(g.dtype == torch.float32 for g in got)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert next(model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_llama_keeps_its_hidden_width_prunable_and_shrinks_exactly(
    dtype: torch.dtype,
) -> None:
    """A Llama-shaped LM in half precision: every group is masked (the hidden width is not
    refused for rounding), the shrunk model stays in its dtype, and its float32 copy gives the
    masked model's float32 logits to float32 rounding."""
    model, ids = _llama(dtype)
    masks = fp.apply_masks(model, ids)
    assert not [s for s in masks.skipped if not s.expected]
    assert any(g.norms for g in masks.groups.values())  # the hidden width is among them
    with torch.no_grad():
        for m in masks.values():
            m.mask[: max(1, m.num_channels // 4)] = 0.0
    small = fp.shrink(model, ids)
    assert {p.dtype for p in small.parameters()} == {dtype}
    want = _comparable_outputs(model, ids)
    got = _comparable_outputs(small, ids)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_float32_outputs_read_half_weights_one_call_at_a_time() -> None:
    """While the float32 outputs are computed, the model's own tensors stay bf16 (each call
    gets a float32 copy of the weights it is handed, so the weights are never held in float32
    whole), and the outputs are bitwise those of the model widened in place."""
    model, ids = _llama(torch.bfloat16)
    seen: set[torch.dtype] = set()

    def spy(module: torch.nn.Module, args: object) -> None:
        with torch._C.DisableTorchFunction():  # the dtypes as held, not as calls read them
            seen.update(p.dtype for p in model.parameters())

    handles = [m.register_forward_pre_hook(spy) for m in model.modules()]
    got = float32_outputs(model, ids)
    for h in handles:
        h.remove()
    assert seen == {torch.bfloat16}
    assert all(torch.equal(g, w) for g, w in zip(got, _widened_in_place(model, ids), strict=True))


def test_float32_outputs_widen_the_model_whole_where_calls_cannot_be_widened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A forward that fails when run call by call is run again on the model widened in place:
    the same float32 outputs, and the model is left in bf16 with its values."""
    model, ids = _llama(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a weight reached around the torch calls")

    monkeypatch.setattr(widen._ReadWidened, "__torch_function__", refuse)
    got = float32_outputs(model, ids)
    assert all(torch.equal(g, w) for g, w in zip(got, _widened_in_place(model, ids), strict=True))
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


def _widened_in_place(model: torch.nn.Module, ids: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The reference: the outputs of a float32 copy of ``model``."""
    return eval_outputs(copy.deepcopy(model).float(), ids)
