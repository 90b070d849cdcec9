"""Does ``--resume`` continue the same run? The settings that change the result, and the
content of the data files, are compared with those a checkpoint was written with.

A resumed run may change only ``ALLOWED_CHANGES`` (how long it runs, how often it evaluates
and saves, threads, output, exports); any other setting, or data whose bytes changed, would
give a result that is neither the old run's nor a new one's (``--seed`` redraws the eval split
and leaks eval rows into training), so it is refused with the list of differences.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fisherprune.export.storage import file_sha256

__all__ = [
    "ALLOWED_CHANGES",
    "DATA_FIELDS",
    "ResumeMismatchError",
    "data_fingerprint",
    "resume_changes",
]

#: settings a resumed run may change: they decide how long and how visibly it runs, not what
ALLOWED_CHANGES: tuple[str, ...] = (
    "steps",
    "fine_tune_steps",
    "eval_every",
    "eval_rows",
    "checkpoint_every",
    "keep_checkpoints",
    "resume",
    "overwrite",
    "threads",
    "progress",
    "save_dir",
    "export_dir",
    "export_formats",
    "export_dense",
    "dist_timeout",
    "pruning_latency_cache",
)

#: settings that name data files, whose content is fingerprinted
DATA_FIELDS: tuple[str, ...] = ("data", "data_spec", "labels", "eval_data")


class ResumeMismatchError(ValueError):
    """``--resume`` with settings or data that differ from the checkpoint's."""


def data_fingerprint(config: dict[str, Any]) -> dict[str, str]:
    """SHA-256 of each data file the settings name (``DATA_FIELDS`` that are files; a
    built-in data set such as ``digits`` has none): ``{field: hex digest}``. Reads the files."""
    out = {}
    for name in DATA_FIELDS:
        value = config.get(name)
        if value and Path(value).is_file():
            out[name] = file_sha256(value)
    return out


def resume_changes(
    saved: dict[str, Any],
    saved_data: dict[str, str] | None,
    now: dict[str, Any],
    now_data: dict[str, str],
    source: str,
    defaults: dict[str, Any] | None = None,
) -> list[str]:
    """The allowed settings that differ between a checkpoint (``saved``: its settings,
    ``saved_data``: its ``data_fingerprint``, None for a checkpoint written before they were
    recorded) and this run (``now``, ``now_data``), one ``"name: old -> new"`` line each.
    A setting ``saved`` lacks (the checkpoint was written before it existed) counts at its
    value in ``defaults``, what the older run did without it.

    Raises:
        ResumeMismatchError: another setting differs, or a data file's content does: the
            message lists every difference, names ``source`` (the checkpoint) and the settings
            that may change.
    """
    refused, allowed = [], []
    saved = {**(defaults or {}), **saved}
    for name in sorted(set(saved) | set(now)):
        old, new = saved.get(name), now.get(name)
        if old == new or name in ("resume", "overwrite"):
            continue
        if name in ALLOWED_CHANGES:
            allowed.append(f"{name}: {old!r} -> {new!r}")
        else:
            refused.append(f"{name}: {old!r} in the checkpoint, {new!r} now")
    if saved_data is not None:
        for name in sorted(set(saved_data) | set(now_data)):
            if saved.get(name) == now.get(name) and saved_data.get(name) != now_data.get(name):
                refused.append(
                    f"{name}: the content of {now.get(name)} changed since the checkpoint "
                    "(its SHA-256 differs)"
                )
    if refused:
        raise ResumeMismatchError(
            f"cannot resume from {source}: settings that change the result differ from "
            "the checkpoint's: "
            + "; ".join(refused)
            + ". Resume with the checkpoint's settings, or start a new run with another "
            "--save_dir (or --overwrite); a resumed run may change only: "
            + ", ".join(ALLOWED_CHANGES)
        )
    return allowed
