"""One-shot quality on a decoder language model trained here on real text (issue 33 point 5).

Model: a Hugging Face ``LlamaForCausalLM`` built from a config, rotary positions, RMSNorm,
query heads sharing key/value heads, untied embedding and head over a byte-level BPE vocabulary
trained with the ``tokenizers`` package on the training text. Two presets (``--preset``):

* ``12m`` (``TrainConfig``'s defaults): hidden 384, 6 layers, MLP 1,024, 6 query heads sharing
  2 key/value heads, vocabulary 4,096: 12.59M parameters, the embedding and head 25% of them.
  Measured on this 2-core machine (one thread, load 1-2), a training step of 16 windows of 64
  tokens took 1.36 CPU-s (750 tokens/s; 6.8M params: 0.88 s, 15.7M with vocabulary 8,192:
  1.84 s, 25.8M: 2.74 s; two threads beside other jobs were 3x slower), so 30 CPU-minutes
  hold about 1,300 steps, 13 passes over the 98k training tokens. The cached run stopped at
  the plateau rule after 650 steps (6.8 passes, 1,019 CPU-s): validation perplexity 72.6,
  77.1, 71.9 at steps 550-650, after gains of 2-3% an evaluation.
* ``1m``: the first run, hidden 128, 4 layers, MLP 384, 4/2 heads, vocabulary 1,024: 1.05M
  parameters (its rows in ``lm_quality.json`` stay reproducible from its cached model).

Corpus: Python's documentation topics shipped with CPython (``pydoc_data.topics``, split as
``one_shot_text.corpus_text``: each tenth topic held out for the test perplexity; the last 5%
of the training tokens are the validation stream that decides when training has plateaued).
Training: AdamW, batches of 16 windows of 64 tokens, a linear warm-up then a constant rate,
held-out validation perplexity every ``eval_every`` steps; it stops at a plateau (no
improvement of 1% over the best in two evaluations) or when ``--train-minutes`` of wall time are
spent, whichever comes first. The model and tokenizer are cached under
``one_shot_text.cache_dir()`` (outside the repository), keyed by configuration and budget.

Cells: per seed (which picks the calibration windows and the random criterion's stream) and
target (20%, 35% and 50% fewer parameters: ``target`` 0.8, 0.65 and 0.5 with
``convention="params"``), ``prune_to_target`` at its defaults (repair on) from a copy of the
dense model, on 32 calibration windows of 64 tokens (the context) with next-token labels:

* ``fisher``, ``l1``, ``activation`` (structured Wanda / FLAP: ``fisherprune.criteria.
  Activation``), ``taylor``, ``random``: width only (channels, heads, hidden width); ``fisher``
  is ``criterion="auto"``, ``FisherMean`` with the repair (issue 31);
* ``fisher_plain``: the seed's Fisher signal (``criterion="fisher"``, the default before);
* ``activation_mean``: ``Activation(normalize="mean")`` (each group's importances scaled to
  mean 1, as ``L1`` does: an ablation, not a rival);
* ``fisher_depth``: ``blocks="only"`` (whole decoder layers, channels left whole);
* ``fisher_both``: ``blocks=True`` (layers and channels ranked in one budget), with the
  seed's signal as it was measured (``fisher_depth`` scores only block gates, which no layer
  reads through a mask: ``FisherMean`` gives them the seed's signal).

Each cell records the held-out test perplexity (``fisherprune.calibrate.perplexity`` over
non-overlapping context-long windows of the test text) and its wall time. ``fisher`` (width only,
the library's default) is ranked among the width-only rivals by ``one_shot_defaults.verdicts``.

``python benchmarks/lm_quality.py [--preset 12m] [--seeds 3] [--targets 0.8 0.65 0.5]
[--methods ...] [--train-minutes M]`` writes ``benchmarks/results/lm_quality_12m.json`` and
``docs/lm_quality_12m.png`` (``lm_quality.json`` and ``.png`` for ``1m``) and prints the
table; ``--first-seed``, ``--out`` and ``--combine`` split a run over processes and merge their
files.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fisherprune as fp
from fisherprune.calibrate.perplexity import perplexity, token_windows
from fisherprune.criteria import Activation, Random
from fisherprune.masks.blocks import BlockGate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import transformers
from _common import machine_info, write_json
from one_shot_defaults import plot, summary, table, verdicts
from one_shot_text import cache_dir, corpus_text, log_cell, result_fields
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
TARGETS = (0.8, 0.65, 0.5)
#: calibration: windows of the training text and their batch size
CALIBRATION_WINDOWS, CALIBRATION_BATCH = 32, 8
METHODS: dict[str, Any] = {
    "fisher": lambda seed: {},
    "fisher_plain": lambda seed: {"criterion": "fisher"},
    "l1": lambda seed: {"criterion": "l1"},
    "activation": lambda seed: {"criterion": "activation"},
    "activation_mean": lambda seed: {"criterion": Activation(normalize="mean")},
    "taylor": lambda seed: {"criterion": "taylor"},
    "random": lambda seed: {"criterion": Random(seed)},
    "fisher_depth": lambda seed: {"blocks": "only"},
    "fisher_both": lambda seed: {"criterion": "fisher", "blocks": True},
}
#: the methods ``fisher`` is ranked among, width only and with ``_depth`` / ``_both``
RIVALS = ("fisher", "l1", "activation", "taylor", "random")
#: whole layers: ``blocks="only"`` (``_depth``) and ``blocks=True`` (``_both``) for every rival
#: that can score a block gate (L1 reads the weights that make a channel: a gate has none)
KINDS = {"depth": {"blocks": "only"}, "both": {"blocks": True}}
for _rival in ("activation", "taylor", "random"):
    for _kind, _blocks in KINDS.items():
        METHODS[f"{_rival}_{_kind}"] = lambda seed, r=_rival, b=_blocks: {**METHODS[r](seed), **b}


@dataclass(frozen=True)
class TrainConfig:
    vocab: int = 4096
    hidden: int = 384
    layers: int = 6
    intermediate: int = 1024
    heads: int = 6
    kv_heads: int = 2
    context: int = 64
    batch: int = 16
    lr: float = 1e-3
    warmup: int = 50
    eval_every: int = 50
    minutes: float = 30.0


@dataclass(frozen=True)
class Preset:
    """A model shape and training run, the name its rows carry and where its report goes."""

    config: TrainConfig
    net: str
    out: str  # the JSON under benchmarks/results/ and the plot under docs/ (``.png``)


PRESETS = {
    "12m": Preset(TrainConfig(), "llama_pydoc_12m", "lm_quality_12m"),
    "1m": Preset(
        TrainConfig(
            vocab=1024,
            hidden=128,
            layers=4,
            intermediate=384,
            heads=4,
            kv_heads=2,
            lr=3e-3,
            eval_every=100,
            minutes=12.0,
        ),
        "llama_pydoc",
        "lm_quality",
    ),
}


# ----------------------------------------------------------------------------- corpus
def tokenizer(cfg: TrainConfig, train_text: str) -> Tokenizer:
    """A byte-level BPE of ``cfg.vocab`` tokens trained on ``train_text``, cached."""
    key = hashlib.sha1(f"{cfg.vocab}:{len(train_text)}".encode()).hexdigest()[:10]
    path = cache_dir() / f"lm_quality_bpe_{key}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([train_text], trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


@dataclass
class Tokens:
    train: Tensor  # (T,) ids the model is trained on
    valid: Tensor  # the last 5% of the training text's ids: when training stops
    test: Tensor  # the held-out topics' ids: the reported perplexity


def tokens(cfg: TrainConfig) -> Tokens:
    text = corpus_text()
    tok = tokenizer(cfg, text["train"])
    train = torch.tensor(tok.encode(text["train"]).ids)
    cut = int(len(train) * 0.95)
    return Tokens(train[:cut], train[cut:], torch.tensor(tok.encode(text["test"]).ids))


# ------------------------------------------------------------------------------ model
def build(cfg: TrainConfig) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.context,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def windows(ids: Tensor, starts: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """Inputs (N, length) at ``starts`` and their next tokens (N, length)."""
    w = ids[starts[:, None] + torch.arange(length + 1)]
    return w[:, :-1], w[:, 1:]


def next_token_loss(outputs: Any, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy: ``outputs.logits`` (N, L, V), targets (N, L)."""
    return F.cross_entropy(outputs.logits.flatten(0, 1).float(), targets.flatten())


def held_out(model: nn.Module, ids: Tensor, context: int) -> float:
    """Perplexity on ``ids`` in non-overlapping windows of ``context`` tokens."""
    return perplexity(model, token_windows(ids, context, context, 32)).value


def train(cfg: TrainConfig, t: Tokens) -> tuple[nn.Module, dict[str, Any]]:
    """The dense model, trained to a plateau or ``cfg.minutes`` (module docstring), from the
    cache when this configuration was trained before."""
    key = hashlib.sha1(json.dumps([asdict(cfg), len(t.train)]).encode()).hexdigest()[:10]
    path = cache_dir() / f"lm_quality_{key}.pt"
    torch.manual_seed(0)
    model = build(cfg)
    if path.exists():
        saved = torch.load(path)
        model.load_state_dict(saved["state"])
        return model.eval(), {**saved["info"], "cached": str(path)}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup))
    g = torch.Generator().manual_seed(0)
    curve: list[list[float]] = []
    best, best_state, stale, step, t0 = math.inf, None, 0, 0, time.perf_counter()
    cpu0 = time.process_time()
    while time.perf_counter() - t0 < cfg.minutes * 60 and stale < 2:
        model.train()
        starts = torch.randint(0, len(t.train) - cfg.context - 1, (cfg.batch,), generator=g)
        x, y = windows(t.train, starts, cfg.context)
        loss = next_token_loss(model(input_ids=x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        if step % cfg.eval_every == 0:
            ppl = held_out(model, t.valid, cfg.context)
            curve.append([step, time.perf_counter() - t0, ppl])
            print(f"step {step} ({curve[-1][1]:.0f} s): validation ppl {ppl:.2f}", flush=True)
            stale = 0 if ppl < 0.99 * best else stale + 1
            if ppl < best:
                best, best_state = ppl, copy.deepcopy(model.state_dict())
    if best_state is not None:
        model.load_state_dict(best_state)
    info = {
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - cpu0,
        "steps": step,
        "tokens_seen": step * cfg.batch * cfg.context,
        "stopped": "plateau" if stale >= 2 else "time budget",
        "parameters": sum(p.numel() for p in model.parameters()),
        "validation_perplexity_by_step": curve,
        "config": asdict(cfg),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": model.state_dict(), "info": info}, path)
    return model.eval(), {**info, "cached": str(path)}


# ------------------------------------------------------------------------------ cells
def calibration(t: Tokens, cfg: TrainConfig, seed: int) -> list[tuple[dict[str, Tensor], Tensor]]:
    """``CALIBRATION_WINDOWS`` windows of the training tokens picked by ``seed``, in batches
    of ``CALIBRATION_BATCH``, with their next tokens as labels."""
    g = torch.Generator().manual_seed(1000 + seed)
    starts = torch.randint(0, len(t.train) - cfg.context - 1, (CALIBRATION_WINDOWS,), generator=g)
    x, y = windows(t.train, starts, cfg.context)
    return [
        ({"input_ids": x[i : i + CALIBRATION_BATCH]}, y[i : i + CALIBRATION_BATCH])
        for i in range(0, CALIBRATION_WINDOWS, CALIBRATION_BATCH)
    ]


def cell(
    dense: nn.Module, t: Tokens, cfg: TrainConfig, seed: int, target: float, settings: dict
) -> dict[str, Any]:
    """Prune a copy of ``dense`` to ``target`` of its parameters (defaults plus ``settings``)
    and measure the held-out perplexity of the result."""
    model = copy.deepcopy(dense)
    batches = calibration(t, cfg, seed)
    example = {"input_ids": batches[0][0]["input_ids"][:1]}
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fp.prune_to_target(
            model, example, batches, target, loss_fn=next_token_loss, convention="params",
            **settings,
        )  # fmt: skip
    seconds = time.perf_counter() - t0
    gate = next((m for m in fp.find_masks(model).values() if isinstance(m, BlockGate)), None)
    ppl = held_out(model, t.test, cfg.context)
    return {
        "quality": ppl,
        "measured": {"perplexity": ppl},
        "layers_kept": cfg.layers if gate is None else gate.kept,
        "cell_seconds": seconds,
        **result_fields(result, caught),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    preset = PRESETS[args.preset]
    cfg = replace(preset.config, minutes=args.train_minutes or preset.config.minutes)
    t = tokens(cfg)
    t0 = time.perf_counter()
    dense, info = train(cfg, t)
    train_seconds = time.perf_counter() - t0
    dense_ppl = held_out(dense, t.test, cfg.context)
    print(f"dense: {info['parameters']} parameters, test perplexity {dense_ppl:.3f}", flush=True)
    rows: list[dict[str, Any]] = []
    for seed in range(args.first_seed, args.seeds):
        for target in args.targets:
            for method in args.methods:
                r = cell(dense, t, cfg, seed, target, METHODS[method](seed))
                rows.append({"net": preset.net, "seed": seed, "target": target, "method": method,
                             "metric": "perplexity", "higher_is_better": False,
                             "dense": dense_ppl, **r})  # fmt: skip
                log_cell(preset.net, seed, target, method, "perplexity", r["quality"], dense_ppl, r)
    details = {
        **info,
        "train_text_tokens": len(t.train),
        "validation_tokens": len(t.valid),
        "test_tokens": len(t.test),
        "dense_test_perplexity": dense_ppl,
        "calibration": f"{CALIBRATION_WINDOWS} windows of {cfg.context} tokens",
    }
    return {"rows": rows, "train_seconds": train_seconds, "details": details}


def kind_verdicts(cells: list[dict[str, Any]]) -> list[str]:
    """``one_shot_defaults.verdicts`` for the width-only methods, then for the ``_depth`` and
    the ``_both`` methods each among their own kind (lines prefixed ``depth:`` / ``both:``)."""
    lines = verdicts([c for c in cells if _kind(c["method"]) is None], RIVALS)
    for kind in KINDS:
        same = [{**c, "method": c["method"].removesuffix(f"_{kind}")} for c in cells
                if _kind(c["method"]) == kind]  # fmt: skip
        lines += [f"{kind}: {line}" for line in verdicts(same, RIVALS)]
    return lines


def _kind(method: str) -> str | None:
    return next((k for k in KINDS if method.endswith(f"_{k}")), None)


def pivot(cells: list[dict[str, Any]]) -> str:
    """Markdown tables for docs/benchmarks.md: width-only methods, then (when run) the
    ``_depth`` and ``_both`` ones; one row per target, one column per method, ``mean ± sd
    (seeds)`` of the held-out perplexity and the mean seconds of a cell."""
    width = [c for c in cells if _kind(c["method"]) is None or c["method"] == "activation_mean"]
    layers = [c for c in cells if c not in width]
    text = _pivot(width) if width else ""
    if layers:
        text += "\n\n" if text else ""
        text += 'Whole layers (`_depth`: `blocks="only"`; `_both`: `blocks=True`):\n\n'
        text += _pivot(layers)
    return text


def _pivot(cells: list[dict[str, Any]]) -> str:
    methods = list(dict.fromkeys(c["method"] for c in cells))
    lines = [
        "| parameters kept | " + " | ".join(methods) + " |",
        "|---|" + "---|" * len(methods),
    ]
    for target in sorted({c["target"] for c in cells}, reverse=True):
        by = {c["method"]: c for c in cells if c["target"] == target}
        row = [
            f"{by[m]['mean']:.2f} ± {by[m]['sd']:.2f} ({by[m]['seeds']}) [{by[m]['seconds']:.0f} s]"
            if m in by
            else "-"
            for m in methods
        ]
        lines.append(f"| {target:.0%} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def report(measured: dict[str, Any], args: argparse.Namespace, seconds: float) -> None:
    """Write the JSON and the plot, print the table and verdicts."""
    cells = summary(measured["rows"], nets=[PRESETS[args.preset].net], methods=list(METHODS))
    data = {
        "benchmark": "lm_quality",
        "timestamp": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "fisherprune_version": fp.__version__,
        "machine": machine_info(),
        "threads": args.threads,
        "note": args.note,
        "seeds": args.seeds,
        "targets": args.targets,
        "seconds": seconds,
        "train_seconds": measured["train_seconds"],
        "details": measured["details"],
        "cells": cells,
        "verdicts": kind_verdicts(cells),
        "rows": measured["rows"],
    }
    write_json(args.out, data)
    plot(cells, args.plot, cost="parameters")
    print(table(cells, cost="parameters"))
    print(pivot(cells))
    print("\n".join(data["verdicts"]))
    print(f"wrote {args.out} and {args.plot} ({seconds:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--targets", nargs="+", type=float, default=list(TARGETS))
    p.add_argument("--first-seed", type=int, default=0, help="run seeds first-seed..seeds-1")
    p.add_argument(
        "--combine", nargs="+", type=Path,
        help="measure nothing: merge the rows of these runs (e.g. two processes given other "
        "seeds or targets) into --out; a later file's row replaces an earlier one's",
    )  # fmt: skip
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument(
        "--preset", choices=list(PRESETS), default="12m",
        help="the model and training run (the 1m preset is the first, 1.05M-parameter run)",
    )  # fmt: skip
    p.add_argument(
        "--train-minutes", type=float,
        help="wall-clock budget of training (it stops earlier at a plateau); the preset's "
        "when not given",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--note", default="", help="a line for the report (how the run was made)")
    p.add_argument("--out", type=Path, help="the preset's JSON under benchmarks/results/")
    p.add_argument("--plot", type=Path, help="the preset's PNG under docs/")
    args = p.parse_args(argv)
    name = PRESETS[args.preset].out
    args.out = args.out or ROOT / "benchmarks" / "results" / f"{name}.json"
    args.plot = args.plot or ROOT / "docs" / f"{name}.png"
    if args.combine:
        runs = [json.loads(path.read_text()) for path in args.combine]
        rows = {(r["seed"], r["target"], r["method"]): r for run_ in runs for r in run_["rows"]}
        merged = {"rows": list(rows.values()), "train_seconds": runs[0]["train_seconds"],
                  "details": runs[0]["details"]}  # fmt: skip
        report(merged, args, sum(r["seconds"] for r in runs))
        return 0
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    measured = run(args)
    report(measured, args, time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
