"""shrink(model, inplace=True, optimizer=...): training goes on on the smaller model as it would
have on the masked one (issue 30, point 5: masks that cost nothing once pruned).

The reference is the masked model trained on, then shrunk: the model shrunk early with its
optimizer carried over and trained the same steps must hold the same weights (float64)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fisherprune as fp
from tests import zoo

Build = Callable[[], tuple[nn.Module, Tensor]]


def _cnn() -> tuple[nn.Module, Tensor]:
    return zoo.build_resnet_basic(seed=1).double(), zoo.image_input(8).double()


def _encoder() -> tuple[nn.Module, Tensor]:
    return zoo.build_transformer(seed=2).double(), zoo.token_input(8).double()


def _hf_bert() -> tuple[nn.Module, Any]:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=16, num_labels=zoo.NUM_CLASSES,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(3)
    model = transformers.BertForSequenceClassification(cfg).double()
    ids = torch.randint(0, 50, (8, 12), generator=torch.Generator().manual_seed(4))
    return model, {"input_ids": ids}


def _hf_gpt2() -> tuple[nn.Module, Any]:
    """GPT-2 from a tiny config: its output layer is tied to the token embedding."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(5)
    model = transformers.GPT2LMHeadModel(cfg).double()
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(1, 50, (8, 12), generator=torch.Generator().manual_seed(6))
    return model, {"input_ids": ids}


OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=1e-2),
}


def _logits(out: Any) -> Tensor:
    """A classifier's logits, or a language model's at the last position."""
    logits = out if isinstance(out, Tensor) else out.logits
    return logits[:, -1] if logits.dim() == 3 else logits


def _batch(x: Any, step: int) -> tuple[Any, Tensor]:
    """The step's inputs (``x`` permuted and noised) and labels, the same in every run."""
    gen = torch.Generator().manual_seed(100 + step)
    if isinstance(x, dict):
        ids = x["input_ids"]
        return {"input_ids": ids[torch.randperm(ids.shape[0], generator=gen)]}, torch.randint(
            0, zoo.NUM_CLASSES, (ids.shape[0],), generator=gen
        )
    noisy = x + 0.1 * torch.randn(x.shape, generator=gen)
    return noisy, torch.randint(0, zoo.NUM_CLASSES, (x.shape[0],), generator=gen)


def _step(model: nn.Module, opt: Any, x: Any, step: int) -> None:
    inputs, y = _batch(x, step)
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    opt.zero_grad()
    F.cross_entropy(_logits(out), y).backward()
    opt.step()


def _pruned(build: Build, optimizer: str) -> tuple[nn.Module, fp.PruningOptimizer, Any]:
    """A model trained with a PruningOptimizer until pruning finished (at 60% of its FLOPs)."""
    model, x = build()
    example = {"input_ids": x["input_ids"][:1]} if isinstance(x, dict) else x[:1]
    fp.apply_masks(model, example)
    model.train()
    popt = fp.PruningOptimizer(
        model, example, optimizer=OPTIMIZERS[optimizer](model), prune_every=1,
        flops_target="60%", round_to=4,
    )  # fmt: skip
    step = 0
    while not popt.finished:
        _step(model, popt, x, step)
        step += 1
        assert step < 500, "pruning did not finish"
    return model, popt, x


def _assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].shape == sb[k].shape, k
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-9, atol=1e-11, msg=k)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    "build", [_cnn, _encoder, _hf_bert, _hf_gpt2], ids=["resnet", "encoder", "hf_bert", "hf_gpt2"]
)
def test_training_the_shrunk_model_moves_the_kept_weights_as_the_masked_model(
    build: Build, optimizer: str
) -> None:
    model, popt, x = _pruned(build, optimizer)
    early, early_opt = copy.deepcopy((model, popt))
    fp.shrink(early, inplace=True, optimizer=early_opt)
    assert fp.find_masks(early) == {}
    for step in range(1000, 1004):
        _step(model, popt, x, step)
        _step(early, early_opt, x, step)
    late = fp.shrink(model)
    _assert_same_weights(early, late)


def test_the_optimizer_holds_the_shrunk_parameters_and_their_sliced_state() -> None:
    model, popt, _ = _pruned(_cnn, "adamw")
    fp.shrink(model, inplace=True, optimizer=popt)
    params = {id(p) for p in model.parameters()}
    held = [p for g in popt.param_groups for p in g["params"]]
    assert {id(p) for p in held} == params
    for p in held:
        state = popt.optimizer.state[p]
        assert state["exp_avg"].shape == p.shape and state["exp_avg_sq"].shape == p.shape
    assert popt.shrunk and popt.finished


def test_cost_and_history_survive_the_shrink() -> None:
    model, popt, x = _pruned(_encoder, "sgd")
    before, events = popt.cost().total, len(popt.history)
    fp.shrink(model, inplace=True, optimizer=popt)
    assert popt.cost().total == before
    _step(model, popt, x, 2000)  # a step after the shrink prunes nothing
    assert len(popt.history) == events


def test_resume_after_the_shrink_gives_the_weights_of_an_uninterrupted_run() -> None:
    model, popt, x = _pruned(_cnn, "adamw")
    fp.shrink(model, inplace=True, optimizer=popt)
    _step(model, popt, x, 3000)
    saved_model = copy.deepcopy(model.state_dict())
    saved_popt = copy.deepcopy(popt.state_dict())
    assert saved_popt["shrunk"] is True
    for step in (3001, 3002):
        _step(model, popt, x, step)

    fresh, _ = _cnn()
    fp.apply_masks(fresh, zoo.image_input(1).double())
    fresh.train()
    resumed = fp.PruningOptimizer(
        fresh, zoo.image_input(1).double(), optimizer=OPTIMIZERS["adamw"](fresh),
        prune_every=1, flops_target="60%", round_to=4,
    )  # fmt: skip
    resumed.load_state_dict(saved_popt)
    fp.shrink(fresh, inplace=True, optimizer=resumed)
    fresh.load_state_dict(saved_model)
    for step in (3001, 3002):
        _step(fresh, resumed, x, step)
    _assert_same_weights(fresh, model)


def test_an_optimizer_needs_the_model_itself_shrunk() -> None:
    model, popt, _ = _pruned(_cnn, "sgd")
    with pytest.raises(ValueError, match="inplace=True"):
        fp.shrink(model, optimizer=popt)
    assert fp.find_masks(model)


def test_a_pruning_optimizer_that_has_not_finished_is_refused_and_nothing_changes() -> None:
    model, x = _cnn()
    fp.apply_masks(model, x[:1])
    popt = fp.PruningOptimizer(model, x[:1], flops_target="50%")
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="not finished"):
        fp.shrink(model, inplace=True, optimizer=popt)
    assert fp.find_masks(model)
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes


def test_a_state_that_cannot_be_sliced_is_refused_before_the_model_changes() -> None:
    model, popt, x = _pruned(_cnn, "sgd")
    plan = fp.PruningPlan.from_model(model, x[:1])
    p = next(
        model.get_submodule(m)._parameters[t]
        for m, tensors in plan.modules.items()
        for t in tensors
        if t in model.get_submodule(m)._parameters
    )
    popt.optimizer.state[p]["row_factor"] = torch.zeros(p.shape[0] + 1)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="row_factor"):
        fp.shrink(model, inplace=True, optimizer=popt)
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    assert not popt.shrunk


def test_something_other_than_an_optimizer_is_refused() -> None:
    model, _, _ = _pruned(_cnn, "sgd")
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        fp.shrink(model, inplace=True, optimizer=object())
