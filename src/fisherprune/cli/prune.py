"""``fisherprune prune``: prune a trained model to a cost target from calibration data, with no
training (``fisherprune.prune_to_target``), optionally fine-tune it by distillation, and write
the shrunk model, its plan and a report.

Models: a built-in name (as ``fisherprune train`` knows them) or ``package.module:function``
with ``--weights`` (a ``state_dict`` file) and a dataset (``--data``, read as ``train`` reads
it, whole: a table, arrays, a folder of images per class or a table column of images with
``--image_size``; calibration from its training split, accuracy or mse on its eval split, or
on ``--eval_data``); or a Hugging Face
model folder (``transformers`` installed; read as the class it was saved as) with
``--text``, one sentence per line (calibration from the first lines, fidelity on the last
``--eval_fraction`` of them: the share of predictions that stay the dense model's for a model
with a head, the cosine similarity of mean-pooled embeddings to the dense model's for one
without). With ``--eval_text`` a causal language model's perplexity on held-out text, dense
and pruned, is reported too (``cli.prune_perplexity``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fisherprune._errors import first_line
from fisherprune.calibrate import PruneResult, output_tensor, prune_to_target
from fisherprune.calibrate.to_target import ROUND_CAP
from fisherprune.cli.help import DefaultsFormatter
from fisherprune.cli.hf_check import check_hf_folder
from fisherprune.cli.prune_latency import add_latency_arguments, latency_spec
from fisherprune.cli.prune_length import (
    LengthCost,
    cost_at_length,
    example_at_length,
    resolve_seq_len,
)
from fisherprune.cli.prune_outputs import HF_FOLDER, REPORT_FILE, check_out, write_outputs
from fisherprune.cli.prune_perplexity import (
    CAUSAL_HEADS,
    HeldOutText,
    add_perplexity_argument,
    check_eval_text,
    held_out_text,
    perplexity_fields,
    perplexity_text,
)
from fisherprune.cli.prune_phases import FinetuneProgress, PhaseClock, bars_on_terminal_only
from fisherprune.cost import CONVENTIONS
from fisherprune.cost.latency import prediction_check, prediction_text
from fisherprune.distill import finetune, frozen_teacher
from fisherprune.export.hf_folder import HFFolder
from fisherprune.export.latency import compare_latency, retain_freed_memory
from fisherprune.export.safe_load import load_plain
from fisherprune.export.storage import atomic_directory, atomic_path, remove_stale_directories
from fisherprune.inputs import call_model
from fisherprune.masks.points import MASKS_ATTR
from fisherprune.modes import eval_mode
from fisherprune.signals.criteria import CRITERIA
from fisherprune.train.data import DataSpec, Scaling, load_data
from fisherprune.train.models import MODELS, build_model
from fisherprune.train.pretrained import misfit
from fisherprune.train.scaling import with_scaling

__all__ = ["prune_command", "prune_parser"]


def prune_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "prune",
        help="prune a trained model to a cost target from calibration data, no training",
        description="Estimate Fisher (or another criterion's) signals on calibration data with "
        "the weights frozen, remove the cheapest channels until the target, repair the layers "
        "that read them by least squares, and write the shrunk model, its plan and a report.",
        formatter_class=DefaultsFormatter,
    )
    p.add_argument(
        "model",
        help="built-in name (mlp, cnn, resnet, densenet, lstm, gru), "
        "package.module:function, or a Hugging Face model folder",
    )
    p.add_argument("--weights", help="state_dict file of the trained model (not for a folder)")
    p.add_argument(
        "--data",
        help="calibration/eval data as fisherprune train reads it: a table, .npy/.npz, a "
        "folder with one sub-folder of images per class, or a built-in name",
    )
    p.add_argument("--eval_data", help="evaluation data of the same kind (default: split --data)")
    p.add_argument("--label", help="label column (tables) or array key (npz)")
    p.add_argument("--labels", help="for a .npy --data: its .npy label array")
    p.add_argument("--task", default="classification", help="classification or regression")
    p.add_argument("--image_shape", help="reshape features to C,H,W, e.g. 1,28,28")
    p.add_argument(
        "--image_size",
        help="resize images (a folder, or --image_column) to H,W (32,24) or a square (32)",
    )
    p.add_argument(
        "--image_mode", default="auto", help="images as L (gray), RGB, or auto (RGB if colour)"
    )
    p.add_argument("--image_column", help="table column of encoded images or image paths")
    p.add_argument("--width", type=int, help="width of a built-in model")
    p.add_argument("--depth", type=int, help="depth of a built-in model")
    p.add_argument("--text", help="Hugging Face model: a text file, one sentence per line")
    p.add_argument("--max_length", type=int, default=128, help="tokens per sentence (text)")
    add_perplexity_argument(p)
    p.add_argument(
        "--seq_len",
        type=int,
        help="text: the input length, in tokens, the cost target is defined at (attention's "
        "share of the cost grows with it; default: --max_length, capped at the model's "
        "max_position_embeddings); the report gives the cost at the calibration length too",
    )
    p.add_argument("--eval_fraction", type=float, default=0.2, help="share held out to evaluate")
    p.add_argument("--calibration", type=int, default=1000, help="calibration examples (most)")
    p.add_argument("--batch_size", type=int, default=32, help="calibration batch size")
    p.add_argument(
        "--target",
        default="50%",
        help="cost to reach: 50%%, 0.5 or an absolute number (per example); with --convention "
        "latency also a time per forward pass, such as 12ms",
    )
    p.add_argument(
        "--convention",
        default="flops",
        choices=CONVENTIONS,
        help="cost of the target; latency: each operator timed on --latency_device at "
        "--latency_batch (docs/usage.md, 'Pruning to a measured latency')",
    )
    p.add_argument(
        "--rounds",
        type=_rounds,
        default="auto",
        help="cost goals, each reached by estimate-and-prune rounds; auto: more the more "
        "is removed (4 to 50%%)",
    )
    p.add_argument(
        "--round_cap",
        type=float,
        default=ROUND_CAP,
        help="the largest share of a group's kept channels one round may remove (1: no cap)",
    )
    p.add_argument(
        "--criterion",
        default="auto",
        choices=["auto", *sorted(CRITERIA)],
        help="how channels are ranked; auto: fisher_mean with the repair (the Fisher of "
        "replacing a channel by its mean, as the repair does), fisher without it",
    )
    p.add_argument(
        "--label_free",
        action="store_true",
        help="Fisher of the model's own predictions instead of the labels",
    )
    p.add_argument(
        "--no-reconstruct",
        dest="reconstruct",
        action="store_false",
        help="skip the least-squares repair",
    )
    p.add_argument(
        "--no-recalibrate_norms",
        dest="recalibrate_norms",
        action="store_false",
        help="measure every round's signals with the dense batch-norm statistics (default: "
        "re-estimated on the calibration data between rounds, then put back)",
    )
    p.add_argument("--min_channels", type=float, default=1, help="fewest channels a group keeps")
    p.add_argument(
        "--round_to",
        type=int,
        default=None,
        help="keep multiples of this many weight rows (a head counts head_dim; default 1, or "
        "with --convention latency the step its table is timed in, 8)",
    )
    p.add_argument(
        "--uniform",
        action="store_true",
        help="prune every copy of a repeated block alike (same head count and widths), so "
        "that a Hugging Face model's hf/ folder has a standard config (no remote code); a "
        "target it cannot reach is refused up front, naming the reachable floor. Without it, "
        "hf/ records each block's widths and loads with trust_remote_code=True",
    )
    p.add_argument(
        "--blocks",
        action="store_true",
        help="also rank whole repeated blocks (decoder layers) against channels in the one "
        "budget: a removed block is dropped from the written model (fewer "
        "num_hidden_layers in hf/)",
    )
    p.add_argument(
        "--experts",
        action="store_true",
        help="also rank the whole experts of mixture-of-experts layers (Qwen3-MoE, Mixtral, "
        "OLMoE): a removed expert is dropped from the router and the written model (pays under "
        "--convention params; under FLOPs an expert costs only its router row)",
    )
    p.add_argument(
        "--score_convention",
        choices=CONVENTIONS,
        help="cost the signal is weighed against (default: FLOPs, the target's); memory "
        "(activation elements) spreads the cut and often runs faster, see docs/usage.md",
    )
    add_latency_arguments(p)
    p.add_argument("--finetune_steps", type=int, default=0, help="distilled fine-tuning steps")
    p.add_argument(
        "--distill.alpha",
        dest="alpha",
        type=float,
        default=0.5,
        help="fine-tuning weight of the dense model's outputs vs the labels",
    )
    p.add_argument("--distill.temperature", dest="temperature", type=float, default=2.0)
    p.add_argument("--lr", type=float, default=1e-3, help="fine-tuning learning rate (Adam)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=prune_command)
    return p


def _rounds(text: str) -> int | str:
    """``--rounds``: ``auto`` or a positive integer."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be auto or an integer, got {text!r}") from None


@dataclass
class _Job:
    """A model with its calibration batches, evaluation inputs and how to score outputs."""

    model: nn.Module
    example: Any
    batches: list[tuple[Any, Any]]
    evaluate: Callable[[nn.Module, nn.Module], float]  # (model, dense) -> metric
    metric: str
    loss_fn: Callable[[Any, Any], Tensor] | None
    task: str
    rebuild: Callable[[], nn.Module]  # a fresh, unmasked instance of the architecture
    #: writes what belongs beside a Hugging Face model's weights (its tokenizer) into a folder
    extras: Callable[[Path], None] | None = None
    #: a text model's first calibration sentence at the calibration batch's padded length
    #: (``example`` has ``--seq_len`` tokens); None for other models
    calibration_example: dict[str, Tensor] | None = None
    #: ``--eval_text`` cut into model inputs (a causal language model given one); else None
    held_out: HeldOutText | None = None


def _weights_file(path: str | None) -> dict[str, Any]:
    """The state_dict in ``path`` (a plain one, or a fisherprune export's).

    Raises:
        ValueError: no path, no state_dict, or a training checkpoint (masks in it).
    """
    if path is None:
        raise ValueError("--weights is required for a built-in or package.module:function model")
    state = load_plain(path, "weights file", "save the model with torch.save(model.state_dict())")
    if isinstance(state, dict) and isinstance(state.get("state_dict", state.get("model")), dict):
        state = state.get("state_dict", state.get("model"))
    if not isinstance(state, dict):
        raise ValueError(f"weights file {path} does not hold a state_dict")
    if any(k.startswith(MASKS_ATTR + ".") or f".{MASKS_ATTR}." in k for k in state):
        raise ValueError(
            f"weights file {path} holds fisherprune masks (a training checkpoint): export it "
            "with fisherprune export, or save the dense model's state_dict"
        )
    return state


def _fitting_build(
    build: Callable[[], nn.Module], scaling: Scaling | None, state: dict[str, Any], path: str
) -> Callable[[], nn.Module]:
    """How to build the model the weights fit: the bare network (a model trained on the
    features as they are), or the network between this data's scaling modules as
    ``fisherprune train`` trains it on a table (``train.scaling``; the file's own scaling
    values load over the data's).

    Raises:
        ValueError: neither fits; it names the mismatches of the bare network.
    """

    def wrapped() -> nn.Module:
        return with_scaling(build(), scaling)

    problems = misfit(build().state_dict(), state)
    if not problems:
        return build
    if scaling is not None and not misfit(wrapped().state_dict(), state):
        return wrapped
    raise ValueError(
        f"weights file {path} does not fit the model ({'; '.join(problems)}); build the "
        "model as it was trained (the same --model, --width, --depth and data shape)"
    )


def _accuracy_or_mse(
    x: Tensor, y: Tensor, classify: bool
) -> Callable[[nn.Module, nn.Module], float]:
    def evaluate(model: nn.Module, dense: nn.Module) -> float:
        with eval_mode(model), torch.no_grad():
            out = torch.cat([model(x[i : i + 512]) for i in range(0, x.shape[0], 512)])
        if classify:
            return float((out.argmax(1) == y).double().mean())
        return float(F.mse_loss(out.reshape(y.shape), y))

    return evaluate


def _sizes(text: str | None, flag: str) -> tuple[int, ...] | None:
    """``"3,32,32"`` -> ``(3, 32, 32)``; None stays None."""
    if text is None:
        return None
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be integers separated by commas, got {text!r}") from None


def _builtin_job(args: argparse.Namespace) -> _Job:
    if args.data is None:
        raise ValueError("--data is required for a built-in or package.module:function model")
    size = _sizes(args.image_size, "--image_size")
    data = load_data(
        DataSpec(
            source=args.data,
            label=args.label,
            labels=args.labels,
            task=args.task,
            eval_source=args.eval_data,
            eval_fraction=args.eval_fraction,
            image_shape=_sizes(args.image_shape, "--image_shape"),
            seed=args.seed,
            image_size=size,
            image_mode=args.image_mode,
            image_column=args.image_column,
            stream="never",
        )
    )
    classify = data.num_classes is not None
    outputs = data.num_classes if classify else 1

    def bare() -> nn.Module:
        return build_model(args.model, data.input_shape, outputs, args.width, args.depth)

    state = _weights_file(args.weights)
    rebuild = _fitting_build(bare, data.scaling, state, args.weights)
    model = rebuild()
    model.load_state_dict(state)
    example = data.x_train[:1]
    n = min(args.calibration, data.x_train.shape[0])
    bs = args.batch_size
    batches = [
        (data.x_train[i : min(i + bs, n)], data.y_train[i : min(i + bs, n)])
        for i in range(0, n, bs)
    ]
    if classify:
        loss_fn: Any = F.cross_entropy
    else:

        def loss_fn(out: Tensor, y: Tensor) -> Tensor:
            return F.mse_loss(out.reshape(y.shape), y)

    return _Job(
        model,
        example,
        batches,
        _accuracy_or_mse(data.x_eval, data.y_eval, classify),
        "accuracy" if classify else "mse",
        None if args.label_free else loss_fn,
        "classification" if classify else "regression",
        rebuild,
    )


def _mean_pooled(out: Any, mask: Tensor) -> Tensor:
    h = output_tensor(out)
    w = mask.unsqueeze(-1).to(h.dtype)
    return (h * w).sum(1) / w.sum(1).clamp_min(1.0)


def _hf_job(args: argparse.Namespace) -> _Job:
    try:  # imported here: transformers takes a second to import, which other jobs need not pay
        import transformers
    except ImportError:
        raise ImportError(
            "a Hugging Face model folder needs transformers: pip install transformers"
        ) from None
    if args.text is None:
        raise ValueError("a Hugging Face model needs --text, a file of sentences, one a line")
    lines = [s.strip() for s in Path(args.text).read_text().splitlines() if s.strip()]
    held = max(1, round(len(lines) * args.eval_fraction))
    if len(lines) - held < 1:
        raise ValueError(f"--text {args.text} needs at least 2 non-empty lines")
    calib, held_out = lines[: len(lines) - held][: args.calibration], lines[len(lines) - held :]
    model_class = _text_model_class(args.model)
    config = transformers.AutoConfig.from_pretrained(args.model)
    check_hf_folder(Path(args.model), config, model_class)
    seq_len = resolve_seq_len(args.seq_len, args.max_length, config)
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    held = (
        held_out_text(args.eval_text, tok, model_class, seq_len, args.batch_size * args.max_length)
        if args.eval_text is not None
        else None
    )

    def rebuild() -> nn.Module:
        return model_class.from_pretrained(args.model).eval()

    def encode(texts: list[str]) -> dict[str, Tensor]:
        enc = tok(
            texts, padding=True, truncation=True, max_length=args.max_length, return_tensors="pt"
        )
        return dict(enc)

    bs = args.batch_size
    batches: list[tuple[Any, Any]] = [
        (encode(calib[i : i + bs]), None) for i in range(0, len(calib), bs)
    ]
    evals = [encode(held_out[i : i + bs]) for i in range(0, len(held_out), bs)]
    model = rebuild()
    _check_length(model, [b for b, _ in batches] + evals, args.max_length)
    with torch.no_grad():
        logits = getattr(call_model(model, evals[0]), "logits", None)
    if logits is None:  # hidden states: mean-pooled, compared by cosine
        metric, task, compare = "cosine_to_dense", "regression", _pooled_cosine
    elif logits.shape[-1] == 1:  # one score per sentence (a regressor, a cross-encoder)
        metric, task, compare = "mse_to_dense", "regression", _squared_difference
    elif logits.dim() == 2:  # one prediction per sentence (a sequence classifier)
        metric, task, compare = "agreement_with_dense", "classification", _same_prediction
    else:  # one per token (token classification, a language model)
        metric, task, compare = "token_agreement_with_dense", "classification", _same_prediction

    def fidelity(model: nn.Module, dense: nn.Module) -> float:
        scores = []
        with eval_mode(model, dense), torch.no_grad():
            for e in evals:
                scores.append(compare(call_model(model, e), call_model(dense, e), e))
        return float(torch.cat(scores).mean())

    return _Job(
        model,
        example_at_length(batches[0][0], seq_len),
        batches,
        fidelity,
        metric,
        None,
        task,
        rebuild,
        extras=tok.save_pretrained,
        calibration_example={k: v[:1] for k, v in batches[0][0].items()},
        held_out=held,
    )


def _check_length(model: nn.Module, encoded: list[dict[str, Tensor]], max_length: int) -> None:
    """Run ``model`` on the longest encoded sentence, so that a sentence longer than the model
    can read (its position embeddings) is refused before any work.

    Raises:
        ValueError: it fails; it names the length and what to give.
    """
    longest = max(encoded, key=lambda e: e["input_ids"].shape[1])
    row = int(longest["attention_mask"].sum(1).argmax())
    try:
        with torch.no_grad():
            call_model(model, {k: v[row : row + 1] for k, v in longest.items()})
    except Exception as e:
        tokens = longest["input_ids"].shape[1]
        limit = getattr(model.config, "max_position_embeddings", None)
        if isinstance(limit, int) and tokens > limit:
            raise ValueError(
                f"the model cannot read a sentence of {tokens} tokens (its config has "
                f"max_position_embeddings={limit}): {first_line(e)}; give a smaller "
                f"--max_length (now {max_length})"
            ) from None
        raise ValueError(
            f"{type(model).__name__} does not run on the tokenized sentences alone "
            f"({first_line(e)}): fisherprune prune reads a text model (a base model, a "
            "sequence or token classifier, a causal language model)"
        ) from None


def _pooled_cosine(out: Any, dense_out: Any, enc: dict[str, Tensor]) -> Tensor:
    """Per sentence: the cosine of the mean-pooled hidden states to the dense model's."""
    mask = enc["attention_mask"]
    return F.cosine_similarity(_mean_pooled(out, mask), _mean_pooled(dense_out, mask), dim=-1)


def _squared_difference(out: Any, dense_out: Any, enc: dict[str, Tensor]) -> Tensor:
    """Per sentence: the squared difference of the score to the dense model's."""
    return (out.logits - dense_out.logits).pow(2).flatten()


def _same_prediction(out: Any, dense_out: Any, enc: dict[str, Tensor]) -> Tensor:
    """Per sentence (per non-padding token, for token logits): 1 where the arg-max of the
    logits is the dense model's, else 0."""
    same = (out.logits.argmax(-1) == dense_out.logits.argmax(-1)).float()
    return same if same.dim() == 1 else same[enc["attention_mask"] > 0]


#: heads that run on the sentences alone, which a folder saved with one keeps
_TEXT_HEADS = (
    "ForSequenceClassification",
    "ForTokenClassification",
    *CAUSAL_HEADS,
    "EncoderModel",
)


def _text_model_class(folder: str) -> Any:
    """The class the folder was saved as when it is one of ``_TEXT_HEADS`` (a fine-tuned
    classifier keeps its head, a ``T5EncoderModel`` stays an encoder), else ``AutoModel``'s
    base model (the encoder of a masked LM, of a question-answering or pre-training head).

    Raises:
        ValueError: an encoder-decoder model (T5, BART), which needs decoder inputs.
    """
    import transformers  # present: the caller checked

    config = transformers.AutoConfig.from_pretrained(folder)
    arch = next(iter(getattr(config, "architectures", None) or []), "")
    if getattr(config, "is_encoder_decoder", False) and not arch.endswith("EncoderModel"):
        raise ValueError(
            f"{folder} holds an encoder-decoder model ({config.model_type}), which needs "
            "decoder inputs besides the sentences; save its encoder alone (e.g. "
            "T5EncoderModel.from_pretrained(folder).save_pretrained(other)) and prune that"
        )
    if arch.endswith(_TEXT_HEADS) and hasattr(transformers, arch):
        return getattr(transformers, arch)
    return transformers.AutoModel


def _job(args: argparse.Namespace) -> _Job:
    if Path(args.model).is_dir():
        return _hf_job(args)
    return _builtin_job(args)


#: the least value of each integer option
_LEAST = {"calibration": 1, "batch_size": 1, "max_length": 1, "finetune_steps": 0}


def _check_args(args: argparse.Namespace) -> None:
    """Refuse, before any work, what would fail or be ignored later: counts out of range,
    a folder that is not a Hugging Face model folder (no ``config.json``), ``--weights`` with
    a Hugging Face folder (its own weights load), a learning rate or
    temperature that is not positive, an ``--eval_text`` that is no file, holds no text or
    comes with a built-in model (``check_eval_text``), and an ``--out`` that is a file or a
    folder holding files of something else (``check_out``)."""
    for name, low in _LEAST.items():
        value = getattr(args, name)
        if value < low:
            raise ValueError(f"--{name} must be an integer >= {low}, got {value}")
    for flag, value in (("--lr", args.lr), ("--distill.temperature", args.temperature)):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    if Path(args.model).is_dir() and not (Path(args.model) / "config.json").is_file():
        raise ValueError(
            f"{args.model} is a folder without config.json, so not a Hugging Face model folder "
            f"(one written by save_pretrained); for a built-in model give its name "
            f"({', '.join(sorted(MODELS))}) or package.module:function, with --weights and --data"
        )
    if args.seq_len is not None and not Path(args.model).is_dir():
        raise ValueError(
            f"--seq_len is for a Hugging Face model folder read with --text; {args.model} "
            "takes inputs of one shape, the data's"
        )
    if Path(args.model).is_dir() and args.weights is not None:
        raise ValueError(
            f"--weights is not read for a Hugging Face folder ({args.model} loads its own "
            "weights): leave it out, or save the trained model into the folder"
        )
    latency_spec(args)  # a bad --latency_* flag is refused now
    check_eval_text(args.eval_text, Path(args.model).is_dir())
    check_out(Path(args.out))


def prune_command(args: argparse.Namespace) -> int:
    """Run ``fisherprune prune``; writes ``model.pt`` (shrunk weights + plan, as
    ``export_model(format="state_dict")``), ``plan.json`` and ``report.json`` under ``--out``,
    and for a Hugging Face folder ``hf/``: the shrunk model and its tokenizer, for
    ``from_pretrained`` (a standard config with ``--uniform``; else the widths of each block
    with modelling code of its own, for ``trust_remote_code=True``). They are written into
    a temporary folder beside ``--out`` that replaces it whole (``atomic_directory``): an
    interrupted run leaves the earlier run's folder as it was. Each phase ends with a line on
    stderr (``PhaseClock``); progress bars are drawn only when stderr is a terminal."""
    with bars_on_terminal_only() as terminal:
        return _prune(args, terminal)


def _prune(args: argparse.Namespace, bars: bool) -> int:
    """``prune_command``'s work; ``bars``: draw progress bars."""
    clock = PhaseClock()
    out = Path(os.path.abspath(args.out))  # "." has a name and a parent
    remove_stale_directories(out)  # a killed run's old folder is put back first
    _check_args(args)
    torch.manual_seed(args.seed)
    job = _job(args)
    dense = copy.deepcopy(job.model).eval()
    clock.lap("load", f"{args.model}: {len(job.batches)} calibration batches")
    before = job.evaluate(job.model, dense)
    clock.lap("evaluate", f"dense {job.metric} {before:.4f}")
    dense_ppl = job.held_out.measure(dense) if job.held_out else None
    if dense_ppl:
        clock.lap("perplexity", f"dense {dense_ppl.value:.4g} on {dense_ppl.tokens:,} tokens")
    teacher = frozen_teacher(job.model) if args.finetune_steps > 0 else None
    min_channels = int(args.min_channels) if args.min_channels >= 1 else args.min_channels
    latency = latency_spec(args)
    result = prune_to_target(
        job.model,
        job.example,
        job.batches,
        args.target,
        loss_fn=job.loss_fn,
        criterion=args.criterion,
        rounds=args.rounds,
        round_cap=args.round_cap,
        min_channels=min_channels,
        round_to=args.round_to,
        uniform=args.uniform,
        blocks=args.blocks,
        experts=args.experts,
        convention=args.convention,
        score_convention=args.score_convention,
        latency=latency,
        reconstruct=args.reconstruct,
        recalibrate_norms=args.recalibrate_norms,
        task=job.task,
        seed=args.seed,
        progress=bars,
    )
    at_calibration = (
        cost_at_length(job.model, dense, job.calibration_example)
        if job.calibration_example is not None
        else None
    )
    clock.lap(
        "prune",
        f"to {result.ratio:.1%} of the cost in {result.rounds} rounds",
        parts=result.phase_seconds,
    )
    after_prune = job.evaluate(job.model, dense)
    clock.lap("evaluate", f"pruned {job.metric} {after_prune:.4f}")
    losses: list[float] = []
    if args.finetune_steps > 0:  # an unlabelled job has only the teacher made for it above
        losses = finetune(
            job.model,
            teacher,
            job.batches,
            args.finetune_steps,
            loss_fn=job.loss_fn,
            alpha=args.alpha if job.loss_fn else 1.0,
            temperature=args.temperature,
            task=job.task,
            lr=args.lr,
            on_step=FinetuneProgress(args.finetune_steps, clock),
        )
        clock.lap("finetune", f"{args.finetune_steps} steps")
        after = job.evaluate(job.model, dense)
        clock.lap("evaluate", f"fine-tuned {job.metric} {after:.4f}")
    else:
        after = after_prune
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(out) as folder:  # every output of this run, or none of them
        written = write_outputs(
            folder, job.model, job.example, job.batches[0][0], job.rebuild, job.extras, args.model
        )
        clock.lap("export", f"{out.name}/")
        ppl: dict[str, Any] = {}
        ppl_line = ""
        if job.held_out is not None and dense_ppl is not None:  # of the model as written
            pruned_ppl = job.held_out.measure(written.small)
            clock.lap("perplexity", f"pruned {pruned_ppl.value:.4g}")
            ppl = perplexity_fields(job.held_out, dense_ppl, pruned_ppl)
            ppl_line = perplexity_text(dense_ppl, pruned_ppl)
        # timed as docs/usage.md advises serving on CPU, with freed memory kept in the process:
        # glibc's defaults page-fault large activations in at every call, a cost that does not
        # shrink with the FLOPs. The setting is process-wide and lasts: the console script ends
        # after the report; a caller of main() in its own process keeps it (retain_freed_memory).
        # Dense and pruned are timed side by side in rounds; the report and the line give the
        # speed-up as a ratio only where the rounds agree on the faster model (SpeedUp)
        retain_freed_memory()
        timed = compare_latency({"dense": dense, "pruned": written.small}, job.batches[0][0])
        speedup = timed.speedup("dense", "pruned")
        predicted = (
            prediction_check(
                result.cost_before, result.cost_after, dense, written.small, job.example, latency
            )
            if latency and result.convention == "latency"
            else None
        )
        clock.lap("latency", f"{timed.rounds} rounds")
        hf = written.hf
        report = {
            "model": args.model,
            "target": args.target,
            "criterion": result.criterion,
            "label_free": job.loss_fn is None,
            "reconstruct": args.reconstruct,
            "recalibrate_norms": args.recalibrate_norms,
            "round_to": result.round_to,
            "uniform": args.uniform,
            "convention": result.convention,
            "score_convention": args.score_convention or result.convention,
            "rounds": result.rounds,
            "cost_before": result.cost_before,
            "cost_after": result.cost_after,
            "cost_ratio": result.ratio,
            **_length_fields(job.example, at_calibration),
            "metric": job.metric,
            "before": before,
            "after_pruning": after_prune,
            "after": after,
            **ppl,
            "finetune_steps": args.finetune_steps,
            "channels_removed": sum(len(e.channels) for e in result.events),
            "channels_kept": {n: {"kept": k, "of": w} for n, (k, w) in result.kept.items()},
            "min_kept_fraction": result.min_kept_fraction,
            "groups_at_floor": result.at_floor,
            "calibration_examples": result.examples,
            "seconds": clock.total,
            "phase_seconds": clock.seconds,
            "repaired_layers": len(result.repair.layers) if result.repair else 0,
            "repair_held_out_error": result.repair.held_out if result.repair else None,
            "repair_skipped": result.repair.skipped if result.repair else {},
            "written_vs_masked_max_abs_diff": written.diff,
            **({"hugging_face_folder": HF_FOLDER if hf.written else None} if hf else {}),
            **({"hugging_face_folder_kind": hf.kind} if hf and hf.written else {}),
            **({"hugging_face_folder_missing": written.hf_missing} if written.hf_missing else {}),
            **({"hugging_face_folder_notes": list(hf.notes)} if hf and hf.notes else {}),
            "latency_seconds": {name: d.median for name, d in timed.models.items()},
            "latency_allocator": timed.allocator,
            "latency_threads": timed.threads,
            "speedup": speedup.median,
            "speedup_resolved": speedup.resolved,
            "latency": {**timed.to_json(), "speedup": speedup.to_json()},
            **({"latency_prediction": predicted} if predicted else {}),
            **({"latency_line": result.latency_line.as_dict()} if result.latency_line else {}),
            **(
                {"latency_checks": [c.as_dict() for c in result.latency_checks]}
                if result.latency_checks
                else {}
            ),
        }
        with atomic_path(folder / REPORT_FILE) as tmp:
            Path(tmp).write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"{job.metric}: {before:.4f} -> {after_prune:.4f} after pruning"
        + (f" -> {after:.4f} after {args.finetune_steps} fine-tuning steps" if losses else "")
        + ppl_line
        + f"; cost {result.cost_before:,.0f} -> {result.cost_after:,.0f} ({result.ratio:.1%}"
        + _length_text(job.example, at_calibration)
        + f"); latency {timed.models['dense'].text()} -> {timed.models['pruned'].text()}, "
        f"{speedup.text()} [{timed.context()}]; {clock.total:.1f} s; wrote {out}"
        + (f" ({_loaded_by(hf)}: {out / HF_FOLDER})" if hf and hf.written else "")
    )
    print(_groups_line(result))
    if predicted:
        print(prediction_text(predicted))
    for line in (written.hf_missing, *(hf.notes if hf else ())):
        if line:
            print(line)
    return 0


def _loaded_by(hf: HFFolder) -> str:
    """How the written ``hf/`` folder loads, for the printed line."""
    return "from_pretrained, trust_remote_code=True" if hf.remote_code else "from_pretrained"


def _length_fields(example: Any, at_calibration: LengthCost | None) -> dict[str, Any]:
    """The report's entries on input length (a text model only): the length the target is
    defined at (``cost_*`` are at it) and the cost at the calibration batch's length."""
    if at_calibration is None:
        return {}
    return {
        "seq_len": int(example["input_ids"].shape[1]),
        "calibration_length": at_calibration.tokens,
        "calibration_cost_before": at_calibration.before,
        "calibration_cost_after": at_calibration.after,
        "calibration_cost_ratio": at_calibration.ratio,
    }


def _length_text(example: Any, at_calibration: LengthCost | None) -> str:
    """`` at 128 tokens; 52.3% at the calibration length, 16`` for a text model, else ``""``."""
    if at_calibration is None:
        return ""
    return (
        f" at {int(example['input_ids'].shape[1])} tokens; {at_calibration.ratio:.1%} at the "
        f"calibration length, {at_calibration.tokens}"
    )


def _groups_line(result: PruneResult) -> str:
    """What pruning left of each channel group: kept / width, the narrowest first, and the
    groups left at their floor."""
    kept = sorted(result.kept.items(), key=lambda kv: kv[1][0] / max(kv[1][1], 1))
    groups = ", ".join(f"{n} {k}/{w}" for n, (k, w) in kept)
    floor = ", ".join(result.at_floor) or "none"
    return (
        f"channels kept per group (narrowest first; smallest share "
        f"{result.min_kept_fraction:.2f}): {groups}; left at their floor: {floor}"
    )
