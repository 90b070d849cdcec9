"""A masked model copied as users copy models (``copy.deepcopy`` for an EMA or a teacher,
``torch.save`` of the whole model, ``load_state_dict(assign=True)``) keeps acting as its masks
say: a pruned channel folded into the weights gets no gradient in the copy either.

The reference is the copy itself with its masks multiplying activations (``no_fold``), where a
pruned channel's input is zero, so its weight columns get a zero gradient without any hook.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import pytest
import torch
from torch import nn

import fisherprune as fp
from fisherprune.masks.points import no_fold
from tests.counted import hf_moe


class _Tagger(nn.Module):
    """Embedding, an MLP, a bidirectional LSTM and attention: every kind of fold (a linear
    layer's input columns, an LSTM's unit columns) and every hook kind ``apply_masks`` adds."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 12)
        self.up = nn.Linear(12, 16)
        self.down = nn.Linear(16, 12)
        self.lstm = nn.LSTM(12, 10, batch_first=True, bidirectional=True)
        self.attn = nn.MultiheadAttention(20, 4, batch_first=True)
        self.head = nn.Linear(20, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        h, _ = self.lstm(h)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(a.mean(1))


def _saved_and_loaded(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _assigned(model: nn.Module) -> nn.Module:
    """The same model with every parameter replaced by a new tensor holding its values."""
    model.load_state_dict(copy.deepcopy(model.state_dict()), assign=True)
    return model


COPIES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "deepcopy": copy.deepcopy,
    "torch_save_load": _saved_and_loaded,
    "load_state_dict_assign": _assigned,
}


def _folded() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A masked model with a third of every mask's channels pruned and pruning over, after one
    training step (its weights folded, their gradient filters on)."""
    torch.manual_seed(0)
    model = _Tagger().double()
    x, y = torch.randint(0, 20, (6, 7)), torch.randint(0, 3, (6,))
    masks = fp.apply_masks(model, x[:1])
    assert "fisherprune_masks.lstm:out" in masks  # its hidden units
    with torch.no_grad():
        for m in masks.values():
            m.mask[torch.randperm(m.num_channels)[: m.num_channels // 3]] = 0.0
    for m in masks.values():
        m.collecting = False
    nn.functional.cross_entropy(model(x), y).backward()
    return model, x, y


def _gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_as_activation_masks(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    got = _gradients(model, x, y)
    with no_fold(model):
        want = _gradients(model, x, y)
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-15, msg=n)


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copied_folded_model_gives_the_gradients_its_masks_give(how: str) -> None:
    """The copy's weight gradients (folded path) equal its activation-masked ones: removed
    columns of the linear layer's and the LSTM's weights get none."""
    model, x, y = _folded()
    twin = COPIES[how](model)
    _assert_as_activation_masks(twin, x, y)


@pytest.mark.parametrize("how", ["deepcopy", "torch_save_load"])
def test_the_original_keeps_its_gradient_filters_when_the_copy_drops_its_masks(how: str) -> None:
    """Removing the copy's masks touches nothing of the original's."""
    model, x, y = _folded()
    twin = COPIES[how](model)
    _gradients(twin, x, y)
    fp.remove_masks(twin)
    _assert_as_activation_masks(model, x, y)


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copied_folded_model_gives_the_outputs_of_the_original(how: str) -> None:
    """Outputs of the copy equal the original's (float64, exactly), before and after the
    copy's masks are removed and the model shrunk."""
    model, x, _ = _folded()
    with torch.no_grad():
        want = model(x)
    twin = COPIES[how](model if how != "load_state_dict_assign" else copy.deepcopy(model))
    with torch.no_grad():
        torch.testing.assert_close(twin(x), want, rtol=0, atol=0)
        small = fp.shrink(twin, x[:1])
        torch.testing.assert_close(small(x), want, rtol=1e-12, atol=1e-12)


def _signals(model: nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    masks = fp.find_masks(model)
    model.zero_grad(set_to_none=True)
    model(**inputs).logits.double().pow(2).sum().backward()
    fp.update_pruning_signals(masks, decay=0.0)
    return {n: m.signal.clone() for n, m in masks.items()}


@pytest.mark.parametrize("experts", ["eager", "batched_mm"])
def test_a_masked_moe_decoder_saved_whole_loads_and_gathers_the_same_signals(
    experts: str,
) -> None:
    """Hugging Face Mixtral with masks on its experts (whose rows a router picks by data):
    ``torch.save`` of the whole model, ``torch.load``, then the loaded model gives the same
    logits and its next collecting step the same signals, in float64 (it failed to pickle:
    the hook telling which tokens an expert took read the masks through a closure)."""
    model, inputs = hf_moe("mixtral", experts)
    fp.apply_masks(model, inputs)
    back = _saved_and_loaded(model)
    want, got = _signals(model, inputs), _signals(back, inputs)
    assert want and set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=0, msg=n)
    with torch.no_grad():
        torch.testing.assert_close(back(**inputs).logits, model(**inputs).logits, rtol=0, atol=0)


def test_a_frozen_copy_of_a_folded_model_runs_as_a_teacher() -> None:
    """``copy.deepcopy(model).requires_grad_(False)`` (a teacher, an EMA) runs without
    gradients and gives the original's outputs: its weights, which require no gradient,
    get no gradient hook (registering one raised)."""
    model, x, _ = _folded()
    teacher = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        torch.testing.assert_close(teacher(x), model(x), rtol=1e-12, atol=1e-12)


def test_a_functional_call_on_other_weights_leaves_the_models_filters_in_place() -> None:
    """A forward of the model, then one through ``torch.func.functional_call`` on other
    tensors (an EMA's), then the first forward's backward: the model's own weights still get
    no gradient at removed columns (the other call took their hooks away)."""
    model, x, y = _folded()
    loss = nn.functional.cross_entropy(model(x), y)
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        torch.func.functional_call(model, ema, (x,))
    model.zero_grad(set_to_none=True)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with no_fold(model):
        want = _gradients(model, x, y)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-15, msg=n)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def test_a_model_converted_by_swapping_tensors_keeps_its_gradient_filters() -> None:
    """``model.double()`` with ``torch.__future__.set_swap_module_params_on_conversion``
    (``torch.utils.swap_tensors``, as FSDP2 converts): the folded layer's removed columns
    still get no gradient (the swap had moved the hook away with the former contents)."""
    torch.manual_seed(0)
    model, x, y = _MLP(), torch.randn(8, 6), torch.randint(0, 3, (8,))
    masks = fp.apply_masks(model, x[:1])
    with torch.no_grad():
        for m in masks.values():
            m.mask[[1, 4]] = 0.0
    for m in masks.values():
        m.collecting = False
    nn.functional.cross_entropy(model(x), y).backward()  # folded, filters on
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    _assert_as_activation_masks(model, x.double(), y)
