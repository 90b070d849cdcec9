"""Example inputs everywhere: a tensor, a tuple of positional arguments or a dict of keyword ones.

The convention (``fisherprune.inputs``) is checked directly against what a model receives, then
through every function that runs a model on example inputs, with a small model written here
that takes its inputs by keyword (``forward(input_ids, attention_mask=None, *, scale=1.0)``),
and with Hugging Face BERT and GPT-2 built from tiny configurations (random weights, nothing
downloaded) called with their own keyword inputs, no wrapper.

References are independent of the code under test: ``FlopCounterMode`` on the shrunk network or
on a network built narrower from its constructor, the masked model's own output in float64,
and the files read back by ``torch.jit.load``, ONNX's reference evaluator and
``load_aoti_export``. Files are written under ``tmp_path`` only.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import fisherprune as fp
import fisherprune.export as fpe
from fisherprune.inputs import Inputs, batch_size, call_model
from fisherprune.masks.points import find_holder

# ------------------------------------------------------------------ tolerances
ATOL_F64 = 1e-10  # shrunk vs masked output, float64, relative to max(1, max |masked output|)
ATOL_F32 = 1e-5  # exported (float32) vs masked output, same scaling

logging.getLogger("fisherprune").setLevel(logging.ERROR)  # apply_masks lists unmasked channels


def _assert_close(actual: Tensor, expected: Tensor, atol: float) -> None:
    assert actual.shape == expected.shape
    scale = max(1.0, float(expected.abs().max()))
    err = float((actual.to(expected.dtype) - expected).abs().max())
    assert err <= atol * scale, f"max abs error {err:.3g} > {atol * scale:.3g}"


def _flops(model: Any, inputs: Any) -> float:
    """FlopCounterMode's total for one call of ``model`` on ``inputs`` (called by hand)."""
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        if isinstance(inputs, dict):
            model(**inputs)
        else:
            model(*inputs)
    return float(counter.get_total_flops())


# ===================================================== the convention itself
class _Recorder:
    """A callable that remembers the positional and keyword arguments of its last call."""

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        self.args, self.kwargs = args, kwargs
        return "called"


_X, _Y = torch.zeros(2, 3), torch.ones(2, 4)
_PAIR = [_X, _Y]  # one list argument (compared by identity)


@pytest.mark.parametrize(
    ("inputs", "args", "kwargs"),
    [
        (_X, (_X,), {}),
        ((_X, _Y), (_X, _Y), {}),
        ([_X, _Y], (_X, _Y), {}),
        ({"x": _X, "mask": None, "flag": True}, (), {"x": _X, "mask": None, "flag": True}),
        ((_PAIR,), (_PAIR,), {}),
    ],
    ids=["tensor", "tuple", "list", "dict", "one-list-argument"],
)
def test_inputs_reach_the_model_as_the_convention_says(
    inputs: Any, args: tuple, kwargs: dict[str, Any]
) -> None:
    """A tensor is the one positional argument, a tuple or list the positional arguments, a
    dict the keyword arguments; non-tensor values (None, bools) arrive unchanged."""
    rec = _Recorder()
    assert call_model(rec, inputs) == "called"
    assert len(rec.args) == len(args) and all(a is b for a, b in zip(rec.args, args, strict=True))
    assert rec.kwargs.keys() == kwargs.keys()
    assert all(rec.kwargs[k] is v for k, v in kwargs.items())


_IMG = torch.zeros(3, 8, 8)  # (C, H, W): C = 3 must not be read as a batch


@pytest.mark.parametrize(
    ("inputs", "expected"),
    [
        (torch.zeros(4, 3), 4),
        ((torch.zeros(5, 2), torch.zeros(7, 2)), 5),  # the first argument sets it
        ({"mask": None, "ids": torch.zeros(6, 9, dtype=torch.long)}, 6),  # None has no batch
        ((torch.tensor(2.0), torch.zeros(3, 2)), 3),  # neither has a 0-d tensor
        (([_IMG, _IMG],), 2),  # a list of images: one example per image
        (([_IMG] * 5, torch.zeros(9, 1)), 5),
        (({"a": torch.zeros(7, 2)},), 7),  # a nested dict: its first tensor's dim 0
        ({"images": (_IMG, _IMG, _IMG, _IMG)}, 4),
        ((torch.zeros(1, 5), torch.zeros(3, 5)), 3),  # a batch of 1 first broadcasts
        ((torch.zeros(1, 5), torch.zeros(1, 5)), 1),
        ((torch.zeros(1, 3, 4), torch.zeros(100, 8)), 1),  # a table of another shape: no
    ],
    ids=[
        "tensor",
        "first-arg",
        "skip-none",
        "skip-0d",
        "list",
        "list-first",
        "nested",
        "kw-list",
        "one-broadcasts",
        "all-one",
        "one-beside-a-table",
    ],
)
def test_batch_size_follows_the_documented_rule(inputs: Any, expected: int) -> None:
    """The batch is the first argument's that has one: a tensor's dim 0, a list or tuple of
    tensors' length, a nested value's first tensor's dim 0; None, numbers and 0-d tensors
    have none; a first batch of 1 gives way to a later larger one of its shape past dim 0 (it
    broadcasts), not to a tensor of another shape."""
    assert batch_size(inputs) == expected


@pytest.mark.parametrize(
    "inputs", [torch.tensor(1.0), (None, 3), {}, {"mask": None}], ids=["0d", "none", "empty", "kw"]
)
def test_inputs_without_a_batch_raise_value_error(inputs: Any) -> None:
    """Inputs with no tensor of at least one dimension have no batch: ValueError saying so."""
    with pytest.raises(ValueError, match="batch dimension"):
        batch_size(inputs)


def test_a_dict_with_a_key_that_is_not_a_string_raises_type_error() -> None:
    """A dict stands for keyword arguments, so a non-string key is refused, named."""
    with pytest.raises(TypeError, match="strings; got 0"):
        Inputs.of({0: torch.zeros(2, 3)})


def test_a_dict_for_a_positional_forward_says_what_to_pass_instead() -> None:
    """A dict of example inputs given to a model whose forward takes one positional input:
    a TypeError naming the forward's input and the dict's keys and saying to pass the tensor
    itself or a tuple (it was Python's 'got an unexpected keyword argument')."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(TypeError) as info:
        fp.apply_masks(model, {"pixel_values": _X})
    text = str(info.value)
    assert text.startswith("Sequential.forward takes input, not the keys ['pixel_values']")
    assert "pass the tensor itself" in text and "a tuple" in text


def test_a_type_error_inside_a_forward_that_takes_the_dict_is_raised_as_it_is() -> None:
    """When the forward's signature takes the dict's keys, a TypeError raised inside it is
    the one the caller gets, not a message blaming the dict."""
    raised = TypeError("inside the forward")

    def forward(x: Tensor) -> Tensor:
        raise raised

    with pytest.raises(TypeError) as info:
        call_model(forward, {"x": _X})
    assert info.value is raised


@pytest.mark.parametrize(
    ("args", "kwargs", "form"),
    [((_X,), {}, "dict"), ((), {"x": _X}, "tuple"), ((_X, _Y), {}, "one"), ((), {}, "set")],
    ids=["args-as-dict", "kwargs-as-tuple", "two-as-one", "unknown"],
)
def test_inputs_refuse_a_form_their_arguments_do_not_fit(
    args: tuple, kwargs: dict[str, Any], form: str
) -> None:
    """Positional arguments in the dict form, keyword ones in a positional form, two arguments
    as one, or an unknown form raise ValueError instead of being called wrongly."""
    with pytest.raises(ValueError, match="form"):
        Inputs(args, kwargs, form)


def test_batch_of_one_cuts_only_batch_data() -> None:
    """The batch-of-one copy keeps the first row of every batch tensor and the first item of a
    list of examples; a tensor whose dim 0 is not the batch (a table shared by all examples)
    stays whole, and non-tensor values stay as they are."""
    table = torch.randn(5, 2)
    imgs = [torch.randn(3, 4, 4) for _ in range(4)]
    ids = torch.arange(24).view(4, 6)
    given = {"images": imgs, "ids": ids, "table": table, "mask": None, "flag": False}
    one = Inputs.of(given).batch_of_one().value()
    assert len(one["images"]) == 1 and torch.equal(one["images"][0], imgs[0])
    assert torch.equal(one["ids"], ids[:1]) and torch.equal(one["table"], table)
    assert one["mask"] is None and one["flag"] is False


@pytest.mark.parametrize(
    "given",
    [torch.randn(3, 2), (torch.randn(3, 2),), [torch.randn(3, 2)], {"x": torch.randn(3, 2)}],
    ids=["tensor", "tuple", "list", "dict"],
)
def test_batch_of_one_keeps_the_form_and_shares_no_storage(given: Any) -> None:
    """The copy has the form it was given in (tensor, tuple, list, dict) and shares no memory
    with the inputs (the model's caller may change them afterwards)."""
    one = Inputs.of(given).batch_of_one().value()
    assert type(one) is type(given)
    src, got = Inputs.of(given).tensors()[0][0], Inputs.of(one).tensors()[0][0]
    assert (
        got.shape[0] == 1 and got.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    )


# ====================================================== a keyword-input model
VOCAB, LENGTH = 20, 6
WIDTHS = {"emb": 8, "up": 12, "mid": 10}  # the prunable channels, by producing layer


class _Tagger(nn.Module):
    """Token ids and an optional attention mask, both by keyword as Hugging Face models take
    them, and a keyword-only number: embedding (N, L, 8) -> linear 12 -> relu -> linear 10 ->
    relu -> linear 5, zeroed at padding, averaged over the tokens and scaled: (N, 5). Its 8
    embedding columns and 12 and 10 hidden units are the prunable channels."""

    def __init__(
        self, emb: int = WIDTHS["emb"], up: int = WIDTHS["up"], mid: int = WIDTHS["mid"]
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, emb)
        self.up, self.mid, self.out = nn.Linear(emb, up), nn.Linear(up, mid), nn.Linear(mid, 5)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, scale: float = 1.0
    ) -> Tensor:
        h = self.emb(input_ids)  # (N, L, 8)
        h = self.out(F.relu(self.mid(F.relu(self.up(h)))))  # (N, L, 5)
        if attention_mask is not None:
            h = h * attention_mask[..., None].to(h.dtype)
        return scale * h.mean(1)  # (N, 5)


def _tokens(batch: int, seed: int = 0) -> dict[str, Tensor]:
    """Keyword inputs: random token ids and an attention mask with the last tokens of the
    first example padded."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, LENGTH, dtype=torch.long)
    mask[0, LENGTH - 2 :] = 0
    return {
        "input_ids": torch.randint(0, VOCAB, (batch, LENGTH), generator=gen),
        "attention_mask": mask,
    }


#: entries zeroed in each hidden layer's mask, by the layer that produces the units
ZEROED = {"emb": [1, 6], "up": [0, 3, 4, 9], "mid": [2, 7]}


def _masked_tagger(dtype: torch.dtype = torch.float64, batch: int = 4) -> nn.Module:
    """A ``_Tagger`` (seeded) with masks applied on keyword inputs and ``ZEROED`` zeroed."""
    torch.manual_seed(0)
    model = _Tagger().to(dtype).eval()
    masks = fp.apply_masks(model, _tokens(batch))
    for name, mask in masks.items():
        (producer,) = masks.groups[name].producers
        mask.mask[ZEROED[producer]] = 0
    return model


def _eval(model: Any, inputs: dict[str, Any]) -> Tensor:
    with torch.no_grad():
        return model(**inputs)


def test_apply_masks_with_keyword_inputs_masks_every_inner_layer() -> None:
    """A dict of inputs is traced as keyword arguments: one mask per layer's output channels
    (embedding columns, hidden units), of its width; with all masks at one the output is
    unchanged."""
    torch.manual_seed(0)
    model = _Tagger().double().eval()
    inputs = _tokens(3)
    before = _eval(model, inputs)
    masks = fp.apply_masks(model, inputs)
    widths = {g.producers[0]: g.num_channels for g in masks.groups.values()}
    assert widths == WIDTHS
    assert torch.equal(_eval(model, inputs), before)


def test_apply_masks_remembers_one_example_as_keyword_inputs() -> None:
    """What apply_masks keeps for shrink and export is a dict of the first example's inputs."""
    model = _masked_tagger()
    kept = find_holder(model)[1].example_inputs  # type: ignore[index]
    assert isinstance(kept, dict) and set(kept) == {"input_ids", "attention_mask"}
    assert torch.equal(kept["input_ids"], _tokens(4)["input_ids"][:1])


@pytest.mark.parametrize("batch", [1, 4])
def test_cost_with_keyword_inputs_equals_flop_counter_on_the_shrunk_model(batch: int) -> None:
    """computational_cost on keyword inputs is FlopCounterMode's count of the shrunk model
    divided by the batch, whatever the batch; and pruning lowered it."""
    model = _masked_tagger()
    inputs = _tokens(batch, seed=1)
    cost = fp.computational_cost(model, inputs).total
    small = fp.shrink(model, inputs)
    assert cost == _flops(small, inputs) / batch
    assert cost < _flops(_Tagger(), inputs) / batch  # not vacuous: channels were removed


def test_cost_equals_flop_counter_on_a_narrower_model_built_from_its_constructor() -> None:
    """The cost of the masked model equals FlopCounterMode on a _Tagger built with the widths
    left (an independent network), per example."""
    inputs = _tokens(3)
    cost = fp.computational_cost(_masked_tagger(), inputs).total
    narrow = _Tagger(**{k: WIDTHS[k] - len(v) for k, v in ZEROED.items()})
    assert cost == _flops(narrow, inputs) / 3


def test_shrunk_model_gives_the_masked_output_on_keyword_inputs() -> None:
    """shrink (with the remembered dict of one example) gives the masked output in float64 on
    keyword inputs of another batch size, and has fewer parameters."""
    model = _masked_tagger()
    small = fp.shrink(model)
    inputs = _tokens(5, seed=2)
    _assert_close(_eval(small, inputs), _eval(model, inputs), ATOL_F64)
    assert sum(p.numel() for p in small.parameters()) < sum(
        p.numel() for p in _Tagger().parameters()
    )


def test_non_tensor_keyword_values_pass_through_shrink_and_cost() -> None:
    """Keyword values that are not tensors (None, a float) reach the model unchanged in the
    trace and in shrink's check: the cost and the shrunk output are those of that call."""
    model = _masked_tagger()
    inputs = {"input_ids": _tokens(3)["input_ids"], "attention_mask": None, "scale": -2.0}
    small = fp.shrink(model, inputs)
    assert fp.computational_cost(model, inputs).total == _flops(small, inputs) / 3
    expected = -2.0 * _eval(model, {"input_ids": inputs["input_ids"]})
    _assert_close(_eval(small, inputs), expected, ATOL_F64)


def test_plan_json_rebuilds_the_shrunk_model_from_keyword_inputs(tmp_path: Path) -> None:
    """PruningPlan read on keyword inputs -> JSON file -> fresh _Tagger -> shrunk state_dict:
    the masked output."""
    model = _masked_tagger()
    inputs = _tokens(3)
    small = fp.shrink(model, inputs)
    fp.PruningPlan.from_model(model, inputs).save(tmp_path / "plan.json")
    fresh = fp.PruningPlan.load(tmp_path / "plan.json").apply(_Tagger().double())
    fresh.load_state_dict(small.state_dict())
    _assert_close(_eval(fresh, inputs), _eval(model, inputs), ATOL_F64)


def test_state_dict_export_round_trip_with_keyword_inputs(tmp_path: Path) -> None:
    """export_model(state_dict) of a model masked on keyword inputs, loaded into a fresh
    _Tagger: the masked output."""
    model = _masked_tagger()
    path = fp.export_model(model, tmp_path / "m.pt", _tokens(2))
    fresh = fp.load_state_dict_export(path, _Tagger().double())
    inputs = _tokens(3, seed=4)
    _assert_close(_eval(fresh, inputs), _eval(model, inputs), ATOL_F64)


@pytest.mark.parametrize("freeze", [False, True])
def test_torchscript_export_of_keyword_inputs_takes_them_by_keyword(
    freeze: bool, tmp_path: Path
) -> None:
    """A TorchScript file traced on keyword inputs (example_kwarg_inputs) takes them by
    keyword at another batch size and gives the masked output."""
    model = _masked_tagger(torch.float32)
    path = fp.export_model(model, tmp_path / "m.pt", _tokens(2), "torchscript", freeze=freeze)
    loaded = torch.jit.load(str(path))
    inputs = _tokens(5, seed=3)
    _assert_close(_eval(loaded, inputs), _eval(model, inputs), ATOL_F32)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript-based"])
def test_onnx_export_of_keyword_inputs_names_them_and_gives_the_masked_output(
    exporter: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With either ONNX exporter (torch.export's, or the TorchScript-based one used when
    onnxscript is missing), the file's graph inputs are the keywords, its batch is dynamic,
    and ONNX's own reference evaluator gives the masked output at another batch size."""
    onnx = pytest.importorskip("onnx")
    from onnx.reference import ReferenceEvaluator

    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    else:
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a: None if name == "onnxscript" else find_spec(name, *a),
        )
    model = _masked_tagger(torch.float32)
    path = fp.export_model(model, tmp_path / "m.onnx", _tokens(2), "onnx")
    assert [i.name for i in onnx.load(str(path)).graph.input] == ["input_ids", "attention_mask"]
    inputs = _tokens(3, seed=5)
    (out,) = ReferenceEvaluator(str(path)).run(None, {k: v.numpy() for k, v in inputs.items()})
    _assert_close(torch.from_numpy(out), _eval(model, inputs), ATOL_F32)


@pytest.fixture(scope="module")
def aoti_tagger(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The masked _Tagger exported on keyword inputs as an AOTInductor package and loaded
    (compiling takes 10-20 s)."""
    model = _masked_tagger(torch.float32)
    path = tmp_path_factory.mktemp("aoti_kw") / "m.pt2"
    fp.export_model(model, path, _tokens(2), "aoti")
    return {"model": model, "loaded": fpe.load_aoti_export(path)}


def test_aoti_package_of_keyword_inputs_takes_them_in_any_order(
    aoti_tagger: dict[str, Any],
) -> None:
    """The loaded package takes the keywords it was exported with, in any order, at another
    batch size, and gives the masked output."""
    inputs = _tokens(3, seed=6)
    reordered = {"attention_mask": inputs["attention_mask"], "input_ids": inputs["input_ids"]}
    assert aoti_tagger["loaded"].input_names == ["input_ids", "attention_mask"]
    got = aoti_tagger["loaded"](**reordered)
    _assert_close(got, _eval(aoti_tagger["model"], inputs), ATOL_F32)


@pytest.mark.parametrize(
    "call",
    [
        lambda m, t: m(t["input_ids"], t["attention_mask"]),
        lambda m, t: m(input_ids=t["input_ids"]),
        lambda m, t: m(input_ids=t["input_ids"], mask=t["attention_mask"]),
    ],
    ids=["positional", "missing", "unknown"],
)
def test_aoti_package_of_keyword_inputs_rejects_other_arguments(
    aoti_tagger: dict[str, Any], call: Any
) -> None:
    """Positional, missing or unknown inputs raise ValueError naming the keywords it takes
    (the compiled code itself would not check)."""
    with pytest.raises(ValueError, match="takes the keyword inputs input_ids, attention_mask"):
        call(aoti_tagger["loaded"], _tokens(2))


def test_aoti_package_of_keyword_inputs_checks_each_by_name(aoti_tagger: dict[str, Any]) -> None:
    """An input of the wrong dtype is named by its keyword in the error."""
    inputs = _tokens(2)
    inputs["attention_mask"] = inputs["attention_mask"].float()
    with pytest.raises(ValueError, match=r"input 'attention_mask' is torch\.float32"):
        aoti_tagger["loaded"](**inputs)


def test_frozen_for_serving_of_keyword_inputs_gives_the_eval_outputs() -> None:
    """frozen_for_serving traces keyword inputs and gives them back as a dict; the frozen module
    takes them by keyword and gives the model's eval output."""
    model = fp.shrink(_masked_tagger(torch.float32))
    inputs = _tokens(3)
    frozen, given = fpe.frozen_for_serving(model, inputs)
    assert isinstance(given, dict) and set(given) == set(inputs)
    _assert_close(_eval(frozen, given), _eval(model, inputs), ATOL_F32)


def test_measure_latency_calls_every_model_with_the_keyword_inputs() -> None:
    """measure_latency passes a dict as keyword arguments to each model it times."""
    rec = _Recorder()
    inputs = _tokens(2)
    times = fpe.measure_latency({"rec": rec}, inputs, repeats=1, warmup=0, rounds=1)
    assert times["rec"] >= 0 and rec.args == () and set(rec.kwargs) == set(inputs)


def test_pruning_optimizer_with_keyword_inputs_prunes_on_schedule() -> None:
    """PruningOptimizer built from keyword inputs costs the dense model as FlopCounterMode
    does per example, prunes one unit at each due step of a training loop on keyword
    batches, and its cost afterwards is computational_cost's."""
    torch.manual_seed(0)
    model = _Tagger().double()
    inputs = _tokens(4)
    fp.apply_masks(model, inputs)
    opt = fp.PruningOptimizer(model, inputs, lr=0.05, prune_every=2, burn_in=1)
    assert opt.start_cost == _flops(_Tagger(), inputs) / 4
    target = torch.randint(0, 5, (4,), generator=torch.Generator().manual_seed(1))
    for _ in range(6):  # counters 2, 4, 6 are due
        opt.minimize(F.cross_entropy(model(**inputs), target))
    assert len(opt.history) == 3
    assert opt.cost().total == fp.computational_cost(model, _tokens(1)).total < opt.start_cost


# ======================================================== a list of images
class _PerImage(nn.Module):
    """Takes a list of images (C, H, W) of any size, as torchvision's detection models do, and
    runs each through conv 3->6 - relu - conv 6->4 - global average pool: (len(list), 4). The
    6 channels of the first conv are prunable."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 4, 3)

    def forward(self, images: list[Tensor]) -> Tensor:
        return torch.cat([self.conv2(F.relu(self.conv1(img[None]))).mean((2, 3)) for img in images])


def _images(n: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(n)
    return [torch.randn(3, 6 + i, 8, generator=gen, dtype=torch.float64) for i in range(n)]


def test_per_example_cost_of_a_list_of_images_is_per_image() -> None:
    """A list of images is a batch of its length (not of the first image's channel count):
    the per-example FLOPs are FlopCounterMode's total divided by the list length, dense and
    after pruning."""
    torch.manual_seed(0)
    model = _PerImage().double().eval()
    images = _images(2)
    assert len(images) != images[0].shape[0]  # the old rule would have divided by 3
    dense = fp.computational_cost(model, (images,)).total
    assert dense == _flops(model, (images,)) / len(images)
    (mask,) = fp.apply_masks(model, (images,)).values()
    mask.mask[[1, 4]] = 0
    small = fp.shrink(model)
    assert fp.computational_cost(model, (images,)).total == _flops(small, (images,)) / 2 < dense


def test_apply_masks_remembers_the_first_image_of_a_list() -> None:
    """The remembered batch-of-one copy of a list of images is a list of its first image (whole,
    all its channels), so that shrink without inputs runs and gives the masked output."""
    torch.manual_seed(0)
    model = _PerImage().double().eval()
    images = _images(3)
    (mask,) = fp.apply_masks(model, (images,)).values()
    mask.mask[[0, 5]] = 0
    (kept,) = find_holder(model)[1].example_inputs  # type: ignore[index]
    assert len(kept) == 1 and torch.equal(kept[0], images[0])
    small = fp.shrink(model)
    with torch.no_grad():
        _assert_close(small(images), model(images), ATOL_F64)


# ========================================================== Hugging Face
BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 99}
BERT_INTER = 37  # MLP hidden units per layer
GPT2 = {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 99, "n_positions": 16}
HF_ZEROED = [[0, 5, 6, 20, 36], [1, 2, 3, 30, 31]]  # per layer: 5 units of 37
HF_BATCH = 3


def _hf_inputs(batch: int = HF_BATCH, seed: int = 0) -> dict[str, Tensor]:
    """input_ids (N, 7) and an attention mask with padding in the first example."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, 7, dtype=torch.long)
    mask[0, 5:] = 0
    return {"input_ids": torch.randint(0, 99, (batch, 7), generator=gen), "attention_mask": mask}


def _bert(inter: int = BERT_INTER) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(**BERT, intermediate_size=inter, attn_implementation="eager")
    return transformers.BertModel(cfg).double().eval()


def _gpt2(inner: int = BERT_INTER) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(**GPT2, n_inner=inner, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def _mlp_masks(model: nn.Module, producer: str) -> list[fp.MaskLayer]:
    """apply_masks on the keyword inputs; the masks of the MLP hidden units, by layer
    (``producer``: the MLP's first layer, ``{i}`` standing for the layer index)."""
    masks = fp.apply_masks(model, _hf_inputs())
    by_producer = {tuple(g.producers): masks[n] for n, g in masks.groups.items()}
    return [by_producer[(producer.format(i=i),)] for i in range(2)]


def _zero_mlp(model: nn.Module, producer: str) -> None:
    """Mask ``model`` on its keyword inputs and zero ``HF_ZEROED`` in its MLP masks."""
    for mask, zeroed in zip(_mlp_masks(model, producer), HF_ZEROED, strict=True):
        mask.mask[zeroed] = 0


BERT_MLP = "encoder.layer.{i}.intermediate.dense"
GPT2_MLP = "transformer.h.{i}.mlp.c_fc"


@pytest.mark.parametrize(("build", "producer"), [(_bert, BERT_MLP), (_gpt2, GPT2_MLP)])
def test_hugging_face_keyword_inputs_mask_the_mlp_hidden_units(build: Any, producer: str) -> None:
    """BERT and GPT-2 called with their own keyword inputs, no wrapper: apply_masks runs and
    gives each layer's MLP hidden units one mask of their width; the output is unchanged."""
    model = build()
    before = _eval(model, _hf_inputs())[0]
    masks = _mlp_masks(model, producer)
    assert [m.num_channels for m in masks] == [BERT_INTER] * 2
    assert torch.equal(_eval(model, _hf_inputs())[0], before)


@pytest.mark.parametrize(("build", "producer"), [(_bert, BERT_MLP), (_gpt2, GPT2_MLP)])
def test_hugging_face_cost_equals_flop_counter_on_a_narrower_model(
    build: Any, producer: str
) -> None:
    """The per-example cost of BERT / GPT-2 with 5 MLP units of 37 zeroed per layer equals
    FlopCounterMode on the same model built with 32 units, divided by the batch."""
    model = build()
    _zero_mlp(model, producer)
    cost = fp.computational_cost(model, _hf_inputs()).total
    assert cost == _flops(build(BERT_INTER - 5), _hf_inputs()) / HF_BATCH


def test_bert_shrunk_model_gives_the_masked_output_and_its_flops() -> None:
    """shrink of BERT masked on keyword inputs gives the masked last hidden state (float64,
    padded example included) and FlopCounterMode's count on it is the cost, per example."""
    model = _bert()
    _zero_mlp(model, BERT_MLP)
    small = fp.shrink(model)
    inputs = _hf_inputs(4, seed=1)
    got, want = _eval(small, inputs), _eval(model, inputs)
    _assert_close(got.last_hidden_state, want.last_hidden_state, ATOL_F64)
    assert fp.computational_cost(model, inputs).total == _flops(small, inputs) / 4


def test_gpt2_shrunk_model_gives_the_masked_output() -> None:
    """shrink of GPT-2 masked on keyword inputs gives the masked logits (float64)."""
    model = _gpt2()
    _zero_mlp(model, GPT2_MLP)
    small = fp.shrink(model)
    inputs = _hf_inputs(2, seed=1)
    _assert_close(_eval(small, inputs).logits, _eval(model, inputs).logits, ATOL_F64)


def test_callbacks_move_every_tensor_of_nested_inputs_to_the_device() -> None:
    """The training-loop callbacks' ``inputs_on`` moves tensors inside a list or a dict
    argument too, not only top-level ones (the meta device stands for a GPU)."""
    from fisherprune.integrations._shared import inputs_on

    given = ({"ids": torch.zeros(2, 3), "extra": [torch.ones(2), 3]}, torch.zeros(2, 1))
    moved = inputs_on(given, torch.device("meta"))
    assert moved[0]["ids"].is_meta and moved[0]["extra"][0].is_meta and moved[1].is_meta
    assert moved[0]["extra"][1] == 3 and given[0]["ids"].device.type == "cpu"
