"""Whole experts as prunable units (issue 34, point 2): ``apply_masks(..., experts=True)``.

Each test states one invariant against a reference outside the code under test: the masked
model against the shrunk one, PyTorch's ``FlopCounterMode`` on the shrunk model for the cost,
a float64 per-example autograd loop through the test's own gate on the shrunk model's routing
weights for the Fisher signal, plain ``from_pretrained`` for the saved model.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.masks.experts import ExpertGate
from tests.counted import call, flops_per_example, hf_moe

pytestmark = [
    pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no grouped matrix product"),
    pytest.mark.filterwarnings("ignore:the model's Hugging Face config still describes"),
]

ATOL64 = 1e-9  # float64 output difference, relative to max(1, max |expected|)
ATOL32 = 1e-5  # float32 (CPU's grouped kernel)


def _gates(masks: dict) -> list[ExpertGate]:
    return [m for m in masks.values() if isinstance(m, ExpertGate)]


def _close(actual: Tensor, expected: Tensor, atol: float) -> bool:
    return float((actual - expected).abs().max()) <= atol * max(1.0, float(expected.abs().max()))


def _lm_loss(logits: Tensor, ids: Tensor) -> Tensor:
    """Next-token cross-entropy, the mean over the batch's predicted tokens."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


CASES = [(k, e) for k in ("qwen3_moe", "mixtral") for e in ("grouped_mm", "batched_mm", "eager")]
CASES += [("qwen2_moe", "batched_mm"), ("olmoe", "eager")]


@pytest.mark.parametrize(("kind", "experts"), CASES)
def test_removed_experts_masked_equals_shrunk_and_cost_equals_flop_counter(
    kind: str, experts: str
) -> None:
    """With one expert gated off in layer 0 and two in layer 1, the masked model's logits
    change, the shrunk model (router rows and stacked weights sliced, expert counts updated)
    gives them, and computational_cost equals FlopCounterMode on it."""
    model, inputs = hf_moe(kind, experts)
    masks = fp.apply_masks(model, inputs, experts=True)
    gates = _gates(masks)
    assert [(g.layer_path, g.num_channels, g.min_kept) for g in gates] == [
        (f"model.layers.{i}.mlp", 4, 2) for i in (0, 1)
    ]
    routers = [s for s in masks.skipped if s.params[0][0].endswith("mlp.gate.weight")]
    assert len(routers) == 2 and all(s.expected for s in routers)  # the gates remove them
    atol = ATOL32 if experts == "grouped_mm" else ATOL64
    with torch.no_grad():
        dense = call(model, inputs)
        gates[0].mask[1] = 0
        gates[1].mask[[0, 3]] = 0
        masked = call(model, inputs)
    assert not _close(masked, dense, 1e-3)  # removing experts re-routes tokens
    cost = fp.computational_cost(model, inputs).total
    small = fp.shrink(model, inputs)
    with torch.no_grad():
        assert _close(call(small, inputs), masked, atol)
    assert flops_per_example(small, inputs) == cost
    for i, kept in ((0, 3), (1, 2)):
        moe = small.model.layers[i].mlp
        assert moe.gate.weight.shape[0] == moe.experts.down_proj.shape[0] == kept
        assert moe.gate.num_experts == moe.experts.num_experts == kept


def test_expert_marginal_cost_is_the_flops_its_removal_saves() -> None:
    """An expert's marginal cost is FlopCounterMode's count on the shrunk model minus that on
    the shrunk model with that expert also removed (its router row: top-k routing keeps the
    experts' products at tokens x top_k rows, whatever the number of experts)."""
    model, inputs = hf_moe("mixtral", "eager")
    masks = fp.apply_masks(model, inputs, experts=True)
    gate = _gates(masks)[1]
    with torch.no_grad():
        gate.mask[0] = 0
    marginal = fp.computational_cost(model, inputs).marginal[gate]
    before = flops_per_example(fp.shrink(copy.deepcopy(model), inputs), inputs)
    with torch.no_grad():
        gate.mask[2] = 0
    after = flops_per_example(fp.shrink(model, inputs), inputs)
    assert marginal[0] == 0.0
    assert marginal[2].item() == before - after == 2 * 32 * 8  # 2 x hidden per token


def test_expert_signal_equals_a_per_example_autograd_loop() -> None:
    """The gate's signal is 1/2 mean_n (dL_n/dg_e)^2, with dL_n/dg_e taken by autograd of each
    example's loss alone through the test's own gate multiplying each expert's routing weights
    in the shrunk model (expert 2 of layer 0 removed: its signal is 0, the others' follow
    the kept experts' numbering)."""
    model, inputs = hf_moe("mixtral", "batched_mm")
    ids = torch.randint(3, 99, (3, 6), generator=torch.Generator().manual_seed(2))
    masks = fp.apply_masks(model, inputs, experts=True)
    gates = _gates(masks)
    with torch.no_grad():
        gates[0].mask[2] = 0
    model.train()
    _lm_loss(model(input_ids=ids).logits, ids).backward()  # mean-reduced: the signal undoes 1/N
    fp.update_pruning_signals(masks, decay=0.0)

    small = fp.shrink(model, inputs).train()
    kept = ([0, 1, 3], [0, 1, 2, 3])
    g = [torch.ones(len(k), dtype=torch.float64, requires_grad=True) for k in kept]

    def gate_weights(i: int):
        def hook(_m: nn.Module, _a: tuple, out: tuple) -> tuple:
            logits, weights, idx = out
            return logits, weights * g[i][idx], idx

        return hook

    handles = [
        small.model.layers[i].mlp.gate.register_forward_hook(gate_weights(i)) for i in (0, 1)
    ]
    expected = [torch.zeros(4, dtype=torch.float64) for _ in kept]
    for n in range(ids.shape[0]):
        loss = _lm_loss(small(input_ids=ids[n : n + 1]).logits, ids[n : n + 1])
        for i, dg in enumerate(torch.autograd.grad(loss, g)):
            expected[i][kept[i]] += dg**2
    for h in handles:
        h.remove()
    for gate, exp in zip(gates, expected, strict=True):
        exp /= 2 * ids.shape[0]
        assert int((exp > 0).sum()) == gate.kept  # every kept expert matters: not vacuous
        # the signal buffer is float32, as every MaskLayer's: float64 gradients rounded once
        torch.testing.assert_close(gate.signal.double(), exp, rtol=1e-6, atol=0)


def test_prune_never_leaves_fewer_experts_than_top_k() -> None:
    """prune with min_channels=0 stops at top_k (2) experts per layer, then reports nothing
    left to prune; the shrunk model still gives the masked model's logits, and a layer set
    below top_k by hand is refused by shrink."""
    model, inputs = hf_moe("qwen3_moe", "batched_mm")
    masks = fp.apply_masks(model, inputs, experts=True)
    gates = {n: m for n, m in masks.items() if isinstance(m, ExpertGate)}
    gen = torch.Generator().manual_seed(0)
    events = []
    while (ev := fp.prune(gates, {n: torch.rand(4, generator=gen) for n in gates}, 0)) is not None:
        events.append(ev)
    assert len(events) == 4 and [g.kept for g in gates.values()] == [2, 2]
    with torch.no_grad():
        masked = call(model, inputs)
        assert _close(call(fp.shrink(model, inputs), inputs), masked, ATOL64)
        next(iter(gates.values())).mask.zero_()[0] = 1
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp keeps 1 experts, fewer than"):
        fp.shrink(model, inputs)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_uniform_expert_prune_round_trips_through_from_pretrained(kind: str, tmp_path) -> None:
    """prune_to_target(experts=True, uniform=True) to a parameter budget, on a model whose
    experts 1 and 3 add almost nothing (their down projections scaled to ~0), removes the
    same experts' count from every layer; the shrunk config holds it and plain
    from_pretrained gives back the masked model's logits."""
    model, inputs = hf_moe(kind, "batched_mm")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.down_proj[[1, 3]] *= 1e-4
    ids = inputs["input_ids"]
    with pytest.warns(UserWarning, match=r"experts \(2 of 4: its own floor, top_k=2\)"):
        result = fp.prune_to_target(
            model, inputs, [(inputs, ids)], "75%", loss_fn=lambda out, t: _lm_loss(out.logits, t),
            convention="params", experts=True, uniform=True, reconstruct=False,
        )  # fmt: skip
    assert result.cost_after <= result.target
    gates = _gates(fp.find_masks(model))
    assert [g.mask.tolist() for g in gates] == [[1.0, 0.0, 1.0, 0.0]] * 2
    with torch.no_grad():
        masked = call(model, inputs)
    small = fp.shrink(model, inputs)
    field = "num_experts" if kind == "qwen3_moe" else "num_local_experts"
    assert getattr(small.config, field) == 2
    assert small.num_experts == 2  # the causal LM's count, read by its load-balancing loss
    small.save_pretrained(tmp_path)
    back = type(small).from_pretrained(tmp_path, dtype=torch.float64).eval()
    back.config._attn_implementation = "eager"
    back.config._experts_implementation = "batched_mm"
    assert getattr(back.config, field) == 2
    with torch.no_grad():
        assert _close(call(back, inputs), masked, ATOL64)


@pytest.mark.filterwarnings("ignore:mask\\(s\\) left at their floor")
def test_cli_prune_experts_writes_a_folder_with_fewer_experts(tmp_path) -> None:
    """``fisherprune prune FOLDER --experts --uniform --convention params`` on a Qwen3-MoE
    whose experts 1 and 3 add almost nothing removes them in every layer: hf/ loads with plain
    from_pretrained with num_experts 2, and report.json records each layer's experts kept."""
    from tests.test_cli import run_cli
    from tests.test_perplexity import text_folder

    transformers = pytest.importorskip("transformers")
    model, _ = hf_moe("qwen3_moe", "eager")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.down_proj[[1, 3]] *= 1e-4
    folder, text, _ = text_folder(tmp_path, model.float())
    out = tmp_path / "out"
    cli = run_cli("prune", folder, "--text", text, "--seq_len", 8, "--target", "75%",
                  "--convention", "params", "--uniform", "--experts", "--no-reconstruct",
                  "--out", out)  # fmt: skip
    assert cli.code == 0, cli.err
    back = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    assert back.config.num_experts == 2
    kept = json.loads((out / "report.json").read_text())["channels_kept"]
    assert [v for n, v in kept.items() if n.endswith(":experts")] == [{"kept": 2, "of": 4}] * 2


def test_plan_json_rebuilds_the_shrunk_model_from_a_dense_copy() -> None:
    """A PruningPlan read off a model with experts gated off (different counts per layer),
    through JSON, applied to a dense copy, gives the shrunk model's experts and logits."""
    model, inputs = hf_moe("qwen3_moe", "eager")
    dense = copy.deepcopy(model)
    gates = _gates(fp.apply_masks(model, inputs, experts=True))
    with torch.no_grad():
        gates[1].mask[[1, 2]] = 0
    plan = fp.PruningPlan.from_json(fp.PruningPlan.from_model(model, inputs).to_json())
    small = fp.shrink(model, inputs)
    rebuilt = plan.apply(dense)
    assert [layer.mlp.experts.num_experts for layer in rebuilt.model.layers] == [4, 2]
    assert rebuilt.num_experts == 4  # layers of different counts: the model's own is left
    with torch.no_grad():
        torch.testing.assert_close(call(rebuilt, inputs), call(small, inputs), rtol=0, atol=0)


def test_remove_masks_takes_the_expert_hooks_away() -> None:
    """remove_masks after gating an expert off leaves the dense logits and no hook."""
    model, inputs = hf_moe("mixtral", "eager")
    with torch.no_grad():
        before = call(model, inputs)
    gates = _gates(fp.apply_masks(model, inputs, experts=True))
    with torch.no_grad():
        gates[0].mask[0] = 0
        assert not torch.equal(call(model, inputs), before)
    fp.remove_masks(model)
    mlp = model.model.layers[0].mlp
    assert not (mlp._forward_pre_hooks or mlp.gate._forward_hooks or mlp.gate._forward_pre_hooks)
    with torch.no_grad():
        assert torch.equal(call(model, inputs), before)


def test_deepseek_v3_router_is_refused() -> None:
    """DeepSeek-V3's router (a score-correction bias, group-limited routing) is refused with
    one line naming the router and the reason; nothing is added."""
    model, inputs = hf_moe("deepseek_v3")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate holds e_score_correction"):
        fp.apply_masks(model, inputs, experts=True)
    assert not fp.find_masks(model)


def test_a_model_without_experts_is_refused() -> None:
    """experts=True on a model with no mixture-of-experts layer raises one clear error."""
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    with pytest.raises(ValueError, match="no mixture-of-experts layer"):
        fp.apply_masks(model, torch.randn(2, 4), experts=True)
    assert not fp.find_masks(model)
