"""Issue 20 on a GPU: training-step overhead, peak memory, host syncs, latency, throughput.

How to run on a GPU
-------------------
From the repository root, with fisherprune importable (``pip install -e .``) and a CUDA torch:
``python benchmarks/gpu.py`` (bf16 autocast, fp32 weights; about 10 minutes on one modern GPU)
prints the tables and writes ``benchmarks/results/gpu.json``. ``--dtype float16`` (GradScaler)
or ``float32`` changes the arithmetic, ``--no-compile`` skips ``torch.compile``, ``--quick``
(2 blocks, small inputs, batch 2, few steps) checks in a minute that everything runs.
``--device cpu`` runs the same code on the CPU: a check of the script, not figures to quote (no
CUDA events, peak memory or sync check there). Send back the JSON: every ratio in it was taken
side by side in one run.

For ResNet-50 (224x224) and BERT-base- and ViT-B/16-sized encoders (12 blocks, d 768, 12 heads;
128 tokens, 224x224), each with every mask ``apply_masks`` finds, at batch 32:

1. overhead: ms per step of ``overhead.py``'s variants (a) plain, (b) collecting, (c) pruned,
   not collecting, built by ``overhead.VARIANT_STEPS`` with a step builder in place of its
   ``make_step`` that runs forward and loss under ``torch.autocast`` (fp16: a GradScaler;
   the signal then gathers scaled gradients, at the same cost); interleaved rounds, rotated
   each round, each block of steps between two CUDA events (no synchronisation inside a
   block); medians, their ratios and the per-round ratios;
2. peak memory: ``torch.cuda.max_memory_allocated`` of one step per variant (one model on the
   device at a time);
3. host syncs: a few steps of each variant, and of the trainer's loop below on steps that do not
   prune, under ``torch.cuda.set_sync_debug_mode("error")``: "pass" or the error message; and
   a short ``PruningTrainer`` run itself (an MLP on a generated table, ``trainer_sync_check``)
   whose steps run under ``set_sync_debug_mode("warn")``: the synchronising calls seen in the
   steps that read no loss (no prune, evaluation or checkpoint due; the trainer reads its
   losses every ``ACCELERATOR_READ_EVERY`` steps on a GPU);
4. latency, batch 32, ``model.to(dtype)``, eager and ``torch.compile``d, of the dense encoders
   and of them shrunk to 50% and 25% of the FLOPs (``transformer_latency.prune_library``,
   ``round_to=8``, ``uniform=True``): speed-up, FLOPs reduction, eff = speed-up / reduction;
5. throughput (examples/s) of the step that ``fisherprune train`` runs (forward under the
   trainer's ``Precision.autocast``, ``Precision.minimize`` of a ``PruningOptimizer`` pruning
   every 10 steps towards 50% of the FLOPs) against a plain step of the unmasked network; not a
   whole ``PruningTrainer`` run, whose data loading, evaluation and export would blur it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import itertools
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import overhead as ov
import standard_nets as sn
import torch
import torch.nn.functional as F
import transformer_latency as tl
from _common import counted_flops, machine_info, write_json
from torch import Tensor, nn

import fisherprune as fp
import fisherprune.train.phases as phases
from fisherprune.export.serving_forms import compile_for_serving
from fisherprune.train import PruningTrainer, TrainConfig
from fisherprune.train.devices import Precision

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PRECISION_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
#: overhead.py's plain, collecting, pruned-not-collecting, and pruned then shrunk in place
#: (``shrink(inplace=True, optimizer=)``: what fine-tuning runs once pruning is over)
STEP_VARIANTS = ("a", "b", "c", "f")
LATENCY_TARGETS = (0.5, 0.25)
#: eager slower than the same forward replayed as a CUDA graph by more than this: launch-bound
LAUNCH_BOUND = 1.3
ROUND_TO = 8
PRUNE_EVERY = 10
SYNC_STEPS = 3
#: what set_sync_debug_mode("warn") says at a synchronising call (its own notice that the mode
#: is a prototype also says "Synchronization", and is not one)
SYNC_WARNING = "called a synchronizing"
#: the PruningOptimizer of the throughput and sync runs (and overhead.py's SGD settings)
POPT: dict[str, Any] = {
    "lr": ov.LR,
    "momentum": ov.MOMENTUM,
    "decay": ov.DECAY,
    "flops_target": "50%",
}
Fn = Callable[[], Any]


# ------------------------------------------------------------------ models
def quick_specs() -> dict[str, ov.ModelSpec]:
    """Two-block encoders, 32x32 images, 32 tokens, 20 LSTM steps: the nets' code at a check
    size, the masked models with every mask ``apply_masks`` finds."""

    def images(n: int, gen: torch.Generator) -> Tensor:
        return torch.randn(n, 3, 32, 32, generator=gen)

    def tokens(n: int, gen: torch.Generator) -> Tensor:
        return torch.randint(0, 30522, (n, 32), generator=gen)

    builds: dict[str, tuple[Callable[[], nn.Module], ov.InputFn]] = {
        "resnet50": (sn.build_resnet50, images),
        "bert_base": (lambda: sn.build_bert_base(length=32, layers=2), tokens),
        "vit_b16": (lambda: sn.Encoder(vocab=None, length=5, layers=2), images),
        "lstm": (ov.LSTMTagger, lambda n, gen: torch.randn(n, 20, 64, generator=gen)),
    }
    return {
        name: dataclasses.replace(
            ov.MODELS[name],
            description=f"{name}, quick size",
            build=ov.found_masks(b, x),
            make_input=x,
        )
        for name, (b, x) in builds.items()
    }


def on_device(spec: ov.ModelSpec, device: torch.device) -> ov.ModelSpec:
    """``spec`` whose models are built (masks found on the CPU) and then moved to ``device``."""
    return dataclasses.replace(spec, build=lambda masked: spec.build(masked).to(device))


def amp_step_builder(
    device: torch.device, dtype: torch.dtype, compiled: bool = False
) -> Callable[..., ov.StepFn]:
    """A drop-in for ``overhead.make_step``: forward and loss under ``torch.autocast(dtype)``
    (fp32 weights), backward and SGD step outside it, a ``GradScaler`` for float16;
    ``compiled``: the model's forward under ``torch.compile``."""

    def make_step(
        model: nn.Module,
        after_backward: Callable[[Tensor, Tensor], None] | None = None,
        after_step: Fn | None = None,
    ) -> ov.StepFn:
        if after_backward is not None:
            raise ValueError("the naive per-example baseline is not run on a GPU")
        opt = torch.optim.SGD(model.parameters(), lr=ov.LR, momentum=ov.MOMENTUM)
        scaler = torch.amp.GradScaler(device.type) if dtype is torch.float16 else None
        model.train()
        forward = torch.compile(model) if compiled else model

        def step(x: Tensor, y: Tensor) -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not torch.float32):
                loss = F.cross_entropy(forward(x), y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            if after_step is not None:
                after_step()

        return step

    return make_step


def variant_step(
    spec: ov.ModelSpec, v: str, device: torch.device, dtype: torch.dtype, compiled: bool = False
) -> ov.StepFn:
    """``overhead.VARIANT_STEPS[v]`` on ``device`` in mixed precision (``compiled``: the
    forward under ``torch.compile``)."""
    build = amp_step_builder(device, dtype, compiled)
    return ov.VARIANT_STEPS[v](on_device(spec, device), ov.DECAY, build)


def device_batches(
    spec: ov.ModelSpec, batch: int, device: torch.device
) -> list[tuple[Tensor, Tensor]]:
    return [(x.to(device), y.to(device)) for x, y in ov.make_batches(spec, ov.NUM_BATCHES, batch)]


def cycling(step: ov.StepFn, batches: Sequence[tuple[Tensor, Tensor]]) -> Fn:
    """One call: one step on the next batch of ``batches``."""
    it = itertools.cycle(batches)
    return lambda: step(*next(it))


def variant_fns(
    spec: ov.ModelSpec, args: argparse.Namespace, keys: Sequence[str], compiled: bool = False
) -> dict[str, Fn]:
    """The steps of the variants ``keys`` on the device, each cycling through the same batches."""
    batches = device_batches(spec, args.batch, args.device)
    return {
        v: cycling(variant_step(spec, v, args.device, args.dtype, compiled), batches) for v in keys
    }


# ------------------------------------------------------------------ timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def block_ms(fn: Fn, count: int, device: torch.device) -> float:
    """ms per call over ``count`` back-to-back calls: between two CUDA events on a GPU (no
    synchronisation inside the block), by the wall clock on the CPU; garbage collector off."""
    gc.collect()
    gc.disable()
    try:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(count):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / count
        t0 = time.perf_counter()
        for _ in range(count):
            fn()
        return (time.perf_counter() - t0) * 1e3 / count
    finally:
        gc.enable()


def interleaved(
    fns: dict[str, Fn], rounds: int, count: int, warmup: int, device: torch.device
) -> dict[str, list[float]]:
    """Per key, ms per call in each of ``rounds`` rounds; every round times a block of ``count``
    calls of each function, in an order rotated every round, after ``warmup`` calls each."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    keys = list(fns)
    out: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            out[k].append(block_ms(fns[k], count, device))
    return out


def warmup_calls(args: argparse.Namespace, compiled: bool) -> int:
    """Untimed calls before timing: at least 3 under ``torch.compile``, whose first calls
    compile (the forward and the backward graphs; a pruned width compiles again), even in
    ``--quick``, so that a rehearsal's compiled ratios time steps, not the compiler."""
    return max(args.warmup, 3) if compiled else args.warmup


def ratios(times: dict[str, list[float]], ref: str) -> dict[str, dict[str, Any]]:
    """Per key: median ms, per-round ms, ratio of medians to ``ref`` and the per-round ratios."""
    base = statistics.median(times[ref])
    out = {}
    for k, ts in times.items():
        per_round = [t / a for t, a in zip(ts, times[ref], strict=True)]
        out[k] = {
            "median_ms": statistics.median(ts),
            "round_ms": ts,
            "ratio": statistics.median(ts) / base,
            "paired_ratio": statistics.median(per_round),
            "round_ratios": per_round,
        }
    return out


# ------------------------------------------------------------------ 1-3: steps
def peak_memory(spec: ov.ModelSpec, args: argparse.Namespace) -> dict[str, Any]:
    """Peak bytes allocated during one step of each variant (after a warm-up step), one
    variant's model on the device at a time; ratios to the plain step."""
    if args.device.type != "cuda":
        return {"skipped": "torch.cuda.max_memory_allocated needs a CUDA device"}
    peaks = {}
    for v in STEP_VARIANTS:
        step = variant_fns(spec, args, v)[v]
        step()
        sync(args.device)
        torch.cuda.reset_peak_memory_stats(args.device)
        step()
        sync(args.device)
        peaks[v] = torch.cuda.max_memory_allocated(args.device)
        del step
        gc.collect()
        torch.cuda.empty_cache()
    return {v: {"peak_bytes": p, "ratio": p / peaks["a"]} for v, p in peaks.items()}


def popt_loop(
    spec: ov.ModelSpec, args: argparse.Namespace, prune_every: int, compiled: bool = False
) -> tuple[Fn, fp.PruningOptimizer, Precision]:
    """One call: one step of the trainer's loop (``Precision.autocast`` forward and loss,
    ``Precision.minimize``) on the masked model with a ``PruningOptimizer`` that prunes every
    ``prune_every`` steps towards 50% of the FLOPs (``compiled``: the forward under
    ``torch.compile``, as ``fisherprune train --compile`` runs it)."""
    model = ov.make_model(on_device(spec, args.device), masked=True)
    batches = itertools.cycle(device_batches(spec, args.batch, args.device))
    example = ov.make_batches(spec, 1, 1)[0][0].to(args.device)
    popt = fp.PruningOptimizer(model, example, prune_every=prune_every, **POPT)
    precision = Precision(PRECISION_NAMES[args.dtype], args.device)
    model.train()
    forward = torch.compile(model) if compiled else model

    def step() -> None:
        x, y = next(batches)
        with precision.autocast():
            loss = F.cross_entropy(forward(x).float(), y)
        precision.minimize(popt, loss)

    return step, popt, precision


def sync_check(spec: ov.ModelSpec, args: argparse.Namespace) -> dict[str, Any]:
    """Per variant (and the ``PruningOptimizer`` loop on non-pruning steps): ``"pass"`` when
    ``SYNC_STEPS`` steps ran under ``set_sync_debug_mode("warn")`` with no synchronising call,
    else ``"FAIL"`` and where each one was made (file:line of the Python code that made it)."""
    if args.device.type != "cuda":
        return {"skipped": "torch.cuda.set_sync_debug_mode needs a CUDA device"}
    fns = variant_fns(spec, args, STEP_VARIANTS)
    fns["pruning_optimizer"] = popt_loop(spec, args, prune_every=10**9)[0]
    out: dict[str, Any] = {}
    for k, fn in fns.items():
        fn()  # first step: lazy initialisation (cuBLAS handles, the first-step checks)
        sync(args.device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(SYNC_STEPS):
                    fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        where = sorted(
            {f"{w.filename}:{w.lineno}" for w in caught if SYNC_WARNING in str(w.message)}
        )
        out[k] = "pass" if not where else f"FAIL: synchronising calls at {', '.join(where)}"
    if args.dtype is torch.float16:
        out["note"] = "GradScaler.step reads its inf check on the host: fp16 fails by design"
    return out


def trainer_sync_check(args: argparse.Namespace, steps: int = 120) -> dict[str, Any]:
    """``steps`` steps of ``PruningTrainer`` (an MLP of width 256 on a generated table of 4,000
    rows, pruning every 10 steps after 20, in the run's precision), each step under
    ``set_sync_debug_mode("warn")``: the synchronising calls seen in the steps that read no
    loss, "pass" when there are none."""
    if args.device.type != "cuda":
        return {"skipped": "torch.cuda.set_sync_debug_mode needs a CUDA device"}
    seen: list[tuple[bool, list[str]]] = []
    original = phases.train_step

    def watched(loop: phases.Loop) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                original(loop)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message)[:160] for w in caught if SYNC_WARNING in str(w.message)]
        seen.append((loop.guard.unread > 0, syncs))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 16, generator=g)
    rows = [",".join(f"{v:.4f}" for v in r) + f",{int(r[0] + r[1] > 0)}" for r in x.tolist()]
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "t.csv"
        table.write_text(",".join(f"f{i}" for i in range(16)) + ",label\n" + "\n".join(rows))
        cfg = TrainConfig(
            data=str(table), label="label", model="mlp", width=256, depth=2, steps=steps,
            pruning_burn_in=20, pruning_iter=10, eval_every=10**6, checkpoint_every=10**6,
            fine_tune_steps=10, save_dir=str(Path(tmp) / "run"), export_formats=["state_dict"],
            progress="none", device=str(args.device), precision=PRECISION_NAMES[args.dtype],
            weight_decay=5e-4,
        )  # fmt: skip
        phases.train_step = watched
        try:
            PruningTrainer(cfg).run()
        finally:
            phases.train_step = original
    quiet = [syncs for unread, syncs in seen if unread]
    found = [s for syncs in quiet for s in syncs]
    return {
        "steps": len(seen),
        "steps_reading_no_loss": len(quiet),
        "syncs_in_those": len(found),
        "result": "pass" if quiet and not found else f"FAIL: {found[:1] or 'no such step'}",
    }


def step_figures(spec: ov.ModelSpec, args: argparse.Namespace) -> dict[str, Any]:
    """Overhead (interleaved rounds), peak memory and the sync check of one model."""
    memory = peak_memory(spec, args)
    syncs = sync_check(spec, args)
    fns = variant_fns(spec, args, STEP_VARIANTS)
    times = interleaved(fns, args.rounds, args.steps, args.warmup, args.device)
    masks = fp.find_masks(ov.make_model(spec, masked=True))
    out = {
        "architecture": spec.description,
        "masks": len(masks),
        "mask_channels": sum(m.num_channels for m in masks.values()),
        "variants": {v: {"label": ov.VARIANTS[v], **r} for v, r in ratios(times, "a").items()},
        "memory": memory,
        "sync_check": syncs,
    }
    if args.compiled_steps:  # (a) and (b) with the forward compiled, as ratios to compiled (a)
        fns = variant_fns(spec, args, ("a", "b"), compiled=True)
        times = interleaved(fns, args.rounds, args.steps, warmup_calls(args, True), args.device)
        out["compiled_variants"] = {
            v: {"label": f"{ov.VARIANTS[v]}, compiled", **r} for v, r in ratios(times, "a").items()
        }
    return out


def throughput(
    spec: ov.ModelSpec, args: argparse.Namespace, compiled: bool = False
) -> dict[str, Any]:
    """Examples/s of the trainer's loop with pruning against a plain step, interleaved
    (``compiled``: both forwards under ``torch.compile``)."""
    try:
        on, popt, _ = popt_loop(spec, args, PRUNE_EVERY, compiled)
    except ValueError as exc:  # e.g. fp16 on a CPU: the trainer refuses it too
        return {"skipped": str(exc)}
    off = variant_fns(spec, args, "a", compiled)["a"]
    calls = warmup_calls(args, compiled)
    times = interleaved({"off": off, "on": on}, args.rounds, args.steps, calls, args.device)
    per_s = {k: args.batch * 1e3 / statistics.median(ts) for k, ts in times.items()}
    return {
        "examples_per_s": per_s,
        "on_over_off": per_s["on"] / per_s["off"],
        "detail": ratios(times, "off"),
        "prunes": len(popt.history),
        "finished": popt.finished,
    }


# ------------------------------------------------------------------ 4: latency
def encoder_latency(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Dense vs shrunk (``prune_library``, uniform, round_to 8) at each FLOPs target, eager
    and compiled, in ``args.dtype`` on the device; speed-ups over the dense net in each form."""
    build, make_input = tl.ENCODERS[name]
    x1 = make_input(1)
    dense = build(layers=args.layers).eval()
    masked = copy.deepcopy(dense)
    masks = dict(fp.apply_masks(masked, x1))
    cost = fp.CostModel(masked, x1)
    nets, flops = {"dense": dense}, {"dense": counted_flops(dense, x1)}
    for target in LATENCY_TARGETS:
        tl.prune_library(masks, cost, target, ROUND_TO, True)
        label = f"uniform r{ROUND_TO} {target:.0%}"
        nets[label] = fp.shrink(masked, x1).eval()
        flops[label] = counted_flops(nets[label], x1)
    rows, compile_errors = [], {}
    for batch in args.latency_batches:
        x = make_input(batch).to(args.device)
        x = x.to(args.dtype) if x.is_floating_point() else x
        forms: dict[str, Fn] = {}
        for label, net in nets.items():
            net = net.to(args.device, args.dtype)
            forms[f"eager|{label}"] = lambda net=net, x=x: net(x)
            if args.device.type == "cuda":
                forms[f"cuda graph|{label}"] = cuda_graph(net, x)
            if args.compile:  # (static shapes, and past dynamo's limit of 8 graphs: 9 here)
                try:
                    compiled = compile_for_serving(net, lambda f, x=x: f(x))
                    forms[f"compiled|{label}"] = lambda net=compiled, x=x: net(x)
                except Exception as exc:  # any compiler failure is recorded
                    compile_errors[label] = f"{type(exc).__name__}: {exc}"[:500]
        with torch.inference_mode():
            times = interleaved(forms, args.rounds, args.calls, 1, args.device)
        graph = {k.split("|")[1]: min(ts) for k, ts in times.items() if k.startswith("cuda graph")}
        for key, ts in times.items():
            form, label = key.split("|")
            dense_ts = times[f"{form}|dense"]
            speedup = min(dense_ts) / min(ts)
            reduction = flops["dense"] / flops[label]
            eager = min(times[f"eager|{label}"])
            rows.append(
                {
                    "batch": batch,
                    "form": form,
                    "network": label,
                    "latency_ms": min(ts),
                    "round_ms": ts,
                    "speedup": speedup,
                    "paired_speedups": [d / t for d, t in zip(dense_ts, ts, strict=True)],
                    "flops_reduction": reduction,
                    "efficiency": speedup / reduction,
                    # eager waits on the host when replaying its kernels as one graph is far
                    # faster: then the forward is bound by launches, not by arithmetic
                    "bound": None
                    if form != "eager" or label not in graph
                    else ("launch" if eager > LAUNCH_BOUND * graph[label] else "compute"),
                }
            )
    return {"flops_per_example": flops, "rows": rows, "compile_errors": compile_errors or None}


def cuda_graph(net: nn.Module, x: Tensor) -> Fn:
    """``net(x)`` captured once as a CUDA graph (inference mode, static input): one call
    replays every kernel with a single launch, as a server that graphs its forward does."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(2):  # warm-up outside the capture (cuBLAS workspaces, autotuning)
            net(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        net(x)
    return graph.replay


# ------------------------------------------------------------------ report
SIZES: dict[str, dict[str, int]] = {  # --quick, and the figures to quote
    "quick": dict(batch=2, rounds=1, steps=1, warmup=0, calls=1, layers=2, latency_batches=(2,)),
    "full": dict(
        batch=32, rounds=10, steps=10, warmup=5, calls=5, layers=12, latency_batches=(1, 32, 256)
    ),
}


def print_tables(results: dict[str, Any]) -> None:
    head = ("model", "variant", "ms/step", "ratio", "paired", "peak MiB", "mem")
    print("\n{:<10} {:<36} {:>9} {:>6} {:>7} {:>9} {:>5}  sync".format(*head))
    for name, res in results["steps"].items():
        for v, r in res["variants"].items():
            mem = res["memory"].get(v, {"peak_bytes": float("nan"), "ratio": float("nan")})
            print(
                f"{name:<10} {f'({v}) ' + r['label']:<36} {r['median_ms']:9.2f} {r['ratio']:6.3f} "
                f"{r['paired_ratio']:7.3f} {mem['peak_bytes'] / 2**20:9.0f} {mem['ratio']:5.2f}  "
                f"{str(res['sync_check'].get(v, '-'))[:60]}"
            )
        for v, r in res.get("compiled_variants", {}).items():
            print(
                f"{name:<10} {f'({v}+) ' + r['label']:<36} {r['median_ms']:9.2f} "
                f"{r['ratio']:6.3f} {r['paired_ratio']:7.3f}"
            )
        print(
            f"{name:<10} PruningOptimizer loop: {res['sync_check'].get('pruning_optimizer', '-')}"
        )
    head = ("model", "batch", "form", "network", "ms", "speed-up", "FLOPs /", "eff")
    print("\n{:<10} {:>5} {:<11} {:<18} {:>9} {:>9} {:>8} {:>5}  bound".format(*head))
    for name, res in results["latency"].items():
        for r in res["rows"]:
            print(
                f"{name:<10} {r['batch']:>5} {r['form']:<11} {r['network']:<18} "
                f"{r['latency_ms']:9.2f} {r['speedup']:9.2f} {r['flops_reduction']:8.2f} "
                f"{r['efficiency']:5.2f}  {r['bound']}"
            )
        if res["compile_errors"]:
            print(f"{name:<10} torch.compile failed: {res['compile_errors']}")
    trainer = results.get("trainer_sync", {})
    print(f"\nPruningTrainer steps reading no loss: {trainer.get('result', trainer)}")
    print(f"\n{'model':<10} {'ex/s off':>10} {'ex/s on':>10} {'on/off':>7}  prunes")
    loops = [(n, "", r) for n, r in results["throughput"].items()]
    loops += [(n, " compiled", r) for n, r in results.get("compiled_throughput", {}).items()]
    for name, form, res in loops:
        e = res.get("examples_per_s", {"off": float("nan"), "on": float("nan")})
        ratio, prunes = res.get("on_over_off", float("nan")), res.get("prunes", res.get("skipped"))
        print(f"{name:<10} {e['off']:10.1f} {e['on']:10.1f} {ratio:7.3f}  {prunes}{form}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (a check)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--quick", action="store_true", help=f"a check: {SIZES['quick']}")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time torch.compile'd encoders (default: on, off with --quick)",
    )
    p.add_argument(
        "--compiled-steps",
        action="store_true",
        help="also time (a) and (b), and the trainer's loop, with the forward under "
        "torch.compile (masks.compiled)",
    )
    p.add_argument(
        "--models",
        nargs="+",
        choices=[*ov.STANDARD, "lstm"],
        default=list(ov.STANDARD),
        help="the standard networks (default) and lstm: overhead.py's LSTMTagger (its units "
        "gathered step by step, against cuDNN's fused kernel)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    args = p.parse_args(argv)
    args.device, args.dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device; --device cpu checks the script")
    if args.device.type == "cuda":
        if args.device.index is None:  # "cuda": the current device, named (set_device needs it)
            args.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(args.device)  # the CUDA events time the current device's stream
    if args.compile is None:
        args.compile = not args.quick
    args.sizes = SIZES["quick" if args.quick else "full"]
    for k, v in args.sizes.items():
        setattr(args, k, v)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    specs = quick_specs() if args.quick else ov.MODELS
    results: dict[str, Any] = {"steps": {}, "latency": {}, "throughput": {}}
    for name in args.models:
        t0 = time.perf_counter()
        results["steps"][name] = step_figures(specs[name], args)
        write_json(args.out, {"partial": True, **results})  # what a timeout leaves stays
        results["throughput"][name] = throughput(specs[name], args)
        if args.compiled_steps:  # (a compiler failure is recorded; the other parts go on)
            try:
                done = throughput(specs[name], args, compiled=True)
            except Exception as exc:
                done = {"skipped": f"{type(exc).__name__}: {str(exc).strip()[:300]}"}
            results.setdefault("compiled_throughput", {})[name] = done
        write_json(args.out, {"partial": True, **results})
        print(f"{name}: training steps {time.perf_counter() - t0:.0f} s", flush=True)
        if name in tl.ENCODERS:
            t0 = time.perf_counter()
            results["latency"][name] = encoder_latency(name, args)
            write_json(args.out, {"partial": True, **results})
            print(f"{name}: latency {time.perf_counter() - t0:.0f} s", flush=True)
    results["trainer_sync"] = trainer_sync_check(args)
    print_tables(results)
    cuda = args.device.type == "cuda"
    payload = {
        "benchmark": "gpu",
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "fisherprune_version": fp.__version__,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "device": str(args.device),
        "device_name": torch.cuda.get_device_name(args.device) if cuda else "cpu",
        "dtype": str(args.dtype).removeprefix("torch."),
        "machine": machine_info(),
        "note": None
        if cuda
        else "a CPU run checks that the script runs: no CUDA events, peak "
        "memory or sync check, and its figures say nothing about a GPU",
        "settings": {"quick": args.quick, "compile": args.compile, **args.sizes}
        | {
            "round_to": ROUND_TO,
            "uniform": True,
            "prune_every": PRUNE_EVERY,
            "sync_steps": SYNC_STEPS,
        }
        | {
            "trainer_loop": POPT,
            "throughput": "the trainer's loop (Precision + "
            "PruningOptimizer) vs a plain SGD step, not a whole PruningTrainer run",
        },
        **results,
        "elapsed_s": time.perf_counter() - started,
    }
    write_json(args.out, payload)
    print(f"\nwrote {args.out} ({payload['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
