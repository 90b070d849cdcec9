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


def _gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2Model(cfg)


def _ids(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 100, (n, 12), generator=g)}


def _pixels(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(n, 3, 16, 16, generator=g)}


#: model, its inputs, the suffixes of the modules whose output is added to the residual stream
CASES = {
    "bert": (_bert, _ids, ("attention.output.dense", "output.dense")),
    "gpt2": (_gpt2, _ids, ("attn.c_proj", "mlp.c_proj")),  # Conv1D: a transposed Linear
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
    assert not any("no least-squares repair" in why for why in report.skipped.values())
    fitted = set(report.layers) | set(report.skipped)
    projections = {n for n in fitted if n.endswith(suffixes)}
    assert set(report.residual) == projections
    x = inputs(4, g)
    with torch.no_grad():
        masked = model(**x)[0]
        small = fp.shrink(model, x)
        torch.testing.assert_close(small(**x)[0], masked, rtol=1e-4, atol=1e-5)


def _mlp_with_conv1d(conv1d: bool) -> torch.nn.Module:
    """6 -> 10 -> 8 -> 3 with ReLUs; the last two layers are GPT-2's ``Conv1D`` (weight stored
    (in, out)) or ``nn.Linear`` holding the same weights."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 10), torch.nn.Linear(10, 8), torch.nn.Linear(8, 3)]
    if conv1d:
        for i in (1, 2):
            c = transformers.pytorch_utils.Conv1D(layers[i].out_features, layers[i].in_features)
            with torch.no_grad():
                c.weight.copy_(layers[i].weight.T)
                c.bias.copy_(layers[i].bias)
            layers[i] = c
    return torch.nn.Sequential(
        layers[0], torch.nn.ReLU(), layers[1], torch.nn.ReLU(), layers[2]
    ).double()


def test_conv1d_refit_equals_the_refit_of_the_same_linear() -> None:
    """GPT-2's Conv1D is repaired as the nn.Linear holding its weights transposed is (whose
    refit test_repair checks against numpy's least squares): the same layers refitted to the
    same weights, and the same outputs kept."""
    from fisherprune.calibrate import repair_consumers

    x = torch.randn(200, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    nets, reports = [], []
    for conv1d in (False, True):
        net = _mlp_with_conv1d(conv1d)
        masks = fp.apply_masks(net, x[:1])
        dense = {n: m.mask.clone() for n, m in masks.items()}
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for m in masks.values():
                m.mask[torch.randperm(m.num_channels, generator=g)[: m.num_channels // 3]] = 0.0
        batches = [(x[i : i + 50], None) for i in range(0, 200, 50)]
        reports.append(repair_consumers(net, batches, dense, ridge=0.0, rows_per_weight=0,
                                        sequential=False, holdout=0.0))  # fmt: skip
        nets.append(net)
    linear, conv = nets
    assert set(reports[0].layers) == set(reports[1].layers) == {"2", "4"}
    for name in ("2", "4"):
        a, b = linear.get_submodule(name), conv.get_submodule(name)
        torch.testing.assert_close(b.weight.T, a.weight, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(b.bias, a.bias, rtol=1e-9, atol=1e-12)
