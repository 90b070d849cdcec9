"""Depth as well as width (issue 33, point 2): whole blocks as prunable units.

Each test states one invariant against a reference: a float64 per-example autograd loop for the
gate's Fisher signal, the masked model against the shrunk one, FlopCounterMode on the shrunk
model for the cost, plain ``from_pretrained`` for the saved model.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import fisherprune as fp
from fisherprune.cost.formulas import SAME_AS_TORCH
from fisherprune.masks.blocks import BlockGate

transformers = pytest.importorskip("transformers")

ATOL = 1e-10  # float64 outputs, relative to max(1, max |reference|)
FLOP_REL = 1e-12


class Block(nn.Module):
    """A pre-LN block: ``h + mlp(ln(h))``."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, h: Tensor) -> Tensor:  # (N, L, d)
        return h + self.down(torch.relu(self.up(self.ln(h))))


class Stack(nn.Module):
    """Embedding-free stack of repeated blocks and a classifier over the mean token."""

    def __init__(self, d: int = 8, hidden: int = 12, depth: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.layers = nn.ModuleList(Block(d, hidden) for _ in range(depth))
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:  # (N, L, 5) -> (N, classes)
        h = self.inp(x)
        for block in self.layers:
            h = block(h)
        return self.head(h.mean(1))


def _stack() -> tuple[Stack, Tensor, Tensor]:
    torch.manual_seed(0)
    model = Stack().double()
    x = torch.randn(6, 7, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    return model, x, y


def _gate(masks: dict) -> BlockGate:
    (gate,) = [m for m in masks.values() if isinstance(m, BlockGate)]
    return gate


def _flops(model: nn.Module, inputs: Tensor | dict) -> float:
    """FlopCounterMode's count on ``model``, per example."""
    with FlopCounterMode(display=False, custom_mapping=dict(SAME_AS_TORCH)) as counter:
        if isinstance(inputs, dict):
            model(**inputs)
            n = next(iter(inputs.values())).shape[0]
        else:
            model(inputs)
            n = inputs.shape[0]
    return counter.get_total_flops() / n


def _assert_round_trip(
    model: nn.Module, inputs: dict[str, Tensor], folder: Path, layers: int
) -> None:
    """The masked model shrunk, saved and loaded back by plain transformers has ``layers``
    blocks in its config and gives the masked model's logits."""
    with torch.no_grad():
        masked = model(**inputs).logits
    small = fp.shrink(model, inputs)
    assert small.config.num_hidden_layers == layers
    small.save_pretrained(folder)
    back = type(model).from_pretrained(folder, attn_implementation="eager").double().eval()
    assert back.config.num_hidden_layers == layers
    with torch.no_grad():
        logits = back(**inputs).logits
    assert (logits - masked).abs().max() <= ATOL * max(1.0, masked.abs().max().item())


def test_gate_signal_equals_a_per_example_autograd_loop() -> None:
    """The gate's signal is 1/2 mean_n (dL_n/dg_i)^2, with dL_n/dg_i taken by autograd of each
    example's loss alone through an explicit gate on the block's residual branch."""
    model, x, y = _stack()
    masks = fp.apply_masks(model, x[:1], blocks=True)
    gate = _gate(masks)
    assert gate.list_path == "layers" and gate.num_channels == 4
    with torch.no_grad():
        gate.mask[2] = 0  # the derivative at a removed block is taken too
    model.train()
    F.cross_entropy(model(x), y).backward()  # mean-reduced: the signal undoes the 1/N
    fp.update_pruning_signals(masks, decay=0.0)

    fp.remove_masks(model)
    expected = torch.zeros(4, dtype=torch.float64)
    for n in range(x.shape[0]):
        g = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64, requires_grad=True)
        h = model.inp(x[n : n + 1])
        for i, block in enumerate(model.layers):
            h = h + g[i] * (block(h) - h)
        loss = F.cross_entropy(model.head(h.mean(1)), y[n : n + 1], reduction="sum")
        (dg,) = torch.autograd.grad(loss, g)
        expected += dg**2
    expected = expected / (2 * x.shape[0])
    assert expected.min() > 0  # every block matters: the check is not vacuous
    # the signal buffer is float32 (as every MaskLayer's): the float64 gradients are rounded once
    torch.testing.assert_close(gate.signal.double(), expected, rtol=1e-6, atol=0)


def test_removed_block_masked_equals_shrunk_and_cost_equals_flop_counter() -> None:
    """With block 1 gated off (and a hidden unit of block 3 pruned), the shrunk model has one
    block fewer, gives the masked model's output, and computational_cost equals FlopCounterMode
    on it; the gate entry's marginal cost is the block's FLOPs at its current width."""
    model, x, _ = _stack()
    masks = fp.apply_masks(model, x[:1], blocks=True)
    gate = _gate(masks)
    dense = fp.computational_cost(model, x).total
    with torch.no_grad():
        gate.mask[1] = 0
        masks["fisherprune_masks.layers_3_up:out"].mask[:5] = 0
    cost = fp.computational_cost(model, x)
    model.eval()
    with torch.no_grad():
        masked = model(x)
    small = fp.shrink(model, x)
    assert len(small.layers) == 3 and [n for n, _ in small.layers.named_children()] == list("012")
    assert small.layers[2].up.out_features == 7
    with torch.no_grad():
        out = small(x)
    assert (out - masked).abs().max() <= ATOL * max(1.0, masked.abs().max().item())
    ref = _flops(small, x)
    assert cost.total < dense
    assert abs(cost.total - ref) <= FLOP_REL * ref
    block = _flops(nn.Sequential(small.layers[2]), torch.randn(6, 7, 8, dtype=torch.float64))
    assert cost.marginal[gate][3].item() == pytest.approx(block, rel=FLOP_REL)
    assert cost.marginal[gate][1].item() == 0.0


def test_pruning_optimizer_removes_near_identity_blocks() -> None:
    """PruningOptimizer on a gated model whose blocks 1 and 2 are near-identities (their output
    layer scaled to almost 0), with a target of two whole blocks fewer, gates those two off;
    the shrunk model has two blocks and FlopCounterMode on it equals the cost it reached."""
    model, x, y = _stack()
    with torch.no_grad():
        for block in model.layers[1:3]:
            block.down.weight.mul_(1e-4)
            block.down.bias.zero_()
    masks = fp.apply_masks(model, x[:1], blocks=True)
    gate = _gate(masks)
    cost = fp.computational_cost(model, x)
    target = cost.total - 2 * cost.marginal[gate][0].item()
    opt = fp.PruningOptimizer(
        model, x, lr=0.0, prune_every=1, burn_in=0, decay=0.0, flops_target=target
    )
    model.train()
    for _ in range(60):
        if opt.finished:
            break
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert opt.finished
    assert gate.mask.tolist() == [1.0, 0.0, 0.0, 1.0]
    reached = fp.computational_cost(model, x).total
    assert reached <= target
    small = fp.shrink(model, x)
    assert len(small.layers) == 2
    assert abs(_flops(small, x) - reached) <= FLOP_REL * reached


def _gated_off_block_1() -> tuple[Stack, Tensor, Tensor, dict]:
    """The stack with block gates, block 1 gated off by hand."""
    model, x, y = _stack()
    masks = fp.apply_masks(model, x[:1], blocks=True)
    with torch.no_grad():
        _gate(masks).mask[1] = 0
    return model, x, y, masks


INSIDE_1 = "fisherprune_masks.layers_1_up:out"


@pytest.mark.parametrize("uniform", [False, True], ids=["free", "uniform"])
def test_prune_to_target_leaves_the_channels_of_a_removed_block(uniform: bool) -> None:
    """Channels inside a gated-off block save nothing and carry no signal: prune_to_target
    never selects them (so ``uniform=True`` does not narrow the kept copies for them), and the
    shrunk model's FLOPs equal the cost it reached."""
    model, x, y, masks = _gated_off_block_1()
    result = fp.prune_to_target(
        model, x[:1], [(x, y)] * 2, "40%", loss_fn=F.cross_entropy, reconstruct=False,
        uniform=uniform,
    )  # fmt: skip
    assert masks[INSIDE_1].kept == masks[INSIDE_1].num_channels
    assert INSIDE_1 not in result.at_floor
    small = fp.shrink(model, x)
    assert abs(_flops(small, x) - result.cost_after) <= FLOP_REL * result.cost_after


def test_pruning_optimizer_leaves_the_channels_of_a_removed_block() -> None:
    """PruningOptimizer's one-channel steps never take a channel inside a gated-off block
    (its signal is 0 there, so it would otherwise go first, for nothing)."""
    model, x, y, masks = _gated_off_block_1()
    opt = fp.PruningOptimizer(model, x, lr=0.0, prune_every=1, burn_in=0, decay=0.0)
    model.train()
    for _ in range(8):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert len(opt.history) == 8
    assert masks[INSIDE_1].kept == masks[INSIDE_1].num_channels


def test_plan_json_rebuilds_the_shrunk_model_from_a_dense_copy() -> None:
    """A PruningPlan read off a gated model, through JSON, applied to a dense copy of the
    model, gives the shrunk model's blocks and outputs."""
    model, x, _ = _stack()
    dense = copy.deepcopy(model)
    masks = fp.apply_masks(model, x[:1], blocks=True)
    with torch.no_grad():
        _gate(masks).mask[[0, 3]] = 0
    plan = fp.PruningPlan.from_json(fp.PruningPlan.from_model(model, x).to_json())
    assert plan.blocks == {"layers": {"count": 4, "removed": [0, 3]}}
    small = fp.shrink(model, x)
    rebuilt = plan.apply(dense)
    assert len(rebuilt.layers) == 2
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), small(x), rtol=0, atol=ATOL)


def test_remove_masks_takes_the_block_hooks_away() -> None:
    """remove_masks after gating a block off leaves the model's dense outputs (no hook left)."""
    model, x, _ = _stack()
    with torch.no_grad():
        before = model(x)
    masks = fp.apply_masks(model, x[:1], blocks=True)
    with torch.no_grad():
        _gate(masks).mask[1] = 0
        assert not torch.equal(model(x), before)
    fp.remove_masks(model)
    assert not any(b._forward_hooks for b in model.layers)
    with torch.no_grad():
        assert torch.equal(model(x), before)


def _llama(**extra: object) -> nn.Module:
    t = transformers
    config = t.LlamaConfig(
        vocab_size=60,
        hidden_size=16,
        intermediate_size=24,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=4,
        max_position_embeddings=32,
        attn_implementation="eager",
        **extra,
    )
    torch.manual_seed(0)
    return t.LlamaForCausalLM(config).double().eval()


def near_identity_llama() -> nn.Module:
    """``_llama`` whose blocks 1 and 2 barely change the hidden state (their down and o
    projections scaled by 1e-4)."""
    model = _llama()
    with torch.no_grad():
        for layer in model.model.layers[1:3]:
            layer.mlp.down_proj.weight.mul_(1e-4)
            layer.self_attn.o_proj.weight.mul_(1e-4)
    return model


def _gpt2() -> nn.Module:
    t = transformers
    config = t.GPT2Config(
        vocab_size=60, n_embd=16, n_layer=4, n_head=2, n_positions=32, attn_implementation="eager"
    )
    torch.manual_seed(0)
    return t.GPT2LMHeadModel(config).double().eval()


IDS = torch.randint(0, 60, (4, 8), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_hf_block_removal_round_trips_through_save_pretrained(build, tmp_path) -> None:
    """A prune to a target that gates blocks off (uniform widths) shrinks to a model with fewer
    num_hidden_layers that plain from_pretrained loads, with the masked model's logits. (Eager
    attention on reload: a dense Llama's own sdpa round trip differs by ~3e-8.)"""
    model = build()
    inputs = {"input_ids": IDS}
    fp.apply_masks(model, inputs, blocks=True)
    gate = _gate(fp.find_masks(model))
    with torch.no_grad():
        gate.mask[[0, 2]] = 0
    _assert_round_trip(model, inputs, tmp_path, layers=2)


def test_prune_to_target_meets_a_target_by_removing_blocks(tmp_path) -> None:
    """prune_to_target(blocks=True) on a Llama whose blocks are near-identities (down and o
    projections scaled to almost 0) meets 60% by removing blocks, ranked against channels in
    one budget; the result saves and loads with fewer layers and the masked model's logits."""
    model = near_identity_llama()
    inputs = {"input_ids": IDS}
    batches = [(inputs, IDS)]

    def loss_fn(out, ids: Tensor) -> Tensor:
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    result = fp.prune_to_target(
        model, inputs, batches, "60%", loss_fn=loss_fn, blocks=True, uniform=True,
        reconstruct=False,
    )  # fmt: skip
    gate = _gate(fp.find_masks(model))
    assert result.cost_after <= result.target
    assert gate.mask.tolist() == [1.0, 0.0, 0.0, 1.0]
    _assert_round_trip(model, inputs, tmp_path, layers=2)


def test_cli_prune_blocks_writes_a_folder_with_fewer_layers(tmp_path) -> None:
    """``fisherprune prune FOLDER --blocks --uniform`` on a Llama whose blocks 1 and 2 are
    near-identities removes those blocks: hf/ loads with plain from_pretrained with two
    num_hidden_layers, and report.json records the blocks kept."""
    from tests.test_cli import run_cli
    from tests.test_perplexity import text_folder

    folder, text, _ = text_folder(tmp_path, near_identity_llama())
    out = tmp_path / "out"
    cli = run_cli("prune", folder, "--text", text, "--seq_len", 8, "--target", "60%",
                  "--uniform", "--blocks", "--no-reconstruct", "--out", out)  # fmt: skip
    assert cli.code == 0, cli.err
    back = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    assert back.config.num_hidden_layers == 2
    report = json.loads((out / "report.json").read_text())
    assert report["channels_kept"]["fisherprune_masks.blocks"] == {"kept": 2, "of": 4}


def test_qwen2_layer_types_follow_the_kept_blocks() -> None:
    """A Qwen2 config's per-layer list (layer_types) keeps the kept blocks' entries."""
    t = transformers
    config = t.Qwen2Config(
        vocab_size=60, hidden_size=16, intermediate_size=24, num_attention_heads=2,
        num_key_value_heads=1, num_hidden_layers=4, max_position_embeddings=32,
        layer_types=["full_attention", "sliding_attention"] * 2, use_sliding_window=True,
        sliding_window=4, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = t.Qwen2ForCausalLM(config).double().eval()
    inputs = {"input_ids": IDS}
    fp.apply_masks(model, inputs, blocks=True)
    with torch.no_grad():
        _gate(fp.find_masks(model)).mask[1] = 0
        masked = model(**inputs).logits
    small = fp.shrink(model, inputs)
    kinds = ["full_attention", "full_attention", "sliding_attention"]
    assert small.config.layer_types == kinds and small.config.num_hidden_layers == 3
    with torch.no_grad():
        out = small(**inputs).logits
    assert (out - masked).abs().max() <= ATOL * max(1.0, masked.abs().max().item())


def test_a_model_without_repeated_blocks_is_refused() -> None:
    """blocks=True on a model with no chain of same-class blocks raises one clear error and
    adds nothing."""
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    with pytest.raises(ValueError, match=r"no nn\.ModuleList of same-class blocks"):
        fp.apply_masks(model, torch.randn(2, 4), blocks=True)
    assert not fp.find_masks(model)
