"""A width the model returns and also reads inside (the hidden width of a base model, a trunk's
features) is prunable: masked in the returned tensor too, so a removed channel reads 0 there,
and the shrunk model zero-fills it back to the full width. A width only the output reads (a
classifier's classes) stays whole. References: the masked model's own outputs in float64 (the
shrunk model must equal them, same shapes), ``FlopCounterMode`` on the shrunk model, and a
per-example float64 loop for the Fisher signal."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

import fisherprune as fp
from fisherprune.cost.formulas import SAME_AS_TORCH
from fisherprune.export.output_fill import output_fill

transformers = pytest.importorskip("transformers")

ATOL_F64 = 1e-10
B = 2
_G = torch.Generator().manual_seed(1)
IDS = torch.randint(3, 100, (B, 12), generator=_G)
TEXT = {"input_ids": IDS, "attention_mask": torch.ones_like(IDS)}
PIXELS = {"pixel_values": torch.randn(B, 3, 32, 32, generator=_G)}
_C = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}


def _bart() -> nn.Module:
    cfg = transformers.BartConfig(
        vocab_size=100,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_labels=3,
        max_position_embeddings=40,
        eos_token_id=2,
    )
    return transformers.BartForSequenceClassification(cfg)


_BART_IDS = torch.cat([IDS[:, :-1], torch.full((B, 1), 2)], 1)  # one end-of-sentence each

#: name -> (build, keyword inputs); every one returns its hidden width
MODELS: dict[str, tuple[Callable[[], nn.Module], dict[str, Tensor]]] = {
    "bert": (
        lambda: transformers.BertModel(
            transformers.BertConfig(vocab_size=100, max_position_embeddings=40, **_C)
        ),
        TEXT,
    ),
    "vit": (
        lambda: transformers.ViTModel(transformers.ViTConfig(image_size=32, patch_size=8, **_C)),
        PIXELS,
    ),
    "clip_vision": (
        lambda: transformers.CLIPVisionModelWithProjection(
            transformers.CLIPVisionConfig(image_size=32, patch_size=8, projection_dim=32, **_C)
        ),
        PIXELS,
    ),
    "bart_classifier": (_bart, {"input_ids": _BART_IDS}),
}
each_model = pytest.mark.parametrize("name", list(MODELS))


def _masked(name: str) -> tuple[nn.Module, dict[str, Tensor], fp.AppliedMasks]:
    build, x = MODELS[name]
    torch.manual_seed(0)
    model = build().double().eval()
    x = {k: v.double() if v.is_floating_point() else v for k, v in x.items()}
    return model, x, fp.apply_masks(model, x)


def _prune_30(masks: fp.AppliedMasks, seed: int = 0) -> None:
    """Zero a random 30% of every mask, as the held-out check does."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in masks.values():
            m.mask[torch.randperm(m.num_channels, generator=g)[: int(0.3 * m.num_channels)]] = 0


def _tensors(model: nn.Module, x: dict[str, Tensor]) -> list[Tensor]:
    with torch.no_grad():
        return [t for t in tree_flatten(model(**x))[0] if isinstance(t, Tensor)]


def _flops(model: nn.Module, x: dict[str, Tensor]) -> float:
    counter = FlopCounterMode(display=False, custom_mapping=dict(SAME_AS_TORCH))
    with counter, torch.no_grad():
        model(**x)
    return counter.get_total_flops() / B


def _width_group(masks: fp.AppliedMasks) -> str:
    """The group masked at a model output: the hidden width."""
    [name] = [
        n for n, g in masks.groups.items() if any(c.startswith("the output") for c in g.consumers)
    ]
    return name


@each_model
def test_shrunk_equals_masked_with_the_same_output_shapes(name: str) -> None:
    """30% of every group removed, the hidden width included: every tensor the shrunk model
    returns has the masked model's shape and values (float64)."""
    model, x, masks = _masked(name)
    _width_group(masks)
    _prune_30(masks)
    small = fp.shrink(model, x)
    want, got = _tensors(model, x), _tensors(small, x)
    assert [t.shape for t in got] == [t.shape for t in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL_F64)


@each_model
def test_cost_equals_flop_counter_on_the_shrunk_model(name: str) -> None:
    model, x, masks = _masked(name)
    _prune_30(masks, 1)
    cost = fp.computational_cost(model, x).total
    assert cost == pytest.approx(_flops(fp.shrink(model, x), x), rel=1e-12)


@each_model
def test_most_flops_are_prunable_and_removing_30_percent_saves_over_a_third(name: str) -> None:
    """The bar of issue 16 on base models: >= 85% of the FLOPs in prunable groups, >= 35%
    of them saved (FlopCounterMode, dense vs shrunk) by removing 30% of every group."""
    model, x, masks = _masked(name)
    dense = _flops(model, x)
    cm = fp.CostModel(model, x)
    assert 1 - cm.total(np.zeros(cm.graph.n_entries)) / cm.dense_total() >= 0.85
    _prune_30(masks, 2)
    assert 1 - _flops(fp.shrink(model, x), x) / dense >= 0.35


def test_removed_channels_read_zero_in_the_masked_output() -> None:
    """The masked BertModel returns exactly 0 in the removed hidden channels, as the shrunk
    model's zero-fill does, and not in the kept ones."""
    model, x, masks = _masked("bert")
    width = masks[_width_group(masks)]
    _prune_30(masks)
    gone = width.mask == 0
    with torch.no_grad():
        out = model(**x).last_hidden_state
    assert bool((out[..., gone] == 0).all())
    assert float(out[..., ~gone].abs().min()) > 0


def test_unpruned_output_masks_leave_the_output_bit_identical() -> None:
    """With nothing pruned the output's mask returns the model's own tensor: bit for bit."""
    build, x = MODELS["bert"]
    torch.manual_seed(0)
    model = build().eval()
    before = _tensors(model, x)
    fp.apply_masks(model, x)
    for a, b in zip(_tensors(model, x), before, strict=True):
        assert torch.equal(a, b)


def test_a_classifiers_classes_are_never_pruned() -> None:
    """Only the output reads a classifier's classes: they stay whole, for the reason that
    they reach the model output, while the hidden width that reaches it through the encoder's
    last state is a group."""
    masks = _masked("bart_classifier")[2]
    [classes] = [s for s in masks.skipped if ("classification_head.out_proj.weight", 0) in s.params]
    assert classes.reason == "reaches the model output" and classes.expected
    assert not any(
        ("classification_head.out_proj.weight", 0) in g.params for g in masks.groups.values()
    )
    assert "the output['encoder_last_hidden_state']" in masks.groups[_width_group(masks)].consumers


class Trunk(nn.Module):
    """A pre-norm residual MLP returning its features (the residual stream), as a trunk
    with its classifier removed does."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.ln = nn.Linear(6, 10), nn.LayerNorm(10)
        self.fc1, self.fc2 = nn.Linear(10, 14), nn.Linear(14, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        return h + self.fc2(torch.relu(self.fc1(self.ln(h))))


def _trunk() -> tuple[nn.Module, Tensor, fp.AppliedMasks]:
    torch.manual_seed(0)
    model = Trunk().double().eval()
    x = torch.randn(3, 6, dtype=torch.float64)
    masks = fp.apply_masks(model, x)
    with torch.no_grad():
        masks["fisherprune_masks.inp:out"].mask[[1, 4, 7]] = 0
    return model, x, masks


@pytest.mark.parametrize("how", ["torch.save", "deepcopy", "plan", "state_dict", "torchscript"])
def test_the_zero_fill_survives_saving_and_rebuilding(how: str, tmp_path) -> None:
    """The shrunk trunk's zero-filled output is the masked one's after torch.save of the
    module, a deep copy, ``PruningPlan`` JSON applied to a fresh model (twice: one fill),
    ``export_model``'s state_dict and TorchScript."""
    model, x, _ = _trunk()
    want = model(x).detach()
    if how == "torch.save":
        buf = io.BytesIO()
        torch.save(fp.shrink(model, x), buf)
        buf.seek(0)
        got = torch.load(buf, weights_only=False)(x)
    elif how == "deepcopy":
        got = copy.deepcopy(fp.shrink(model, x))(x)
    elif how == "plan":
        plan = fp.PruningPlan.from_json(fp.PruningPlan.from_model(model, x).to_json())
        fresh = plan.apply(plan.apply(Trunk().double()))
        fresh.load_state_dict(fp.shrink(model, x).state_dict())
        assert len(fresh._forward_hooks) == 1
        got = fresh(x)
    elif how == "state_dict":
        path = fp.export_model(model, tmp_path / "m.pt", x)
        got = fp.load_state_dict_export(path, Trunk().double())(x)
    else:
        got = torch.jit.load(fp.export_model(model, tmp_path / "m.ts", x, format="torchscript"))(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got.detach(), want, rtol=0, atol=ATOL_F64)
    assert bool((got[:, [1, 4, 7]] == 0).all())


def test_a_plan_with_a_malformed_output_entry_is_refused() -> None:
    model, x, _ = _trunk()
    data = fp.PruningPlan.from_model(model, x).to_dict()
    assert data["outputs"] == [{"path": "", "dim": 1, "size": 10, "kept": [0, 2, 3, 5, 6, 8, 9]}]
    data["outputs"][0]["kept"] = [0, 12]
    with pytest.raises(ValueError, match="outputs"):
        fp.PruningPlan.from_dict(data)


def test_output_width_fisher_signal_equals_a_per_example_loop() -> None:
    """The width's signal counts the output too: 1/2 mean_n g_n^2, g_n the derivative of
    example n's loss (a fixed projection of the features) w.r.t. one multiplier per channel
    applied at fc1's input and on the returned features (float64)."""
    model, x, masks = _trunk()
    fp.remove_masks(model)
    masks = fp.apply_masks(model, x)
    model.double()
    w = torch.randn(3, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def loss(out: Tensor, i: int) -> Tensor:
        return ((out * w[i]).sum(-1) ** 2).sum()

    out = model(x)
    sum(loss(out[i : i + 1], i) for i in range(3)).div(3).backward()
    fp.update_pruning_signals(masks, decay=0)
    ref = Trunk().double().eval()
    ref.load_state_dict(model.state_dict(), strict=False)
    m = torch.ones(10, dtype=torch.float64, requires_grad=True)

    def masked_ref(xi: Tensor) -> Tensor:  # the masks: at fc1's input and on the output
        h = ref.inp(xi)
        return (h + ref.fc2(torch.relu(ref.fc1(ref.ln(h) * m)))) * m

    want = torch.zeros(10, dtype=torch.float64)
    for i in range(3):
        (g,) = torch.autograd.grad(loss(masked_ref(x[i : i + 1]), i), [m])
        want += 0.5 * g * g / 3
    torch.testing.assert_close(masks["fisherprune_masks.inp:out"].signal, want, rtol=1e-9, atol=0)


def test_a_uniform_base_model_loads_back_from_pretrained_with_its_kept_channels(tmp_path) -> None:
    """T5's encoder pruned with uniform=True, hidden width included: ``from_pretrained`` of
    the saved shrunk model (no fisherprune code, so no fill) returns the kept channels of the
    shrunk model's zero-filled ``last_hidden_state``: ``OutputFill.kept_outputs``."""
    cfg = transformers.T5Config(
        vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4
    )
    torch.manual_seed(0)
    model = transformers.T5EncoderModel(cfg).eval()  # (float32: T5's norm computes in it)
    fp.apply_masks(model, TEXT)
    opt = fp.PruningOptimizer(
        model, TEXT, uniform=True, criterion=fp.criteria.Random(seed=0), prune_every=1
    )
    for _ in range(6):
        opt.after_update()
    small = fp.shrink(model, TEXT)
    fill = output_fill(small)
    assert fill is not None and small.config.d_model < 64
    small.save_pretrained(tmp_path)
    back = type(model).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        want = fill.kept_outputs(small(**TEXT)).last_hidden_state
        got = back(**TEXT).last_hidden_state
    assert got.shape == (B, IDS.shape[1], small.config.d_model)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_the_fill_copies_its_index_to_a_device_once(monkeypatch) -> None:
    """The zero-fill hook copies its kept positions to the output's device on the first call
    only: a copy from the host in every call would wait for a GPU and cannot be captured in a
    CUDA graph (the H200's ``cuda_graphs`` serving form failed on it). A pickled model carries
    no device copies."""
    build, inputs = MODELS["bert"]
    torch.manual_seed(0)
    model = build().eval()
    masks = fp.apply_masks(model, inputs)
    with torch.no_grad():
        masks["fisherprune_masks.embeddings_word_embeddings:dim1"].mask[::3] = 0.0
    small = fp.shrink(model, inputs)
    fill = output_fill(small)
    assert fill is not None
    with torch.no_grad():
        first = small(**inputs)  # the hook has run once: its index is on the device
        narrow = first.last_hidden_state[..., fill.outputs[0].kept]
        copies: list[Tensor] = []
        real_to = Tensor.to

        def spy(self: Tensor, *args, **kwargs):
            copies.append(self)
            return real_to(self, *args, **kwargs)

        monkeypatch.setattr(Tensor, "to", spy)
        again = fill(small, (), type(first)(last_hidden_state=narrow))
        monkeypatch.undo()
    assert copies == []
    torch.testing.assert_close(again.last_hidden_state, first.last_hidden_state, rtol=0, atol=0)
    saved = io.BytesIO()
    torch.save(small, saved)
    saved.seek(0)
    back = output_fill(torch.load(saved, weights_only=False))
    assert (
        back is not None
        and back._on_device == {}
        and back.index(next(iter(back._index)), torch.device("cpu")).equal(
            fill.index(next(iter(fill._index)), torch.device("cpu"))
        )
    )
