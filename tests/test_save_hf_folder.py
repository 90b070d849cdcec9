"""``fisherprune.save_hf_folder``: a library user's shrunk transformers model saved as a folder
that loads with plain transformers, a standard config when every block keeps the same widths
and remote code otherwise, both giving the shrunk model's outputs back; anything else is
refused with no folder left."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import fisherprune as fp

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))


def _llama() -> nn.Module:
    """A LlamaForCausalLM from a small config (2 layers, 4 query heads over 2 key/value)."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _pruned_llama(uniform: bool) -> nn.Module:
    """``_llama()`` pruned to 60% of its FLOPs on random tokens (without uniform, its blocks
    keep different widths) and shrunk."""
    model = _llama()
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 64, (4, 12), generator=g)} for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # floors; the uneven config's (tested elsewhere)
        fp.prune_to_target(model, {"input_ids": IDS[:1]}, batches, "60%", uniform=uniform)
        return fp.shrink(model, {"input_ids": IDS[:1]})


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("uniform", [False, True], ids=["uneven", "uniform"])
def test_a_shrunk_model_reloads_with_plain_transformers_to_its_outputs(
    tmp_path: Path, uniform: bool
) -> None:
    small = _pruned_llama(uniform)
    done = fp.save_hf_folder(small, tmp_path / "hf", {"input_ids": IDS})
    assert done.written and done.remote_code is (not uniform)
    if uniform:
        back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    else:
        back = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "hf", trust_remote_code=True
        )
    want = _logits(small)
    torch.testing.assert_close(_logits(back.eval()), want, rtol=1e-5, atol=1e-5)
    assert sum(p.numel() for p in back.parameters()) == sum(p.numel() for p in small.parameters())


def test_a_model_without_a_transformers_config_is_refused_and_nothing_written(
    tmp_path: Path,
) -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match="PruningPlan"):
        fp.save_hf_folder(net, tmp_path / "hf", torch.randn(2, 4))
    assert not (tmp_path / "hf").exists()


def test_an_existing_folder_with_files_is_refused_and_kept(tmp_path: Path) -> None:
    """The folder is written whole, so one that already holds files is refused before any
    work, its files untouched (a failed save would otherwise have removed it)."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    model = _llama()
    with pytest.raises(ValueError, match="not an empty folder"):
        fp.save_hf_folder(model, tmp_path / "hf", {"input_ids": IDS})
    assert (tmp_path / "hf" / "notes.txt").read_text() == "mine"
