"""Issue 37, point 3: a Hugging Face model pruned unevenly (blocks of different widths) is
written as a folder that plain ``transformers`` loads with ``trust_remote_code=True`` to the
shrunk model's outputs exactly; ``uniform=True`` refuses up front a target it cannot reach."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fisherprune as fp  # noqa: E402
from fisherprune.export.hf_folder import write_hf_folder  # noqa: E402
from tests.test_cli import run_cli  # noqa: E402
from tests.test_cli_prune import _bert_folder  # noqa: E402
from tests.test_hf_integration import _models  # noqa: E402

#: the Auto class a user loads each architecture of ``_models`` with
AUTO = {
    "bert": "AutoModelForSequenceClassification",
    "gpt2": "AutoModelForCausalLM",
    "llama": "AutoModelForCausalLM",
    "qwen2": "AutoModelForCausalLM",
    "gemma": "AutoModelForCausalLM",
    "vit": "AutoModelForImageClassification",
    "t5": "AutoModelForSeq2SeqLM",
}


def _uneven(name: str, seed: int = 1):
    """``_models()[name]`` with each mask losing a random share (up to half) of its channels
    at random, blocks independently: the masked model, its inputs and its shrunk copy."""
    build, x = _models()[name]
    torch.manual_seed(0)
    model = build().eval()
    masks = fp.apply_masks(model, x)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in masks.values():
            k = m.num_channels
            drop = int(torch.randint(0, k // 2, (1,), generator=g))
            m.mask[torch.randperm(k, generator=g)[:drop]] = 0.0
    with warnings.catch_warnings():  # the config cannot describe it: said by the folder
        warnings.simplefilter("ignore")
        small = fp.shrink(model, x)
    return model, x, small


def _logits(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("name", sorted(AUTO))
def test_an_uneven_prune_loads_with_trust_remote_code_to_the_same_logits(
    name: str, tmp_path: Path
) -> None:
    """The folder's config keeps the dense widths (no standard config holds blocks of
    different widths) and the Auto class of the model's task, with trust_remote_code=True,
    builds the shrunk shapes and gives the shrunk model's logits bit for bit."""
    _, x, small = _uneven(name)
    dense_config = small.config.to_dict()
    done = write_hf_folder(small, tmp_path / "hf", x, tmp_path, lambda path: None)
    assert done.written and done.remote_code, done.missing
    back = getattr(transformers, AUTO[name]).from_pretrained(
        tmp_path / "hf", trust_remote_code=True
    )
    back.eval()
    assert type(back).__mro__[1] is type(small)  # the transformers class, resized
    shapes = {k: v.shape for k, v in small.state_dict().items()}
    assert {k: v.shape for k, v in back.state_dict().items()} == shapes
    saved = back.config.to_dict()
    written = ("architectures", "dtype", "_name_or_path")  # save / load's own
    assert {k: saved.get(k) for k in dense_config if k not in written} == {
        k: v for k, v in dense_config.items() if k not in written
    }
    with torch.no_grad():
        assert torch.equal(_logits(back(**x)), _logits(small(**x)))


def test_the_blocks_really_differ_and_the_dense_class_cannot_load_them(tmp_path: Path) -> None:
    """Not vacuous: the two Llama blocks keep different MLP widths, and the plain class (no
    remote code) refuses the folder's weights."""
    _, x, small = _uneven("llama")
    widths = {layer.mlp.up_proj.out_features for layer in small.model.layers}
    assert len(widths) == 2, widths
    write_hf_folder(small, tmp_path / "hf", x, tmp_path, lambda path: None)
    with pytest.raises(RuntimeError):  # transformers reports the shapes that do not fit
        transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")


def test_a_tied_lm_head_stays_tied(tmp_path: Path) -> None:
    """GPT-2 ties its LM head to the token embeddings: in the reloaded model they are one
    tensor, of the pruned hidden width."""
    _, x, small = _uneven("gpt2")
    write_hf_folder(small, tmp_path / "hf", x, tmp_path, lambda path: None)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", trust_remote_code=True
    )
    assert back.lm_head.weight is back.transformer.wte.weight
    assert back.lm_head.weight.shape == small.transformer.wte.weight.shape
    assert small.transformer.wte.weight.shape[1] < 32  # the hidden width did lose units


def test_a_sliced_table_its_class_leaves_out_of_the_file_is_written_and_reloaded(
    tmp_path: Path,
) -> None:
    """Marian leaves its sinusoidal position tables out of the file and regenerates them for
    the width it is built with; a pruned hidden width keeps the dense table's columns, which
    differ from a table made for the narrower width: the folder holds them and the reload
    gives the shrunk model's logits bit for bit (it was refused, 1e-3 away, before)."""
    config = transformers.MarianConfig(
        vocab_size=100, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layers=2,
        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        max_position_embeddings=64, pad_token_id=1, decoder_start_token_id=1,
        share_encoder_decoder_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (2, 12), generator=g)
    x = {"input_ids": ids, "decoder_input_ids": ids.flip(1)}
    masks = fp.apply_masks(model, x)
    with torch.no_grad():
        for m in masks.values():  # the hidden widths among them: the tables lose columns
            m.mask[torch.randperm(m.num_channels, generator=g)[: m.num_channels // 3]] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small = fp.shrink(model, x)
    table = small.model.encoder.embed_positions
    assert table.weight.shape[1] < 32
    assert not torch.equal(table.weight, table.create_weight())  # not what a rebuild makes
    left_out = small._keys_to_ignore_on_save
    done = write_hf_folder(small, tmp_path / "hf", x, tmp_path, lambda path: None)
    assert done.written and done.remote_code, done.missing
    back = transformers.AutoModelForSeq2SeqLM.from_pretrained(
        tmp_path / "hf", trust_remote_code=True
    )
    with torch.no_grad():
        assert torch.equal(back.eval()(**x).logits, small(**x).logits)
    assert small._keys_to_ignore_on_save == left_out  # the model's own setting, restored


def test_automodel_loads_the_base_model_of_a_head_models_folder(tmp_path: Path) -> None:
    """AutoModel on the folder of a LlamaForCausalLM gives its base model, resized by the
    record's entries under ``model.``, with the shrunk base model's hidden states."""
    _, x, small = _uneven("llama")
    write_hf_folder(small, tmp_path / "hf", x, tmp_path, lambda path: None)
    base = transformers.AutoModel.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    assert type(base).__mro__[1] is transformers.LlamaModel
    with torch.no_grad():
        want = small.model(**x).last_hidden_state
        assert torch.equal(base.eval()(**x).last_hidden_state, want)


def test_built_from_the_config_alone_it_has_the_shapes_and_initialised_weights(
    tmp_path: Path,
) -> None:
    """from_config (no weights loaded) builds the pruned shapes, every tensor initialised
    (finite) by the class's own initialisation, for training from scratch."""
    _, x, small = _uneven("llama")
    write_hf_folder(small, tmp_path / "hf", x, tmp_path, lambda path: None)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    fresh = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    state = fresh.state_dict()
    assert {k: v.shape for k, v in state.items()} == {
        k: v.shape for k, v in small.state_dict().items()
    }
    assert all(bool(torch.isfinite(v).all()) for v in state.values())
    assert float(state["model.layers.0.mlp.up_proj.weight"].std()) > 0


def test_a_pruned_returned_width_comes_back_as_its_kept_units(tmp_path: Path) -> None:
    """A base Llama whose hidden width lost every 4th unit and whose blocks differ: the
    folder returns the kept units of the hidden state (the shrunk model zero-fills them),
    and a note says so."""
    config = transformers.LlamaConfig(
        vocab_size=45, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaModel(config).eval()
    x = {"input_ids": torch.randint(0, 45, (2, 8), generator=torch.Generator().manual_seed(0))}
    masks = fp.apply_masks(model, x)
    with torch.no_grad():
        masks["fisherprune_masks.embed_tokens:dim1"].mask[::4] = 0.0
        masks["fisherprune_masks.layers_0_mlp_gate_proj:out"].mask[:5] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small = fp.shrink(model, x)
    done = write_hf_folder(small, tmp_path / "hf", x, tmp_path, lambda path: None)
    assert done.written and done.remote_code
    assert any("24 of 32" in n for n in done.notes) and any("trust_remote_code" in n
                                                            for n in done.notes)  # fmt: skip
    back = transformers.AutoModel.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    kept = [i for i in range(32) if i % 4]
    with torch.no_grad():
        want = small(**x).last_hidden_state[..., kept]
        assert torch.equal(back.eval()(**x).last_hidden_state, want)


def test_the_modelling_file_imports_only_torch_and_transformers(tmp_path: Path) -> None:
    """The written modelling file imports nothing but torch and transformers, and the folder
    loads to the same logits in a process where fisherprune cannot be imported."""
    _, x, small = _uneven("qwen2")
    write_hf_folder(small, tmp_path / "hf", x, tmp_path, lambda path: None)
    tree = ast.parse((tmp_path / "hf" / "modeling_fisherprune.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}  # fmt: skip
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"__future__", "torch", "transformers"}
    torch.save(x["input_ids"], tmp_path / "ids.pt")
    script = (
        "import sys; sys.modules['fisherprune'] = None\n"
        "import torch, transformers\n"
        f"m = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / 'hf')!r}, "
        "trust_remote_code=True).eval()\n"
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r})\n"
        "with torch.no_grad():\n"
        f"    torch.save(m(input_ids=ids).logits, {str(tmp_path / 'out.pt')!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "out.pt"), small(**x).logits)


def test_the_command_writes_a_remote_code_folder_for_an_uneven_prune(tmp_path: Path) -> None:
    """fisherprune prune without --uniform on a BERT folder: hf/ holds the tokenizer and
    loads with AutoModel(trust_remote_code=True) to model.pt's outputs; the report and the
    printed line say it is remote code."""
    folder, text = _bert_folder(tmp_path)
    out = tmp_path / "out"
    cli = run_cli("prune", folder, "--text", text, "--target", "60%", "--out", out)
    assert cli.code == 0, cli.err
    report = json.loads((out / "report.json").read_text())
    assert report["hugging_face_folder"] == "hf"
    assert report["hugging_face_folder_kind"] == "remote code"
    assert "trust_remote_code=True" in cli.out
    back = transformers.AutoModel.from_pretrained(out / "hf", trust_remote_code=True).eval()
    small = load = fp.load_state_dict_export(
        out / "model.pt", transformers.AutoModel.from_pretrained(folder)
    ).eval()
    assert load is small
    tok = transformers.AutoTokenizer.from_pretrained(out / "hf")
    enc = tok(text.read_text().splitlines()[:4], padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(
            back(**enc).last_hidden_state, small(**enc).last_hidden_state, rtol=0, atol=1e-6
        )


def _bert_floor_ratio() -> tuple[float, dict]:
    """BERT of ``_models`` under uniform=True can prune only its MLP (to one unit): the cost
    ratio of that model, from a BERT built with ``intermediate_size=1`` (independent of the
    pruner), and the inputs."""
    t = transformers
    build, x = _models()["bert"]
    dense = build()
    config = dense.config.to_dict() | {"intermediate_size": 1}
    floor = t.BertForSequenceClassification(t.BertConfig.from_dict(config))
    ratio = fp.computational_cost(floor, x).total / fp.computational_cost(dense, x).total
    return ratio, x


def test_an_unreachable_uniform_target_is_refused_before_any_work() -> None:
    """uniform=True on BERT at 20% of the FLOPs (its floor, every MLP at one unit, is higher):
    ValueError naming the floor as a share, a mask kept whole and the way out; no mask was
    changed (no channel pruned, no signal gathered)."""
    ratio, x = _bert_floor_ratio()
    build, _ = _models()["bert"]
    model = build().eval()
    g = torch.Generator().manual_seed(3)
    batches = [({"input_ids": torch.randint(0, 100, (4, 8), generator=g)}, None)]
    with pytest.raises(ValueError, match="out of reach with uniform=True") as caught:
        fp.prune_to_target(model, x, batches, "20%", uniform=True, reconstruct=False)
    message = str(caught.value)
    assert f"its floor is {ratio:.1%}" in message, (ratio, message)
    assert "kept whole" in message or "whole, e.g." in message
    assert "trust_remote_code=True" in message
    masks = fp.find_masks(model)
    assert all(m.is_all_ones() for m in masks.values())
    assert all(float(m.signal.abs().sum()) == 0 for m in masks.values())


def test_a_uniform_target_at_the_named_floor_is_reached() -> None:
    """Two-sided: the share the refusal names is reachable (the MLPs at one unit)."""
    ratio, x = _bert_floor_ratio()
    build, _ = _models()["bert"]
    model = build().eval()
    g = torch.Generator().manual_seed(3)
    batches = [({"input_ids": torch.randint(0, 100, (4, 8), generator=g)}, None)]
    target = f"{ratio * 100 + 0.1:.1f}%"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fp.prune_to_target(
            model, x, batches, target, uniform=True, reconstruct=False, rounds=1, round_cap=1
        )
    assert result.cost_after <= result.target


def test_the_command_refuses_an_unreachable_uniform_target_in_one_line(tmp_path: Path) -> None:
    """fisherprune prune --uniform at 20% on a BERT folder: exit 2, one line naming the floor
    and what to do, nothing written under --out."""
    folder, text = _bert_folder(tmp_path)
    out = tmp_path / "out"
    cli = run_cli("prune", folder, "--text", text, "--target", "20%", "--uniform", "--out", out)
    assert cli.code == 2
    lines = [line for line in cli.err.splitlines() if line.strip()]
    said = [line for line in lines if "out of reach with uniform=True" in line]
    assert len(said) == 1 and "its floor is" in said[0] and "--uniform" in said[0], cli.err
    assert "Traceback" not in cli.err and not out.exists()
