"""The parts a training run is made of, each on its own: the run state a checkpoint keeps, the
metrics log, the run's finish, and the one-way imports between the modules of ``train/``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fisherprune import PruningOptimizer, apply_masks
from fisherprune.train import PruningTrainer, TrainConfig, TrainResult
from fisherprune.train.config import TrainConfig as ConfigFromModule
from fisherprune.train.finish import FinishedRun, RunOutput, finish_run
from fisherprune.train.progress import Progress
from fisherprune.train.shrunk import shrink_pruned
from fisherprune.train.state import MetricsLog, RunState
from fisherprune.train.trainer import PruningTrainer as TrainerFromModule

TRAIN = Path(__file__).resolve().parent.parent / "src" / "fisherprune" / "train"


# ========================================================================== run state
def _state() -> RunState:
    dense = {"step": 5, "kind": "dense", "accuracy": 0.5, "cost": 100.0}
    prune = {"step": 6, "kind": "prune", "mask": "m", "channel": 1, "channels": [1], "cost": 90.0}
    return RunState(step=7, dense=dense, finished_at=None, metrics=[dense, prune])


def test_run_state_is_saved_as_the_checkpoint_dict_and_read_back(tmp_path: Path) -> None:
    """as_dict gives the checkpoint's plain dict (four keys), a copy that later steps do not
    change, with ``dense`` still the same object as its metrics entry; through torch.save and
    torch.load (as checkpoints go) from_dict gives an equal state back."""
    state = _state()
    saved = state.as_dict()
    assert saved == {
        "step": 7,
        "dense": state.dense,
        "finished_at": None,
        "metrics": state.metrics,
    }
    assert saved["dense"] is saved["metrics"][0]
    state.step += 1
    state.metrics.append({"step": 8, "kind": "eval"})
    assert saved["step"] == 7 and len(saved["metrics"]) == 2, "as_dict must copy"
    torch.save({"state": saved}, tmp_path / "ckpt.pt")
    loaded = RunState.from_dict(torch.load(tmp_path / "ckpt.pt", weights_only=False)["state"])
    assert loaded == RunState(7, saved["dense"], None, saved["metrics"])
    assert loaded != state


# ======================================================================== metrics log
def test_metrics_log_restarts_from_its_entries_and_appends_each_record(tmp_path: Path) -> None:
    """restart replaces whatever the file held with the entries so far; record appends to the
    same list it was given and one JSON line to the file."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 99, "kind": "recorded after the checkpoint"}\n')
    entries = [{"step": 5, "kind": "dense"}]
    log = MetricsLog(path, entries, write=True)
    log.restart()
    assert path.read_text() == '{"step": 5, "kind": "dense"}\n'
    log.record({"step": 6, "kind": "eval"})
    assert log.entries is entries and entries[-1] == {"step": 6, "kind": "eval"}
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == entries


def test_metrics_log_that_does_not_write_keeps_its_entries_only(tmp_path: Path) -> None:
    """With write=False (ranks other than 0) entries are kept and no file is made."""
    log = MetricsLog(tmp_path / "metrics.jsonl", [], write=False)
    log.restart()
    log.record({"step": 1, "kind": "eval"})
    assert log.entries == [{"step": 1, "kind": "eval"}]
    assert list(tmp_path.iterdir()) == []


# ============================================================================= finish
def _trained_run() -> FinishedRun:
    """A masked 4-16-3 MLP trained and pruned a little, shrunk and handed over as the trainer
    does when the step cap comes before the target (a shrunk copy)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(80, 4)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    apply_masks(model, x[:1])
    popt = PruningOptimizer(model, x[:1], lr=0.05, prune_every=2, flops_target=0.5)
    for i in range(12):
        popt.minimize(F.cross_entropy(model(x[i * 4 : i * 4 + 8]), y[i * 4 : i * 4 + 8]))
    assert popt.history, "nothing was pruned: the check below would be vacuous"
    prunes = sum(len(e.channels) for e in popt.history)
    return FinishedRun(
        popt=popt,
        pruned=shrink_pruned(model, x[:1], popt, inplace=False),
        example=x[:1],
        samples=x,
        metrics=[{"step": 12, "kind": "final", "accuracy": 0.5, "cost": popt.cost().total}],
        metric_name="accuracy",
        dense_metric=0.4,
        dense_cost=popt.start_cost,
        final_metric=0.5,
        final_cost=popt.cost().total,
        steps=12,
        prunes=prunes,
    )


def test_finish_off_rank_0_measures_but_changes_and_writes_nothing(tmp_path: Path) -> None:
    """finish_run with write=False returns the numbers (fewer parameters, both latencies)
    with no files, leaves the shrunk and the dense model as they were, and creates nothing on
    disk."""
    run = _trained_run()
    models = (run.pruned.small, run.pruned.dense)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    out = RunOutput(tmp_path / "run", tmp_path / "run" / "export", Progress(None, "none"), False)
    result = finish_run(TrainConfig(), run, out)
    assert result.files == {}
    assert result.final_params < result.dense_params
    assert result.prunes == run.prunes and result.final_cost == run.final_cost
    assert {"dense_b1_ms", "pruned_b64_ms", "speedup_b64"} <= set(result.latency)
    for model, saved in zip(models, before, strict=True):
        after = model.state_dict()
        assert after.keys() == saved.keys()
        assert all(torch.equal(after[k], v) for k, v in saved.items())
    assert list(tmp_path.iterdir()) == []


def test_finish_on_rank_0_writes_the_files_it_names_and_result_json(tmp_path: Path) -> None:
    """finish_run with write=True writes every file its result names, and result.json holds
    the result, its own path included."""
    run = _trained_run()
    save = tmp_path / "run"
    save.mkdir()
    out = RunOutput(save, save / "export", Progress(None, "none"), write=True)
    result = finish_run(TrainConfig(export_formats=["state_dict"]), run, out)
    assert {"plan", "state_dict", "report", "result"} <= set(result.files)
    assert all(Path(p).is_file() for p in result.files.values())
    assert json.loads((save / "result.json").read_text()) == result.__dict__


# ============================================================================ imports
def test_train_package_exports_the_trainer_and_its_settings() -> None:
    """``from fisherprune.train import PruningTrainer, TrainConfig`` gives the classes
    themselves."""
    assert PruningTrainer is TrainerFromModule and TrainConfig is ConfigFromModule
    assert TrainResult.__module__ == "fisherprune.train.result"
