"""What fisherprune can prune in Hugging Face transformers, against Torch-Pruning 1.6.1.

What is measured
----------------
Hugging Face models with a 2-label task head (``...ForSequenceClassification``,
``ViTForImageClassification``; the T5 encoder without one), as a fine-tuned model comes: the
hidden width is then inside the model (the T5 encoder returns it as ``last_hidden_state``:
pruned there, its units come back as zero columns, the output's shape kept). Built from small
but realistically shaped configs with random weights (nothing downloads): hidden size 128, 4
layers, 8 attention heads of 16, MLP intermediate size 512 (4x), vocabulary 1000, batch 2 x
sequence 64 (one example padded: its last 16 tokens have ``attention_mask`` 0) or 2 images of
64x64 in 8x8 patches. BERT, GPT-2, LLaMA and Qwen2 with grouped-query attention (4 key/value
heads for 8 query heads), ViT and the T5 encoder, each with ``attn_implementation`` ``eager``
and/or ``sdpa``, called with their keyword inputs directly (``model(**inputs)``). Float32,
eval mode, CPU.

For fisherprune (whatever the installed version prunes; rerun it when the library grows):

* ``groups`` / ``channels``: groups of coupled channels ``apply_masks`` found, and their size;
* ``prunable``: the share of the model's FLOPs in prunable groups, defined as
  ``1 - C(all groups emptied) / C(dense)``, where ``C`` is the cost model's FLOPs per example
  (``fisherprune.CostModel.total`` with every mask entry 0 against all 1). It is the FLOPs that
  depend on at least one prunable channel: what would go if every group were removed entirely.
  (The sum over channels of their marginal costs is not used: a matmul between two prunable
  dimensions would be counted by both.)
* ``saved``: the share of FLOPs saved by removing ``floor(0.3 * n)`` channels of every group of
  ``n`` channels (fewer where the channels kept must be a multiple,
  ``MaskLayer.keep_multiple``, as ``prune`` keeps them: the experts of ``grouped_mm``), chosen
  uniformly at random (``torch.randperm`` with a seeded generator, seed 0, groups in ``masks``
  order). It is measured with ``FlopCounterMode`` (2 FLOPs per multiply-accumulate;
  ``custom_mapping=SAME_AS_TORCH`` so that CPU's fused attention op is counted as torch counts
  its flash kernel) on the shrunk model against the dense model, per example; ``cost ==
  counted`` says whether ``computational_cost(...).total`` of the masked model equals that
  count on the shrunk one (relative difference below 1e-9);
* ``trace s``: wall time of ``apply_masks`` (one call, after one warm-up call on another copy);
* ``max |shrunk - masked|``: largest absolute difference between the shrunk model's and the
  masked model's logits (T5: ``last_hidden_state``), float32.

For Torch-Pruning 1.6.1, when it can be imported (``pip install --no-deps torch-pruning==1.6.1
--target DIR`` and ``PYTHONPATH=DIR``; without it the rows say "not installed"), on a fresh copy
of the same model: its ``MetaPruner`` with the settings its README and Hugging Face / LLM
examples give for transformers: ``MagnitudeImportance(p=2)``, ``pruning_ratio=0.3`` with
``global_pruning=True`` as in its BERT and ViT examples (uniform per-layer ratios raised
``IndexError`` on BERT here), ``num_heads`` for every query/key/value projection (key/value
heads for k and v), ``prune_num_heads=True``, ``prune_head_dims=False``,
``head_pruning_ratio=0.3``, ``ignored_layers`` the task head (its outputs are the labels),
``output_transform`` summing the last hidden state; then, as its examples do by hand, each
attention module's head-count attributes are set from ``pruner.num_heads``. Recorded: whether
pruning raised, whether the pruned model runs, the FLOPs saved (``FlopCounterMode`` as above on
its pruned model against the dense one; Torch-Pruning also prunes the hidden width, so its
output is not the dense model's), and its time (pruner construction + step). A failure is a row
saying so; construction or step running longer than ``TP_LIMIT_S`` seconds is stopped (SIGALRM)
and reported as a failure.

Run ``python benchmarks/hf_transformers.py`` (not ``transformers.py``: a script of that name
would shadow the ``transformers`` package it imports); the table is printed and the JSON written to
``--out`` (default ``benchmarks/results/transformers.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import counted_flops, machine_info, write_json
from torch import Tensor, nn

import fisherprune as fp

RATIO = 0.3
TP_LIMIT_S = 30  # Torch-Pruning's construction or step taking longer is a failure row
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 128, 4, 8, 4, 512, 1000
SEQ, BATCH, IMAGE, PATCH = 64, 2, 64, 8

CASES: list[tuple[str, str]] = [
    ("bert", "eager"), ("bert", "sdpa"), ("gpt2", "eager"), ("gpt2", "sdpa"),
    ("llama", "eager"), ("llama", "sdpa"), ("qwen2", "sdpa"), ("vit", "eager"),
    ("vit", "sdpa"), ("t5", "eager"),
]  # fmt: skip

#: ``--cases 2026``: the architectures of issue 34 at the same sizes (its bar: >= 85% of the
#: FLOPs prunable, >= 35% saved): a fused-QKV encoder (ModernBERT), repeated key/value heads
#: (DeBERTa-v2), a mixture-of-experts decoder (Qwen3-MoE, 8 experts of 128, top 2), a
#: state-space model (Mamba) and a vision transformer with per-head relative-position bias
#: tables (Swin, 64x64 images in 4x4 patches, windows of 4, two stages)
CASES_2026: list[tuple[str, str]] = [
    ("modernbert", "eager"), ("deberta_v2", "eager"), ("qwen3_moe", "eager"),
    ("mamba", "eager"), ("swin", "eager"),
]  # fmt: skip


def build(kind: str, attention: str) -> tuple[nn.Module, dict[str, Tensor]]:
    """The model (seeded random weights, eval mode) and its keyword inputs."""
    import transformers as tr

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[0, SEQ - 16 :] = 0
    inputs: dict[str, Tensor] = {"input_ids": ids, "attention_mask": mask}
    common: dict[str, Any] = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "intermediate_size": FFN,
        "attn_implementation": attention,
    }
    model: nn.Module
    # a task head (2 labels), as a fine-tuned model comes: the hidden width is then inside the
    # model; a base model returns it (last_hidden_state), so there it is never prunable
    heads: dict[str, Any] = {"num_labels": 2, "pad_token_id": 0}
    if kind == "bert":
        model = tr.BertForSequenceClassification(tr.BertConfig(vocab_size=VOCAB, **common, **heads))
    elif kind == "gpt2":
        cfg = tr.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
            n_inner=FFN, attn_implementation=attention, **heads,
        )  # fmt: skip
        model = tr.GPT2ForSequenceClassification(cfg)
    elif kind == "llama":
        cfg = tr.LlamaConfig(vocab_size=VOCAB, num_key_value_heads=KV_HEADS, **common, **heads)
        model = tr.LlamaForSequenceClassification(cfg)
    elif kind == "qwen2":
        cfg = tr.Qwen2Config(vocab_size=VOCAB, num_key_value_heads=KV_HEADS, **common, **heads)
        model = tr.Qwen2ForSequenceClassification(cfg)
    elif kind == "vit":
        cfg = tr.ViTConfig(image_size=IMAGE, patch_size=PATCH, **common, num_labels=2)
        model = tr.ViTForImageClassification(cfg)
        inputs = {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g)}
    elif kind == "modernbert":
        cfg = tr.ModernBertConfig(vocab_size=VOCAB, **common, **heads, global_attn_every_n_layers=2)
        model = tr.ModernBertForSequenceClassification(cfg)
    elif kind == "deberta_v2":
        cfg = tr.DebertaV2Config(vocab_size=VOCAB, **common, **heads)
        model = tr.DebertaV2ForSequenceClassification(cfg)
    elif kind == "qwen3_moe":
        cfg = tr.Qwen3MoeConfig(
            vocab_size=VOCAB, num_key_value_heads=KV_HEADS, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=HIDDEN, decoder_sparse_step=1, **common, **heads,
        )  # fmt: skip
        model = tr.Qwen3MoeForSequenceClassification(cfg)
    elif kind == "mamba":
        cfg = tr.MambaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS)
        model = tr.MambaForCausalLM(cfg)
        inputs = {"input_ids": ids}
    elif kind == "swin":
        cfg = tr.SwinConfig(
            image_size=IMAGE, patch_size=4, embed_dim=HIDDEN // 2, depths=[2, 2],
            num_heads=[HEADS // 2, HEADS], window_size=4, num_labels=2,
        )  # fmt: skip
        model = tr.SwinForImageClassification(cfg)
        inputs = {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g)}
    elif kind == "t5":
        cfg = tr.T5Config(
            vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=LAYERS,
            num_heads=HEADS, attn_implementation=attention,
        )  # fmt: skip
        model = tr.T5EncoderModel(cfg)
    else:
        raise ValueError(kind)
    return model.float().eval(), inputs


def hidden(model: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    """The model's logits (task-head models) or last hidden state (T5's encoder)."""
    with torch.no_grad():
        return _main_output(model(**inputs))


def _main_output(out: Any) -> Tensor:
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


# ---------------------------------------------------------------- fisherprune
def run_fisherprune(kind: str, attention: str) -> dict[str, Any]:
    model, inputs = build(kind, attention)
    row: dict[str, Any] = {"ok": False}
    try:
        dense = counted_flops(model, inputs)
        row["dense_flops"] = dense
        fp.apply_masks(copy.deepcopy(model), inputs)  # warm-up
        t0 = time.perf_counter()
        masks = fp.apply_masks(model, inputs)
        row["trace_s"] = time.perf_counter() - t0
        row["groups"] = len(masks)
        row["channels"] = sum(m.num_channels for m in masks.values())
        row["skipped"] = [str(s) for s in masks.skipped]
        cm = fp.CostModel(model, inputs)
        row["cost_dense_flops"] = cm.dense_total()
        row["prunable_share"] = 1.0 - cm.total(np.zeros(cm.graph.n_entries)) / cm.dense_total()
        gen = torch.Generator().manual_seed(0)
        removed = 0
        with torch.no_grad():
            for m in masks.values():
                k = int(np.floor(RATIO * m.num_channels))
                while k and (m.num_channels - k) % m.keep_multiple:  # as prune keeps them:
                    k -= 1  # whole multiples where a kernel needs them (grouped_mm's experts)
                m.mask[torch.randperm(m.num_channels, generator=gen)[:k]] = 0.0
                removed += k
        row["removed_channels"] = removed
        cost = fp.computational_cost(model, inputs).total
        row["cost_flops"] = cost
        small = fp.shrink(model)
        got = counted_flops(small, inputs)
        row["shrunk_flops"] = got
        row["saved_share"] = 1.0 - got / dense
        row["cost_equals_counted"] = abs(cost - got) <= 1e-9 * max(abs(got), 1.0)
        row["max_abs_diff"] = float((hidden(small, inputs) - hidden(model, inputs)).abs().max())
        row["ok"] = True
    except Exception as e:  # a failure is a row, not a crash
        row["error"] = _error(e)
        row["traceback"] = traceback.format_exc(limit=4)
    return row


# -------------------------------------------------------------- Torch-Pruning
def _qkv(attn: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module] | None:
    """The query, key and value projections of an attention module, if it has separate ones."""
    for names in (("query", "key", "value"), ("q_proj", "k_proj", "v_proj"), ("q", "k", "v")):
        mods = [getattr(attn, n, None) for n in names]
        if all(isinstance(m, nn.Linear) for m in mods):
            return mods[0], mods[1], mods[2]
    return None


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if _qkv(m) is not None or hasattr(m, "c_attn")]


def _head_settings(model: nn.Module) -> dict[nn.Module, int]:
    """``num_heads`` for Torch-Pruning: every projection with its head count."""
    cfg = model.config  # type: ignore[union-attr]
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    out: dict[nn.Module, int] = {}
    for attn in _attention_modules(model):
        qkv = _qkv(attn)
        if qkv is None:
            out[attn.c_attn] = heads  # type: ignore[index]  # GPT-2's fused projection
        else:
            out[qkv[0]], out[qkv[1]], out[qkv[2]] = heads, kv, kv
    return out


def _update_attention_attributes(model: nn.Module, num_heads: dict[nn.Module, int]) -> None:
    """What Torch-Pruning's examples do by hand after pruning: head counts from the pruner."""
    for attn in _attention_modules(model):
        qkv = _qkv(attn)
        q = attn.c_attn if qkv is None else qkv[0]  # type: ignore[union-attr]
        h = num_heads.get(q)
        if h is None:
            continue
        width = q.out_features if isinstance(q, nn.Linear) else q.weight.shape[1] // 3
        kv = num_heads.get(qkv[1], h) if qkv is not None else h
        for name in ("num_attention_heads", "num_heads", "n_heads", "n_head"):
            if hasattr(attn, name):
                setattr(attn, name, h)
        for name in ("all_head_size", "inner_dim", "embed_dim"):
            if hasattr(attn, name):
                setattr(attn, name, width)
        if hasattr(attn, "split_size"):
            attn.split_size = width
        if hasattr(attn, "num_key_value_groups"):
            attn.num_key_value_groups = h // max(kv, 1)


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    """Raise ``TimeoutError`` in the main thread after ``seconds`` (SIGALRM; Unix)."""

    def alarm(signum: int, frame: object) -> None:
        raise TimeoutError(f"gave up after {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _task_head(model: nn.Module) -> list[nn.Module]:
    """The classifier layer, which Torch-Pruning must not prune (its outputs are the labels)."""
    return [m for name in ("classifier", "score") if (m := getattr(model, name, None)) is not None]


def run_torch_pruning(tp: Any, kind: str, attention: str) -> dict[str, Any]:
    model, inputs = build(kind, attention)
    row: dict[str, Any] = {"ok": False, "runs": False}
    try:
        dense = counted_flops(model, inputs)
        row["dense_flops"] = dense
        t0 = time.perf_counter()
        with _time_limit(TP_LIMIT_S):
            pruner = tp.pruner.MetaPruner(
                model,
                example_inputs=inputs,
                importance=tp.importance.MagnitudeImportance(p=2),
                pruning_ratio=RATIO,
                global_pruning=True,
                num_heads=_head_settings(model),
                prune_num_heads=True,
                prune_head_dims=False,
                head_pruning_ratio=RATIO,
                ignored_layers=_task_head(model),
                output_transform=lambda out: _main_output(out).sum(),
            )
        with _time_limit(TP_LIMIT_S):
            pruner.step()
        row["prune_s"] = time.perf_counter() - t0
        _update_attention_attributes(model, pruner.num_heads)
    except Exception as e:
        row["error"] = "pruning: " + _error(e)
        row["traceback"] = traceback.format_exc(limit=4)
        return row
    try:
        out = hidden(model, inputs)
        row["runs"] = bool(torch.isfinite(out).all())
        row["output_width"] = int(out.shape[-1])
        got = counted_flops(model, inputs)
        row["pruned_flops"] = got
        row["saved_share"] = 1.0 - got / dense
        row["ok"] = row["runs"]
    except Exception as e:
        row["error"] = "pruned model: " + _error(e)
        row["traceback"] = traceback.format_exc(limit=4)
    return row


# ----------------------------------------------------------------------- main
def _pct(v: Any) -> str:
    return f"{100 * v:.1f}%" if isinstance(v, float) else "-"


def _tp_cell(r: dict[str, Any] | None) -> tuple[str, str, str]:
    if r is None:
        return "not installed", "-", "-"
    if "error" in r and not r.get("runs"):
        return "FAILED", "-", "-"
    return "runs", _pct(r.get("saved_share")), f"{r.get('prune_s', float('nan')):.2f}"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Bar chart: prunable share and FLOPs saved, fisherprune and Torch-Pruning."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\n{r['attention']}" for r in rows]
    fpr = [r["fisherprune"] for r in rows]
    series = {
        "fisherprune: prunable share": [r.get("prunable_share") or 0.0 for r in fpr],
        "fisherprune: saved at 30%": [r.get("saved_share") or 0.0 for r in fpr],
        "Torch-Pruning 1.6.1: saved at 30%": [
            (r["torch_pruning"] or {}).get("saved_share") or 0.0 for r in rows
        ],
    }
    x = np.arange(len(rows))
    w = 0.27
    fig, ax = plt.subplots(figsize=(10, 4))
    for i, (name, vals) in enumerate(series.items()):
        ax.bar(x + (i - 1) * w, [100 * v for v in vals], w, label=name)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("% of dense FLOPs")
    ax.set_title("Hugging Face models (hidden 128, 4 layers, 8 heads, seq 64)")
    ax.set_ylim(0, 125)
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-torch-pruning", action="store_true", help="skip Torch-Pruning")
    ap.add_argument(
        "--cases", choices=("standard", "2026"), default="standard",
        help="the standard encoders and decoders, or issue 34's architectures (CASES_2026)",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results/transformers.json")
    ap.add_argument(
        "--plot",
        type=Path,
        default=Path(__file__).resolve().parent.parent / "docs/transformers.png",
        help="bar chart ('' for none)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import transformers

    tp: Any = None
    tp_version = None
    if not args.no_torch_pruning:
        try:
            import torch_pruning as tp

            try:  # its own __version__ string said 1.6.0 in the 1.6.1 wheel
                tp_version = importlib.metadata.version("torch-pruning")
            except importlib.metadata.PackageNotFoundError:
                tp_version = getattr(tp, "__version__", "?")
        except ImportError:
            print("Torch-Pruning is not installed: its columns say so (see the docstring)")
    run_tp: Callable[[str, str], dict[str, Any] | None] = (
        (lambda k, a: run_torch_pruning(tp, k, a)) if tp is not None else (lambda k, a: None)
    )

    rows: list[dict[str, Any]] = []
    for kind, attention in CASES_2026 if args.cases == "2026" else CASES:
        r = {"model": kind, "attention": attention}
        r["fisherprune"] = run_fisherprune(kind, attention)
        r["torch_pruning"] = run_tp(kind, attention)
        rows.append(r)
        f = r["fisherprune"]
        print(f"{kind}/{attention}: fisherprune {'ok' if f['ok'] else f.get('error')}", flush=True)

    header = (
        f"{'model':<14}{'groups':>7}{'chan':>6}{'prunable':>10}{'saved':>8}{'cost==cnt':>10}"
        f"{'trace s':>9}{'max|diff|':>11}  {'TP':<14}{'TP saved':>9}{'TP s':>7}"
    )
    print(
        f"\nfloor({RATIO} n) random channels of every group removed; FLOPs per example by "
        f"FlopCounterMode; float32; {args.threads} threads; Torch-Pruning "
        f"{tp_version or 'not installed'}"
    )
    print(header)
    for r in rows:
        f = r["fisherprune"]
        name = f"{r['model']}/{r['attention']}"
        tpc = _tp_cell(r["torch_pruning"])
        if not f["ok"]:
            print(f"{name:<14}  fisherprune FAILED: {f.get('error')}")
            continue
        print(
            f"{name:<14}{f['groups']:>7}{f['channels']:>6}{_pct(f['prunable_share']):>10}"
            f"{_pct(f['saved_share']):>8}{'yes' if f['cost_equals_counted'] else 'NO':>10}"
            f"{f['trace_s']:>9.2f}{f['max_abs_diff']:>11.2e}  {tpc[0]:<14}{tpc[1]:>9}{tpc[2]:>7}"
        )
    for r in rows:
        t = r["torch_pruning"]
        if t is not None and t.get("error"):
            print(f"Torch-Pruning {r['model']}/{r['attention']}: {t['error']}")

    out = {
        "benchmark": "transformers",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "fisherprune": fp.__version__,
            "torch_pruning": tp_version,
        },
        "threads": args.threads,
        "machine": machine_info(),
        "config": {
            "hidden": HIDDEN,
            "layers": LAYERS,
            "heads": HEADS,
            "kv_heads_gqa": KV_HEADS,
            "intermediate": FFN,
            "vocab": VOCAB,
            "batch": BATCH,
            "sequence": SEQ,
            "image": IMAGE,
            "patch": PATCH,
            "ratio": RATIO,
            "dtype": "float32",
        },
        "removal": "floor(ratio * n) channels of every group, torch.randperm, seed 0",
        "prunable_definition": "1 - cost(all mask entries 0) / cost(dense), fisherprune CostModel",
        "torch_pruning_settings": (
            "MetaPruner, MagnitudeImportance(p=2), pruning_ratio=0.3, head_pruning_ratio=0.3, "
            "num_heads per q/k/v projection, prune_num_heads=True, prune_head_dims=False, "
            "global_pruning=True (its BERT/ViT examples; False raised IndexError on BERT)"
        ),
        "rows": rows,
    }
    write_json(args.out, out)
    print(f"\nwrote {args.out}")
    if str(args.plot) not in ("", "."):
        try:
            plot(rows, args.plot)
            print(f"wrote {args.plot}")
        except ImportError:
            print("matplotlib is not installed: no plot")
    return out


if __name__ == "__main__":
    main()
