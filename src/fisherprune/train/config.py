"""TrainConfig: every setting of ``fisherprune train``, validated, with both flag spellings.

Defaults suit small data on a CPU, not the seed's production runs: the seed
waited ``100,000`` steps before the first prune and pruned one channel every
5,000 steps with a signal EMA of 0.9999 (about 10,000 steps), sized for
streams of millions of records. On thousands of examples that would never
prune. Here the burn-in is a couple of epochs, one channel goes every 10 steps
and the EMA spans about 20 steps (0.95), which on digits or MNIST-5k still
averages over a few thousand examples per decision.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fisherprune.cost import CONVENTIONS, LatencySpec
from fisherprune.cost.latency import spec_for
from fisherprune.export.files import FORMATS
from fisherprune.pruner.optimizer import resolve_target
from fisherprune.settings import (
    check_decay,
    check_min_channels,
    check_optimizer_name,
    check_round_to,
    parse_flops_weight,
)
from fisherprune.signals.criteria import CRITERIA
from fisherprune.train.compiling import check_compile_settings

__all__ = ["ALIASES", "HELP", "TrainConfig"]


def _is_instance(value: Any, tp: Any) -> bool:
    """isinstance for the setting types used here: bool, int, float (ints allowed), str, lists."""
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_is_instance(v, item) for v in value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _canonical(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` keyed by field name (seed spellings, dots and dashes resolved), in order.

    Raises:
        ValueError: two keys spell the same setting (``pruning.iter`` and ``pruning_iter``).
    """
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for key, v in values.items():
        name = ALIASES.get(key, key.replace(".", "_").replace("-", "_"))
        if name in seen:
            raise ValueError(f"{seen[name]!r} and {key!r} both set {name}; keep one of them")
        seen[name] = key
        out[name] = v
    return out


# seed flag spellings (dotted and underscore) -> config field
ALIASES: dict[str, str] = {
    "pruning.iter": "pruning_iter",
    "pruning.burn_in": "pruning_burn_in",
    "pruning.flops_target": "pruning_flops_target",
    "pruning.decay": "pruning_decay",
    "pruning.flops_weight": "pruning_flops_weight",
    "pruning.min_channels": "pruning_min_channels",
    "pruning.convention": "pruning_convention",
    "pruning.score_convention": "pruning_score_convention",
    "pruning.latency_device": "pruning_latency_device",
    "pruning.latency_batch": "pruning_latency_batch",
    "pruning.latency_threads": "pruning_latency_threads",
    "pruning.latency_form": "pruning_latency_form",
    "pruning.latency_cache": "pruning_latency_cache",
    "pruning.round_to": "pruning_round_to",
    "pruning.uniform": "pruning_uniform",
    "pruning.criterion": "pruning_criterion",
    "train.batch_size": "batch_size",
    "train.steps": "steps",
    "train.epochs": "epochs",
    "distill.alpha": "distill_alpha",
    "distill.temperature": "distill_temperature",
    "eval.period": "eval_every",
    "eval.steps": "eval_every",
    "schedule.min_dense_steps": "min_dense_steps",
    "schedule.dense_check": "dense_check",
    "data.image_size": "image_size",
    "data.image_mode": "image_mode",
    "data.image_column": "image_column",
    "data.categorical": "categorical",
    "data.remap_labels": "remap_labels",
    "data.no_standardize": "no_standardize",
    "data.stream": "stream",
    "data.shuffle_buffer": "shuffle_buffer",
}


HELP: dict[str, str] = {
    "data": "data file (.csv, .csv.gz, .parquet, .npy, .npz), a folder with a sub-folder of "
    "images per class, or built-in: digits, mnist5k",
    "data_spec": "JSON data spec file (source, label, features, task, ...)",
    "label": "label column (tables) or array key (npz); default 'label' / 'y'",
    "features": "comma-separated feature columns; default all but the label",
    "labels": "label array file for .npy features",
    "task": "classification or regression",
    "eval_data": "separate evaluation file (else a split of --data)",
    "eval_fraction": "fraction held out for evaluation when no --eval_data",
    "image_shape": "reshape features to C,H,W, e.g. 1,28,28",
    "image_size": "resize images (folder per class, --image_column) to H,W (32,24) or square (32)",
    "image_mode": "images as L (grayscale), RGB, or auto (RGB if they have colour)",
    "image_column": "table column holding image bytes or image file paths",
    "categorical": "text feature columns: onehot (categories of the training rows) or refuse",
    "remap_labels": "map integer class labels' sorted distinct values to 0..K-1",
    "no_standardize": "do not standardise table features and regression targets",
    "stream": "read a table in batches: auto (files over 512 MiB), always or never",
    "shuffle_buffer": "rows shuffled together when streaming a table",
    "model": "mlp, cnn, resnet, densenet, lstm, gru, or package.module:function",
    "width": "width of a built-in model",
    "depth": "depth of a built-in model",
    "optimizer": "sgd (momentum, the seed's), adam or adamw",
    "learning_rate": "learning rate",
    "momentum": "SGD momentum",
    "weight_decay": "L2 weight decay; unset: chosen among 5e-4, 5e-3, 5e-2 by validation on "
    "held-out training rows when the run passes over its data more than 10 times, else 5e-4",
    "batch_size": "examples per step (per process under torchrun)",
    "steps": "hard cap on training steps (default: burn-in + pruning + fine-tuning)",
    "epochs": "dense epochs before the first prune, when --pruning.burn_in is not set",
    "min_dense_steps": "fewest dense steps before the first prune, when --pruning.burn_in is "
    "not set (the burn-in is the larger of this and --epochs epochs)",
    "dense_check": "when the dense model is no better than chance or the majority class (or "
    "than predicting the mean): stop (exit before pruning, with a checkpoint), warn (go on "
    "pruning) or off",
    "init_from": "start from trained weights: a state_dict file or a fisherprune checkpoint "
    "for --model; the dense phase then only gathers the pruning statistics (no training)",
    "fine_tune_steps": "training steps after the target is reached",
    "distill_alpha": "fine-tuning learns this much from the dense model's outputs (frozen at "
    "the end of the dense phase) and 1 - this from the labels; 0: labels only",
    "distill_temperature": "softmax temperature of the distillation (classification)",
    "fine_tune_masked": "fine-tune the masked model: every step then pays the dense model's "
    "cost and the masks' (default: the model is shrunk in place when pruning ends, its "
    "optimizer state carried over, and fine-tunes at its smaller cost)",
    "eval_every": "steps between evaluations",
    "eval_rows": "eval rows read by each evaluation during training (the same first rows each "
    "time; the dense and final evaluations read them all); 0: all",
    "pruning_iter": "prune one channel every this many steps",
    "pruning_burn_in": "steps before the first prune (default: --epochs epochs)",
    "pruning_flops_target": "stop at this cost per example: absolute, 0.25 or 25%% of the start",
    "pruning_decay": "EMA factor of the pruning signal, in [0, 1)",
    "pruning_flops_weight": "auto (signal/cost), a number w (signal - w*cost), or 0",
    "pruning_min_channels": "fewest channels any group keeps: a count, or a fraction such as 0.1",
    "pruning_round_to": "every group keeps a multiple of this many weight rows (a head counts "
    "head_dim; 8: CPU-friendly; default 1, or the latency table's step, 8, with latency)",
    "pruning_uniform": "repeated blocks keep the same widths (a Hugging Face config stays valid)",
    "pruning_criterion": "how channels are ranked: fisher (the seed's), taylor, l1 or random",
    "pruning_convention": "cost of the target: flops, macs, twml, memory, params or latency "
    "(timed on --pruning.latency_device; the target may then be a time such as 12ms)",
    "pruning_score_convention": "cost the signal is weighed against (default: the target's); "
    "memory = Group Fisher Pruning's memory-normalised selection",
    "pruning_latency_device": "where the latency convention times the model: cpu or cuda[:N]",
    "pruning_latency_batch": "examples per forward pass the latency convention times",
    "pruning_latency_threads": "CPU threads while timing (default: as set)",
    "pruning_latency_form": "serving form the whole model is timed in: eager, torchscript, "
    "aoti (CPU), compile, cuda_graphs (GPU); operators are timed in eager",
    "pruning_latency_cache": "folder or .json file of latency tables (default "
    "~/.cache/fisherprune/latency)",
    "save_dir": "directory for checkpoints, metrics, report",
    "export_dir": "directory for exported models (default SAVE_DIR/export)",
    "checkpoint_every": "steps between checkpoints",
    "keep_checkpoints": "how many checkpoints to keep",
    "resume": "continue from the newest checkpoint in SAVE_DIR",
    "overwrite": "start afresh in a SAVE_DIR holding another run's checkpoints (deletes them)",
    "dist_timeout": "under torchrun: seconds to wait for another rank before ending the job",
    "export_dense": "write the dense model, as trained when the dense phase ends, to "
    "EXPORT_DIR/dense.pt, the file fisherprune prune --weights reads (on by default: no later "
    "file holds it, every checkpoint after that step is pruned, and it costs one file the "
    "size of the model; --no-export_dense leaves it out)",
    "export_formats": "comma-separated: state_dict, torchscript, onnx, aoti (a .pt2 "
    "AOTInductor package: needs a C++ compiler, adds 15-60 s)",
    "seed": "random seed (data order, initialisation)",
    "threads": "torch CPU threads",
    "progress": "auto, bar, plain or none",
    "device": "auto, cpu, cuda, cuda:N or mps",
    "precision": "fp32, bf16 or fp16 (autocast; fp16 needs a GPU); pruning statistics stay fp32",
    "log": "comma-separated extra metric logs besides metrics.jsonl: tensorboard",
    "compile": "run the training steps through torch.compile, masks and their signal inside "
    "the graph (evaluation and export run eager)",
    "compile_backend": "torch.compile backend: inductor, or aot_eager (builds no kernels, needs "
    "no C++ compiler)",
    "compile_mode": "torch.compile mode: default or max-autotune-no-cudagraphs",
}


@dataclass
class TrainConfig:
    """Settings of a training-with-pruning run. Every field is also a CLI flag.

    Data:
        data: a file (.csv, .csv.gz, .parquet, .npy, .npz) or built-in name (digits, mnist5k).
        data_spec: a JSON data spec file (overrides the data fields below when given).
        label, features, labels, task, eval_data, eval_fraction, image_shape: see DataSpec.
        image_size, image_mode, image_column, categorical, remap_labels, stream,
            shuffle_buffer: see DataSpec; no_standardize: DataSpec's ``standardize=False``.
    Model:
        model: mlp, cnn, resnet, densenet, lstm, gru, or ``package.module:function``.
        width, depth: size of a built-in model.
    Optimisation:
        optimizer: sgd (momentum SGD, the seed's) or adam / adamw.
        learning_rate, momentum, batch_size.
        weight_decay: L2 decay of the optimizer; None (the default) chooses it: a run that
            passes over its training rows more than 10 times picks 5e-4, 5e-3 or 5e-2 by
            validation on a slice of the training rows (``fisherprune.train.regularize``),
            others use 5e-4.
        steps: hard cap on training steps (None: burn-in + pruning + fine-tuning).
        epochs: dense epochs before pruning starts (the burn-in), when pruning_burn_in is None.
        min_dense_steps: fewest dense steps when pruning_burn_in is None (the burn-in is the
            larger of this and ``epochs`` epochs; 3 epochs of a small table are a few steps).
        dense_check: what happens when the dense model learned nothing (eval accuracy within
            3 points of chance or of the majority class, or MSE within 3% of the eval labels'
            variance): "stop" (the default: a checkpoint, then a ValueError before the first
            prune, so a model that learned nothing is not pruned and exported; resume with
            other settings), "warn" (a warning, and ``dense_learned: false`` in
            ``result.json``) or "off".
        init_from: a state_dict or fisherprune checkpoint to start from; the dense phase then
            trains nothing and only gathers the pruning statistics.
        fine_tune_steps: steps after the target is reached.
        fine_tune_masked: fine-tune the masked model (every step pays the dense model's cost
            and the masks'); False (the default): once pruning finishes, the model is shrunk in
            place with its optimizer state carried over (``fisherprune.shrink(...,
            optimizer=)``) and the fine-tuning, its checkpoints and the export use the smaller
            model.
        eval_every: steps between evaluations.
        eval_rows: rows of the eval split each evaluation during training reads (the first
            ones, the same each time: a streamed eval split is not read whole every
            ``eval_every`` steps); 0 reads them all. The dense and final points read all.
    Pruning (the seed's flags, plus ours):
        pruning_iter: prune one channel every this many steps.
        pruning_burn_in: steps before the first prune (None: ``epochs`` epochs).
        pruning_flops_target: absolute cost, fraction in (0, 1) or percentage string.
        pruning_decay: signal EMA factor in [0, 1).
        pruning_flops_weight: "auto", or a number (0 = plain Fisher).
        pruning_min_channels: fewest channels per group.
        pruning_round_to: every group keeps a multiple of this many weight rows (a head counts
            its ``head_dim``; 1: any count; None: 1, or 8 with a ``latency`` convention, the
            step its table is timed in); see ``PruningOptimizer``.
        pruning_uniform: the copies of a mask in repeated blocks keep the same widths (see
            ``PruningOptimizer``'s ``uniform``); a resumed run must keep it.
        pruning_criterion: how channels are ranked, a name in ``fisherprune.criteria.CRITERIA``
            (fisher, taylor, l1, random); a resumed run must keep it.
        pruning_convention: cost convention (flops, macs, twml, memory, params, latency) of the
            target.
        pruning_score_convention: cost convention the signal is weighed against when choosing
            a channel (None: ``pruning_convention``); see ``PruningOptimizer``.
        pruning_latency_device, pruning_latency_batch, pruning_latency_threads,
            pruning_latency_form, pruning_latency_cache: the ``LatencySpec`` of the ``latency``
            convention (device, batch, CPU threads, serving form, table cache), read only
            when a convention is ``latency``.
    Files:
        save_dir: where checkpoints, metrics, report go; export_dir: exported models
        (default ``save_dir/export``); checkpoint_every, keep_checkpoints; resume (a resumed
        run may change only ``resume_check.ALLOWED_CHANGES``); overwrite (start afresh in a
        save_dir holding another run's checkpoints, deleting them);
        export_dense: write the dense model at the end of the dense phase to
            ``export_dir/dense.pt`` (``DENSE_FILE``; the format ``fisherprune prune
            --weights`` reads);
        export_formats: any of ``fisherprune.export.FORMATS`` (state_dict, torchscript, onnx,
            aoti).
    Run:
        seed, threads, progress ("auto", "bar", "plain", "none"); dist_timeout: seconds a rank
        waits for the others under torchrun before the job ends with an error.
        device: "auto", "cpu", "cuda", "cuda:N" or "mps"; precision: "fp32", "bf16", "fp16";
        log: metric logs besides ``metrics.jsonl`` (``"tensorboard"``).
        compile: run the training steps' forward and backward through ``torch.compile`` with
            ``compile_backend`` and ``compile_mode`` (``fisherprune.train.compiling``); a
            resumed run must keep them.
    """

    data: str = "digits"
    data_spec: str | None = None
    label: str | None = None
    features: list[str] | None = None
    labels: str | None = None
    task: str = "classification"
    eval_data: str | None = None
    eval_fraction: float = 0.2
    image_shape: list[int] | None = None
    image_size: list[int] | None = None
    image_mode: str = "auto"
    image_column: str | None = None
    categorical: str = "onehot"
    remap_labels: bool = False
    no_standardize: bool = False
    stream: str = "auto"
    shuffle_buffer: int = 65536

    model: str = "cnn"
    width: int | None = None
    depth: int | None = None

    optimizer: str = "sgd"
    learning_rate: float = 0.05
    momentum: float = 0.9
    weight_decay: float | None = None
    batch_size: int = 64
    steps: int | None = None
    epochs: float = 3.0
    min_dense_steps: int = 300
    dense_check: str = "stop"
    init_from: str | None = None
    fine_tune_steps: int = 200
    distill_alpha: float = 0.0
    distill_temperature: float = 2.0
    fine_tune_masked: bool = False
    eval_every: int = 100
    eval_rows: int = 10000

    pruning_iter: int = 10
    pruning_burn_in: int | None = None
    pruning_flops_target: str = "50%"
    pruning_decay: float = 0.95
    pruning_flops_weight: str = "auto"
    pruning_min_channels: int | float = 1
    pruning_round_to: int | None = None
    pruning_uniform: bool = False
    pruning_criterion: str = "fisher"
    pruning_convention: str = "flops"
    pruning_score_convention: str | None = None
    pruning_latency_device: str = "cpu"
    pruning_latency_batch: int = 1
    pruning_latency_threads: int | None = None
    pruning_latency_form: str = "eager"
    pruning_latency_cache: str | None = None

    save_dir: str = "runs/fisherprune"
    export_dir: str | None = None
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    resume: bool = False
    overwrite: bool = False
    export_dense: bool = True
    export_formats: list[str] = field(default_factory=lambda: ["state_dict", "torchscript", "onnx"])
    seed: int = 0
    threads: int | None = None
    progress: str = "auto"
    device: str = "auto"
    precision: str = "fp32"
    log: list[str] = field(default_factory=list)
    dist_timeout: float = 120.0
    compile: bool = False
    compile_backend: str = "inductor"
    compile_mode: str = "default"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first bad setting."""
        self._check_types()
        pos_int = [
            "batch_size",
            "pruning_iter",
            "eval_every",
            "checkpoint_every",
            "keep_checkpoints",
        ]
        for name in pos_int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.width is not None and not isinstance(self.width, bool) and self.width < 1:
            raise ValueError(
                f"width must be an integer >= 1 (channels per layer), got {self.width}"
            )
        if self.resume and self.overwrite:
            raise ValueError("resume and overwrite exclude each other: give one of them")
        try:  # refused now, not when the pruning phase starts
            resolve_target(self.pruning_flops_target, 1.0, self.pruning_convention)
        except ValueError as e:
            raise ValueError(f"pruning.{e}") from None
        for name in (
            "steps",
            "pruning_burn_in",
            "width",
            "depth",
            "threads",
            "min_dense_steps",
            "eval_rows",
        ):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if not isinstance(self.fine_tune_steps, int) or self.fine_tune_steps < 0:
            raise ValueError(
                f"fine_tune_steps must be an integer >= 0, got {self.fine_tune_steps!r}"
            )
        wd = self.weight_decay
        if wd is not None and (not math.isfinite(wd) or wd < 0):
            raise ValueError(f"weight_decay must be a number >= 0, got {wd!r}")
        for name in ("learning_rate", "epochs", "dist_timeout"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        check_decay(self.pruning_decay, "pruning_decay")
        if not 0.0 <= self.distill_alpha <= 1.0:
            raise ValueError(f"distill_alpha must lie in [0, 1], got {self.distill_alpha!r}")
        if not self.distill_temperature > 0:
            raise ValueError(f"distill_temperature must be > 0, got {self.distill_temperature!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        check_optimizer_name(self.optimizer)
        if self.dense_check not in ("warn", "stop", "off"):
            raise ValueError(f"dense_check must be warn, stop or off, got {self.dense_check!r}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if self.progress not in ("auto", "bar", "plain", "none"):
            raise ValueError(f"progress must be auto, bar, plain or none, got {self.progress!r}")
        bad = [f for f in self.export_formats if f not in FORMATS]
        if bad:
            raise ValueError(f"unknown export format(s) {bad}; use {', '.join(FORMATS)}")
        check_min_channels(self.pruning_min_channels, "pruning_min_channels")
        check_round_to(self.pruning_round_to, "pruning_round_to")
        parse_flops_weight(self.pruning_flops_weight, "pruning_flops_weight")
        if self.pruning_criterion not in CRITERIA:
            raise ValueError(
                f"pruning_criterion must be one of {', '.join(CRITERIA)}, "
                f"got {self.pruning_criterion!r}"
            )
        for name in ("pruning_convention", "pruning_score_convention"):
            v = getattr(self, name)
            if v is not None and v not in CONVENTIONS:
                raise ValueError(f"{name} must be one of {', '.join(CONVENTIONS)}, got {v!r}")
        self.latency_spec()  # a bad device, batch or thread count is refused now
        if self.compile:
            check_compile_settings(self.compile_backend, self.compile_mode)

    def latency_spec(self) -> LatencySpec | None:
        """The ``LatencySpec`` of the run's ``latency`` convention, or None when neither
        convention is ``latency``.

        Raises:
            ValueError: a bad latency field (named ``pruning_latency_...``).
        """
        return spec_for(
            (self.pruning_convention, self.pruning_score_convention),
            "pruning_latency",
            device=self.pruning_latency_device,
            batch=self.pruning_latency_batch,
            threads=self.pruning_latency_threads,
            form=self.pruning_latency_form,
            cache=self.pruning_latency_cache,
            step=self.pruning_round_to,
        )

    def _check_types(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            tp = hints[f.name]
            union = typing.get_origin(tp) in (typing.Union, types.UnionType)
            allowed = [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]
            if v is None and union and type(None) in typing.get_args(tp):
                continue
            if not any(_is_instance(v, a) for a in allowed):
                want = " or ".join(getattr(a, "__name__", str(a)) for a in allowed)
                raise ValueError(f"{f.name} must be {want}, got {v!r}")

    # ------------------------------------------------------------- building
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Build from a dict; seed spellings are accepted, unknown keys are errors."""
        known = set(cls.field_names())
        out = _canonical(values)
        for key, name in zip(values, out, strict=True):
            if name not in known:
                raise ValueError(
                    f"unknown setting {key!r}; known settings: {', '.join(sorted(known))}"
                )
        return cls(**out)

    @classmethod
    def from_file(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
        """Read a JSON config file, then apply ``overrides`` (command-line values win)."""
        p = Path(path)
        if p.is_dir():
            raise ValueError(f"config file {p} is a directory; give the JSON file in it")
        if not p.is_file():
            raise FileNotFoundError(f"config file {p} does not exist")
        try:
            values = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {p} is not valid JSON: {e}") from None
        if not isinstance(values, dict):
            raise ValueError(f"config file {p} must hold a JSON object of settings")
        try:
            values = _canonical(values)
        except ValueError as e:
            raise ValueError(f"config file {p}: {e}") from None
        values.update(overrides or {})
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def data_options(self) -> dict[str, Any]:
        """The image, encoding and streaming options, as ``DataSpec`` keyword arguments."""
        return {
            "image_size": tuple(self.image_size) if self.image_size else None,
            "image_mode": self.image_mode,
            "image_column": self.image_column,
            "categorical": self.categorical,
            "remap_labels": self.remap_labels,
            "standardize": not self.no_standardize,
            "stream": self.stream,
            "shuffle_buffer": self.shuffle_buffer,
        }
