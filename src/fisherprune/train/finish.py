"""The end of a ``fisherprune train`` run: time the shrunk model against the dense one, export
it, and write the report, ``result.json`` and the summary.

It takes what the training loop measured (``FinishedRun``) and where the run's output goes
(``RunOutput``); it knows nothing of the trainer, so imports flow trainer -> finish -> report.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from fisherprune._errors import first_line
from fisherprune.cost.conventions import cost_unit
from fisherprune.cost.latency import prediction_check, prediction_text
from fisherprune.export import export_model
from fisherprune.export.files import default_file_name
from fisherprune.export.latency import compare_latency, frozen_for_serving
from fisherprune.export.manifest import ExportSet
from fisherprune.export.storage import atomic_write_bytes
from fisherprune.pruner import PruningOptimizer
from fisherprune.train.checkpoint import CheckpointManager
from fisherprune.train.config import TrainConfig
from fisherprune.train.progress import Progress
from fisherprune.train.report import write_report
from fisherprune.train.result import TrainResult, latency_fields
from fisherprune.train.shrunk import Pruned

__all__ = ["FinishedRun", "RunOutput", "finish_run"]

_BATCH_SIZES = (1, 64)  # the batch sizes the latency is timed at


@dataclass(frozen=True)
class FinishedRun:
    """What the training loop hands over once it has stopped and evaluated the final model.

    Costs are per example in the run's convention; metrics are on the eval split.
    """

    popt: PruningOptimizer  # its masks give the channels kept, its cost model the convention
    pruned: Pruned  # the trained model shrunk, its plan and the dense architecture (CPU)
    example: Tensor  # one input, (1, ...), to trace and export the model with
    samples: Tensor  # training inputs, (N, ...): the first 1 and 64 time the latency
    metrics: list[dict[str, Any]]  # the run's metrics log (metrics.jsonl), for the plots
    metric_name: str  # "accuracy" or "mse"
    dense_metric: float
    dense_cost: float
    final_metric: float
    final_cost: float
    steps: int
    prunes: int  # channels removed
    dense_learned: bool | None = None  # None: not checked
    warnings: tuple[str, ...] = ()  # printed at the end and kept in result.json


@dataclass(frozen=True)
class RunOutput:
    """Where a run's output goes."""

    save_dir: Path  # report.md, plots, result.json; checkpoints/ and metrics.jsonl are here
    export_dir: Path  # plan.json, the exported model files, data.json and their manifest
    progress: Progress  # the lines the user reads
    write: bool = True  # False on ranks other than 0 under torchrun: measure, write nothing
    #: the run's export set in ``export_dir``, begun when the run started (``dense.pt`` may be
    #: in it); None: begin one at the export
    exports: ExportSet | None = None
    #: written to ``export_dir/data.json``: what the exported model takes and returns
    data_card: dict[str, Any] | None = None


def finish_run(config: TrainConfig, run: FinishedRun, out: RunOutput) -> TrainResult:
    """Time the shrunk model ``run.pruned.small`` against the dense one and, when ``out.write``,
    export it and write the report and ``result.json``, then print the summary.

    Changes nothing in ``run``. Writes into
    ``out.export_dir`` (``plan.json``, one file per format of ``config.export_formats`` that
    could be exported and ``data.json``, then the manifest marking the run's set complete)
    and ``out.save_dir`` (``report.md``, plots when matplotlib is installed, ``result.json``);
    a format that cannot be exported is skipped with a line saying why.

    Returns:
        The result; ``files`` names every file written (empty when not ``out.write``).

    Raises:
        OSError: a file could not be written (the run must not look complete); when it is an
            export's, a note on it names the commands that export from the run's last
            checkpoint.
        Exception: the ``state_dict`` export failed.
    """
    dense_model, small = run.pruned.dense, run.pruned.small
    result = TrainResult(
        dense_metric=run.dense_metric,
        final_metric=run.final_metric,
        metric_name=run.metric_name,
        dense_cost=run.dense_cost,
        final_cost=run.final_cost,
        dense_params=sum(p.numel() for p in dense_model.parameters()),
        final_params=sum(p.numel() for p in small.parameters()),
        latency=_latency(dense_model, small, run.samples, out.progress)
        | _predicted_latency(run, dense_model, small),
        steps=run.steps,
        prunes=run.prunes,
        dense_learned=run.dense_learned,
        warnings=list(run.warnings),
    )
    if not out.write:
        return result
    try:
        result.files.update(_export(config, run, out))
    except OSError as e:
        _note_export_commands(e, config, out)
        raise
    result.files.update(write_report(out.save_dir, config, run.metrics, run.popt, result))
    result_path = out.save_dir / "result.json"
    result.files["result"] = str(result_path)
    result_path.write_text(json.dumps(result.__dict__, indent=1))
    for line in _summary(config, result, out.save_dir):
        out.progress.line(line)
    return result


def _latency(
    dense: nn.Module, small: nn.Module, samples: Tensor, progress: Progress
) -> dict[str, Any]:
    """CPU latency of the dense and the pruned model at batch 1 and 64, timed side by side in
    rounds (``compare_latency``): as eager modules (``dense_b1_ms``, ...) and as served, frozen
    TorchScript in channels-last layout for images (``served_dense_b1_ms``, ...; left out,
    with a line saying why, when the model cannot be traced); ``latency_fields`` lists the
    keys. ``threads``, ``allocator``, ``device``, ``load``, ``cpus`` and ``conditions`` (their
    words) of the first timing come first."""
    latency: dict[str, Any] = {}
    serve = True
    for bs in _BATCH_SIZES:
        x = samples[:bs]
        forms: dict[str, tuple[dict[str, Any], Any]] = {"": ({"dense": dense, "pruned": small}, x)}
        if serve:
            try:
                (fd, args), (fs, _) = (frozen_for_serving(m, x) for m in (dense, small))
                forms["served_"] = ({"dense": fd, "pruned": fs}, args)
            except Exception as e:  # any tracing failure; the eager figures still stand
                progress.line(f"skipped the latency as served: {first_line(e)}")
                serve = False
        for prefix, (models, inputs) in forms.items():
            timed = compare_latency(models, inputs)
            for key in ("threads", "allocator", "device", "load", "cpus"):
                latency.setdefault(key, getattr(timed, key))
            latency.setdefault("conditions", timed.conditions())
            latency.update(latency_fields(timed, prefix, bs))
    return latency


def _export(config: TrainConfig, run: FinishedRun, out: RunOutput) -> dict[str, str]:
    """Write ``plan.json``, the model in each of ``config.export_formats`` and ``data.json``
    (given ``out.data_card``) into ``out.export_dir`` (created if missing) as files of the
    run's export set, then mark the set complete (``ExportSet``: its manifest, written last,
    names each file with its SHA-256). Returns the files written, kind -> path, the manifest
    included. A failure leaves the set marked incomplete."""
    exports = out.exports or ExportSet.begin(out.export_dir, str(out.save_dir.resolve()))
    files: dict[str, str] = {}
    plan, small = run.pruned.plan, run.pruned.small
    plan_path = exports.write("plan.json", "the kept channels of each module", plan.save)
    files["plan"] = str(plan_path)
    for fmt in config.export_formats:
        try:
            path = exports.write(
                default_file_name(fmt),
                f"the pruned model, {fmt} export",
                partial(export_model, small, example_inputs=run.example, format=fmt, plan=plan),
            )
            files[fmt] = str(path)
        except ImportError as e:
            out.progress.line(f"skipped {fmt} export: {e}")
        except OSError:
            raise  # a failed write: the run must not look complete
        except Exception as e:
            if fmt == "state_dict":
                raise
            # the model cannot be traced: the state_dict export and the report still stand
            out.progress.line(f"skipped {fmt} export: {first_line(e)}")
    if out.data_card is not None:
        card = json.dumps(out.data_card, indent=2).encode()
        path = exports.write(
            "data.json",
            "what the exported model takes and returns (inputs, outputs, labels, scaling)",
            partial(atomic_write_bytes, data=card),
        )
        files["data"] = str(path)
    exports.complete()
    files["manifest"] = str(exports.path)
    return files


def _note_export_commands(e: OSError, config: TrainConfig, out: RunOutput) -> None:
    """Add to ``e``, the failure of the run's export, a note naming the ``fisherprune export``
    commands that write each of ``config.export_formats`` from the run's last checkpoint
    (saved before the export, so kept); nothing when there is no checkpoint."""
    checkpoint = CheckpointManager(out.save_dir / "checkpoints", config.keep_checkpoints).latest()
    if checkpoint is None:
        return
    ckpt = ["fisherprune", "export", "--checkpoint", str(checkpoint)]
    commands = "; ".join(
        shlex.join([*ckpt, "--format", fmt, "--out", str(out.export_dir / default_file_name(fmt))])
        for fmt in config.export_formats
    )
    note = f"the run's export is lost, but its last checkpoint is kept; export with: {commands}"
    e.__notes__ = [*getattr(e, "__notes__", ()), note]  # BaseException.add_note from 3.11


def _predicted_latency(run: FinishedRun, dense: nn.Module, small: nn.Module) -> dict[str, Any]:
    """With the ``latency`` convention: ``{"prediction": ..., "line": ...}``, the table's
    latency of the dense and the pruned model beside both timed whole in the run's
    ``LatencySpec`` (``prediction_check``), and the slope and offset (microseconds) that priced
    the operators (``fit_latency_line``; offset 0: in proportion; the curve's widest segment
    when there is one) and the curve's knots (operators, price; microseconds) or None; else
    nothing."""
    cm = run.popt.cost_model
    if cm.latency is None:
        return {}
    check = prediction_check(run.popt.start_cost, cm.total(), dense, small, run.example, cm.latency)
    return {
        "prediction": check,
        "line": {
            "slope": cm.latency_scale,
            "offset_us": cm.latency_offset,
            "curve_us": None if cm.latency_curve is None else cm.latency_curve.as_list(),
        },
    }


def _summary(config: TrainConfig, r: TrainResult, save_dir: Path) -> list[str]:
    """The lines that end a run: dense against pruned, the latency, and the files written."""
    conv = config.pruning_convention
    lat = r.latency
    lines = [
        "",
        f"dense:  {r.metric_name} {r.dense_metric:.4f}, {r.dense_cost:,.0f} {cost_unit(conv)}, "
        f"{r.dense_params:,} parameters",
        f"pruned: {r.metric_name} {r.final_metric:.4f}, {r.final_cost:,.0f} {cost_unit(conv)} "
        f"({r.final_cost / r.dense_cost:.1%}), {r.final_params:,} parameters "
        f"({r.final_params / r.dense_params:.1%}); {r.prunes} channels removed in "
        f"{r.steps} steps",
        f"latency ({lat['device'].upper()}, {lat['conditions']}; median ±half IQR of "
        f"{_rounds_text(lat)} side-by-side rounds): {_latency_text(r, '')}",
    ]
    if "served_speedup_b64" in lat:
        lines.append(
            "latency as served (frozen TorchScript, channels-last for images): "
            + _latency_text(r, "served_")
        )
    if "prediction" in lat:
        lines.append(prediction_text(lat["prediction"]))
    lines += [f"WARNING: {w}" for w in r.warnings]
    lines.append("files:")
    lines += [f"  {k}: {v}" for k, v in r.files.items()]
    lines.append(f"  checkpoints: {save_dir / 'checkpoints'}")
    lines.append(f"  metrics: {save_dir / 'metrics.jsonl'}")
    return lines


def _rounds_text(latency: dict[str, Any]) -> str:
    """``9``, or ``5-9`` when the time budget cut some timings short."""
    counts = [
        len(v["dense"]) for k, v in latency.items() if k.startswith(("blocks_", "served_blocks_"))
    ]
    low, high = min(counts), max(counts)
    return f"{low}" if low == high else f"{low}-{high}"


def _latency_text(r: TrainResult, prefix: str) -> str:
    """``batch 1 a ms ±x% -> b ms ±y%, s x (IQR ...); batch 64 ...``, or ``..., no
    resolvable speed-up: ...`` for a batch size whose rounds disagree on the faster model."""
    parts = []
    for bs in _BATCH_SIZES:
        cells = r.latency_cells(prefix, bs)
        if cells is not None:
            parts.append(f"batch {bs} {cells[0]} -> {cells[1]}, {cells[2]}")
    return "; ".join(parts)
