"""PruningTrainer: data on disk -> trained, pruned, fine-tuned, exported model (the seed's
PruningDataRecordTrainer, with the export it left as a TODO)."""

from __future__ import annotations

import logging
import os
import random
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from fisherprune.cost.conventions import cost_unit
from fisherprune.export import export_model
from fisherprune.export.manifest import ExportSet
from fisherprune.graph import apply_masks
from fisherprune.masks import find_masks
from fisherprune.masks.ddp_sync import BroadcastExclusion
from fisherprune.modes import eval_mode
from fisherprune.pruner import PruningOptimizer
from fisherprune.train.checkpoint import CheckpointManager, DamagedCheckpointError, rng_state
from fisherprune.train.compiling import check_compiler, compiled
from fisherprune.train.config import TrainConfig
from fisherprune.train.data import Dataset, DataSpec, StreamingDataset, data_card, load_data
from fisherprune.train.devices import Precision, process_group_backend, resolve_device
from fisherprune.train.finish import RunOutput
from fisherprune.train.interrupts import StopGuard, init_distributed, loss_read_every
from fisherprune.train.lock import RunLock
from fisherprune.train.logging_sinks import open_sinks
from fisherprune.train.models import build_model
from fisherprune.train.phases import (
    Loop,
    dense_phase,
    fine_tune_phase,
    finish_phase,
    pruning_phase,
    restore_shrunk,
    restore_teacher,
)
from fisherprune.train.preflight import preflight_lines
from fisherprune.train.pretrained import load_pretrained
from fisherprune.train.progress import Progress
from fisherprune.train.regularize import choose_weight_decay
from fisherprune.train.result import TrainResult
from fisherprune.train.resume_check import data_fingerprint, resume_changes
from fisherprune.train.rundir import claim_save_dir
from fisherprune.train.scaling import with_scaling
from fisherprune.train.schedule import (
    DenseCheck,
    build_optimizer,
    burn_in_steps,
    check_dense,
    step_cap,
)
from fisherprune.train.state import MetricsLog, RunState, resume_state

__all__ = ["DENSE_FILE", "PruningTrainer", "TrainResult"]

#: the dense model's file in the export directory (``export_dense``)
DENSE_FILE = "dense.pt"

log = logging.getLogger("fisherprune")


def _dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class PruningTrainer:
    """Train with ``PruningOptimizer``, prune to the target, fine-tune, evaluate and export.

    Args:
        config: the run's settings.
        model: optional model instead of ``config.model`` (masks are applied if it has none).
        data: optional ``Dataset`` instead of reading ``config.data``.

    ``config.device`` places the model, its masks and every batch (``auto``: a GPU when there
    is one); ``config.precision`` runs forward passes under ``torch.autocast``. Under
    ``torchrun`` (WORLD_SIZE > 1) it joins the process group (NCCL on CUDA, gloo otherwise),
    trains with DistributedDataParallel, and only rank 0 writes files; Fisher statistics are
    all-reduced so that every rank prunes the same channels. The run's phases are in
    ``fisherprune.train.phases``; how long each lasts, in ``fisherprune.train.schedule``.
    """

    def __init__(
        self,
        config: TrainConfig,
        model: nn.Module | None = None,
        data: Dataset | StreamingDataset | None = None,
    ) -> None:
        self.config = config
        self._model = model
        self._data = data

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0")))
        self.precision = Precision(cfg.precision, self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            init_distributed(cfg.dist_timeout, process_group_backend(self.device))
        self.rank, self.world = _dist_info()
        if cfg.compile:  # a backend that cannot build kernels here is refused before training
            check_compiler(cfg.compile_backend, cfg.compile_mode, self.device)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.save_dir = Path(cfg.save_dir)
        self.export_dir = Path(cfg.export_dir) if cfg.export_dir else self.save_dir / "export"
        self.progress = Progress(None, cfg.progress, enabled=self.rank == 0)

    def _load(self) -> None:
        cfg = self.config
        if self._data is None:
            if cfg.data_spec:
                spec = DataSpec.from_file(cfg.data_spec)
            else:
                spec = DataSpec(
                    source=cfg.data,
                    label=cfg.label,
                    features=cfg.features,
                    labels=cfg.labels,
                    task=cfg.task,
                    eval_source=cfg.eval_data,
                    eval_fraction=cfg.eval_fraction,
                    image_shape=tuple(cfg.image_shape) if cfg.image_shape else None,
                    seed=cfg.seed,
                    **cfg.data_options(),
                )
            self._data = load_data(spec)
        self.data = self._data
        self.classify = self.data.num_classes is not None
        outputs = self.data.num_outputs
        self._outputs = outputs
        if self._model is None:
            name = cfg.model
            if name in ("cnn", "resnet", "densenet") and len(self.data.input_shape) != 3:
                raise ValueError(
                    f"--model {name} needs image data; {self.data.source} has features of shape "
                    f"{self.data.input_shape} (use --model mlp, or --image_shape C,H,W)"
                )
            built = build_model(name, self.data.input_shape, outputs, cfg.width, cfg.depth)
            self._model = with_scaling(built, self.data.scaling)
        self.model = self._model
        example = self.data.example()
        self.masks = find_masks(self.model) or apply_masks(self.model, example)
        for s in getattr(self.masks, "skipped", []):
            log.info("not masked: %s", s)
        if cfg.init_from:
            load_pretrained(self.model, dict(self.masks), cfg.init_from)
        self.model.to(self.device)
        self.example = example.to(self.device)

    def _optimizer(self) -> PruningOptimizer:
        cfg = self.config
        n = self.data.num_train
        self.global_batch = min(cfg.batch_size * self.world, n)
        self.batches_per_epoch = max(1, n // self.global_batch)
        self.burn_in = burn_in_steps(cfg, self.batches_per_epoch)
        cap = step_cap(cfg, self.burn_in, sum(m.num_channels for m in self.masks.values()))
        self.weight_decay = choose_weight_decay(
            cfg,
            self.data,
            self.model,
            steps=cap,
            trial_steps=min(self.burn_in, cap),
            batch_size=self.global_batch,
            loss=self._loss,
            precision=self.precision,
            device=self.device,
        )
        return build_optimizer(
            cfg,
            self.model,
            self.example,
            self.burn_in,
            self.weight_decay.value,
            self._saved_calibration(),
        )

    def _saved_calibration(self) -> dict[str, Any] | None:
        """With ``--resume`` and the ``latency`` convention: how the newest checkpoint that
        loads priced the operators (``PruningOptimizer.latency_calibration``), so that the
        resumed run does not time the model whole again and prunes as the first run would;
        None otherwise, with a line when that checkpoint was written before it was kept (the
        model is then timed afresh)."""
        cfg = self.config
        if not cfg.resume or cfg.latency_spec() is None:
            return None
        ckpts = CheckpointManager(self.save_dir / "checkpoints", cfg.keep_checkpoints)
        for path in reversed(ckpts.paths()):
            try:
                saved = CheckpointManager.load(path)
            except DamagedCheckpointError:
                continue  # set aside, and said, when the run resumes from the one before
            calibration = saved.get("pruner", {}).get("latency")
            if calibration is None:
                self.progress.line(
                    f"--resume: {path.name} holds no latency calibration (written before it "
                    "was kept): the model is timed afresh"
                )
            return calibration
        return None

    # -------------------------------------------------------------- batches
    def _batch(self, step: int) -> tuple[Tensor, Tensor]:
        x, y = self.data.train_batch(step, self.global_batch, self.rank, self.world)
        return self._to_device(x, y)

    def _to_device(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        nb = self.device.type == "cuda"
        return x.to(self.device, non_blocking=nb), y.to(self.device, non_blocking=nb)

    def _loss(self, out: Tensor, y: Tensor) -> Tensor:
        if self.classify:
            return F.cross_entropy(out, y)
        # the MSE of standardised targets: the built model returns the data's units
        return F.mse_loss(out.reshape(y.shape), y) * self.data.loss_scale

    def evaluate(self, model: nn.Module | None = None, limit: int | None = None) -> float:
        """Accuracy (classification) or mean squared error (regression) on the eval split (its
        first ``limit`` rows when given), computed on the run's device in its precision."""
        model = model or self.model
        correct, total, sq = 0, 0, 0.0
        with eval_mode(model), torch.no_grad():
            for xb, yb in self.data.eval_batches(512, limit):
                x, y = self._to_device(xb, yb)
                with self.precision.autocast():
                    out = model(x).float()
                if self.classify:
                    correct += int((out.argmax(1) == y).sum())
                else:
                    sq += float(((out.reshape(y.shape) - y) ** 2).sum())
                total += y.shape[0]
        return correct / total if self.classify else sq / total

    @property
    def metric_name(self) -> str:
        """``"accuracy"`` (classification) or ``"mse"`` (regression), as ``evaluate`` measures."""
        return "accuracy" if self.classify else "mse"

    # ------------------------------------------------------------------- run
    def run(self) -> TrainResult:
        """Train dense, prune to the target, fine-tune, evaluate, export and report; return
        the result.

        Reads the data and builds the model unless they were given; leaves ``self.model``
        trained on the CPU: shrunk in place once pruning finished (unless
        ``config.fine_tune_masked``, or the step cap came first: then with its masks). On
        rank 0 it writes under ``config.save_dir``:
        checkpoints, ``metrics.jsonl`` (entry by entry, and to the ``config.log`` sinks), and
        at the end the exports, the report and ``result.json``. With ``config.resume`` it goes
        on from the newest checkpoint there.

        The save directory is locked for the run (``claim_save_dir``); SIGINT / SIGTERM stop
        it after the step under way, with a checkpoint of that step.

        Raises:
            ValueError: bad data, model or device settings, a checkpoint or ``init_from`` file
                that does not fit, settings that differ from the resumed checkpoint's
                (``ResumeMismatchError``), a save directory in use or holding another run
                (``SaveDirInUseError``, ``OtherRunError``), or (``dense_check="stop"``) a
                dense model that learned nothing.
            DivergedError: the loss became NaN or infinite (nothing pruned or exported on it).
            Interrupted: SIGINT or SIGTERM; it names the checkpoint written.
            PeerTimeoutError: under torchrun, another rank did not answer in time.
            OSError: a file could not be written (it names the file).
        """
        self._setup()
        self._load()
        self.lock: RunLock | None = None
        try:
            loop = self._start()
            try:
                with loop.guard:
                    dense_phase(loop)
                    pruning_phase(loop)
                    fine_tune_phase(loop)
                return self._finish(loop)
            finally:
                loop.metrics.close()
                self.progress.close()
        finally:
            if self.lock is not None:
                self.lock.release()

    def _start(self) -> Loop:
        """The optimizer, the resumed or fresh run state, the metric logs: the ``Loop`` the
        phases work on. Prints the line that opens the run."""
        cfg = self.config
        popt = self._optimizer()
        ckpts = CheckpointManager(self.save_dir / "checkpoints", cfg.keep_checkpoints)
        self._claim(ckpts, popt)
        self._teacher_weights: dict[str, Tensor] | None = None  # set by _resume
        self._shrunk_weights: dict[str, Tensor] | None = None  # set by _resume
        state = self._resume(ckpts, popt) if cfg.resume else RunState()
        cap = step_cap(cfg, self.burn_in, _prunable_channels(popt))
        self.progress.total = cap
        self._announce(popt)
        write = self.rank == 0
        sinks = open_sinks(cfg.log, self.save_dir) if write else []
        metrics = MetricsLog(self.save_dir / "metrics.jsonl", state.metrics, write, sinks)
        metrics.restart()
        loop = Loop(
            config=cfg,
            net=self._wrap(self.model),
            popt=popt,
            state=state,
            metrics=metrics,
            ckpts=ckpts,
            progress=self.progress,
            precision=self.precision,
            burn_in=self.burn_in,
            cap=cap,
            batch=self._batch,
            loss=self._loss,
            evaluate=lambda limit=None: self.evaluate(limit=limit),
            metric_name=self.metric_name,
            check_dense=self._check_dense,
            checkpoint=lambda: self._checkpoint(popt, state),
            write=write,
            guard=StopGuard(cfg.dist_timeout, loss_read_every(self.device)),
            model=self.model,
            save_dense=self._export_dense if cfg.export_dense else None,
            example=self.example,
            wrap=self._wrap,
        )
        restore_teacher(loop, self._teacher_weights)  # a copy of the masked model: first
        if self._shrunk_weights is not None:
            restore_shrunk(loop, self._shrunk_weights)
        return loop

    def _wrap(self, model: nn.Module) -> nn.Module:
        """What the steps train: ``model`` in DistributedDataParallel under torchrun (built
        again after the shrink, whose parameters are new objects), else ``model`` itself;
        under ``torch.compile`` with ``config.compile``."""
        net = model
        if self.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            BroadcastExclusion(model)  # (masks placed by hand too: masks.ddp_sync)
            net = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        cfg = self.config
        return compiled(net, cfg.compile_backend, cfg.compile_mode) if cfg.compile else net

    def _export_dense(self) -> None:
        """Write the model as it stands, unpruned, to ``export_dir/DENSE_FILE`` in
        ``export_model``'s ``state_dict`` format (weights on the CPU, no masks), the file
        ``fisherprune prune --weights`` reads, as the first file of the run's export set
        (``self.exports``); say where. Creates ``export_dir``. Weights that are not finite (a
        run diverging in its dense phase) are not written: it says so."""
        if not all(bool(torch.isfinite(p).all()) for p in self.model.parameters()):
            self.progress.line("dense model not written: its weights are not finite")
            return
        assert self.exports is not None, "rank 0 only"
        path = self.exports.write(
            DENSE_FILE,
            "the dense model when the dense phase ended (state_dict export, for fisherprune "
            "prune --weights)",
            partial(export_model, self.model, example_inputs=self.example, format="state_dict"),
        )
        self.progress.line(f"dense model written to {path} (for fisherprune prune --weights)")

    def _claim(self, ckpts: CheckpointManager, popt: PruningOptimizer) -> None:
        """Every rank fingerprints the data files (saved in checkpoints, compared on resume)
        and checks the settings; rank 0 takes the save directory (``claim_save_dir``: sets
        ``self.lock``, released by ``run``) and starts the run's export set in ``export_dir``
        (``ExportSet.begin``: an earlier run's set there is retired; a resumed run keeps its
        own ``dense.pt``, which it does not write again). Other ranks get None for both."""
        cfg = self.config
        self.data_files = data_fingerprint(cfg.to_dict())
        for line in preflight_lines(cfg, popt):
            self.progress.line(line)
        self.exports: ExportSet | None = None
        if self.rank != 0:
            return
        ExportSet.previous(self.export_dir)  # refused before --overwrite deletes anything
        self.lock = claim_save_dir(
            self.save_dir, self.export_dir, ckpts, cfg.resume, cfg.overwrite, self.progress.line
        )
        resumed = cfg.resume and bool(ckpts.paths())
        self.exports = ExportSet.begin(
            self.export_dir,
            owner=str(self.save_dir.resolve()),
            carry=(DENSE_FILE,) if resumed else (),
            say=self.progress.line,
        )

    def _check_dense(self, value: float) -> DenseCheck:
        """Whether the dense model's eval metric ``value`` beats a trivial predictor."""
        labels = torch.cat([y for _, y in self.data.eval_batches(4096)])
        return check_dense(value, labels, self.data.num_classes)

    def _announce(self, popt: PruningOptimizer) -> None:
        """Print the line that opens a run: data, model, channels, cost, target, schedule."""
        cfg = self.config
        dense = "statistics only" if cfg.init_from else "training"
        self.progress.line(
            f"fisherprune train: {self.data.source}: {self.data.num_train} train / "
            f"{self.data.num_eval} eval examples; model {cfg.model}; "
            f"{len(popt.masks)} channel groups, {_prunable_channels(popt)} prunable channels; "
            f"cost {popt.start_cost:,.0f} {cost_unit(cfg.pruning_convention)}; target "
            f"{popt.target:,.0f}; dense phase {self.burn_in} steps ({dense}), a prune every "
            f"{cfg.pruning_iter} steps, fine-tuning {cfg.fine_tune_steps} steps; device "
            f"{self.device}, {cfg.precision}; world size {self.world}; "
            f"{self.weight_decay.line(self.metric_name)}"
        )

    def _checkpoint(self, popt: PruningOptimizer, state: RunState) -> dict[str, Any]:
        """What a checkpoint holds: weights (on the CPU), pruner, RNG states, run state,
        settings, model."""
        return {
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "pruner": popt.state_dict(),
            "rng": rng_state(),
            "state": state.as_dict(),
            "config": self.config.to_dict(),
            "data_files": self.data_files,
            "model_meta": {
                "name": self.config.model,
                "input_shape": list(self.data.input_shape),
                "num_outputs": self._outputs,
                "width": self.config.width,
                "depth": self.config.depth,
                "scaling": None if self.data.scaling is None else self.data.scaling.to_dict(),
            },
        }

    def _resume(self, ckpts: CheckpointManager, popt: PruningOptimizer) -> RunState:
        """The run state of the newest checkpoint, loaded into the model, pruner and RNGs (see
        ``resume_state``); a fresh state, and a line saying so, when there is none."""
        found = ckpts.load_newest(self.progress.line)
        if found is None:
            self.progress.line(f"--resume: no checkpoint in {ckpts.directory}; starting afresh")
            return RunState()
        path, saved = found
        # round_to compared as pruned with: None resolves by convention (``round_to_for``)
        before = dict(saved.get("config", {}))
        used = saved.get("pruner", {}).get("settings", {}).get("round_to")
        if used is not None:
            before["pruning_round_to"] = used
        for line in resume_changes(
            before,
            saved.get("data_files"),
            {**self.config.to_dict(), "pruning_round_to": popt.round_to},
            self.data_files,
            str(path),
            defaults=TrainConfig().to_dict(),
        ):
            self.progress.line(f"--resume: changed {line}")
        state = resume_state(saved, path, self.model, popt)
        self._teacher_weights = saved.get("teacher")
        if popt.awaiting_shrink:
            self._shrunk_weights = saved["model"]  # loaded once the model is shrunk again
        self.progress.line(f"resumed from {path} (step {state.step})")
        return state

    # ----------------------------------------------------------------- end
    def _finish(self, loop: Loop) -> TrainResult:
        """The finish phase (``finish_phase``), on the CPU."""
        out = RunOutput(
            self.save_dir,
            self.export_dir,
            self.progress,
            write=self.rank == 0,
            exports=self.exports,
            data_card=data_card(self.data) if self.rank == 0 else None,
        )
        return finish_phase(loop, self.model, self.example, self.data.samples(64), out)


def _prunable_channels(popt: PruningOptimizer) -> int:
    """Channels in all the pruner's masks, pruned or not."""
    return sum(m.num_channels for m in popt.masks.values())
