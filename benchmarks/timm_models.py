"""fisherprune on timm's image models as a user brings them: groups, exact shrink, exact cost.

What is measured
----------------
Each model is built by ``timm.create_model(name, pretrained=False, num_classes=10)`` (at
``--res``, passed as ``img_size`` where the model takes it; a few models need their own
resolution, ``RESOLUTION``), in float64 and eval mode, with random batch-norm running
statistics (so that eval mode hides no channel). Then, for fisherprune:

* ``dense cost == counted``: ``computational_cost`` of the unmasked model equals
  ``FlopCounterMode`` on it, per example (batch 2; work done once per batch, such as a
  relative-position table, is shared by the batch's examples in both counts);
* ``groups`` / ``channels``: the masks ``apply_masks`` placed (traced on one example) and their
  channels; ``apply s``: its wall time;
* ``prunable``: ``1 - C(every mask entry 0) / C(dense)`` by the cost model: the share of FLOPs
  that depends on some prunable channel;
* then 30-50% of every mask's channels are zeroed at random (seeded, as the architecture
  tests do) and the model is shrunk: ``max |shrunk - masked|`` (relative to max(1, max
  |output|), on another batch of 2), ``cost == counted`` (``computational_cost`` of the masked
  model against ``FlopCounterMode`` on the shrunk one) and ``saved`` (counted FLOPs of the
  shrunk model against the dense one's).

Then the training path, on a fresh float32 copy in training mode: ``PruningOptimizer`` over
every mask (a prune every 2 steps, no burn-in, target 70% of the FLOPs) for 4 steps on random
images and labels, then shrunk: the channels pruned, the signals finite, and the shrunk model's
largest difference from the masked one (``trained``).

A row passes when both costs equal the counts exactly, the shrunk model gives the masked
model's outputs within 1e-9, and the trained copy pruned some channels, kept finite signals
and shrank to its masked outputs within 1e-4.

timm needs torchvision, which does not import beside the CPU torch 2.13 wheel: run this in a
separate environment (``python -m venv /tmp/timm-venv`` then ``pip install torch==2.14.1
torchvision==0.29.1 timm`` and ``pip install -e .``; see docs/benchmarks.md). Nothing is
downloaded: every model is built from its definition.

    python benchmarks/timm_models.py [--models a,b] [--res 64] [--out FILE] [--update]

``--update`` replaces only the named models' rows of an existing ``--out`` (each new row
carries its own ``date``; the file's ``date`` stays that of the full sweep).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import counted_flops, machine_info, write_json

import fisherprune as fp

OUT = Path(__file__).resolve().parent / "results" / "timm_models.json"
TOLERANCE = 1e-9  # float64, relative to max(1, max |output|)
TRAIN_TOLERANCE = 1e-4  # float32, after training steps

#: one or more of every family timm ships that builds at a small size, CNNs and transformers
MODELS = [
    "resnet18",
    "resnet50d",
    "resnext26ts",
    "seresnext26d_32x4d",
    "efficientnet_b0",
    "efficientnetv2_rw_t",
    "mobilenetv3_small_100",
    "mobilenetv4_conv_small",
    "mobilenetv2_050",
    "mnasnet_small",
    "ghostnet_100",
    "ghostnetv2_100",
    "mixnet_s",
    "tinynet_e",
    "regnetx_002",
    "regnety_002",
    "rexnet_100",
    "densenet121",
    "dla34",
    "dpn48b",
    "hrnet_w18_small",
    "cspresnet50",
    "cspdarknet53",
    "res2net50_14w_8s",
    "resnest14d",
    "repvgg_a0",
    "mobileone_s0",
    "fastvit_t8",
    "ese_vovnet19b_dw",
    "nf_resnet26",
    "convnext_atto",
    "convnextv2_atto",
    "edgenext_xx_small",
    "poolformer_s12",
    "poolformerv2_s12",
    "convmixer_768_32",
    "vit_tiny_patch16_224",
    "deit_tiny_patch16_224",
    "deit_tiny_distilled_patch16_224",
    "swin_tiny_patch4_window7_224",
    "swinv2_cr_tiny_224",
    "levit_128s",
    "coat_lite_tiny",
    "coatnet_nano_rw_224",
    "maxvit_nano_rw_256",
    "efficientformer_l1",
    "efficientformerv2_s0",
    "mobilevit_xxs",
    "mobilevitv2_050",
    "pit_ti_224",
    "cait_xxs24_224",
    "xcit_nano_12_p16_224",
    "crossvit_tiny_240",
    "twins_pcpvt_small",
    "pvt_v2_b0",
    "tnt_s_patch16_224",
    "visformer_tiny",
    "gcvit_xxtiny",
    "eva02_tiny_patch14_224",
    "beit_base_patch16_224",
    "deit3_small_patch16_224",
    "vit_small_patch16_rope_224",
    "hgnetv2_b0",
    "inception_v3",
    "xception41",
    "nasnetalarge",
    "selecsls42b",
    "tresnet_m",
    "lcnet_050",
    "hardcorenas_a",
    "fbnetc_100",
    "rdnet_tiny",
    "starnet_s1",
    "repghostnet_050",
    "vovnet39a",
    "mambaout_femto",
    "focalnet_tiny_srf",
    "davit_tiny",
    "inception_next_atto",
    "sequencer2d_s",
    "gmlp_ti16_224",
    "resmlp_12_224",
    "mixer_s16_224",
    "halonet26t",
    "botnet26t_256",
    "lambda_resnet26t",
    "cs3darknet_s",
    "tiny_vit_5m_224",
    "efficientvit_b0",
    "efficientvit_m0",
    "fastvit_sa12",
    "repvit_m0_9",
    "hiera_tiny_224",
    "vitamin_small_224",
    "nextvit_small",
]

#: models whose code fixes the resolution (attention biases sized for it, a stem too deep
#: for 64 pixels): built and run at this size instead of --res
RESOLUTION = {
    "efficientformer_l1": 224,
    "crossvit_tiny_240": 240,
    "inception_v3": 160,
    "halonet26t": 256,
}


class _TimedOut(Exception):
    pass


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise _TimedOut


def build(name: str, res: int) -> torch.nn.Module:
    """The timm model ``name`` for 10 classes at ``res`` pixels, float64, eval mode, with
    random batch-norm running statistics (seed 0)."""
    import timm

    try:
        model = timm.create_model(name, pretrained=False, num_classes=10, img_size=res)
    except TypeError:  # a model without an img_size argument
        model = timm.create_model(name, pretrained=False, num_classes=10)
    model = model.double().eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            for stat, low in (("running_mean", -0.25), ("running_var", 0.75)):
                buf = getattr(module, stat, None)
                if isinstance(buf, torch.Tensor) and buf.is_floating_point():
                    buf.copy_(torch.rand(buf.shape, generator=gen, dtype=buf.dtype) * 0.5 + low)
    return model


def prune_at_random(masks: fp.AppliedMasks, seed: int = 0) -> None:
    """Zero 30-50% (at least one, at most all but one) of every mask's channels."""
    gen = torch.Generator().manual_seed(seed)
    for m in masks.values():
        n = m.num_channels
        k = min(n - 1, max(1, round((0.3 + 0.2 * float(torch.rand(1, generator=gen))) * n)))
        m.mask[torch.randperm(n, generator=gen)[:k]] = 0.0


def _first(out: Any) -> torch.Tensor:
    """A model's logits (a distilled DeiT returns two heads' in training mode)."""
    return out if isinstance(out, torch.Tensor) else out[0]


def train_check(name: str, res: int) -> dict[str, Any]:
    """The training path on a fresh float32 copy in training mode: ``PruningOptimizer``
    (every mask, ``prune_every=2``, no burn-in, target 70% of the FLOPs) for 4 steps of
    cross-entropy on 4 random images, then shrunk in eval mode: the channels it pruned,
    whether every signal stayed finite, and the shrunk model's largest difference from the
    masked one (relative to max(1, max |output|))."""
    model = build(name, res).float().train()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, res, res, generator=gen)
    y = torch.randint(0, 10, (4,), generator=gen)
    masks = fp.apply_masks(model, x[:1])
    popt = fp.PruningOptimizer(model, x[:1], lr=0.01, prune_every=2, burn_in=0, flops_target="70%")
    for _ in range(4):
        popt.minimize(torch.nn.functional.cross_entropy(_first(model(x)), y))
    finite = all(bool(torch.isfinite(m.signal).all()) for m in masks.values())
    model.eval()
    with torch.no_grad():
        expected = _first(model(x))
        got = _first(fp.shrink(model, x[:1])(x))
    return {
        "train_pruned": sum(int((m.mask == 0).sum()) for m in masks.values()),
        "train_signal_finite": finite,
        "train_max_diff": float((got - expected).abs().max())
        / max(1.0, float(expected.abs().max())),
    }


def measure(name: str, res: int) -> dict[str, Any]:
    """One row: see the module docstring."""
    row: dict[str, Any] = {"model": name, "res": res}
    stage = "build"
    try:
        model = build(name, res)
        gen = torch.Generator().manual_seed(1)
        one = torch.randn(1, 3, res, res, generator=gen, dtype=torch.float64)
        check = torch.randn(2, 3, res, res, generator=gen, dtype=torch.float64)
        stage = "dense cost"
        dense = counted_flops(model, check, autograd=True)
        row["dense_cost_exact"] = fp.computational_cost(model, check).total == dense
        stage = "apply_masks"
        start = time.perf_counter()
        masks = fp.apply_masks(model, one)
        row["apply_s"] = time.perf_counter() - start
        row["groups"] = len(masks)
        row["channels"] = sum(m.num_channels for m in masks.values())
        cm = fp.CostModel(model, one)
        row["prunable_share"] = 1.0 - cm.total(np.zeros(cm.graph.n_entries)) / cm.dense_total()
        stage = "shrink"
        prune_at_random(masks)
        with torch.no_grad():
            expected = model(check)
            small = fp.shrink(model)
            got = small(check)
        scale = max(1.0, float(expected.abs().max()))
        row["max_diff"] = float((got - expected).abs().max()) / scale
        stage = "cost"
        counted = counted_flops(small, check, autograd=True)
        row["cost_exact"] = fp.computational_cost(model, check).total == counted
        row["saved_share"] = 1.0 - counted / dense
        stage = "training"
        row.update(train_check(name, res))
        trained = (
            row["train_pruned"] > 0
            and row["train_signal_finite"]
            and row["train_max_diff"] <= TRAIN_TOLERANCE
        )
        exact = row["dense_cost_exact"] and row["cost_exact"] and row["max_diff"] <= TOLERANCE
        row["status"] = "pass" if exact and trained else "FAIL"
    except _TimedOut:
        row.update(status="timeout", stage=stage)
    except Exception as e:  # a row says what failed; the sweep goes on
        row.update(status="error", stage=stage, error=f"{type(e).__name__}: {e}"[:400])
        row["traceback"] = traceback.format_exc()[-2000:]
    return row


def _trained(r: dict[str, Any]) -> str:
    if "train_pruned" not in r:
        return "-"
    finite = "" if r["train_signal_finite"] else ", signal not finite"
    return f"{r['train_pruned']}, {r['train_max_diff']:.1e}{finite}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| model | res | status | groups | channels | prunable | saved (random 30-50%) | "
        "max rel. diff | dense cost == counted | cost == counted | apply s | "
        "trained: pruned, max rel. diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        status = r["status"] if r["status"] in ("pass", "FAIL") else (
            f"{r['status']} at {r.get('stage')}: {r.get('error', '')[:80]}"
        )  # fmt: skip
        diff = r.get("max_diff")
        lines.append(
            f"| {r['model']} | {r['res']} | {status} | {r.get('groups', '-')} | "
            f"{r.get('channels', '-')} | {_pct(r.get('prunable_share'))} | "
            f"{_pct(r.get('saved_share'))} | {'-' if diff is None else f'{diff:.1e}'} | "
            f"{r.get('dense_cost_exact', '-')} | {r.get('cost_exact', '-')} | "
            f"{r.get('apply_s', 0):.1f} | {_trained(r)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated timm names")
    parser.add_argument("--res", type=int, default=64, help="image size (default 64)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--update",
        action="store_true",
        help="replace only these models' rows in an existing --out, keep the others",
    )
    args = parser.parse_args(argv)
    try:
        import timm
    except ImportError:
        print("timm is not installed: see this script's docstring", file=sys.stderr)
        return 2
    if args.update and not args.out.is_file():
        parser.error(f"--update replaces rows of {args.out}, which does not exist")
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    import logging

    logging.getLogger("fisherprune").setLevel(logging.ERROR)
    signal.signal(signal.SIGALRM, _alarm)
    rows = []
    for name in args.models.split(","):
        signal.alarm(args.timeout)
        try:
            row = measure(name, RESOLUTION.get(name, args.res))
        finally:
            signal.alarm(0)
        row.update(  # (each row its own: --update mixes runs in one file)
            date=time.strftime("%Y-%m-%d %H:%M:%S"), torch=torch.__version__,
            timm=timm.__version__, fisherprune=fp.__version__,
        )  # fmt: skip
        rows.append(row)
        print(f"{name}: {row['status']} {row.get('stage', '')} {row.get('error', '')}"[:300])
    print(table(rows))
    ok = all(r["status"] == "pass" for r in rows)
    print(f"{sum(r['status'] == 'pass' for r in rows)} of {len(rows)} pass")
    record = {
        "torch": torch.__version__,
        "timm": timm.__version__,
        "fisherprune": fp.__version__,
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if args.update:
        record = json.loads(args.out.read_text())
        new = {r["model"]: r for r in rows}
        kept = [new.pop(r["model"], r) for r in record["rows"]]
        rows = kept + list(new.values())
    record.update(rows=rows, passed=sum(r["status"] == "pass" for r in rows))
    write_json(args.out, record)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
