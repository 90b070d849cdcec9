"""Models held in bf16 / fp16, end to end (issue 36): the Fisher signal, the least-squares
repair, masking, shrink, plans, exports and the Hugging Face round trip behave as they do in
float32, and every result keeps the model's dtype. References: the same model in float32, and
``from_pretrained`` of the written folder."""

from __future__ import annotations

import copy
import functools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fisherprune as fp
from fisherprune.calibrate.repair import repair_consumers
from fisherprune.calibrate.to_target import estimate_signals
from fisherprune.masks import find_masks
from fisherprune.signals import resolve_criterion
from tests.test_hf_integration import _models

transformers = pytest.importorskip("transformers")
T = transformers

HALF = [torch.bfloat16, torch.float16]
IDS = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
_SMALL = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
#: an encoder and three decoders, as test_hf_integration builds them from their configs
_HF = {n: case for n, case in _models().items() if n in ("bert", "gpt2", "llama", "qwen2")}


def _layout(masks: fp.AppliedMasks) -> tuple[list[tuple[str, int]], list[str]]:
    """The masks' names and widths, and the unexpected skips."""
    widths = sorted((n, m.num_channels) for n, m in masks.items())
    return widths, sorted(str(s) for s in masks.skipped if not s.expected)


class _Bank:
    """The ``_HF`` models written once by ``save_pretrained`` (seed 0) and loaded in a half
    dtype by ``from_pretrained``, as a user brings a half-precision checkpoint; and the pruned
    ones, built once per module (the tests only read them: shrink copies)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @functools.cache  # noqa: B019 - one bank per module
    def folder(self, name: str) -> Path:
        torch.manual_seed(0)
        self._build(name).save_pretrained(self.root / name)
        return self.root / name

    def _build(self, name: str) -> nn.Module:
        return _HF[name][0]()

    def loaded(self, name: str, dtype: torch.dtype) -> nn.Module:
        folder = self.folder(name)
        return type(self._build(name)).from_pretrained(folder, dtype=dtype).eval()

    @functools.cache  # noqa: B019 - one bank per module
    def pruned(self, name: str, dtype: torch.dtype) -> tuple[nn.Module, dict, Any]:
        """The model masked and pruned by four uniform prunes of random scores (heads, MLP
        units and, where the config can describe it, hidden width), with the masks' layout
        in this dtype and in float32."""
        model, x = self.loaded(name, dtype), _HF[name][1]
        wide = copy.deepcopy(model).float()
        layouts = (_layout(fp.apply_masks(model, x)), _layout(fp.apply_masks(wide, x)))
        with warnings.catch_warnings():  # which masks uniform=True keeps whole
            warnings.simplefilter("ignore")
            opt = fp.PruningOptimizer(
                model, x, uniform=True, criterion=fp.criteria.Random(seed=0), prune_every=1
            )
            for _ in range(4):
                opt.after_update()
        assert opt.history, "nothing was pruned"
        return model, x, layouts


@pytest.fixture(scope="module")
def bank(tmp_path_factory: pytest.TempPathFactory) -> _Bank:
    return _Bank(tmp_path_factory.mktemp("half"))


# every model in bf16, and an encoder and a decoder in fp16 (the same code paths, other
# kernels)
ROUND_TRIPS = [(n, torch.bfloat16) for n in sorted(_HF)] + [
    ("bert", torch.float16), ("llama", torch.float16)
]  # fmt: skip


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(("name", "dtype"), ROUND_TRIPS, ids=lambda v: str(v).split(".")[-1])
def test_hf_model_in_half_precision_masks_shrinks_and_round_trips(
    bank: _Bank, name: str, dtype: torch.dtype, tmp_path: Path
) -> None:
    """A Hugging Face model loaded in bf16 / fp16 gets the float32 model's masks (hidden
    width, heads, MLP), its shrunk model stays in the dtype and gives the masked logits, and
    ``from_pretrained(dtype=...)`` of the folder it writes gives the shrunk logits exactly."""
    model, x, (half_layout, float_layout) = bank.pruned(name, dtype)
    assert half_layout == float_layout
    small = fp.shrink(model, x)
    assert {p.dtype for p in small.parameters()} == {dtype}
    with torch.no_grad():
        masked, shrunk = model(**x).logits, small(**x).logits
    torch.testing.assert_close(shrunk, masked)  # the dtype's own tolerance
    small.save_pretrained(tmp_path)
    back = type(model).from_pretrained(tmp_path, dtype=dtype).eval()
    assert {p.dtype for p in back.parameters()} == {dtype}
    with torch.no_grad():
        assert torch.equal(back(**x).logits, shrunk)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_plan_applied_to_a_half_precision_model_gives_the_shrunk_model(
    bank: _Bank, dtype: torch.dtype
) -> None:
    """A ``PruningPlan`` read off a pruned bf16 / fp16 model and applied to an unpruned copy
    gives the shrunk model's weights, dtype and logits."""
    model, x, _ = bank.pruned("llama", dtype)
    plan = fp.PruningPlan.from_model(model, x)
    fresh = bank.loaded("llama", dtype)
    plan.apply(fresh)
    assert {p.dtype for p in fresh.parameters()} == {dtype}
    with torch.no_grad():
        assert torch.equal(fresh(**x).logits, fp.shrink(model, x)(**x).logits)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
def test_exports_of_a_bf16_decoder_keep_its_dtype(bank: _Bank, fmt: str, tmp_path: Path) -> None:
    """TorchScript and ONNX files of a pruned bf16 Llama hold bf16 weight matrices (the rotary
    frequencies stay the float32 buffer transformers keeps) and give the shrunk model's logits
    (the decoder's key/value cache is left out of the traced graph)."""
    pytest.importorskip("onnx")
    model, x, _ = bank.pruned("llama", torch.bfloat16)
    with torch.no_grad():
        want = fp.shrink(model, x)(**x).logits
    path = fp.export_model(model, tmp_path / f"m.{fmt}", x, format=fmt)
    assert model.config.use_cache  # given back after the export
    if fmt == "torchscript":
        loaded = torch.jit.load(path)
        assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
        with torch.no_grad():
            torch.testing.assert_close(loaded(**x)["logits"], want)
    else:
        import onnx

        graph = onnx.load(str(path)).graph
        floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
        matrices = {t.data_type for t in graph.initializer if len(t.dims) == 2} & floats
        assert matrices == {onnx.TensorProto.BFLOAT16}
        assert graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_fisher_signals_of_a_half_precision_model_match_float32(dtype: torch.dtype) -> None:
    """The Fisher signal of every mask of a Llama held in bf16 / fp16 is the float32 model's
    to half-precision rounding (statistics accumulate in float32): within 2% in norm."""
    torch.manual_seed(0)
    build, _ = _HF["llama"]
    dense = build().eval()
    g = torch.Generator().manual_seed(1)
    batches = [({"input_ids": (ids := torch.randint(0, 100, (8, 12), generator=g)),
                 "labels": ids}, None) for _ in range(3)]  # fmt: skip
    signals = {}
    for dt in (torch.float32, dtype):
        model = copy.deepcopy(dense).to(dt)
        masks = fp.apply_masks(model, {"input_ids": IDS[:1]})
        estimate_signals(
            model, dict(masks.items()), batches, lambda out, _t: out.loss.float(),
            resolve_criterion("fisher"),
        )  # fmt: skip
        signals[dt] = {n: m.signal.double() for n, m in masks.items()}
    for name, want in signals[torch.float32].items():
        got = signals[dtype][name]
        assert float((got - want).norm() / want.norm()) < 0.02, name


class _Redundant(nn.Sequential):
    """An MLP on inputs of rank 6 in 32 features: half of its hidden units can be removed
    and their work refitted onto the others (the repair's best case). Its activations reach
    tens, so a batch's ``X^T X`` over 512 rows overflows float16 (issue 36)."""

    def __init__(self) -> None:
        super().__init__(
            nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
        )


def _repaired_error(dtype: torch.dtype) -> tuple[float, float, dict[str, str], set]:
    """The relative squared output error against the dense model of the same dtype on held-out
    inputs, before and after the repair, with half of every mask's channels removed (the same
    ones in every dtype); the skipped layers; the parameters' dtypes."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(6, 32, generator=g)

    def data(n: int) -> torch.Tensor:
        return (torch.randn(n, 6, generator=g) @ mix * 8).to(dtype)

    model = _Redundant().eval().to(dtype)
    batches, test = [(data(512), None) for _ in range(8)], data(1024)
    fp.apply_masks(model, test[:1])
    masks = find_masks(model)
    dense = {n: m.mask.detach().clone() for n, m in masks.items()}
    with torch.no_grad():
        ref = model(test).double()
        pick = torch.Generator().manual_seed(3)
        for _, m in sorted(masks.items()):
            m.mask[torch.randperm(m.num_channels, generator=pick)[: m.num_channels // 2]] = 0

    def error() -> float:
        with torch.no_grad():
            out = model(test).double()
        return float((out - ref).square().sum() / ref.square().sum())

    before = error()
    report = repair_consumers(model, batches, dense)
    return before, error(), report.skipped, {p.dtype for p in model.parameters()}


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_repair_of_a_half_precision_model_comes_as_close_as_in_float32(
    dtype: torch.dtype,
) -> None:
    """The least-squares repair of a bf16 / fp16 model (normal equations in float32 / float64,
    weights written back in the dtype) brings it as close to its dense model as the repair of
    the float32 model brings that one, up to half-precision rounding; no layer is skipped
    (fp16 products of 512 rows overflowed before)."""
    before32, after32, skipped32, _ = _repaired_error(torch.float32)
    _, after, skipped, dtypes = _repaired_error(dtype)
    assert after32 < 0.2 * before32 and not skipped32  # the repair matters here
    assert not skipped, skipped
    assert dtypes == {dtype}
    assert after <= 1.05 * after32 + 1e-3


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_prune_command_on_a_bf16_folder_writes_a_bf16_folder(tmp_path: Path) -> None:
    """``fisherprune prune --uniform`` on a BERT folder saved in bf16: the written ``hf/``
    folder (checked by reloading it, whose tolerance follows the dtype) holds bf16 weights,
    and ``from_pretrained`` of it in bf16 gives ``model.pt``'s outputs exactly."""
    from fisherprune.export import load_state_dict_export
    from tests.test_cli import run_cli
    from tests.test_cli_prune import _bert_folder

    torch.manual_seed(0)
    dense = T.BertModel(
        T.BertConfig(vocab_size=45, hidden_size=32, max_position_embeddings=64, **_SMALL)
    ).to(torch.bfloat16)
    folder, text = _bert_folder(tmp_path, dense)
    out = tmp_path / "out"
    cli = run_cli("prune", folder, "--text", text, "--target", "70%", "--uniform", "--out", out)
    assert cli.code == 0, cli.err
    back = T.AutoModel.from_pretrained(out / "hf", dtype=torch.bfloat16).eval()
    assert {p.dtype for p in back.parameters()} == {torch.bfloat16}
    assert back.config.intermediate_size < 64
    small = load_state_dict_export(
        out / "model.pt", T.AutoModel.from_pretrained(folder, dtype=torch.bfloat16)
    ).eval()
    assert {p.dtype for p in small.parameters()} == {torch.bfloat16}
    enc = T.AutoTokenizer.from_pretrained(out / "hf")(
        text.read_text().splitlines()[:4], padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        assert torch.equal(back(**enc).last_hidden_state, small(**enc).last_hidden_state)
