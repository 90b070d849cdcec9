"""Activation checkpointing of the signal pass (``fisherprune.calibrate.checkpoint``): the
recomputed forwards change no signal, the model comes back as it was, and a model without
repeated blocks is refused when checkpointing is asked for."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from torch import nn

import fisherprune as fp
from fisherprune.calibrate import checkpoint as checkpointing
from fisherprune.calibrate import estimate_signals
from fisherprune.calibrate.checkpoint import checkpointed_blocks, resolve_block_list
from fisherprune.calibrate.label_free import LabelFreeLoss
from fisherprune.masks.blocks import find_block_list

transformers = pytest.importorskip("transformers")


def _decoder(family: str) -> nn.Module:
    """A three-layer Llama or Qwen2 from a config (GQA, an MLP 56 wide), eval mode."""
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    torch.manual_seed(0)
    config = config_class(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, intermediate_size=56,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=False,
    )  # fmt: skip
    return model_class(config).eval()


@functools.cache
def masked_decoder(family: str) -> tuple[nn.Module, dict, torch.Tensor]:
    """``_decoder(family)`` with masks and a block gate (traced once for the module's tests:
    they change no weight, and each sets the masks it needs), and token ids (4, 10)."""
    model = _decoder(family)
    ids = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(1))
    return model, fp.apply_masks(model, {"input_ids": ids[:1]}, blocks=True), ids


def _signals(model: nn.Module, masks: dict, data: list, blocks: nn.ModuleList | None) -> dict:
    estimate_signals(model, masks, data, LabelFreeLoss("auto", 0), fp.criteria.Fisher(),
                     blocks=blocks)  # fmt: skip
    return {n: m.signal.clone() for n, m in masks.items()}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_checkpointed_signals_equal_the_plain_passes(family: str) -> None:
    """The Fisher signals of a pass whose decoder layers are recomputed in backward equal those
    of the plain pass (every mask: heads, MLP units, the hidden width shared by all layers,
    the block gate; with some channels removed, so that both product paths run), though each
    layer's forward runs twice per batch."""
    model, masks, ids = masked_decoder(family)
    mlp = next(m for m in masks.values() if m.num_channels == 56)
    with torch.no_grad():
        for m in masks.values():
            m.mask.fill_(1.0)
        mlp.mask[:20] = 0.0
    data = [({"input_ids": ids[i : i + 2]}, None) for i in (0, 2)]
    _, layers = find_block_list(model, {"input_ids": ids[:1]})
    calls = [0]
    handle = layers[1].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        plain = _signals(model, masks, data, None)
        assert calls[0] == 2
        checkpointed = _signals(model, masks, data, layers)
    finally:
        handle.remove()
    assert calls[0] == 2 + 4  # the recomputation ran
    assert all(s.abs().sum() > 0 for s in plain.values())
    for name, s in plain.items():
        torch.testing.assert_close(checkpointed[name], s, rtol=1e-6, atol=0.0)


def test_the_model_comes_back_with_its_own_layers_and_cache_flag() -> None:
    """After a checkpointed pass, the layer list holds the model's own layers again (no
    wrapper) and ``config.use_cache`` is what it was."""
    model, masks, ids = masked_decoder("llama")
    layers = list(model.model.layers)
    flag = model.config.use_cache
    _signals(model, masks, [({"input_ids": ids}, None)], model.model.layers)
    assert list(model.model.layers) == layers
    assert all(a is b for a, b in zip(model.model.layers, layers, strict=True))
    assert model.config.use_cache == flag


def test_checkpoint_is_refused_without_repeated_blocks_and_for_a_bad_value() -> None:
    """``checkpoint=True`` on a model without a list of repeated blocks, and a value that is
    not True, False or "auto", are errors that say so."""
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 2, (8,), generator=torch.Generator().manual_seed(1))
    data = [(x, y)]
    loss = nn.functional.cross_entropy
    with pytest.raises(ValueError, match=r"checkpoint=True: the model has no nn\.ModuleList"):
        fp.prune_to_target(net, x[:1], data, "60%", loss_fn=loss, checkpoint=True)
    with pytest.raises(ValueError, match='checkpoint must be True, False or "auto"'):
        fp.prune_to_target(net, x[:1], data, "60%", loss_fn=loss, checkpoint="yes")


def _resolved_and_forwards(model: nn.Module, masks: dict, example: dict) -> tuple[object, int]:
    """What ``resolve_block_list(..., "auto")`` gives, and how many forwards it ran."""
    calls = [0]
    handle = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        found = resolve_block_list(model, example, masks, "auto")
    finally:
        handle.remove()
    return found, calls[0]


def test_auto_leaves_a_model_under_the_size_floor_alone_without_a_forward() -> None:
    """``checkpoint="auto"`` does not checkpoint a model whose parameters take fewer than
    ``AUTO_MIN_BYTES``, and runs no forward pass to look for its blocks."""
    model, masks, ids = masked_decoder("llama")
    assert sum(p.numel() * p.element_size() for p in model.parameters()) < (
        checkpointing.AUTO_MIN_BYTES
    )
    assert _resolved_and_forwards(model, masks, {"input_ids": ids[:1]}) == (None, 0)


def test_auto_checkpoints_a_model_at_the_size_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose parameters take exactly ``AUTO_MIN_BYTES`` gets its decoder layers
    checkpointed under ``checkpoint="auto"``."""
    model, masks, ids = masked_decoder("llama")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(checkpointing, "AUTO_MIN_BYTES", size)
    found, _ = _resolved_and_forwards(model, masks, {"input_ids": ids[:1]})
    assert found is model.model.layers


def test_a_backward_on_another_thread_recomputes_as_the_first_forward_ran() -> None:
    """CUDA's autograd engine runs a backward, and so the layers' recomputation, on a thread of
    the device, not the one that ran the forward: a checkpointed pass whose backwards run on
    another thread gives the plain pass's signals, with nothing pruned (the masks' aliasing
    path, which the recomputation must also leave alone)."""
    model, masks, ids = masked_decoder("llama")
    with torch.no_grad():
        for m in masks.values():
            m.mask.fill_(1.0)
    data = [({"input_ids": ids[i : i + 2]}, None) for i in (0, 2)]
    plain = _signals(model, masks, data, None)
    _, layers = find_block_list(model, {"input_ids": ids[:1]})
    for m in masks.values():
        m.reset_statistics()
    loss_fn, errors = LabelFreeLoss("auto", 0), []

    def backward(loss: torch.Tensor) -> None:
        try:
            loss.backward()
        except Exception as e:  # reported below, on the test's thread
            errors.append(e)

    model.requires_grad_(False)
    try:
        with checkpointed_blocks(model, layers), torch.enable_grad():
            for inputs, _ in data:
                worker = threading.Thread(target=backward, args=(loss_fn(model(**inputs), None),))
                worker.start()
                worker.join()
    finally:
        model.requires_grad_(True)
    assert errors == []
    fp.criteria.Fisher().update(masks, 0.0, loss_reduction="mean")
    for name, s in plain.items():
        torch.testing.assert_close(masks[name].signal, s, rtol=1e-6, atol=0.0)
