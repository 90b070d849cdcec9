"""prune_to_target: the target is met, nothing but masks (and, with repair, the repaired
layers) changes, the signal is the training-time estimate over all calibration examples, and
every criterion runs the same workflow."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.calibrate.to_target import (
    UNREACHED,
    PruneResult,
    _stuck_message,
    estimate_signals,
)
from fisherprune.criteria import L1, Activation, Random, Taylor
from tests import zoo


def _data(n: int = 48) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return zoo.image_input(n), torch.randint(0, zoo.NUM_CLASSES, (n,), generator=g)


def _batches(x: Tensor, y: Tensor, size: int = 16) -> list[tuple[Tensor, Tensor]]:
    return [(x[i : i + size], y[i : i + size]) for i in range(0, x.shape[0], size)]


def _net() -> nn.Module:
    return zoo.build_resnet_basic(seed=0)


def test_meets_the_target_and_reports_the_cost() -> None:
    """cost_after is at or below the target and equals computational_cost of the masked model;
    events record every removal; the phases are timed."""
    net = _net()
    x, y = _data()
    result = fp.prune_to_target(net, x[:1], _batches(x, y), "50%", loss_fn=F.cross_entropy)
    total = fp.computational_cost(net, x[:1]).total
    assert result.cost_after == pytest.approx(total) and result.cost_after <= result.target
    assert result.target == pytest.approx(0.5 * result.cost_before)
    removed = sum(len(e.channels) for e in result.events)
    assert removed == sum(m.num_channels - m.kept for m in fp.find_masks(net).values())
    assert set(result.phase_seconds) == {"signals", "selection", "repair"}
    assert result.examples == 48


def test_without_repair_no_weight_statistic_grad_or_flag_changes() -> None:
    """reconstruct=False: parameters, batch-norm statistics, .grad and train flags are as they
    were; only mask buffers changed."""
    net = _net().train()
    x, y = _data()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    fp.prune_to_target(
        net, x[:1], _batches(x, y), "60%", loss_fn=F.cross_entropy, reconstruct=False, rounds=2
    )
    after = net.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert all(p.grad is None for p in net.parameters())
    assert all(m.training for m in net.modules())
    assert any(m.kept < m.num_channels for m in fp.find_masks(net).values())
    assert not any(m.collecting for m in fp.find_masks(net).values())


def test_one_round_signal_is_the_training_time_estimate_over_all_examples() -> None:
    """With one scoring (rounds=1, round_cap=1) each mask's (float32) signal equals
    update_pruning_signals(decay=0) after one backward of the mean loss over all calibration
    examples at once, in eval mode."""
    torch.manual_seed(0)
    net = _net().double()
    x, y = _data()
    x = x.double()
    ref = _net().double()
    ref.load_state_dict(net.state_dict())
    fp.apply_masks(ref, x[:1])
    ref.eval()
    F.cross_entropy(ref(x), y).backward()
    fp.update_pruning_signals(fp.find_masks(ref), decay=0.0)
    result = fp.prune_to_target(
        net,
        x[:1],
        _batches(x, y),
        "70%",
        loss_fn=F.cross_entropy,
        reconstruct=False,
        rounds=1,
        round_cap=1.0,
    )
    assert result.rounds == 1
    for name, m in fp.find_masks(net).items():
        torch.testing.assert_close(m.signal, fp.find_masks(ref)[name].signal, rtol=1e-6, atol=0)


def test_rounds_stop_at_equal_cost_ratios() -> None:
    """With rounds=3 and no cap (round_cap=1) round r removes channels until
    start * (target / start) ** (r / 3): the last event of each round is the first at or
    below it, and every round prunes."""
    net = _net()
    x, y = _data()
    result = fp.prune_to_target(
        net,
        x[:1],
        _batches(x, y),
        "40%",
        loss_fn=F.cross_entropy,
        rounds=3,
        round_cap=1.0,
        reconstruct=False,
    )
    assert result.rounds == 3 and {e.step for e in result.events} == {1, 2, 3}
    for r in (1, 2, 3):
        goal = result.cost_before * 0.4 ** (r / 3)
        costs = [e.cost_after for e in result.events if e.step == r]
        assert costs[-1] <= goal * (1 + 1e-9) and all(c > goal for c in costs[:-1])


@pytest.mark.parametrize(
    "criterion", ["taylor", L1(), Random(3), Taylor(normalize="l2"), Activation()]
)
def test_every_criterion_runs_the_workflow(criterion: object) -> None:
    """Gradient, weight-only and activation criteria reach the target the same way (a
    ResNet: convolutions read the activation criterion's channels)."""
    net = _net()
    x, y = _data()
    result = fp.prune_to_target(
        net,
        x[:1],
        _batches(x, y),
        "50%",
        loss_fn=F.cross_entropy,
        criterion=criterion,
        flops_weight=0,
    )
    assert result.cost_after <= result.target


def test_min_channels_and_round_to_are_honoured() -> None:
    """Every mask keeps at least half its channels and a multiple of 2 (or its full width)."""
    net = _net()
    x, y = _data()
    fp.prune_to_target(
        net, x[:1], _batches(x, y), "80%", loss_fn=F.cross_entropy, min_channels=0.5, round_to=2
    )
    for m in fp.find_masks(net).values():
        assert m.kept >= m.num_channels / 2
        assert m.kept % 2 == 0 or m.kept == m.num_channels


def test_keyword_inputs_and_an_iterator_of_batches() -> None:
    """A model called with keyword inputs; batches given as a one-pass generator."""

    class _Kw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 3)

        def forward(self, features: Tensor) -> Tensor:
            return self.b(torch.relu(self.a(features)))

    torch.manual_seed(0)
    net = _Kw()
    x = torch.randn(40, 4)
    gen = (({"features": x[i : i + 10]}, None) for i in range(0, 40, 10))
    result = fp.prune_to_target(net, {"features": x[:1]}, gen, "50%", rounds=2)
    assert result.cost_after <= result.target and result.repair is not None
    assert result.repair.examples == 40


def _hf_classifier() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).eval()


def _hf_rows(n: int = 24) -> list[dict[str, Tensor]]:
    """Rows as a Hugging Face dataset gives them to a DataLoader: keyword inputs and labels."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (n, 12), generator=g)
    labels = torch.randint(0, 3, (n,), generator=g)
    return [
        {"input_ids": ids[i], "attention_mask": torch.ones(12, dtype=torch.long),
         "labels": labels[i]}
        for i in range(n)
    ]  # fmt: skip


def _removed(net: nn.Module) -> dict[str, list[int]]:
    return {n: (m.mask < 0.5).nonzero().flatten().tolist() for n, m in fp.find_masks(net).items()}


def test_a_hugging_face_dataloader_of_dict_batches_prunes_as_pairs_do() -> None:
    """Batches of a DataLoader over Hugging Face rows (dicts with ``labels``) are the model's
    keyword inputs: with the model's own loss (``out.loss``) they remove the channels that
    (inputs, labels) pairs with cross-entropy remove (it failed with "too many values to
    unpack")."""
    rows = _hf_rows()
    loader = torch.utils.data.DataLoader(rows, batch_size=8)
    example = {k: v[:1] for k, v in next(iter(loader)).items() if k != "labels"}
    by_dict = _hf_classifier()
    fp.prune_to_target(by_dict, example, loader, "50%", loss_fn=lambda out, _: out.loss)
    pairs = [({k: v for k, v in b.items() if k != "labels"}, b["labels"]) for b in loader]
    by_pair = _hf_classifier()
    fp.prune_to_target(
        by_pair, example, pairs, "50%", loss_fn=lambda out, y: F.cross_entropy(out.logits, y)
    )
    assert _removed(by_dict) == _removed(by_pair) and any(_removed(by_dict).values())


@pytest.mark.parametrize("batch", [(1, 2, 3), torch.zeros(2, 4)])
def test_a_batch_neither_pair_nor_dict_is_refused_naming_it(batch: object) -> None:
    net = _net()
    x, _ = _data(2)
    with pytest.raises(
        ValueError, match=r"\(inputs, targets\) pair or a dict.*got a (tuple of 3|Tensor)"
    ):
        fp.prune_to_target(net, x[:1], [batch], "50%")


def test_repaired_model_shrinks_to_the_same_outputs() -> None:
    """After prune_to_target with repair, shrink gives the masked model's outputs."""
    net = _net().eval()
    x, y = _data()
    fp.prune_to_target(net, x[:1], _batches(x, y), "50%", loss_fn=F.cross_entropy)
    with torch.no_grad():
        masked = net(x)
        small = fp.shrink(net)
        torch.testing.assert_close(small(x), masked, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("target", "match"), [("150%", "must lie between"), ("abc", "not a number")]
)
def test_bad_target_is_refused(target: str, match: str) -> None:
    net = _net()
    x, y = _data(8)
    with pytest.raises(ValueError, match=match):
        fp.prune_to_target(net, x[:1], _batches(x, y), target)


def test_no_batches_is_refused() -> None:
    net = _net()
    x, _ = _data(2)
    with pytest.raises(ValueError, match="no calibration batches"):
        fp.prune_to_target(net, x[:1], [], "50%")


def test_repair_budget_is_the_dense_flops_times_the_forwards() -> None:
    """The repair's passes and examples follow ``repair_budget`` in FLOPs: the dense model's
    FLOPs per example times ``examples x (passes + 1)`` (one stage per pass with no limit),
    and ``repair_examples`` caps the examples read."""
    x, y = _data()
    free = fp.prune_to_target(_net(), x[:1], _batches(x, y), "50%", repair_budget=None)
    stages = free.repair.passes
    assert free.repair.examples == 48 and 1 < stages <= 8
    budget = free.cost_before * 16 * (stages + 1)  # one batch of 16, one stage per pass
    cut = fp.prune_to_target(_net(), x[:1], _batches(x, y), "50%", repair_budget=budget)
    assert (cut.repair.passes, cut.repair.examples) == (stages, 16)
    few = fp.prune_to_target(_net(), x[:1], _batches(x, y), "50%", repair_examples=32)
    assert (few.repair.passes, few.repair.examples) == (stages, 32)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"repair_passes": 0}, "repair_passes"),
        ({"repair_examples": 1.5}, "repair_examples"),
        ({"repair_budget": -1.0}, "repair_budget"),
    ],
)
def test_bad_repair_settings_are_refused_before_anything_changes(kw: dict, match: str) -> None:
    net = _net()
    x, y = _data(8)
    with pytest.raises(ValueError, match=match):
        fp.prune_to_target(net, x[:1], _batches(x, y), "50%", **kw)
    assert not fp.find_masks(net)


def _mlp(hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 3)
    )


def _mlp_floor_share() -> float:
    """FLOPs of the MLP with both hidden layers at one unit over the dense one's, counted by
    PyTorch's FlopCounterMode on models built at those widths (not by the cost model)."""
    from torch.utils.flop_counter import FlopCounterMode

    def flops(model: nn.Module) -> int:
        with FlopCounterMode(display=False) as counter:
            model(torch.randn(1, 12))
        return counter.get_total_flops()

    return flops(_mlp(1)) / flops(_mlp(32))


def test_an_unreachable_target_is_refused_before_anything_changes() -> None:
    """A target below the FLOPs of the model with every hidden layer at one unit is refused
    without uniform=True too (it used to prune every layer to one unit, then warn): the error
    names the floor as a share, and no mask, signal or weight changed."""
    net = _mlp(32)
    x = torch.randn(32, 12, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(2))
    fp.apply_masks(net, x[:1])
    before = {k: v.clone() for k, v in net.state_dict().items()}
    floor = _mlp_floor_share()
    target = f"{floor * 100 - 1:.1f}%"
    with pytest.raises(ValueError, match="out of reach") as caught:
        fp.prune_to_target(net, x[:1], [(x, y)], target, loss_fn=F.cross_entropy)
    assert f"its floor is {floor:.1%}" in str(caught.value), (floor, str(caught.value))
    assert "nothing was changed" in str(caught.value)
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_target_at_the_named_floor_is_reached() -> None:
    """Two-sided: just above the floor the refusal names, the prune runs and meets it."""
    net = _mlp(32)
    x = torch.randn(32, 12, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(2))
    target = f"{_mlp_floor_share() * 100 + 0.5:.1f}%"
    with pytest.warns(UserWarning, match="floor"):
        result = fp.prune_to_target(net, x[:1], [(x, y)], target, loss_fn=F.cross_entropy)
    assert result.cost_after <= result.target


def test_a_refused_target_leaves_an_unmasked_model_without_masks() -> None:
    """prune_to_target masks a model that has none before it prices the floor; when it then
    refuses the target, it takes those masks off again: the state_dict has the same keys and
    values as before the call, and no mask is left."""
    net = _mlp(32)
    x = torch.randn(32, 12, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(2))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ValueError, match="nothing was changed"):
        fp.prune_to_target(net, x[:1], [(x, y)], "1%", loss_fn=F.cross_entropy)
    after = net.state_dict()
    assert not fp.find_masks(net) and list(after) == list(before)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    ("target", "kw", "match"),
    [("150%", {}, "must lie between"), ("50%", {"convention": "nope"}, "convention"),
     ("50%", {"latency": fp.LatencySpec()}, "latency= describes")],
)  # fmt: skip
def test_any_error_before_the_first_removal_takes_the_masks_it_added_off(
    target: str, kw: dict, match: str
) -> None:
    """An unmasked model given to prune_to_target, which masks it, comes back as it was
    (no mask, the same state_dict keys) when the call fails before it prunes anything."""
    net = _mlp(16)
    x = torch.randn(16, 12, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(2))
    keys = list(net.state_dict())
    with pytest.raises(ValueError, match=match):
        fp.prune_to_target(net, x[:1], [(x, y)], target, loss_fn=F.cross_entropy, **kw)
    assert not fp.find_masks(net) and list(net.state_dict()) == keys


def test_a_latency_spec_with_computed_conventions_is_refused_not_ignored() -> None:
    """latency= with the default FLOPs convention used to be dropped silently (the prune then
    priced FLOPs); prune_to_target and PruningOptimizer refuse it, naming what to pass."""
    net = _mlp(16)
    x = torch.randn(16, 12, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="convention='latency'"):
        fp.prune_to_target(net, x[:1], [(x, y)], "50%", latency=fp.LatencySpec())
    fp.apply_masks(net, x[:1])
    with pytest.raises(ValueError, match="convention='latency'"):
        fp.PruningOptimizer(net, x[:1], flops_target="50%", latency=fp.LatencySpec())


def test_a_depth_only_target_below_one_block_is_refused_naming_that_floor() -> None:
    """blocks="only" on a 3-layer Llama by parameters: with every channel kept its floor is one
    layer, so 20% is refused naming blocks='only' and that floor, which is the parameter share
    of the same model built with one layer (counted by PyTorch, not the cost model)."""
    transformers = pytest.importorskip("transformers")

    def llama(layers: int) -> nn.Module:
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64,
        )  # fmt: skip
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).eval()

    def params(model: nn.Module) -> int:
        return sum(p.numel() for p in model.parameters())

    floor = params(llama(1)) / params(llama(3))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model = llama(3)
    with pytest.raises(ValueError, match="out of reach with blocks='only'") as caught:
        fp.prune_to_target(
            model, {"input_ids": ids[:1]}, [{"input_ids": ids}], "20%", blocks="only",
            convention="params",
        )  # fmt: skip
    assert f"its floor is {floor:.1%}" in str(caught.value), (floor, str(caught.value))
    assert not fp.find_masks(model)


def test_a_chunk_that_went_past_the_goal_is_redone_one_removal_at_a_time(monkeypatch) -> None:
    """The cost reports' marginal costs price a fifth of what each removal saves (as a latency
    table's staircase under-prices a mask's blocks after its first): a chunk of removals then
    lands well past the goal (at 93% of a 50% target before). It is undone and the goal
    approached one removal per exact report, so the prune lands where it does with exact
    marginals (97%: this network's removals are coarse)."""
    from fisherprune.cost.model import CostModel

    real = CostModel.report

    def under_priced(self, *args, **kwargs):
        rep = real(self, *args, **kwargs)
        rep.marginal = {n: v * 0.2 for n, v in rep.marginal.items()}
        return rep

    x, y = _data()
    landed = {}
    for priced in ("exact", "a fifth"):
        if priced == "a fifth":
            monkeypatch.setattr(CostModel, "report", under_priced)
        result = fp.prune_to_target(
            _net(), x[:1], _batches(x, y), "50%", loss_fn=F.cross_entropy, reconstruct=False
        )
        landed[priced] = result.cost_after / result.target
    assert landed["exact"] - 0.005 <= landed["a fifth"] <= 1, landed


class _TwoHeads(nn.Module):
    """A classifier that also returns a second head's output, which the loss leaves unused
    (as a Hugging Face image classifier's pooler)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        self.aux = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.body(x), self.aux(x)


def _two_heads_data() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g))] * 3


def _first_output_loss(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    return F.cross_entropy(out[0], y)


def test_a_mask_the_loss_does_not_reach_is_kept_whole_and_listed() -> None:
    """A mask no calibration gradient reaches is left whole, named in a warning and in
    ``kept_whole`` (it raised, so such a model could not be pruned at all), while the others
    reach the target; the shrunk model gives both outputs of the masked one."""
    net, data = _TwoHeads(), _two_heads_data()
    x = data[0][0]
    with pytest.warns(UserWarning, match="aux_0:out whole: no gradient reached"):
        result = fp.prune_to_target(net, x[:1], data, 0.75, loss_fn=_first_output_loss)
    masks = fp.find_masks(net)
    (aux,) = [n for n in masks if "aux" in n]
    assert result.kept_whole == {aux: UNREACHED}
    assert masks[aux].kept == masks[aux].num_channels
    assert result.cost_after <= result.target
    small = fp.shrink(net, x)
    with torch.no_grad():
        for a, b in zip(small(x), net(x), strict=True):
            torch.testing.assert_close(a, b)


def test_a_target_beyond_what_the_reached_masks_allow_is_refused_naming_the_rest() -> None:
    """When the masks the loss reaches cannot meet the target alone, the refusal says which
    mask was kept whole for want of a gradient, and the model is given back unmasked."""
    net, data = _TwoHeads(), _two_heads_data()
    x = data[0][0]
    with (
        pytest.warns(UserWarning, match="no gradient"),
        pytest.raises(
            ValueError,
            match=r"no gradient reached in the calibration passes kept whole, e\.g\. .*aux",
        ),
    ):
        fp.prune_to_target(net, x[:1], data, 0.3, loss_fn=_first_output_loss)
    assert not fp.find_masks(net)


def test_estimate_signals_refuses_a_mask_the_loss_does_not_reach_unless_asked() -> None:
    """``estimate_signals`` raises naming a mask no gradient reached; given an ``unreached``
    set, it adds the mask there instead and estimates the others."""
    net, data = _TwoHeads(), _two_heads_data()
    masks = fp.apply_masks(net, data[0][0][:1])
    with pytest.raises(ValueError, match=r"aux_0:out.*received no gradient"):
        estimate_signals(net, masks, data, _first_output_loss, fp.criteria.Fisher())
    unreached: set[str] = set()
    estimate_signals(net, masks, data, _first_output_loss, fp.criteria.Fisher(), None, None,
                     unreached)  # fmt: skip
    (body,) = [n for n in masks if "body" in n]
    assert unreached == set(masks) - {body}
    assert bool((masks[body].signal > 0).any())


class _TwinHeads(nn.Module):
    """Two copies of one head (``uniform=True`` keeps them at one width); the loss reads the
    first."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads = nn.ModuleList(
            nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)) for _ in range(2)
        )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.heads[0](x), self.heads[1](x)


def test_uniform_keeps_the_copies_of_a_mask_the_loss_does_not_reach_whole_and_says_so() -> None:
    """With ``uniform=True`` a mask no gradient reached keeps its copies whole too (they must
    keep one width, and nothing tells which of its channels to drop): a target that needs
    them is refused naming both, and what to do."""
    net, data = _TwinHeads(), _two_heads_data()
    x = data[0][0]
    with pytest.warns(UserWarning, match="no gradient"), pytest.raises(ValueError) as caught:
        fp.prune_to_target(net, x[:1], data, 0.75, loss_fn=_first_output_loss, uniform=True)
    text = str(caught.value)
    assert "heads_1_0:out: the loss does not use their output" in text
    assert "1 of their copies, e.g. fisherprune_masks.heads_0_0:out" in text
    assert "build the model without it" in text and "nothing was changed" in text


def test_a_stuck_prune_names_the_unreached_masks_once() -> None:
    """When every mask that may be pruned is at its floor and masks no gradient reached were
    kept whole, the reason says so once (it was added twice)."""
    result = PruneResult(100.0, 80.0, 50.0, kept_whole={"m_aux": UNREACHED})
    text = _stuck_message(result, 50.0, 1, 1, None)
    assert text.count("no gradient reached") == 1 and "e.g. m_aux" in text
    assert text.startswith("every mask is at its floor (min_channels=1, round_to=1)")
