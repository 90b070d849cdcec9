"""What ``fisherprune prune`` writes under ``--out``: ``model.pt``, ``plan.json``, ``hf/`` and
``report.json``, one run's set.

The command writes them into a temporary folder that replaces ``--out`` whole
(``export.storage.atomic_directory``), so ``--out`` holds one complete run, never files of two;
``check_out`` refuses, before any work, a folder holding anything else, which the swap would
otherwise remove.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fisherprune.calibrate import output_tensor
from fisherprune.export import export_model, load_state_dict_export
from fisherprune.export.hf_folder import HFFolder, write_hf_folder
from fisherprune.export.safe_load import load_plain
from fisherprune.export.storage import atomic_path
from fisherprune.inputs import call_model
from fisherprune.modes import eval_mode

__all__ = [
    "HF_FOLDER",
    "MODEL_FILE",
    "OUTPUTS",
    "PLAN_FILE",
    "REPORT_FILE",
    "Written",
    "check_out",
    "write_outputs",
]

MODEL_FILE = "model.pt"
PLAN_FILE = "plan.json"
REPORT_FILE = "report.json"
HF_FOLDER = "hf"  # a Hugging Face model's shrunk folder, for from_pretrained
#: everything a run writes under --out
OUTPUTS = frozenset({MODEL_FILE, PLAN_FILE, REPORT_FILE, HF_FOLDER})


def check_out(out: Path) -> None:
    """Refuse an ``--out`` that a run cannot replace whole without losing something: a file,
    or a folder holding anything but the outputs of an earlier run. Changes nothing.

    Raises:
        ValueError: it names the file or the first foreign entries.
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: give a folder (it is created if absent)")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in OUTPUTS) if out.is_dir() else []
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if foreign[3:] else "")
        raise ValueError(
            f"--out {out} holds files fisherprune prune does not write ({shown}): a run "
            "replaces the folder whole, so give a new or empty folder, or one an earlier "
            "fisherprune prune wrote"
        )


@dataclass(frozen=True)
class Written:
    """What ``write_outputs`` wrote: the shrunk model as reloaded from ``model.pt``, its
    largest output difference to the masked model, and the Hugging Face folder's verdict."""

    small: nn.Module
    diff: float
    hf: HFFolder | None
    hf_missing: str | None


def write_outputs(
    folder: Path,
    model: nn.Module,
    example: Any,
    batch: Any,
    rebuild: Callable[[], nn.Module],
    save_tokenizer: Callable[[Path], Any] | None,
    source: str,
) -> Written:
    """Write the masked ``model`` shrunk (``model.pt``), its plan (``plan.json``) and, given a
    ``save_tokenizer`` (a Hugging Face model read from the folder ``source``), ``hf/`` into
    ``folder``; reload the shrunk model from ``model.pt`` into ``rebuild()`` and compare its
    outputs on ``batch`` with the masked model's.

    Changes: ``folder``'s files; the Hugging Face config of the shrunk copy
    (``write_hf_folder``). ``model`` is left as it is.

    Raises:
        OSError: a file could not be written.
    """
    with eval_mode(model), torch.no_grad():
        masked_out = output_tensor(call_model(model, batch))
    with warnings.catch_warnings():  # the config's verdict is reported by the caller
        warnings.filterwarnings("ignore", "the model's Hugging Face config still describes")
        path = export_model(model, folder / MODEL_FILE, example, format="state_dict")
        small = load_state_dict_export(path, rebuild()).eval()
    with torch.no_grad():
        diff = float((output_tensor(call_model(small, batch)) - masked_out).abs().max())
    payload = load_plain(path, "export", "")
    with atomic_path(folder / PLAN_FILE) as tmp:
        Path(tmp).write_text(json.dumps(payload["plan"], indent=1) + "\n")
    hf, hf_missing = None, None
    if save_tokenizer is not None:
        hf = write_hf_folder(small, folder / HF_FOLDER, batch, Path(source), save_tokenizer)
    if hf is not None and not hf.written:
        hf_missing = (
            f"no {HF_FOLDER}/ folder for from_pretrained: {hf.missing}. {MODEL_FILE} loads with "
            "fisherprune.load_state_dict_export"
        )
    return Written(small, diff, hf, hf_missing)
