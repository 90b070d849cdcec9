"""``prune_to_target(blocks="only")``: depth pruning alone, every channel left whole."""

from __future__ import annotations

import warnings

import pytest
import torch

import fisherprune as fp
from fisherprune.masks.blocks import BlockGate

transformers = pytest.importorskip("transformers")


def _llama() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval(), {"input_ids": torch.randint(0, 64, (4, 8))}


def test_blocks_only_removes_blocks_and_keeps_every_channel() -> None:
    """A 30% parameter cut (target 70%) with ``blocks="only"`` is met by gating off whole
    decoder layers: every channel mask stays all ones, and the shrunk model has fewer layers
    and the same hidden, head and MLP widths."""
    model, x = _llama()
    batches = [(x, x["input_ids"])]
    loss = lambda out, y: out.logits.float().mean()  # noqa: E731 - reaches every mask
    result = fp.prune_to_target(
        model, {"input_ids": x["input_ids"][:1]}, batches, "70%", loss_fn=loss, blocks="only",
        convention="params", reconstruct=False, rounds=1, round_cap=1.0,
    )  # fmt: skip
    masks = fp.find_masks(model)
    gates = [m for m in masks.values() if isinstance(m, fp.masks.blocks.BlockGate)]
    assert len(gates) == 1 and gates[0].kept < 4
    assert all(m.is_all_ones() for m in masks.values() if m is not gates[0])
    assert result.ratio <= 0.7 + 1e-9 and len(result.kept_whole) == len(masks) - 1
    small = fp.shrink(model, {"input_ids": x["input_ids"][:1]})
    assert small.config.num_hidden_layers == gates[0].kept
    assert small.config.hidden_size == 32 and small.config.intermediate_size == 48


def test_blocks_bad_value_is_refused() -> None:
    """A ``blocks`` value other than True, False or "only" is an error naming the choices."""
    model, x = _llama()
    with pytest.raises(ValueError, match="only"):
        fp.prune_to_target(model, x, [(x, None)], "50%", blocks="depth")


class _Residual(torch.nn.Module):
    """x + down(relu(up(x))), hidden width ``h``."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, h), torch.nn.Linear(h, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Widths(torch.nn.Module):
    """Residual MLP blocks of one class but of hidden widths ``hidden``."""

    def __init__(self, hidden: list[int]) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.layers = torch.nn.ModuleList(_Residual(h) for h in hidden)
        self.out = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.layers:
            x = block(x)
        return self.out(x)


@pytest.mark.parametrize("hidden", [[512, 8, 8, 8], [8, 8, 8, 512]])
def test_the_floor_keeps_the_cheapest_blocks_wherever_they_are(hidden: list[int]) -> None:
    """blocks='only' to 20% of the FLOPs: reachable by keeping one 8-wide block, wherever the
    512-wide block sits (the floor priced by gating off the first blocks refused it when the
    wide one came last), and met with the wide block gated off."""
    torch.manual_seed(0)
    net, x = _Widths(hidden), torch.randn(8, 16)
    labels = torch.randint(0, 4, (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fp.prune_to_target(
            net, x[:1], [(x, labels)], 0.2, loss_fn=torch.nn.functional.cross_entropy,
            blocks="only", reconstruct=False,
        )  # fmt: skip
    assert result.cost_after <= result.target
    gate = next(m for m in fp.find_masks(net).values() if isinstance(m, BlockGate))
    assert gate.kept_blocks()[hidden.index(512)] is False
