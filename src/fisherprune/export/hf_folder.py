"""A shrunk Hugging Face model as a folder that loads with no fisherprune code: what
``fisherprune prune`` writes beside ``model.pt`` (``write_hf_folder``: the model by
``save_pretrained``, its tokenizer, and a sentence-transformers model's own files), and what a
library user calls on a model they shrank (``save_hf_folder``), uniform or not.

Two kinds: when the model's config can describe the shrunk model (every block the same
widths: ``uniform=True``), a standard folder with the new widths in its config; otherwise
(blocks of different widths) a remote-code folder (``fisherprune.export.hf_remote``): the
config records each module's new shapes, and a modelling file of its own, needing only torch
and transformers, rebuilds them when loaded with ``trust_remote_code=True``.

It is written only when a reload, as a user loads it (the Auto class of the model's task for
remote code), gives the shrunk model's outputs back (those of the kept units, where a width
the model returns lost some), into a temporary folder swapped in whole; otherwise a folder of
an earlier run is removed, so that it is never stale, and the reason is returned.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fisherprune._errors import first_line
from fisherprune.calibrate.label_free import output_tensor
from fisherprune.export.hf_config import is_hf_model, update_config
from fisherprune.export.hf_remote import RemoteCode, remote_code, write_remote_code
from fisherprune.export.output_fill import output_fill
from fisherprune.export.storage import atomic_directory
from fisherprune.inputs import call_model
from fisherprune.modes import eval_mode
from fisherprune.tolerance import output_rtol

__all__ = ["HFFolder", "save_hf_folder", "write_hf_folder"]

#: sentence-transformers modules that hold no weights of the pruned width: copied, the pooling's
#: width rewritten (a Dense module after the pooling reads that width: copied only if unchanged)
_ST_WIDTHLESS = {
    f"sentence_transformers.models.{m}" for m in ("Transformer", "Pooling", "Normalize")
}
_ST_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


@dataclass(frozen=True)
class HFFolder:
    """What ``write_hf_folder`` did: ``written``, else ``missing`` (why not); ``notes``: what
    the folder returns or lacks, one line each; ``remote_code``: the folder loads only with
    ``trust_remote_code=True`` (blocks of different widths), else with a standard config."""

    written: bool
    missing: str | None = None
    notes: tuple[str, ...] = ()
    remote_code: bool = False

    @property
    def kind(self) -> str:
        """The kind of folder, as the report names it."""
        return "remote code" if self.remote_code else "standard config"


class _NotWritten(Exception):
    """The folder was abandoned (its temporary copy removed)."""


def save_hf_folder(
    small: nn.Module, folder: str | Path, example_inputs: Any, tokenizer: Any = None
) -> HFFolder:
    """Save the shrunk Hugging Face model ``small`` to ``folder`` so that ``from_pretrained``
    loads it with no fisherprune code: a standard folder when its config can describe it
    (every block the same widths: ``uniform=True``), else a folder with a modelling file of its
    own, loaded with ``trust_remote_code=True`` by the Auto class of its task (blocks of
    different widths: ``AutoModelForCausalLM.from_pretrained(folder,
    trust_remote_code=True)``). The folder is written only once a reload of it gives
    ``small``'s outputs on ``example_inputs`` back, and whole or not at all.

    Args:
        small: the model ``fisherprune.shrink`` returned (a transformers model).
        folder: where to write it: a new path or an empty folder (an existing file or
            folder with files is refused, never replaced).
        example_inputs: inputs of ``small`` (a tensor, a tuple or a dict of keyword
            arguments) that the reload check runs.
        tokenizer: anything with ``save_pretrained(folder)`` (its tokenizer), or None.

    Returns:
        The ``HFFolder`` written: ``remote_code`` says whether it needs
        ``trust_remote_code=True``; ``notes`` what it returns or lacks.

    Changes: ``folder``; ``small.config``'s widths where one config describes them.

    Raises:
        ValueError: ``small`` is not a transformers model, ``folder`` holds something
            already, or no folder reloads as it (the reason is named; no folder is left).
        OSError: the folder could not be written.
    """
    if not (is_hf_model(small) and hasattr(small, "save_pretrained")):
        raise ValueError(
            f"save_hf_folder saves transformers models; {type(small).__name__} has no config "
            "and save_pretrained: keep its PruningPlan (fisherprune.export_model) instead"
        )
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(
            f"{folder} exists and is not an empty folder: save_hf_folder writes a folder whole "
            "and would replace it; choose a new path, or remove it first"
        )
    save = (lambda path: None) if tokenizer is None else tokenizer.save_pretrained
    done = write_hf_folder(small, folder, example_inputs, None, save)
    if not done.written:
        raise ValueError(
            f"no Hugging Face folder was written for {type(small).__name__}: {done.missing}; "
            "keep its PruningPlan (fisherprune.export_model) instead"
        )
    return done


def write_hf_folder(
    small: nn.Module,
    folder: Path,
    batch: Any,
    source: Path | None,
    save_tokenizer: Callable[[Path], Any],
) -> HFFolder:
    """Write ``small`` (shrunk, with a Hugging Face config) to ``folder`` with
    ``save_pretrained``, ``save_tokenizer(folder)`` and the sentence-transformers files of the
    ``source`` folder (None: none): a standard folder when its config can describe it, else a
    remote-code folder (``export.hf_remote``); written when the reload gives ``small``'s outputs on
    ``batch`` back (``type(small).from_pretrained``, or the Auto class of its task with
    ``trust_remote_code=True``).

    Changes: ``folder`` (replaced whole, or removed when nothing fits or the write fails);
    ``small.config``'s widths (``update_config``; a remote-code folder leaves them).

    Raises:
        OSError: the folder could not be written (it names it; no folder is left).
    """
    why, st_note, code = update_config(small), None, None
    if why is not None:  # blocks of different widths: the config records them instead
        found = remote_code(small)
        if isinstance(found, str):
            why = f"{why}; nor can a folder with modelling code of its own: {found}"
        else:
            why, code = None, found
    if why is None:
        try:
            with atomic_directory(folder) as tmp:
                _save_every_tensor(small, tmp)
                if code is not None:
                    write_remote_code(tmp, code)
                save_tokenizer(tmp)
                why, width = _reload(_from_pretrained(small, tmp, code), small, batch)
                if why is not None:
                    raise _NotWritten
                if source is not None:
                    st_note = _copy_sentence_transformers(source, tmp, width)
        except _NotWritten:
            pass
        except Exception as e:  # a class that cannot save or reload itself: no folder
            if isinstance(e, OSError):  # a write that failed (a full disk) fails the command
                shutil.rmtree(folder, ignore_errors=True)
                raise
            why = f"saving or reloading it failed ({first_line(e)})"
        except BaseException:  # interrupted: no folder from an earlier run beside this one's
            shutil.rmtree(folder, ignore_errors=True)
            raise
    if why is not None:
        shutil.rmtree(folder, ignore_errors=True)
        return HFFolder(False, missing=why)
    notes = [n for n in (_remote_note(code, folder.name), _filled_note(small, folder.name), st_note)
             if n]  # fmt: skip
    return HFFolder(True, notes=tuple(notes), remote_code=code is not None)


def _save_every_tensor(small: nn.Module, folder: Path) -> None:
    """``small.save_pretrained(folder)`` with the tensors its class leaves out of the file
    (``_keys_to_ignore_on_save``: Marian's sinusoidal position tables, which a reload
    regenerates for the width it is built with) written too: a shrunk model holds those
    tables' kept columns, which differ from the table regenerated for the narrower width."""
    had = "_keys_to_ignore_on_save" in vars(small)
    old = vars(small).get("_keys_to_ignore_on_save")
    small._keys_to_ignore_on_save = None
    try:
        small.save_pretrained(folder)
    finally:
        if had:
            small._keys_to_ignore_on_save = old
        else:
            del small._keys_to_ignore_on_save


def _from_pretrained(small: nn.Module, folder: Path, code: RemoteCode | None) -> nn.Module:
    """``folder`` loaded as a user loads it: by ``type(small).from_pretrained``, or for remote
    code by the Auto class of the model's task with ``trust_remote_code=True``; in ``small``'s
    floating dtype, as a user loads a bf16 / fp16 checkpoint (transformers before 4.56 names
    it ``torch_dtype``)."""
    import transformers

    cls = type(small) if code is None else getattr(transformers, code.auto_class)
    kwargs: dict[str, Any] = {} if code is None else {"trust_remote_code": True}
    dtype = next((p.dtype for p in small.parameters() if p.is_floating_point()), None)
    if dtype is not None:
        new = tuple(int(v) for v in transformers.__version__.split(".")[:2]) >= (4, 56)
        kwargs["dtype" if new else "torch_dtype"] = dtype
    return cls.from_pretrained(folder, **kwargs)


def _remote_note(code: RemoteCode | None, name: str) -> str | None:
    """How a remote-code folder loads, or None for a standard one."""
    if code is None:
        return None
    return (
        f"{name}/ keeps the widths of each block in its config with modelling code of its own "
        f"(torch and transformers only): load it with {code.auto_class}.from_pretrained(path, "
        "trust_remote_code=True)"
    )


def _reload(back: nn.Module, small: nn.Module, batch: Any) -> tuple[str | None, int]:
    """Why ``back`` (reloaded by ``from_pretrained``) does not give ``small``'s outputs on
    ``batch`` (its kept units, where ``small`` zero-fills a returned width), or None; and the
    width of ``back``'s output."""
    fill = output_fill(small)
    with eval_mode(back, small), torch.no_grad():
        want = call_model(small, batch)
        got = output_tensor(call_model(back, batch))
    want = output_tensor(fill.kept_outputs(want) if fill is not None else want)
    width = got.shape[-1]
    if got.shape != want.shape:
        return (
            f"from_pretrained gives outputs of shape {tuple(got.shape)}, not {tuple(want.shape)}",
            width,
        )
    err = float((got.double() - want.double()).abs().max())
    if err > output_rtol(want.dtype) * max(1.0, float(want.abs().max())):
        return f"from_pretrained gives outputs {err:.3g} away from the pruned model's", width
    return None, width


def _filled_note(small: nn.Module, name: str) -> str | None:
    """What the folder returns where ``small`` zero-fills a returned width, or None."""
    fill = output_fill(small)
    if fill is None:
        return None
    kept = ", ".join(f"{len(o.kept)} of {o.size} along dim {o.dim} of {o.path or 'the output'}"
                     for o in fill.outputs)  # fmt: skip
    return (
        f"{name}/ returns the kept units only ({kept}); model.pt returns the removed ones as "
        "zeros: cosine similarities and dot products are the same"
    )


def _copy_sentence_transformers(source: Path, target: Path, width: int) -> str | None:
    """Copy a sentence-transformers model's files (``modules.json``, its settings, each module's
    folder) from ``source`` to ``target``, the pooling's ``word_embedding_dimension`` set to
    ``width`` and the transformer module pointed at the folder's root (the pruned model, not a
    dense copy in a module folder); returns why they were not copied (a module after the
    pooling that reads the pruned width), or None (also when ``source`` is no
    sentence-transformers model)."""
    listed = source / "modules.json"
    if not listed.is_file():
        return None
    modules = json.loads(listed.read_text())
    pooling = [m for m in modules if m.get("type", "").endswith(".Pooling")]
    dense_width = _pooling_width(source, pooling)
    others = sorted({m.get("type", "?") for m in modules} - _ST_WIDTHLESS)
    if others and dense_width != width:
        return (
            f"the sentence-transformers modules were not copied: {', '.join(others)} read the "
            f"embedding width, pruned from {dense_width} to {width}; load the folder with "
            "transformers, or prune with the hidden width whole"
        )
    for name in _ST_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    for m in modules:
        path = m.get("path", "")
        if m.get("type", "").endswith(".Transformer"):  # the pruned model at the folder's root
            if path and (source / path / _ST_FILES[1]).is_file():
                shutil.copy2(source / path / _ST_FILES[1], target / _ST_FILES[1])
            m["path"] = ""
        elif path and (source / path).is_dir():
            shutil.copytree(source / path, target / path)
        elif path:
            (target / path).mkdir(parents=True)  # a module with nothing saved (Normalize)
    (target / _ST_FILES[0]).write_text(json.dumps(modules, indent=2) + "\n")
    for m in pooling:
        config = target / m["path"] / "config.json"
        if config.is_file():
            settings = json.loads(config.read_text())
            settings["word_embedding_dimension"] = width
            config.write_text(json.dumps(settings, indent=2) + "\n")
    return None


def _pooling_width(source: Path, pooling: list[dict[str, Any]]) -> int | None:
    """The embedding width the source's pooling module was saved with, if it says."""
    for m in pooling:
        config = source / m.get("path", "") / "config.json"
        if config.is_file():
            return json.loads(config.read_text()).get("word_embedding_dimension")
    return None
