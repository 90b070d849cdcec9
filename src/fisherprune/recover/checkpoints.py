"""Sharded checkpoints of an FSDP2 run with ``torch.distributed.checkpoint`` (DCP): written
whole or not at all, verified before they are loaded, the newest whole one resumed from.

A checkpoint is a folder ``step-<8 digits>`` holding DCP's files (the sharded model and
optimizer state from ``get_state_dict``; every rank writes its own shards), one
``rng-<rank>.pt`` per rank (its random state), and last ``manifest.json``: the step (the
data position), the number of batches, the world size and the SHA-256 of every other file.
The folder is written under a temporary name beside it (``export.storage.atomic_directory``
on rank 0, which every rank writes into) and renamed only once every rank's files and the
manifest are on disk, so a run killed while saving leaves no ``step-*`` folder, and
``load_newest`` never reads one whose files differ from their hashes: it sets it aside
(``.damaged``) and tries the one before. The files are hashed, on saving and on loading, by
every rank in turn (rank ``r`` hashes every ``world``-th file from the ``r``-th), so the
work is shared out.

The folder must be on a file system every rank sees (as DCP's own file writer needs).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fisherprune._errors import first_line
from fisherprune.export.storage import atomic_directory, atomic_write_bytes, file_sha256
from fisherprune.train.checkpoint import DamagedCheckpointError, rng_state, set_rng_state

__all__ = ["MANIFEST", "Position", "ShardedCheckpoints"]

#: the file written last into a checkpoint folder: its step, data position and file hashes
MANIFEST = "manifest.json"
_NAME = re.compile(r"^step-(\d{8})$")
_FORMAT = 1


@dataclass(frozen=True)
class Position:
    """Where a run stands: ``step`` optimizer steps done, on a sequence of ``num_batches``
    batches read in step order (step ``i`` reads batch ``i % num_batches``, so the step is
    the data position too, and a resume on other data is refused by its count)."""

    step: int
    num_batches: int


class ShardedCheckpoints:
    """Checkpoint folders ``step-<step>`` in ``directory``, the newest ``keep`` kept.

    Every method that reads or writes a checkpoint is a collective: every rank calls it at
    the same point, with the same arguments.
    """

    def __init__(self, directory: Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 checkpoint, got {keep}")
        self.directory = Path(directory)
        self.keep = keep

    def paths(self) -> list[Path]:
        """The checkpoint folders (renamed into place, so written whole), oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if _NAME.match(p.name) and p.is_dir()]
        return sorted(found, key=lambda p: p.name)

    def save(self, position: Position, model: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
        """Write ``model``'s and ``optimizer``'s sharded state, every rank's random state and
        ``position`` as ``step-<position.step>``; then delete all but the newest ``keep``.
        Returns the folder.

        Raises:
            OSError: a file could not be written; no ``step-*`` folder is left for it.
        """
        path = self.directory / f"step-{position.step:08d}"
        rank, world = dist.get_rank(), dist.get_world_size()
        with _shared_directory(path) as tmp:
            import torch.distributed.checkpoint as dcp  # slow to import: only when used
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
            torch.save(_rng(), tmp / f"rng-{rank}.pt")
            dist.barrier()  # every rank's files are on disk before they are hashed
            digests = _hashes(tmp, sorted(p.name for p in tmp.iterdir()))
            if rank == 0:
                manifest = {"format": _FORMAT, "world_size": world, "files": digests,
                            **asdict(position)}  # fmt: skip
                atomic_write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        if rank == 0:
            for old in self.paths()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()  # no rank goes on before the folder is in place
        return path

    def load_newest(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        report: Callable[[str], None],
    ) -> tuple[Path, Position] | None:
        """Load the newest checkpoint whose files match their hashes into ``model`` and
        ``optimizer`` (resharded if the world size changed) and restore this rank's random
        state (when it was saved at the same world size); None when there is none.

        Changes: a damaged checkpoint newer than it is renamed ``step-<step>.damaged`` on
        rank 0, and ``report`` is called (on rank 0) with one line naming it and why.

        Raises:
            DamagedCheckpointError: every checkpoint is damaged.
        """
        damaged = []
        for path in reversed(self.paths()):
            why = _verify(path)
            if why is None:
                position, world = _load(path, model, optimizer)
                if world != dist.get_world_size() and dist.get_rank() == 0:
                    report(
                        f"checkpoint {path} was saved by {world} ranks, loaded by "
                        f"{dist.get_world_size()}: the model and optimizer are resharded, "
                        "the random state is not restored"
                    )
                return path, position
            aside = path.with_name(path.name + ".damaged")
            dist.barrier()  # every rank has looked at it before it moves
            if dist.get_rank() == 0:
                path.replace(aside)
                report(
                    f"checkpoint {path} is damaged ({why}): set it aside as {aside.name}, "
                    "trying the one before"
                )
            damaged.append(path.name)
        if damaged:
            raise DamagedCheckpointError(
                f"every checkpoint in {self.directory} is damaged ({', '.join(damaged)}); "
                "start afresh with another checkpoint directory"
            )
        return None


@contextmanager
def _shared_directory(path: Path) -> Iterator[Path]:
    """``atomic_directory(path)`` opened on rank 0, its temporary folder given to every rank:
    what every rank writes there takes ``path``'s place when the block ends on rank 0."""
    if dist.get_rank() != 0:
        yield Path(_broadcast(None))
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(path) as tmp:
        _broadcast(str(tmp))
        yield tmp


def _broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _hashes(folder: Path, names: list[str]) -> dict[str, str]:
    """``{name: SHA-256}`` of ``folder``'s files ``names`` (a file that is missing or cannot
    be read: ``"missing"``), each hashed by one rank, gathered on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {}
    for name in names[rank::world]:
        try:
            mine[name] = file_sha256(folder / name)
        except OSError:
            mine[name] = "missing"
    parts: list[dict[str, str]] = [{} for _ in range(world)]
    dist.all_gather_object(parts, mine)
    return {name: d[name] for d in parts for name in d}


def _verify(path: Path) -> str | None:
    """Why checkpoint ``path`` cannot be loaded (the same answer on every rank), or None."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        Position(manifest["step"], manifest["num_batches"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST} cannot be read: {first_line(e)}"
    found = _hashes(path, sorted(files))
    bad = sorted(name for name, digest in files.items() if found[name] != digest)
    if bad:
        return f"{', '.join(bad)} differ from the hashes written with them"
    return None


def _load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Position, int]:
    """Load a verified checkpoint into ``model`` and ``optimizer``; restore this rank's
    random state when the world size is the one it was saved at. Returns its position and
    the world size it was saved at."""
    import torch.distributed.checkpoint as dcp  # slow to import: only when used
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    manifest = json.loads((path / MANIFEST).read_text())
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    if manifest["world_size"] == dist.get_world_size():
        saved = torch.load(path / f"rng-{dist.get_rank()}.pt", weights_only=True)
        set_rng_state(saved["host"])
        if "cuda" in saved:
            torch.cuda.set_rng_state(saved["cuda"])
    position = Position(manifest["step"], manifest["num_batches"])
    return position, manifest["world_size"]


def _rng() -> dict[str, Any]:
    """This process's random state: Python, numpy and torch's CPU generator (``rng_state``),
    and its current GPU's generator when it has one."""
    state: dict[str, Any] = {"host": rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state
