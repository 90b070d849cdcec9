"""The repair on Hugging Face models built from their configs: the output projections the
forward adds to the residual stream are the ones fitted to the dense sum, and the repaired
masked model still shrinks to the same outputs."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fisherprune as fp  # noqa: E402

_SMALL = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def _bert() -> torch.nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=32, max_position_embeddings=64, **_SMALL
    )
    return transformers.BertModel(cfg, add_pooling_layer=False)


def _llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, num_key_value_heads=2, max_position_embeddings=64, **_SMALL
    )
    return transformers.LlamaForCausalLM(cfg)


def _vit() -> torch.nn.Module:
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, **_SMALL)
    return transformers.ViTModel(cfg, add_pooling_layer=False)


def _ids(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 100, (n, 12), generator=g)}


def _pixels(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(n, 3, 16, 16, generator=g)}


#: model, its inputs, the suffixes of the modules whose output is added to the residual stream
CASES = {
    "bert": (_bert, _ids, ("attention.output.dense", "output.dense")),
    "llama": (_llama, _ids, ("self_attn.o_proj", "mlp.down_proj")),
    "vit": (_vit, _pixels, ("attention.o_proj", "mlp.fc2")),
}


@pytest.mark.filterwarnings("ignore:the model.s Hugging Face config still describes")
@pytest.mark.parametrize("name", sorted(CASES))
def test_residual_layers_are_the_output_projections_and_shrink_matches(name: str) -> None:
    build, inputs, suffixes = CASES[name]
    torch.manual_seed(0)
    model = build().eval()
    g = torch.Generator().manual_seed(1)
    batches = [(inputs(8, g), None) for _ in range(8)]
    example = {k: v[:1] for k, v in batches[0][0].items()}
    result = fp.prune_to_target(model, example, batches, 0.5, seed=0)
    report = result.repair
    assert report is not None and report.residual
    fitted = set(report.layers) | set(report.skipped)
    projections = {n for n in fitted if n.endswith(suffixes)}
    assert set(report.residual) == projections
    x = inputs(4, g)
    with torch.no_grad():
        masked = model(**x)[0]
        small = fp.shrink(model, x)
        torch.testing.assert_close(small(**x)[0], masked, rtol=1e-4, atol=1e-5)
