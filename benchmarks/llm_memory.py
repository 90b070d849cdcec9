"""Peak memory and wall time of ``apply_masks`` + ``prune_to_target`` on Llama- and Qwen-shaped
decoders, against their parameter count and the calibration tokens (issue 33, point 1).

Each cell runs in a fresh Python process (``--child``) so that no other cell's allocation is
counted. It builds a ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` from a config (random
weights: memory and time do not depend on the values) at about ``--sizes`` parameters, in
``--dtype``, then runs ``fp.apply_masks`` (the trace) and ``fp.prune_to_target(..., "50%")``
label-free, with the repair and every other argument at its default, on synthetic token
batches: ``--tokens`` calibration tokens per cell, in micro-batches of ``--micro`` sequences
of ``--seq`` tokens.

Memory is the resident set (Linux ``/proc/self/status``): ``rss0`` after the imports
(torch, fisherprune and the family's modelling module, which ``transformers`` imports lazily:
rows before 2026-11-29 took ``rss0`` before it and counted its ~130 MiB as the call's),
``base`` after the model is built, and per phase the high-water mark (``VmHWM``, reset by
writing 5 to ``/proc/self/clear_refs`` as the phase starts). The phases are ``trace``
(``apply_masks``), ``signals``, ``selection`` and ``repair`` (the library's own functions,
wrapped here to reset and read the mark). With ``W`` the parameter bytes, the table gives
``peak / W``, with ``peak`` the highest mark less ``rss0`` (weights plus everything the call
holds: the issue's goal is about 1.3 plus one micro-batch's activations), and ``extra / W``,
the highest mark less ``base``. Each row also gives the process CPU seconds of each of
``prune_to_target``'s phases (steadier than wall time on a shared machine) and its
``checkpoint`` (``--checkpoint off``: the signal passes hold every decoder layer's
activations, as before 2026-11-29, to measure what checkpointing saves and costs). Rows from
2026-11-29 evening on also give the issue's allowance, measured: ``activation_mib``, the
resident set's mark over the built model in a fresh process during one plain forward and
backward of a micro-batch (weights frozen), ``allowance_mib`` = 0.3 W + that, and
``extra_mib``, the whole call's highest mark less ``base``, to compare with it.

Run::

    python benchmarks/llm_memory.py --sizes 30M,100M                  # minutes on 2 cores
    python benchmarks/llm_memory.py --sizes 500M,1B --tokens 512      # the issue's sizes
    python benchmarks/llm_memory.py --sizes 30M --tokens 256,1024,4096  # growth with tokens
    python benchmarks/llm_memory.py --sizes 30M --checkpoint off --label off  # without it
    python benchmarks/llm_memory.py --replot          # the plot again from the JSON's rows

JSON to ``--out`` (default ``benchmarks/results/llm_memory.json``), plot to ``--plot``
(default ``docs/llm_memory.png``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from _common import machine_info, write_json

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "llm_memory.json"
DEFAULT_PLOT = HERE.parent / "docs" / "llm_memory.png"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PHASES = ("trace", "signals", "selection", "repair")

#: (hidden, layers, heads, key/value heads, MLP) per nominal size; the vocabulary is
#: ``VOCAB`` for both families (the Qwen2 family's real 151,936 would make the embedding most
#: of a small model)
SHAPES = {
    "30M": (384, 6, 6, 2, 1024),
    "100M": (768, 12, 12, 4, 2048),
    "500M": (1024, 24, 16, 4, 2816),
    "1B": (2048, 16, 32, 8, 5632),
}
VOCAB = 32000


def _status(field: str) -> float:
    """A ``/proc/self/status`` field, in MiB."""
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")
    return int(match.group(1)) / 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _classes(family: str) -> tuple[Any, Any]:
    """The family's config and causal-LM classes (reading them imports the modelling module,
    which ``transformers`` imports lazily: about 130 MiB of resident set)."""
    import transformers

    if family == "llama":
        return transformers.LlamaConfig, transformers.LlamaForCausalLM
    return transformers.Qwen2Config, transformers.Qwen2ForCausalLM


def build(family: str, size: str, dtype: str, seq: int) -> torch.nn.Module:
    """A causal LM of the family at the nominal size, random weights, eval mode."""
    hidden, layers, heads, kv, mlp = SHAPES[size]
    config_class, model_class = _classes(family)
    config = config_class(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=mlp,
        max_position_embeddings=max(seq, 64), tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    # built in float32 then converted: the build's own peak is before the phases measured
    return model_class(config).to(DTYPES[dtype]).eval()


class _Phases:
    """Wraps the library's phase functions to record each phase's peak resident set."""

    def __init__(self) -> None:
        self.peak = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Any:
        _reset_peak()
        try:
            yield
        finally:
            self.peak[name] = max(self.peak[name], _status("VmHWM"))

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return inner(*args, **kwargs)

        setattr(owner, attr, wrapped)


def activations(args: dict[str, Any]) -> float:
    """One micro-batch's activations (MiB) in this process: the resident set's mark over the
    built model during a plain forward and backward of ``micro`` x ``seq`` random tokens
    (the causal-LM loss, every weight frozen, the gradient taken to the input embeddings), the
    "plus one micro-batch's activations" of the issue's 1.3 W allowance."""
    torch.set_num_threads(args["threads"])
    model = build(args["family"], args["size"], args["dtype"], args["seq"])
    model.requires_grad_(False)
    model.get_input_embeddings().register_forward_hook(lambda m, i, o: o.requires_grad_())
    ids = torch.randint(0, VOCAB, (args["micro"], args["seq"]), generator=torch.Generator())
    base = _status("VmRSS")
    _reset_peak()
    model(input_ids=ids, labels=ids).loss.backward()
    return _status("VmHWM") - base


def child(args: dict[str, Any]) -> dict[str, Any]:
    """One cell in this process: the row of the table."""
    import fisherprune as fp
    from fisherprune.calibrate import to_target

    torch.set_num_threads(args["threads"])
    _classes(args["family"])  # imported before rss0: a fixed cost, not the call's
    rss0 = _status("VmRSS")
    model = build(args["family"], args["size"], args["dtype"], args["seq"])
    params = sum(p.numel() for p in model.parameters())
    weight_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    g = torch.Generator().manual_seed(1)
    micro = args["micro"]
    count = max(1, args["tokens"] // (micro * args["seq"]))
    data = [
        {"input_ids": torch.randint(0, VOCAB, (micro, args["seq"]), generator=g)}
        for _ in range(count)
    ]
    example = {"input_ids": data[0]["input_ids"][:1]}
    base = _status("VmRSS")
    phases = _Phases()
    phases.wrap(to_target, "estimate_signals", "signals")
    phases.wrap(to_target._Selection, "run", "selection")
    phases.wrap(to_target, "repair_consumers", "repair")
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with phases.phase("trace"):
            fp.apply_masks(model, example)
        trace_s = time.perf_counter() - start
        result = fp.prune_to_target(model, example, data, "50%", checkpoint=args["checkpoint"])
    seconds = time.perf_counter() - start
    peak = max(phases.peak.values())
    return {
        "family": args["family"],
        "size": args["size"],
        "dtype": args["dtype"],
        "parameters": params,
        "weight_mib": round(weight_mib, 1),
        "tokens": count * micro * args["seq"],
        "micro_batch": [micro, args["seq"]],
        "seconds": round(seconds, 1),
        "phase_seconds": {"trace": round(trace_s, 1)}
        | {k: round(v, 1) for k, v in result.phase_seconds.items()},
        "phase_cpu_seconds": {k: round(v, 1) for k, v in result.phase_cpu_seconds.items()},
        "checkpoint": args["checkpoint"],
        "cost_ratio": round(result.ratio, 4),
        "rss0_mib": round(rss0),
        "base_mib": round(base),
        "phase_peak_mib": {k: round(v) for k, v in phases.peak.items()},
        "peak_over_w": round((peak - rss0) / weight_mib, 3),
        "extra_over_w": round((peak - base) / weight_mib, 3),
        "repair_passes": result.repair.passes if result.repair else 0,
        "repaired_layers": len(result.repair.layers) if result.repair else 0,
    } | ({"run": args["label"]} if args.get("label") else {})


def _allowance(row: dict[str, Any], cell: dict[str, Any]) -> dict[str, Any]:
    """The cell's allowance, 0.3 W plus one micro-batch's activations (measured in a fresh
    process), and the whole call's extra over the built model against it (MiB)."""
    cmd = [sys.executable, __file__, "--child", json.dumps(cell)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:  # the row stands without its allowance, as a failed cell is left out
        print(f"the micro-batch's activations failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return {}
    act = float(done.stdout.strip().splitlines()[-1])
    allowance = 0.3 * row["weight_mib"] + act
    extra = max(row["phase_peak_mib"].values()) - row["base_mib"]
    return {
        "activation_mib": round(act),
        "allowance_mib": round(allowance),
        "extra_mib": round(extra),
        "over_allowance_mib": round(extra - allowance),
    }


def _table(rows: list[dict[str, Any]]) -> None:
    head = f"{'model':<12} {'dtype':<8} {'params':>7} {'W MiB':>7} {'tokens':>6} {'sec':>6}"
    head += "".join(f" {p[:6]:>6}" for p in PHASES) + f" {'peak/W':>6} {'extra/W':>7}  peak MiB"
    print(head)
    for r in rows:
        ph = r["phase_seconds"]
        line = (
            f"{r['family'] + ' ' + r['size']:<12} {r['dtype']:<8} {r['parameters'] / 1e6:>6.0f}M "
            f"{r['weight_mib']:>7.0f} {r['tokens']:>6} {r['seconds']:>6.0f}"
        )
        line += "".join(f" {ph.get(p, 0):>6.1f}" for p in PHASES)
        peaks = "/".join(str(r["phase_peak_mib"][p]) for p in PHASES)
        allowed = f"  extra {r['extra_mib']} of {r['allowance_mib']}" if "extra_mib" in r else ""
        print(f"{line} {r['peak_over_w']:>6.2f} {r['extra_over_w']:>7.2f}  {peaks}{allowed}")


def _cell(r: dict[str, Any]) -> str:
    off = " ckpt off" if r.get("checkpoint") is False else ""
    return f"{r['family']} {r['size']} {r['dtype']} {r['tokens']}{off}"


def _growth(
    ax: Any,
    groups: dict[tuple, list[dict[str, Any]]],
    key: str,
    scale: float,
    xlabel: str,
    unit: str,
) -> None:
    """Peak/W (and seconds, dashed, on a twin axis) against ``key`` for each group of at least
    two rows, labelled by the group's key (and ``unit``)."""
    tx = ax.twinx()
    for group, rs in groups.items():
        if len(rs) < 2:
            continue
        rs.sort(key=lambda r: r[key])
        x = [r[key] * scale for r in rs]
        label = " ".join(str(g) for g in group) + (f" {unit}" if unit else "")
        ax.plot(x, [r["peak_over_w"] for r in rs], "o-", label=f"peak/W {label}")
        tx.plot(x, [r["seconds"] for r in rs], "s--", alpha=0.5, label=f"s {label}")
    ax.set(xscale="log", xlabel=xlabel, ylabel="peak RSS / weight bytes")
    tx.set(ylabel="seconds (dashed)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left")


def _plot(rows: list[dict[str, Any]], baseline: list[dict[str, Any]], path: Path) -> None:
    """Peak/W and seconds against parameters (tokens fixed) and against tokens (size fixed),
    and peak/W per cell before (``baseline``) and now: each cell's newest row (the table
    keeps every run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    latest = list({_cell(r): r for r in rows}.values())  # each cell's newest row only
    series: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    by_tokens: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in latest:
        if r.get("checkpoint") is False:  # (its own bar only)
            continue
        series.setdefault((r["family"], r["dtype"], r["tokens"]), []).append(r)
        by_tokens.setdefault((r["family"], r["dtype"], r["size"]), []).append(r)
    _growth(axes[0], series, "parameters", 1e-6, "parameters (M)", "tok")
    _growth(axes[1], by_tokens, "tokens", 1.0, "calibration tokens", "")
    ax = axes[2]
    before = {_cell(r): r["peak_over_w"] for r in baseline}
    rows = latest
    cells = [_cell(r) for r in rows]
    ax.barh([i + 0.2 for i in range(len(cells))], [r["peak_over_w"] for r in rows], 0.4,
            label="now")  # fmt: skip
    ax.barh([i - 0.2 for i in range(len(cells))], [before.get(c, 0) for c in cells], 0.4,
            label="before (baseline)")  # fmt: skip
    ax.set_yticks(range(len(cells)), cells, fontsize=7)
    ax.axvline(1.3, color="k", ls=":", lw=1)
    ax.set(xlabel="peak RSS / weight bytes (dotted: 1.3)")
    ax.legend(fontsize=7)
    fig.suptitle("apply_masks + prune_to_target('50%'), repair on, label-free (CPU)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="llama,qwen2")
    parser.add_argument("--sizes", default="30M,100M", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tokens", default="512", help="calibration tokens per cell (a list)")
    parser.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--checkpoint", default="auto", choices=("auto", "off"),
        help="prune_to_target's checkpoint (off: the signal passes hold every layer's tensors)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT)
    parser.add_argument("--append", action="store_true", help="add to the rows of --out")
    parser.add_argument("--label", help="the run's name in the table (default: now)")
    parser.add_argument(
        "--baseline", type=Path, help="a JSON of this script whose rows are kept as 'baseline'"
    )
    parser.add_argument(
        "--replot", action="store_true", help="redraw --plot from the rows of --out, run nothing"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        cell = json.loads(args.child)
        print(json.dumps(activations(cell) if cell.get("activations") else child(cell)))
        return 0
    if args.replot:
        saved = json.loads(args.out.read_text())
        _plot(saved["rows"], saved.get("baseline", []), args.plot)
        return 0
    old = json.loads(args.out.read_text()) if args.append and args.out.exists() else {}
    rows = old.get("rows", [])
    baseline = (
        json.loads(args.baseline.read_text())["rows"] if args.baseline else old.get("baseline", [])
    )
    for family in args.families.split(","):
        for size in args.sizes.split(","):
            for dtype in args.dtypes.split(","):
                for tokens in args.tokens.split(","):
                    cell = {"family": family, "size": size, "dtype": dtype,
                            "tokens": int(tokens), "micro": args.micro, "seq": args.seq,
                            "threads": args.threads, "label": args.label,
                            "checkpoint": args.checkpoint == "auto" and "auto"}  # fmt: skip
                    cmd = [sys.executable, __file__, "--child", json.dumps(cell)]
                    done = subprocess.run(cmd, capture_output=True, text=True)
                    if done.returncode != 0:
                        print(done.stderr[-2000:], file=sys.stderr)
                        continue
                    row = json.loads(done.stdout.strip().splitlines()[-1])
                    rows.append(row | _allowance(row, cell | {"activations": True}))
                    _table(rows[-1:])
    print()
    _table(rows)
    write_json(
        args.out,
        old  # --append keeps the file's other fields (its notes and changes)
        | {
            "benchmark": "llm_memory",
            "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(),
            "torch": torch.__version__,
            "rows": rows,
            "baseline": baseline,
        },
    )
    _plot(rows, baseline, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
