"""The Hugging Face folder ``fisherprune prune`` writes (``export.hf_folder.write_hf_folder``):
it reloads with no fisherprune code to the shrunk model's outputs, a returned width that lost
units comes back narrower (said in a note), and a sentence-transformers model keeps its
pipeline files with the pooling's width rewritten, or is told why not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fisherprune as fp
from fisherprune.export.hf_folder import write_hf_folder

transformers = pytest.importorskip("transformers")

X = {"input_ids": torch.randint(0, 45, (2, 8), generator=torch.Generator().manual_seed(0))}


class _OwnLlama(transformers.LlamaModel):
    """A user's own subclass: no class of transformers that remote code could extend."""


def _llama_without_hidden_units(every: int, cls: type = transformers.LlamaModel):
    """A LLaMA base model (hidden 32) of class ``cls`` with every ``every``-th hidden unit
    removed: the masked model and its shrunk copy (which zero-fills the returned hidden
    state)."""
    config = transformers.LlamaConfig(
        vocab_size=45, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = cls(config).eval()
    masks = fp.apply_masks(model, X)
    with torch.no_grad():
        masks["fisherprune_masks.embed_tokens:dim1"].mask[::every] = 0.0
    return model, fp.shrink(model, X)


def _sentence_transformer(source: Path, extra: list[dict] | None = None) -> None:
    """A sentence-transformers pipeline's files as such a model folder holds them (mean
    pooling of the 32-wide hidden state, then normalisation, then ``extra`` modules)."""
    source.mkdir()
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ] + (extra or [])
    (source / "modules.json").write_text(json.dumps(modules))
    (source / "sentence_bert_config.json").write_text('{"max_seq_length": 128}')
    (source / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}
    (source / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


def test_a_pruned_returned_width_reloads_as_its_kept_units(tmp_path: Path) -> None:
    """Hidden width 32 less 8 units: from_pretrained gives the shrunk model's output without
    its zero columns, and a note says so."""
    _, small = _llama_without_hidden_units(every=4)
    done = write_hf_folder(small, tmp_path / "hf", X, tmp_path, lambda path: None)
    assert done.written and done.missing is None
    assert any("24 of 32" in n and "zeros" in n for n in done.notes), done.notes
    back = transformers.LlamaModel.from_pretrained(tmp_path / "hf").eval()
    kept = [i for i in range(32) if i % 4]
    with torch.no_grad():
        full = small(**X).last_hidden_state
        torch.testing.assert_close(back(**X).last_hidden_state, full[..., kept])
    assert full[..., ::4].abs().max() == 0


def test_sentence_transformers_files_follow_with_the_pooling_width_rewritten(
    tmp_path: Path,
) -> None:
    """modules.json, the settings and every module folder are copied (the Normalize folder
    that was never saved is made), the pooling's width set to the 24 units kept."""
    source = tmp_path / "source"
    _sentence_transformer(source)
    _, small = _llama_without_hidden_units(every=4)
    done = write_hf_folder(small, tmp_path / "hf", X, source, lambda path: None)
    assert done.written
    hf = tmp_path / "hf"
    assert json.loads((hf / "modules.json").read_text())[1]["path"] == "1_Pooling"
    assert (hf / "sentence_bert_config.json").is_file() and (hf / "2_Normalize").is_dir()
    pooling = json.loads((hf / "1_Pooling" / "config.json").read_text())
    assert pooling == {"word_embedding_dimension": 24, "pooling_mode_mean_tokens": True}


def test_a_dense_module_after_the_pooling_is_not_copied_when_the_width_changed(
    tmp_path: Path,
) -> None:
    """A Dense module reads the embedding width: with the width pruned the pipeline files are
    left out (the folder still loads with transformers) and a note says why."""
    source = tmp_path / "source"
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    _sentence_transformer(source, [dense])
    _, small = _llama_without_hidden_units(every=4)
    done = write_hf_folder(small, tmp_path / "hf", X, source, lambda path: None)
    assert done.written and not (tmp_path / "hf" / "modules.json").exists()
    assert any("Dense" in n and "from 32 to 24" in n for n in done.notes), done.notes


def test_a_folder_that_no_longer_fits_is_removed_not_left_stale(tmp_path: Path) -> None:
    """When neither a config nor modelling code can describe the model (blocks of different
    widths, a class that is not transformers' own), an hf/ of an earlier run is removed and
    the reason returned."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    model, _ = _llama_without_hidden_units(every=4, cls=_OwnLlama)
    masks = fp.find_masks(model)
    with torch.no_grad():
        masks["fisherprune_masks.layers_0_mlp_gate_proj:out"].mask[:5] = 0.0
    with pytest.warns(UserWarning, match="still describes the dense model"):
        small = fp.shrink(model, X)
    done = write_hf_folder(small, tmp_path / "hf", X, tmp_path, lambda path: None)
    assert not done.written and "different widths" in done.missing
    assert "not a class of transformers itself" in done.missing
    assert not (tmp_path / "hf").exists()


def test_a_transformer_module_in_a_sub_folder_is_pointed_at_the_pruned_root(
    tmp_path: Path,
) -> None:
    """A pipeline whose transformer was saved in 0_Transformer/: the copied modules.json points
    it at the folder's root, where the pruned model is, and the dense copy is not carried."""
    source = tmp_path / "source"
    _sentence_transformer(source)
    modules = json.loads((source / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (source / "modules.json").write_text(json.dumps(modules))
    (source / "0_Transformer").mkdir()
    (source / "0_Transformer" / "sentence_bert_config.json").write_text('{"max_seq_length": 64}')
    _, small = _llama_without_hidden_units(every=4)
    assert write_hf_folder(small, tmp_path / "hf", X, source, lambda path: None).written
    hf = tmp_path / "hf"
    assert json.loads((hf / "modules.json").read_text())[0]["path"] == ""
    assert not (hf / "0_Transformer").exists()
    assert json.loads((hf / "sentence_bert_config.json").read_text()) == {"max_seq_length": 64}


def test_a_failed_write_leaves_no_folder_of_an_earlier_run(tmp_path: Path) -> None:
    """A full disk while writing: OSError, and the earlier run's hf/ is gone rather than left
    beside this run's model.pt."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"old": "run"}')
    _, small = _llama_without_hidden_units(every=4)

    def full(path: Path) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_hf_folder(small, tmp_path / "hf", X, tmp_path, full)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_model_that_cannot_save_itself_gets_no_folder_and_a_reason(tmp_path: Path) -> None:
    _, small = _llama_without_hidden_units(every=4)

    def broken(path: Path) -> None:
        raise RuntimeError("tokenizer has no files")

    done = write_hf_folder(small, tmp_path / "hf", X, tmp_path, broken)
    assert not done.written and "tokenizer has no files" in done.missing
    assert not (tmp_path / "hf").exists()


def test_an_old_folder_that_cannot_be_put_back_is_kept_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """atomic_directory: the new folder fails to move in and the old one cannot be moved back:
    the old one is kept where it was set aside, named in the error, not deleted."""
    import os

    from fisherprune.export import storage

    target = tmp_path / "hf"
    target.mkdir()
    (target / "old.txt").write_text("old")
    real = os.replace
    calls = []

    def failing(src: object, dst: object) -> None:
        calls.append(dst)
        if len(calls) >= 2:  # the new folder moving in, then the old one moving back
            raise OSError(5, "I/O error")
        real(src, dst)

    monkeypatch.setattr(storage.os, "replace", failing)
    with (
        pytest.raises(OSError, match="left at") as caught,
        storage.atomic_directory(target) as tmp,
    ):
        (tmp / "new.txt").write_text("new")
    kept = Path(str(caught.value).split("left at ")[1].split(":")[0].rstrip(")"))
    assert (kept / "old.txt").read_text() == "old"
