"""A Hugging Face folder is checked before ``fisherprune prune`` does any work with it (issue 35,
point 2): no tokenizer files, a config whose widths are not the weights', or a weight file cut
short each give exit 2 with one line naming the problem, and nothing is written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.test_cli import run_cli
from tests.test_cli_prune import _bert_folder


def _prune(folder: Path, text: Path, out: Path) -> tuple[int, str]:
    cli = run_cli("prune", folder, "--text", text, "--target", "50%", "--out", out)
    return cli.code, cli.err


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("tokenizer", r"has no tokenizer files \(tokenizer.json, vocab.txt"),
        ("config", r"config.json says hidden_size=48, but model.safetensors holds "
                   r"embeddings\.\S+ of shape \[[\d, ]*32\]"),
        ("truncated", r"weight file .*model.safetensors cannot be read"),
    ],
)  # fmt: skip
def test_a_bad_hugging_face_folder_exits_2_before_any_work(
    tmp_path: Path, damage: str, message: str
) -> None:
    """No tokenizer files (transformers built an empty one and every word became [UNK]), a
    config.json saying hidden_size 48 over weights 32 wide, a model.safetensors cut in half
    (both were tracebacks): exit 2, one line, no --out."""
    folder, text = _bert_folder(tmp_path)
    if damage == "tokenizer":
        for name in ("vocab.txt", "tokenizer.json"):
            (folder / name).unlink(missing_ok=True)
    elif damage == "config":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 48}))
    else:
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, err = _prune(folder, text, tmp_path / "out")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()
