"""``fisherprune prune``: the written model reloads to the pruned (masked) model's outputs and
accuracy; the report says what happened; bad inputs exit 2 with one line."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from fisherprune.calibrate import prune_to_target
from fisherprune.cli.main import build_parser
from fisherprune.cli.prune import _job
from fisherprune.export import load_state_dict_export
from fisherprune.masks import find_masks
from fisherprune.train.data import DataSpec, load_data
from fisherprune.train.models import build_model
from tests.test_cli import run_cli


def _data_and_weights(tmp_path: Path) -> tuple[Path, Path, torch.Tensor, torch.Tensor]:
    """A 3-class table (6 features) and the weights of an MLP trained on it."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] + x[:, 2] > 0).astype(np.int64)
    lines = ["a,b,c,d,e,f,label"] + [
        ",".join(f"{v:.6f}" for v in row) + f",{t}" for row, t in zip(x, y, strict=True)
    ]
    data = tmp_path / "t.csv"
    data.write_text("\n".join(lines) + "\n")
    torch.manual_seed(0)
    net = build_model("mlp", (6,), 3, 32, 2)
    opt = torch.optim.Adam(net.parameters(), 1e-2)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(150):
        opt.zero_grad()
        F.cross_entropy(net(xt), yt).backward()
        opt.step()
    weights = tmp_path / "w.pt"
    torch.save(net.state_dict(), weights)
    return data, weights, xt, yt


def test_prune_writes_a_model_that_reloads_to_the_reported_accuracy(tmp_path: Path) -> None:
    """The shrunk model.pt, rebuilt from a fresh MLP by its plan, has the accuracy on the eval
    split that the report gives for the masked model after pruning, its outputs equal the
    masked model's (report), and the cost ratio meets the target."""
    data, weights, _, _ = _data_and_weights(tmp_path)
    out = tmp_path / "out"
    cli = run_cli(
        "prune",
        "mlp",
        "--width",
        "32",
        "--depth",
        "2",
        "--weights",
        weights,
        "--data",
        data,
        "--target",
        "50%",
        "--rounds",
        "2",
        "--out",
        out,
    )
    assert cli.code == 0, cli.err
    report = json.loads((out / "report.json").read_text())
    assert report["cost_ratio"] <= 0.5 and report["written_vs_masked_max_abs_diff"] < 1e-4
    assert report["metric"] == "accuracy" and report["repaired_layers"] > 0
    assert set(report["latency_seconds"]) == {"dense", "pruned"}
    small = load_state_dict_export(out / "model.pt", build_model("mlp", (6,), 3, 32, 2)).eval()
    # the eval split is the one load_data makes (seed 0, 20%): re-read it the same way
    ev = load_data(DataSpec(source=str(data), seed=0, eval_fraction=0.2))
    with torch.no_grad():
        acc = float((small(ev.x_eval).argmax(1) == ev.y_eval).double().mean())
    assert acc == report["after"]
    assert (out / "plan.json").is_file()


def test_label_free_and_finetune_and_no_repair(tmp_path: Path) -> None:
    """--label_free --no-reconstruct --no-recalibrate_norms --finetune_steps 20 runs; the
    report records them."""
    data, weights, _, _ = _data_and_weights(tmp_path)
    out = tmp_path / "out"
    cli = run_cli(
        "prune",
        "mlp",
        "--width",
        "32",
        "--depth",
        "2",
        "--weights",
        weights,
        "--data",
        data,
        "--target",
        "0.6",
        "--label_free",
        "--no-reconstruct",
        "--no-recalibrate_norms",
        "--finetune_steps",
        "20",
        "--out",
        out,
    )
    assert cli.code == 0, cli.err
    report = json.loads((out / "report.json").read_text())
    assert report["label_free"] and not report["reconstruct"] and report["repaired_layers"] == 0
    assert report["recalibrate_norms"] is False
    assert report["finetune_steps"] == 20 and report["cost_ratio"] <= 0.6


def test_missing_weights_exits_2(tmp_path: Path) -> None:
    data, _, _, _ = _data_and_weights(tmp_path)
    cli = run_cli("prune", "mlp", "--data", data, "--out", tmp_path / "o")
    assert cli.code == 2 and "--weights is required" in cli.err
    assert not (tmp_path / "o").exists()


def test_prune_reads_an_image_folder_and_writes_a_cnn_with_the_masked_accuracy(
    tmp_path: Path,
) -> None:
    """``fisherprune prune cnn --data FOLDER --image_size H,W``: a folder of PNGs per class is
    read as ``train`` reads it (resized, one channel), the CNN is pruned to the target, and
    the written model, rebuilt from a fresh CNN by its plan, has the accuracy the report gives
    for the masked model, on the eval images read independently; its measured FLOPs (torch's
    FlopCounterMode) are at most half the dense model's."""
    image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    for k, cls in enumerate(["dark", "light"]):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(12):
            px = rng.integers(0, 120, (10, 9), dtype=np.uint8) + 120 * k
            image.fromarray(px.astype(np.uint8)).save(tmp_path / "imgs" / cls / f"{i}.png")
    torch.manual_seed(0)
    dense = build_model("cnn", (1, 8, 8), 2, 4, 2)
    weights = tmp_path / "w.pt"
    torch.save(dense.state_dict(), weights)
    out = tmp_path / "out"
    cli = run_cli(
        "prune", "cnn", "--width", "4", "--depth", "2", "--weights", weights,
        "--data", tmp_path / "imgs", "--image_size", "8,8", "--image_mode", "L",
        "--target", "50%", "--out", out,
    )  # fmt: skip
    assert cli.code == 0, cli.err
    report = json.loads((out / "report.json").read_text())
    assert report["written_vs_masked_max_abs_diff"] < 1e-5
    small = load_state_dict_export(out / "model.pt", build_model("cnn", (1, 8, 8), 2, 4, 2))
    spec = DataSpec(str(tmp_path / "imgs"), image_size=(8, 8), image_mode="L", seed=0)
    ev = load_data(spec)
    with torch.no_grad():
        acc = float((small.eval()(ev.x_eval).argmax(1) == ev.y_eval).double().mean())
    assert acc == report["after"]

    def flops(model: torch.nn.Module) -> int:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model.eval()(ev.x_eval[:1])
        return counter.get_total_flops()

    assert flops(small) <= 0.5 * flops(dense)


def test_score_convention_and_uniform_choose_what_prune_to_target_chooses(
    tmp_path: Path,
) -> None:
    """--score_convention memory --uniform keep exactly the channels that prune_to_target
    keeps with score_convention="memory", uniform=True on the command's own calibration
    batches (the reference), which differ from the FLOPs-weighed choice; the report says so."""
    data, weights, _, _ = _data_and_weights(tmp_path)
    common = ["prune", "mlp", "--width", "32", "--depth", "2", "--weights", weights]
    common += ["--data", data, "--target", "50%", "--no-reconstruct"]
    argv = [*common, "--score_convention", "memory", "--uniform", "--out", tmp_path / "m"]
    cli = run_cli(*argv)
    assert cli.code == 0, cli.err
    report = json.loads((tmp_path / "m" / "report.json").read_text())
    assert report["score_convention"] == "memory" and report["uniform"] is True

    args = build_parser().parse_args([str(a) for a in argv])
    torch.manual_seed(args.seed)
    job = _job(args)
    prune_to_target(job.model, job.example, job.batches, "50%", loss_fn=job.loss_fn,
                    score_convention="memory", uniform=True, reconstruct=False,
                    task=job.task, seed=args.seed)  # fmt: skip
    expected = {
        name: [int(i) for i in torch.nonzero(m.mask).flatten()]
        for name, m in find_masks(job.model).items()
    }

    def kept(folder: str) -> list[list[int]]:
        plan = json.loads((tmp_path / folder / "plan.json").read_text())
        return [
            p["weight"]["kept"]["0"] for p in plan["modules"].values() if "0" in p["weight"]["kept"]
        ]

    assert sorted(kept("m")) == sorted(expected.values())
    assert run_cli(*common, "--out", tmp_path / "f").code == 0
    assert kept("f") != kept("m")


def test_unknown_score_convention_exits_2(tmp_path: Path) -> None:
    data, weights, _, _ = _data_and_weights(tmp_path)
    cli = run_cli("prune", "mlp", "--weights", weights, "--data", data,
                  "--score_convention", "seconds", "--out", tmp_path / "o")  # fmt: skip
    assert cli.code == 2 and "--score_convention" in cli.err and "memory" in cli.err
    assert not (tmp_path / "o").exists()


def _bert_folder(tmp_path: Path, model: Any = None) -> tuple[Path, Path]:
    """A small BERT built from its config (or ``model``), saved with a word-piece tokenizer
    as a Hugging Face model folder, and a text file of 40 sentences over the tokenizer's
    words."""
    transformers = pytest.importorskip("transformers")
    words = [f"w{i}" for i in range(40)]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    folder = tmp_path / "bert"
    transformers.BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(folder)
    config = transformers.BertConfig(
        vocab_size=45, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    (model or transformers.BertModel(config)).save_pretrained(folder)
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(words, size=rng.integers(4, 12))) for _ in range(40)]
    text = tmp_path / "sentences.txt"
    text.write_text("\n".join(lines) + "\n")
    return folder, text


def test_prune_a_hugging_face_folder_without_fine_tuning(tmp_path: Path) -> None:
    """A Hugging Face folder with --text and no --finetune_steps (no labels, so no loss):
    model.pt loaded into the folder's model has the fidelity the report gives after pruning,
    recomputed here on the held-out lines (the last 20%) against the dense model."""
    transformers = pytest.importorskip("transformers")
    folder, text = _bert_folder(tmp_path)
    out = tmp_path / "out"
    cli = run_cli("prune", folder, "--text", text, "--target", "50%", "--out", out)
    assert cli.code == 0, cli.err
    report = json.loads((out / "report.json").read_text())
    assert report["metric"] == "cosine_to_dense" and report["cost_ratio"] <= 0.5
    assert report["label_free"] and report["finetune_steps"] == 0
    assert "perplexity" not in report and "perplexity" not in cli.out  # no --eval_text
    small = load_state_dict_export(
        out / "model.pt", transformers.AutoModel.from_pretrained(folder)
    ).eval()
    dense = transformers.AutoModel.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    held = [s for s in text.read_text().splitlines() if s][-8:]
    enc = tok(held, padding=True, truncation=True, max_length=128, return_tensors="pt")

    def pooled(model: torch.nn.Module) -> torch.Tensor:
        h = model(**enc).last_hidden_state
        w = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
        return (h * w).sum(1) / w.sum(1)

    with torch.no_grad():
        a, b = pooled(small), pooled(dense)
    cosine = float(F.cosine_similarity(a, b, dim=-1).mean())
    assert cosine == pytest.approx(report["after"], abs=1e-5)


def test_uniform_pruned_hugging_face_folder_is_written_for_from_pretrained(
    tmp_path: Path,
) -> None:
    """With --uniform the shrunk BERT is also written as a Hugging Face folder (out/hf, with
    its tokenizer): AutoModel.from_pretrained, with no fisherprune code, gives model.pt's
    outputs, on a smaller config than the dense one."""
    transformers = pytest.importorskip("transformers")
    folder, text = _bert_folder(tmp_path)
    out = tmp_path / "out"
    cli = run_cli("prune", folder, "--text", text, "--target", "70%", "--uniform", "--out", out)
    assert cli.code == 0, cli.err
    report = json.loads((out / "report.json").read_text())
    assert report["hugging_face_folder"] == "hf" and "from_pretrained" in cli.out
    back = transformers.AutoModel.from_pretrained(out / "hf").eval()
    assert back.config.intermediate_size < 64  # BERT's MLP is what uniform=True prunes
    small = load_state_dict_export(
        out / "model.pt", transformers.AutoModel.from_pretrained(folder)
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out / "hf")
    enc = tok(text.read_text().splitlines()[:4], padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(
            back(**enc).last_hidden_state, small(**enc).last_hidden_state, rtol=1e-4, atol=1e-5
        )


def test_uneven_pruning_writes_a_remote_code_folder_in_place_of_a_uniform_one(
    tmp_path: Path,
) -> None:
    """Without --uniform the blocks keep different head counts, which no standard config
    holds: out/hf (replacing the one of an earlier --uniform run) records them with modelling
    code of its own, the report and the output say so, and the config's verdict is not said
    again as a Python warning (loading it: tests/test_hf_remote_code.py)."""
    folder, text = _bert_folder(tmp_path)
    out = tmp_path / "out"
    args = ("prune", folder, "--text", text, "--out", out)
    assert run_cli(*args, "--target", "70%", "--uniform").code == 0
    assert not (out / "hf" / "modeling_fisherprune.py").exists()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = run_cli(*args, "--target", "60%")
    assert cli.code == 0, cli.err
    report = json.loads((out / "report.json").read_text())
    assert report["hugging_face_folder"] == "hf"
    assert report["hugging_face_folder_kind"] == "remote code"
    assert (out / "hf" / "modeling_fisherprune.py").is_file() and "trust_remote_code" in cli.out
    said = [w for w in caught if "still describes the dense model" in str(w.message)]
    assert not said, said  # said once, in the output, not again as a Python warning


def _t5(encoder_only: bool) -> Any:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=45, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4
    )
    torch.manual_seed(0)
    return (transformers.T5EncoderModel if encoder_only else transformers.T5Model)(config)


def test_a_t5_encoder_folder_is_pruned_as_the_encoder_it_was_saved_as(tmp_path: Path) -> None:
    """A T5EncoderModel folder (sentence-T5 style) loads as T5EncoderModel, not AutoModel's
    T5Model (which asked for decoder inputs), and --uniform writes it back as one."""
    transformers = pytest.importorskip("transformers")
    folder, text = _bert_folder(tmp_path, _t5(encoder_only=True))
    out = tmp_path / "out"
    cli = run_cli("prune", folder, "--text", text, "--target", "60%", "--uniform", "--out", out)
    assert cli.code == 0, cli.err
    assert json.loads((out / "report.json").read_text())["cost_ratio"] <= 0.6
    back = transformers.AutoConfig.from_pretrained(out / "hf")
    assert back.architectures == ["T5EncoderModel"] and back.d_ff < 64


def test_a_fine_tuned_classifier_folder_keeps_its_head(tmp_path: Path) -> None:
    """A BertForSequenceClassification folder is pruned as that class (AutoModel dropped its
    classifier): fidelity is the share of held-out sentences whose predicted class stays,
    recomputed here from model.pt, and hf/ reloads as the classifier with model.pt's logits."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=45, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    folder, text = _bert_folder(tmp_path, transformers.BertForSequenceClassification(config))
    out = tmp_path / "out"
    cli = run_cli("prune", folder, "--text", text, "--target", "70%", "--uniform", "--out", out)
    assert cli.code == 0, cli.err
    report = json.loads((out / "report.json").read_text())
    assert report["metric"] == "agreement_with_dense"
    dense = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    small = load_state_dict_export(
        out / "model.pt", transformers.BertForSequenceClassification.from_pretrained(folder)
    ).eval()
    back = transformers.AutoModelForSequenceClassification.from_pretrained(out / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    held = [s for s in text.read_text().splitlines() if s][-8:]
    enc = tok(held, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = small(**enc).logits
        same = (logits.argmax(-1) == dense(**enc).logits.argmax(-1)).float().mean()
        torch.testing.assert_close(back(**enc).logits, logits, rtol=1e-4, atol=1e-5)
    assert float(same) == pytest.approx(report["after"])


def _bert_config(**kw: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.BertConfig(
        vocab_size=45, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, **kw,
    )  # fmt: skip


def test_a_one_score_head_is_judged_by_the_squared_difference(tmp_path: Path) -> None:
    """A sequence classifier with one label (a regressor, a cross-encoder): the report's
    metric is the mean squared difference of the scores to the dense ones, recomputed here
    (arg-max agreement was always 1, and a one-class label-free loss has no gradient)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    head = transformers.BertForSequenceClassification(_bert_config(num_labels=1))
    folder, text = _bert_folder(tmp_path, head)
    out = tmp_path / "out"
    cli = run_cli("prune", folder, "--text", text, "--target", "50%", "--out", out)
    assert cli.code == 0, cli.err
    report = json.loads((out / "report.json").read_text())
    assert report["metric"] == "mse_to_dense" and report["before"] == 0.0
    dense = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    small = load_state_dict_export(
        out / "model.pt", transformers.BertForSequenceClassification.from_pretrained(folder)
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    held = [s for s in text.read_text().splitlines() if s][-8:]
    enc = tok(held, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        mse = float((small(**enc).logits - dense(**enc).logits).pow(2).mean())
    assert mse == pytest.approx(report["after"], rel=1e-4) and mse > 0


@pytest.mark.parametrize(
    ("config", "arch", "read_as"),
    [
        ("BertConfig", "BertForSequenceClassification", "BertForSequenceClassification"),
        ("BertConfig", "BertForTokenClassification", "BertForTokenClassification"),
        ("LlamaConfig", "LlamaForCausalLM", "LlamaForCausalLM"),
        ("GPT2Config", "GPT2LMHeadModel", "GPT2LMHeadModel"),
        ("T5Config", "T5EncoderModel", "T5EncoderModel"),
        ("BertConfig", "BertForMaskedLM", "AutoModel"),
        ("BertConfig", "BertForQuestionAnswering", "AutoModel"),
        ("ElectraConfig", "ElectraForPreTraining", "AutoModel"),
        ("BertConfig", "BertModel", "AutoModel"),
    ],
)
def test_a_folder_is_read_as_its_head_when_that_runs_on_text(
    tmp_path: Path, config: str, arch: str, read_as: str
) -> None:
    transformers = pytest.importorskip("transformers")
    from fisherprune.cli.prune import _text_model_class

    getattr(transformers, config)(architectures=[arch]).save_pretrained(tmp_path)
    assert _text_model_class(str(tmp_path)) is getattr(transformers, read_as)


def test_a_head_that_needs_more_than_text_is_pruned_as_its_base_model(tmp_path: Path) -> None:
    """A question-answering folder (its head returns start and end logits) is read as its
    encoder, as AutoModel reads it, and judged by the cosine of embeddings (it failed with
    "cannot tell which tensor the model's output is")."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    folder, text = _bert_folder(tmp_path, transformers.BertForQuestionAnswering(_bert_config()))
    out = tmp_path / "out"
    cli = run_cli("prune", folder, "--text", text, "--target", "70%", "--uniform", "--out", out)
    assert cli.code == 0, cli.err
    assert json.loads((out / "report.json").read_text())["metric"] == "cosine_to_dense"
    assert transformers.AutoConfig.from_pretrained(out / "hf").architectures == ["BertModel"]


def test_a_model_that_does_not_run_on_text_alone_exits_2_saying_so(tmp_path: Path) -> None:
    """CLIP (text and images) is refused before any work, naming the class and the error, not
    blamed on --max_length."""
    transformers = pytest.importorskip("transformers")
    config = transformers.CLIPConfig(
        text_config={"vocab_size": 45, "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 1, "num_attention_heads": 4},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 4, "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )  # fmt: skip
    folder, text = _bert_folder(tmp_path, transformers.CLIPModel(config))
    cli = run_cli("prune", folder, "--text", text, "--out", tmp_path / "o")
    assert cli.code == 2, cli.err
    assert "CLIPModel does not run on the tokenized sentences alone" in cli.err
    assert "--max_length" not in cli.err and not (tmp_path / "o").exists()


def test_an_encoder_decoder_folder_exits_2_saying_to_save_its_encoder(tmp_path: Path) -> None:
    folder, text = _bert_folder(tmp_path, _t5(encoder_only=False))
    cli = run_cli("prune", folder, "--text", text, "--out", tmp_path / "o")
    assert cli.code == 2, cli.err
    assert "encoder-decoder" in cli.err and "T5EncoderModel" in cli.err
    assert not (tmp_path / "o").exists()


def test_sentences_longer_than_the_model_reads_exit_2_naming_the_length(tmp_path: Path) -> None:
    """Sentences of 100 words for a BERT with 64 positions (truncated to --max_length 128):
    exit 2 naming the length, the model's limit and --max_length, before any work (it failed
    with a traceback from inside the embeddings); --max_length 64 then runs."""
    folder, _ = _bert_folder(tmp_path)
    rng = np.random.default_rng(1)
    text = tmp_path / "long.txt"
    text.write_text(
        "\n".join(" ".join(f"w{i}" for i in rng.integers(0, 40, 100)) for _ in range(12))
    )
    out = tmp_path / "o"
    cli = run_cli("prune", folder, "--text", text, "--out", out)
    assert cli.code == 2, cli.err
    assert "102 tokens" in cli.err and "max_position_embeddings=64" in cli.err
    assert "--max_length" in cli.err and "Traceback" not in cli.err and not out.exists()
    assert run_cli("prune", folder, "--text", text, "--max_length", "64", "--out", out).code == 0


def test_the_command_shows_fisherprune_warnings_as_one_line(tmp_path: Path) -> None:
    """A group pruned to its floor on BERT at 40%: the warning is one line,
    ``fisherprune prune: warning: ...``, not Python's file, line and source line (run as the
    console script runs, since pytest records warnings in-process)."""
    folder, text = _bert_folder(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "fisherprune", "prune", str(folder), "--text", str(text),
         "--target", "40%", "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "left at their floor" in line]
    assert len(said) == 1 and said[0].startswith("fisherprune prune: warning: mask(s) left")
    assert "UserWarning" not in done.stderr and "prune_to_target(" not in done.stderr


def test_the_reported_latency_is_timed_with_freed_memory_retained_on_glibc(
    tmp_path: Path,
) -> None:
    """The command times dense and pruned as docs/usage.md advises serving them, with glibc
    told to keep freed memory (else large activations are page-faulted in at every call), and
    the report says so; elsewhere the allocator stays as it was, and the report says that (run
    as the console script runs: the setting is process-wide)."""
    data, weights, _, _ = _data_and_weights(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "fisherprune", "prune", "mlp", "--width", "32", "--depth", "2",
         "--weights", str(weights), "--data", str(data), "--target", "50%", "--rounds", "1",
         "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    expected = "freed memory retained" if glibc else "the platform's malloc (not glibc)"
    assert report["latency_allocator"].startswith(expected)


def test_a_folder_that_is_no_hugging_face_model_exits_2_before_any_work(tmp_path: Path) -> None:
    """A folder without config.json (an image folder given as the model) is refused naming
    it and what to give instead, not with transformers' six-line tokenizer error."""
    (tmp_path / "images" / "a").mkdir(parents=True)
    text = tmp_path / "s.txt"
    text.write_text("a b\nc d\n")
    cli = run_cli("prune", tmp_path / "images", "--text", text, "--out", tmp_path / "o")
    assert cli.code == 2, cli.err
    assert "without config.json" in cli.err and "mlp" in cli.err
    assert len(cli.err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_a_dense_model_exported_by_fisherprune_train_is_pruned_as_trained(
    tmp_path: Path,
) -> None:
    """``fisherprune train`` wraps a table's network in its feature scaling; its dense export
    given as --weights is read with that scaling (it was refused: "model.net.1.weight not in
    the model"), and the dense accuracy prune reports is the one train reported."""
    data, _, _, _ = _data_and_weights(tmp_path)
    run = tmp_path / "dense"
    trained = run_cli(
        "train", "--data", data, "--label", "label", "--model", "mlp", "--width", "32",
        "--depth", "2", "--steps", "150", "--pruning.flops_target", "1e12",
        "--save_dir", run, "--progress", "none", "--export_formats", "state_dict",
    )  # fmt: skip
    assert trained.code == 0, trained.err
    out = tmp_path / "out"
    cli = run_cli("prune", "mlp", "--width", "32", "--depth", "2", "--weights",
                  run / "export" / "model.pt", "--data", data, "--target", "50%",
                  "--out", out)  # fmt: skip
    assert cli.code == 0, cli.err
    report = json.loads((out / "report.json").read_text())
    result = json.loads((run / "result.json").read_text())
    assert report["before"] == pytest.approx(result["final_metric"])
    assert report["cost_ratio"] <= 0.5 and report["written_vs_masked_max_abs_diff"] < 1e-5


def test_weights_of_another_width_exit_2_naming_the_mismatch(tmp_path: Path) -> None:
    """Weights trained at --width 32 given to a --width 16 build: exit 2 with the first
    mismatched tensor and both shapes (not a load_state_dict traceback); nothing written."""
    data, weights, _, _ = _data_and_weights(tmp_path)
    cli = run_cli("prune", "mlp", "--width", "16", "--depth", "2", "--weights", weights,
                  "--data", data, "--out", tmp_path / "o")  # fmt: skip
    assert cli.code == 2, cli.err
    assert "does not fit the model" in cli.err and "shapes differ" in cli.err
    assert "net.1.weight (32, 6) (model: (16, 6))" in cli.err
    assert "Traceback" not in cli.err and not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--batch_size", "0"], "--batch_size must be an integer >= 1, got 0"),
        (["--calibration", "0"], "--calibration must be an integer >= 1, got 0"),
        (["--finetune_steps", "-3"], "--finetune_steps must be an integer >= 0, got -3"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--distill.temperature", "-1"], "--distill.temperature must be > 0"),
    ],
)
def test_bad_counts_exit_2_before_any_work(tmp_path: Path, extra: list[str], message: str) -> None:
    data, weights, _, _ = _data_and_weights(tmp_path)
    cli = run_cli("prune", "mlp", "--width", "32", "--depth", "2", "--weights", weights,
                  "--data", data, *extra, "--out", tmp_path / "o")  # fmt: skip
    assert cli.code == 2 and message in cli.err
    assert "signals" not in cli.err  # refused before the calibration pass
    assert not (tmp_path / "o").exists()


def test_out_that_is_a_file_exits_2_and_leaves_it(tmp_path: Path) -> None:
    data, weights, _, _ = _data_and_weights(tmp_path)
    taken = tmp_path / "taken"
    taken.write_text("mine")
    cli = run_cli("prune", "mlp", "--width", "32", "--depth", "2", "--weights", weights,
                  "--data", data, "--out", taken)  # fmt: skip
    assert cli.code == 2 and "is a file" in cli.err and taken.read_text() == "mine"


def test_weights_with_a_hugging_face_folder_exit_2(tmp_path: Path) -> None:
    """--weights would be ignored for a folder (it loads its own): refused, not ignored."""
    folder, text = _bert_folder(tmp_path)
    _, weights, _, _ = _data_and_weights(tmp_path)
    cli = run_cli("prune", folder, "--text", text, "--weights", weights, "--out", tmp_path / "o")
    assert cli.code == 2 and "--weights is not read for a Hugging Face folder" in cli.err
    assert not (tmp_path / "o").exists()


def test_the_target_is_met_at_seq_len_tokens_and_reported_at_the_calibration_length(
    tmp_path: Path,
) -> None:
    """The cost ratio of the report is FlopCounterMode's, shrunk over dense, on inputs of
    --seq_len tokens, and its calibration_cost_ratio the same on the calibration batch's
    length; the two differ (attention's share grows with length), so neither stands in for
    the other. (Eager attention: FlopCounterMode has no formula for the fused CPU
    attention kernel SDPA dispatches to and would count no attention at all.)"""
    transformers = pytest.importorskip("transformers")
    folder, text = _bert_folder(tmp_path)
    out = tmp_path / "out"
    cli = run_cli("prune", folder, "--text", text, "--target", "50%", "--seq_len", "60",
                  "--out", out)  # fmt: skip
    assert cli.code == 0, cli.err
    report = json.loads((out / "report.json").read_text())
    eager = {"attn_implementation": "eager"}
    small = load_state_dict_export(
        out / "model.pt", transformers.AutoModel.from_pretrained(folder, **eager)
    ).eval()
    dense = transformers.AutoModel.from_pretrained(folder, **eager).eval()

    def flops(model: torch.nn.Module, tokens: int) -> int:
        ids = torch.full((1, tokens), 5)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
        return counter.get_total_flops()

    assert report["seq_len"] == 60 and report["calibration_length"] < 60
    calibration = report["calibration_length"]
    for key, tokens in (("cost_ratio", 60), ("calibration_cost_ratio", calibration)):
        assert report[key] == pytest.approx(flops(small, tokens) / flops(dense, tokens), rel=1e-6)
    assert report["cost_ratio"] <= 0.5
    assert report["cost_ratio"] != pytest.approx(report["calibration_cost_ratio"], rel=1e-4)
    assert "at 60 tokens" in cli.out and "Loading weights" not in cli.err


def test_seq_len_with_a_model_that_reads_no_text_exits_2(tmp_path: Path) -> None:
    """--seq_len with a built-in model (inputs of the data's one shape) is refused before any
    work, not ignored."""
    data, weights, _, _ = _data_and_weights(tmp_path)
    cli = run_cli("prune", "mlp", "--width", "32", "--depth", "2", "--weights", weights,
                  "--data", data, "--seq_len", "64", "--out", tmp_path / "o")  # fmt: skip
    assert cli.code == 2 and "--seq_len is for a Hugging Face model folder" in cli.err
    assert not (tmp_path / "o").exists()


def test_the_dense_model_train_writes_by_default_prunes_from_the_dense_accuracy(
    tmp_path: Path,
) -> None:
    """fisherprune train writes export/dense.pt when its dense phase ends (on by default),
    though the run goes on to prune: given to prune --weights, it has the dense accuracy the
    run measured, not the pruned model's."""
    data, _, _, _ = _data_and_weights(tmp_path)
    run = tmp_path / "run"
    trained = run_cli(
        "train", "--data", data, "--label", "label", "--model", "mlp", "--width", "32",
        "--depth", "2", "--pruning.burn_in", "100", "--fine_tune_steps", "0", "--save_dir", run,
        "--progress", "none", "--export_formats", "state_dict",
    )  # fmt: skip
    assert trained.code == 0, trained.err
    result = json.loads((run / "result.json").read_text())

    def size(name: str) -> int:
        state = torch.load(run / "export" / name, weights_only=True)["state_dict"]
        return sum(v.numel() for v in state.values())

    assert result["prunes"] > 0 and size("dense.pt") > size("model.pt")  # pruned after it
    cli = run_cli("prune", "mlp", "--width", "32", "--depth", "2", "--weights",
                  run / "export" / "dense.pt", "--data", data,
                  "--out", tmp_path / "out")  # fmt: skip
    assert cli.code == 0, cli.err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["before"] == pytest.approx(result["dense_metric"])


def test_no_export_dense_writes_no_dense_file(tmp_path: Path) -> None:
    """--no-export_dense turns the dense file off."""
    data, _, _, _ = _data_and_weights(tmp_path)
    run = tmp_path / "run"
    trained = run_cli(
        "train", "--data", data, "--label", "label", "--model", "mlp", "--width", "8",
        "--depth", "1", "--steps", "20", "--pruning.burn_in", "10", "--dense_check", "off",
        "--save_dir", run,
        "--progress", "none", "--export_formats", "state_dict", "--no-export_dense",
    )  # fmt: skip
    assert trained.code == 0, trained.err
    assert (run / "export" / "model.pt").is_file() and not (run / "export" / "dense.pt").exists()


def test_seconds_count_every_phase_of_the_run_fine_tune_included(tmp_path: Path) -> None:
    """report.json's seconds is the sum of its phase_seconds, which hold the fine-tune; each
    phase ends with a line on stderr, and the fine-tune says its progress every tenth of its
    steps."""
    data, weights, _, _ = _data_and_weights(tmp_path)
    out = tmp_path / "out"
    cli = run_cli("prune", "mlp", "--width", "32", "--depth", "2", "--weights", weights,
                  "--data", data, "--finetune_steps", "20", "--out", out)  # fmt: skip
    assert cli.code == 0, cli.err
    report = json.loads((out / "report.json").read_text())
    phases = report["phase_seconds"]
    assert {"load", "evaluate", "signals", "selection", "repair", "finetune", "export",
            "latency"} <= set(phases)  # fmt: skip
    assert report["seconds"] == pytest.approx(sum(phases.values()), rel=1e-9)
    assert phases["finetune"] > 0
    assert cli.err.count("fisherprune prune: fine-tuning step") == 10
    for phase in ("load", "prune", "finetune", "export", "latency"):
        assert f"fisherprune prune: {phase} " in cli.err


def test_no_progress_bar_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    """With stderr redirected (a log file, a pipe) no progress bar is drawn: stderr holds
    the phase lines and no carriage return."""
    data, weights, _, _ = _data_and_weights(tmp_path)
    cli = run_cli("prune", "mlp", "--width", "32", "--depth", "2", "--weights", weights,
                  "--data", data, "--out", tmp_path / "out")  # fmt: skip
    assert cli.code == 0, cli.err
    assert "fisherprune prune: prune " in cli.err
    assert "\r" not in cli.err and "signals, round" not in cli.err


def test_prune_help_shows_the_defaults() -> None:
    """prune --help gives each option's default where it has one (not for flags)."""
    cli = run_cli("prune", "--help")
    assert cli.code == 0
    text = " ".join(cli.out.split())  # argparse wraps lines
    for default in ("(default: 128)", "(default: 1000)", "(default: 0.2)", "(default: 32)",
                    "(default: 50%)"):  # fmt: skip
        assert default in text
    assert "(default: None)" not in text and "(default: False)" not in text
