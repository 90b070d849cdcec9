"""PruningTrainer: data on disk -> trained, pruned, fine-tuned, exported model (the seed's
PruningDataRecordTrainer, with the export it left as a TODO)."""

from __future__ import annotations

import logging
import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from fisherprune._errors import first_line
from fisherprune.distill import distill_loss, frozen_teacher
from fisherprune.graph import apply_masks
from fisherprune.masks import find_masks
from fisherprune.modes import eval_mode
from fisherprune.pruner import PruningOptimizer
from fisherprune.settings import OPTIMIZERS, parse_flops_weight
from fisherprune.train.checkpoint import CheckpointManager, rng_state, set_rng_state
from fisherprune.train.config import TrainConfig
from fisherprune.train.data import Dataset, DataSpec, load_data
from fisherprune.train.finish import FinishedRun, RunOutput, finish_run
from fisherprune.train.models import build_model
from fisherprune.train.progress import Progress
from fisherprune.train.result import TrainResult
from fisherprune.train.state import MetricsLog, RunState

__all__ = ["PruningTrainer", "TrainResult"]

log = logging.getLogger("fisherprune")

#: the inner optimizer of each name in ``settings.OPTIMIZERS`` (the seed's is momentum SGD)
_INNER_OPTIMIZERS: dict[str, Callable[[list[nn.Parameter], TrainConfig], torch.optim.Optimizer]] = {
    "sgd": lambda params, cfg: torch.optim.SGD(
        params, lr=cfg.learning_rate, momentum=cfg.momentum, weight_decay=cfg.weight_decay
    ),
    "adam": lambda params, cfg: torch.optim.Adam(
        params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay
    ),
    "adamw": lambda params, cfg: torch.optim.AdamW(
        params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay
    ),
}
assert set(_INNER_OPTIMIZERS) == set(OPTIMIZERS)


def _dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass
class _Loop:
    """What the training loop works on; ``PruningTrainer.run`` makes one per run."""

    net: nn.Module  # the trainer's model, in DistributedDataParallel under torchrun
    popt: PruningOptimizer
    state: RunState  # advanced by every step, saved in every checkpoint
    metrics: MetricsLog  # appends to state.metrics
    ckpts: CheckpointManager
    cap: int  # the step count no run goes beyond


class PruningTrainer:
    """Train with ``PruningOptimizer``, prune to the target, fine-tune, evaluate and export.

    Args:
        config: the run's settings.
        model: optional model instead of ``config.model`` (masks are applied if it has none).
        data: optional ``Dataset`` instead of reading ``config.data``.

    Under ``torchrun`` (WORLD_SIZE > 1) it joins the gloo process group, trains with
    DistributedDataParallel, and only rank 0 writes files; Fisher statistics are
    all-reduced so that every rank prunes the same channels.
    """

    def __init__(
        self, config: TrainConfig, model: nn.Module | None = None, data: Dataset | None = None
    ) -> None:
        self.config = config
        self._model = model
        self._data = data
        self._teacher: nn.Module | None = None  # the dense model, with distill_alpha > 0

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            dist.init_process_group("gloo")
        self.rank, self.world = _dist_info()
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.save_dir = Path(cfg.save_dir)
        self.export_dir = Path(cfg.export_dir) if cfg.export_dir else self.save_dir / "export"
        if self.rank == 0:
            self.save_dir.mkdir(parents=True, exist_ok=True)
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
                )
            self._data = load_data(spec)
        self.data = self._data
        self.classify = self.data.num_classes is not None
        outputs = self.data.num_classes if self.classify else _regression_outputs(self.data)
        self._outputs = outputs
        if self._model is None:
            name = cfg.model
            if name in ("cnn", "resnet", "densenet") and len(self.data.input_shape) != 3:
                raise ValueError(
                    f"--model {name} needs image data; {self.data.source} has features of shape "
                    f"{self.data.input_shape} (use --model mlp, or --image_shape C,H,W)"
                )
            self._model = build_model(name, self.data.input_shape, outputs, cfg.width, cfg.depth)
        self.model = self._model
        self.example = self.data.x_train[:1]
        self.masks = find_masks(self.model) or apply_masks(self.model, self.example)
        for s in getattr(self.masks, "skipped", []):
            log.info("not masked: %s", s)

    def _optimizer(self) -> PruningOptimizer:
        cfg = self.config
        params = [p for p in self.model.parameters() if p.requires_grad]
        inner = _INNER_OPTIMIZERS[cfg.optimizer](params, cfg)
        n = self.data.x_train.shape[0]
        self.global_batch = min(cfg.batch_size * self.world, n)
        self.batches_per_epoch = max(1, n // self.global_batch)
        burn_in = cfg.pruning_burn_in
        if burn_in is None:
            burn_in = math.ceil(cfg.epochs * self.batches_per_epoch)
        self.burn_in = burn_in
        return PruningOptimizer(
            self.model,
            self.example,
            optimizer=inner,
            prune_every=cfg.pruning_iter,
            burn_in=burn_in,
            decay=cfg.pruning_decay,
            flops_weight=parse_flops_weight(cfg.pruning_flops_weight, "pruning_flops_weight"),
            flops_target=cfg.pruning_flops_target,
            min_channels=cfg.pruning_min_channels,
            round_to=cfg.pruning_round_to,
            convention=cfg.pruning_convention,
            score_convention=cfg.pruning_score_convention,
            criterion=cfg.pruning_criterion,
        )

    # -------------------------------------------------------------- batches
    def _batch(self, step: int) -> tuple[Tensor, Tensor]:
        epoch, b = divmod(step, self.batches_per_epoch)
        if getattr(self, "_perm_epoch", None) != epoch:
            g = torch.Generator().manual_seed(self.config.seed * 100_003 + epoch)
            self._perm = torch.randperm(self.data.x_train.shape[0], generator=g)
            self._perm_epoch = epoch
        lo = b * self.global_batch
        idx = self._perm[lo : lo + self.global_batch]
        per = math.ceil(idx.numel() / self.world)
        idx = idx[self.rank * per : (self.rank + 1) * per]
        return self.data.x_train[idx], self.data.y_train[idx]

    def _loss(self, out: Tensor, y: Tensor) -> Tensor:
        if self.classify:
            return F.cross_entropy(out, y)
        return F.mse_loss(out.reshape(y.shape), y)

    def evaluate(self, model: nn.Module | None = None) -> float:
        """Accuracy (classification) or mean squared error (regression) on the eval split."""
        model = model or self.model
        correct, total, sq = 0, 0, 0.0
        with eval_mode(model), torch.no_grad():
            for lo in range(0, self.data.x_eval.shape[0], 512):
                x = self.data.x_eval[lo : lo + 512]
                y = self.data.y_eval[lo : lo + 512]
                out = model(x)
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
        """Train, prune, fine-tune, evaluate, export and report; return the result.

        Reads the data and builds the model unless they were given; leaves ``self.model``
        trained with its masks. On rank 0 it writes under ``config.save_dir``: checkpoints,
        ``metrics.jsonl`` (entry by entry), and at the end the exports, the report and
        ``result.json``. With ``config.resume`` it goes on from the newest checkpoint there.

        Raises:
            ValueError: bad data or model settings, or a checkpoint that does not fit.
            OSError: a file could not be written.
        """
        self._setup()
        self._load()
        popt = self._optimizer()
        net: nn.Module = self.model
        if self.world > 1:
            net = nn.parallel.DistributedDataParallel(self.model)
        ckpts = CheckpointManager(self.save_dir / "checkpoints", self.config.keep_checkpoints)
        state = self._resume(ckpts, popt) if self.config.resume else RunState()
        cap = self._step_cap(popt)
        self.progress.total = cap
        self._announce(popt)
        metrics = MetricsLog(self.save_dir / "metrics.jsonl", state.metrics, self.rank == 0)
        metrics.restart()
        loop = _Loop(net, popt, state, metrics, ckpts, cap)
        self._prune_to_target(loop)
        self._fine_tune(loop)
        if not popt.finished:
            log.warning(
                "the step cap %d was reached before the target: cost %.6g > %.6g",
                cap,
                popt.cost().total,
                popt.target,
            )
        if self.rank == 0:
            ckpts.save(state.step, self._checkpoint(popt, state))
        result = self._finish(loop)
        self.progress.close()
        return result

    def _step_cap(self, popt: PruningOptimizer) -> int:
        """``config.steps``, or enough steps to prune every channel and fine-tune after."""
        cfg = self.config
        if cfg.steps is not None:
            return cfg.steps
        channels = _prunable_channels(popt)
        return self.burn_in + cfg.pruning_iter * (channels + 1) + cfg.fine_tune_steps + 1

    def _announce(self, popt: PruningOptimizer) -> None:
        """Print the line that opens a run: data, model, channels, cost, target, world size."""
        self.progress.line(
            f"fisherprune train: {self.data.source}: {self.data.x_train.shape[0]} train / "
            f"{self.data.x_eval.shape[0]} eval examples; model {self.config.model}; "
            f"{len(popt.masks)} channel groups, {_prunable_channels(popt)} prunable channels; "
            f"cost {popt.start_cost:,.0f} {self.config.pruning_convention}/example; target "
            f"{popt.target:,.0f}; world size {self.world}"
        )

    def _prune_to_target(self, loop: _Loop) -> None:
        """The dense phase and the pruning phase: take steps until the pruner reaches its
        target or the step cap. ``PruningOptimizer`` trains dense for its burn-in, then prunes
        every ``pruning_iter`` steps; the dense model is measured when the burn-in ends."""
        if loop.state.dense is None and self.burn_in == 0:
            loop.state.dense = self._dense_point(loop, 0)
        while loop.state.step < loop.cap and not loop.popt.finished:
            self._step(loop)

    def _fine_tune(self, loop: _Loop) -> None:
        """The fine-tuning phase: once the target is reached, ``fine_tune_steps`` more steps
        (counted from ``state.finished_at``, so a resumed run does not start them over), within
        the step cap. Does nothing when the cap came first."""
        state = loop.state
        if not loop.popt.finished or state.step >= loop.cap:
            return
        if state.finished_at is None:
            state.finished_at = state.step
            self.progress.line(
                f"step {state.step}: {_channels_removed(loop.popt)} channels "
                f"pruned; fine-tuning for {self.config.fine_tune_steps} steps"
            )
        while (
            state.step < loop.cap and state.step - state.finished_at < self.config.fine_tune_steps
        ):
            self._step(loop)

    def _step(self, loop: _Loop) -> None:
        """One optimizer step (the pruner may prune in it), then what it is due: the dense
        point at the end of the burn-in, its prunes in the metrics, an eval every
        ``eval_every`` steps and a checkpoint every ``checkpoint_every`` steps."""
        cfg, popt, state = self.config, loop.popt, loop.state
        x, y = self._batch(state.step)
        loop.net.train()
        loss = self._train_loss(loop, x, y)
        seen = len(popt.history)
        popt.minimize(loss)
        loss_value = loss.item()
        state.step += 1
        step = state.step
        if state.dense is None and step >= self.burn_in:
            state.dense = self._dense_point(loop, step)
        for ev in popt.history[seen:]:
            loop.metrics.record(
                {
                    "step": ev.step,
                    "kind": "prune",
                    "mask": ev.mask,
                    "channel": ev.channel,
                    "channels": list(ev.channels),
                    "cost": ev.cost_after,
                }
            )
        self.progress.update(step, f"loss {loss_value:.4f} pruned {_channels_removed(popt)}")
        if step % cfg.eval_every == 0:
            self._eval_point(loop, step, loss_value)
        if step % cfg.checkpoint_every == 0 and self.rank == 0:
            loop.ckpts.save(step, self._checkpoint(popt, state))

    def _train_loss(self, loop: _Loop, x: Tensor, y: Tensor) -> Tensor:
        """The label loss; once pruning is over and a dense teacher was kept
        (``distill_alpha`` > 0), mixed with the teacher's outputs (``fisherprune.distill``)."""
        out = loop.net(x)
        if self._teacher is None or not loop.popt.finished:
            return self._loss(out, y)
        with torch.no_grad():
            teacher_out = self._teacher(x)
        return distill_loss(
            out,
            teacher_out,
            y,
            loss_fn=self._loss,
            alpha=self.config.distill_alpha,
            temperature=self.config.distill_temperature,
            task="classification" if self.classify else "regression",
        )

    def _dense_point(self, loop: _Loop, step: int) -> dict[str, Any]:
        """Evaluate the model before pruning, record it and print it; return its entry. With
        ``distill_alpha`` > 0, keep a frozen copy of it as the fine-tuning teacher."""
        if self.config.distill_alpha > 0:
            self._teacher = frozen_teacher(self.model)
        value = self.evaluate()
        metric = self.metric_name
        entry = {"step": step, "kind": "dense", metric: value, "cost": loop.popt.cost().total}
        loop.metrics.record(entry)
        self.progress.line(
            f"dense model (step {step}): eval {metric} {value:.4f}, cost "
            f"{entry['cost']:,.0f} {self.config.pruning_convention}/example"
        )
        return entry

    def _eval_point(self, loop: _Loop, step: int, loss: float) -> None:
        """Evaluate the model as it stands, record the entry and print it."""
        value = self.evaluate()
        cost = loop.popt.cost().total
        metric = self.metric_name
        loop.metrics.record(
            {
                "step": step,
                "kind": "eval",
                metric: value,
                "cost": cost,
                "loss": loss,
                "kept": self._kept(loop.popt),
            }
        )
        self.progress.line(
            f"step {step}: loss {loss:.4f}, eval {metric} "
            f"{value:.4f}, cost {cost:,.0f} "
            f"({cost / loop.popt.start_cost:.1%} of start)"
        )

    @staticmethod
    def _kept(popt: PruningOptimizer) -> dict[str, int]:
        return {n: m.kept for n, m in popt.masks.items()}

    def _checkpoint(self, popt: PruningOptimizer, state: RunState) -> dict[str, Any]:
        """What a checkpoint holds: weights, pruner, RNG states, run state, settings, model."""
        return {
            "model": self.model.state_dict(),
            "pruner": popt.state_dict(),
            "rng": rng_state(),
            "state": state.as_dict(),
            "config": self.config.to_dict(),
            "model_meta": {
                "name": self.config.model,
                "input_shape": list(self.data.input_shape),
                "num_outputs": self._outputs,
                "width": self.config.width,
                "depth": self.config.depth,
            },
        }

    def _resume(self, ckpts: CheckpointManager, popt: PruningOptimizer) -> RunState:
        """Load the newest checkpoint into the model, the pruner and the RNGs and return its
        run state; a fresh state (and a line saying so) when there is none.

        Raises:
            ValueError: the checkpoint was written for another model or other settings.
        """
        path = ckpts.latest()
        if path is None:
            self.progress.line(f"--resume: no checkpoint in {ckpts.directory}; starting afresh")
            return RunState()
        saved = ckpts.load(path)
        try:
            self.model.load_state_dict(saved["model"])
            popt.load_state_dict(saved["pruner"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise ValueError(
                f"cannot resume from {path}: it was written for a different model or settings "
                f"({first_line(e, with_type=False)}); use another --save_dir or the original "
                "settings"
            ) from None
        set_rng_state(saved["rng"])
        self.progress.line(f"resumed from {path} (step {saved['state']['step']})")
        return RunState.from_dict(saved["state"])

    # ----------------------------------------------------------------- end
    def _finish(self, loop: _Loop) -> TrainResult:
        """Evaluate the trained model, record it as the ``final`` metrics entry, and hand the
        run over to ``finish_run`` (shrink, time, export, report, summary)."""
        popt, state, metric = loop.popt, loop.state, self.metric_name
        final = self.evaluate()
        cost = popt.cost().total
        dense = state.dense or {metric: float("nan"), "cost": popt.start_cost}
        loop.metrics.record(
            {
                "step": state.step,
                "kind": "final",
                metric: final,
                "cost": cost,
                "kept": self._kept(popt),
            }
        )
        run = FinishedRun(
            popt=popt,
            model=self.model,
            example=self.example,
            samples=self.data.x_train,
            metrics=state.metrics,
            metric_name=metric,
            dense_metric=dense[metric],
            dense_cost=dense["cost"],
            final_metric=final,
            final_cost=cost,
            steps=state.step,
            prunes=_channels_removed(popt),
        )
        out = RunOutput(self.save_dir, self.export_dir, self.progress, write=self.rank == 0)
        return finish_run(self.config, run, out)


def _prunable_channels(popt: PruningOptimizer) -> int:
    """Channels in all the pruner's masks, pruned or not."""
    return sum(m.num_channels for m in popt.masks.values())


def _regression_outputs(data: Dataset) -> int:
    return 1 if data.y_train.dim() == 1 else int(data.y_train.shape[1])


def _channels_removed(popt: PruningOptimizer) -> int:
    """Channels pruned so far (a prune removes a block of them with ``round_to > 1``)."""
    return sum(len(e.channels) for e in popt.history)
